# Two entry points: `make train` (the main job) and `make test` (lint + tests).
# Both create or reuse a virtual environment in $(VENV) and install the project into it.
#
# Torch: on a machine without an NVIDIA GPU we install a CPU build ($(TORCH_CPU_SPEC),
# optionally from $(TORCH_CPU_INDEX)); with a GPU we keep an installed CUDA build or take
# PyPI's default (a CUDA build).

VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_CPU_SPEC ?= torch==2.13.0
TORCH_CPU_INDEX ?=
EXTRAS ?= dev
TRAIN_ARGS ?=
PYTEST_ARGS ?= -m "not slow"
# Test modules run in parallel worker processes, one module per worker at a time (tests/parallel.py).
PYTEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); echo $$(( n < 4 ? n : 4 )))
PYTEST_PARALLEL ?= -n $(PYTEST_WORKERS) --dist loadfile

.PHONY: setup train test test-all lint clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	@if $(PY) -c "import torch" 2>/dev/null; then \
		echo "torch already installed: $$($(PY) -c 'import torch; print(torch.__version__)')"; \
	elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		$(PIP) install torch; \
	else \
		$(PIP) install "$(TORCH_CPU_SPEC)" $(if $(TORCH_CPU_INDEX),--index-url $(TORCH_CPU_INDEX)); \
	fi
	$(PIP) install -e ".[$(EXTRAS)]"
	touch $@

# A trainer stopped by SIGINT checkpoints and exits 130; make would report any failed recipe as its
# own status 2, so the recipe interrupts make instead, which then exits as Ctrl-C does (130). The recipe
# outlives the signal by a second: make's handler waits for its child, and a child that exits while the
# signal arrives makes make stop with "wait: No child processes" (status 2). A make started with SIGINT
# ignored (in the background by a non-interactive shell, as nohup does) cannot be interrupted: 2.
train: setup
	$(info $(PY) -m nemofp4.train experiment=tiny_ue5m3 $(TRAIN_ARGS))
	@$(PY) -m nemofp4.train experiment=tiny_ue5m3 $(TRAIN_ARGS); rc=$$?; \
	if [ $$rc -eq 130 ]; then kill -INT $$PPID; sleep 1; fi; exit $$rc

lint: setup
	$(VENV)/bin/ruff check .

test: setup
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q $(PYTEST_PARALLEL) $(PYTEST_ARGS)  # exit 5, no tests collected, fails too

test-all: setup
	$(PY) -m pytest -q $(PYTEST_PARALLEL) -m ""

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
