# Two entry points: `make train` (the main job) and `make test` (lint, format check, tests).
# Both create or reuse a virtual environment in $(VENV) and install into it the committed lock
# requirements/$(LOCK).txt (hash-checked, nothing resolved) and then the project itself:
# `dev` (CPU PyTorch) on a machine without an NVIDIA GPU, `gpu` (PyPI's CUDA PyTorch and the gpu
# extra) with one. `make lock` regenerates the locks from pyproject.toml's ranges; `make drift`
# tries the newest releases those ranges admit in a throwaway environment.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
LOCK ?= $(shell if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then echo gpu; else echo dev; fi)
# A pip index that serves PyTorch's CPU wheels (torch==2.13.0+cpu), for machines whose configured
# indexes and wheel folders do not: e.g. TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
TORCH_CPU_INDEX ?=
TRAIN_ARGS ?=
PYTEST_ARGS ?= -m "not slow"
# Test modules run in parallel worker processes, one module per worker at a time (tests/parallel.py).
PYTEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); echo $$(( n < 4 ? n : 4 )))
PYTEST_PARALLEL ?= -n $(PYTEST_WORKERS) --dist loadfile

.PHONY: setup train test test-all lint lock drift clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml requirements/$(LOCK).txt requirements/mamba-ssm.txt scripts/install_lock.sh
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(if $(TORCH_CPU_INDEX),PIP_EXTRA_INDEX_URL=$(TORCH_CPU_INDEX)) bash scripts/install_lock.sh $(PY) $(LOCK)
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
	$(VENV)/bin/ruff format --check .

test: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m pytest -q $(PYTEST_PARALLEL) $(PYTEST_ARGS)  # exit 5, no tests collected, fails too

test-all: setup
	$(PY) -m pytest -q $(PYTEST_PARALLEL) -m ""

lock: setup
	$(if $(TORCH_CPU_INDEX),TORCH_CPU_INDEX=$(TORCH_CPU_INDEX)) UV=$(VENV)/bin/uv bash scripts/lock.sh

# RESOLUTION=lowest-direct: the oldest releases the ranges admit instead of the newest.
drift:
	PYTHON=$(PYTHON) RESOLUTION=$(or $(RESOLUTION),highest) bash scripts/check_drift.sh

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
