#!/usr/bin/env bash
# Drift check (`make drift`): a throwaway virtual environment with the newest releases that
# pyproject.toml's ranges admit (RESOLUTION=lowest-direct: the oldest, to check the lower bounds),
# PyTorch kept at the lock's CPU build (the platform, chosen apart), then the tests that touch outside
# packages: transformers (parity, export, import), datasets and tokenizers (loading), lm-eval,
# DeepSpeed, Hydra composition, torchao, mamba_ssm. It needs the registries, so it is not part of CI;
# its last results are in docs/benchmarks.md ("Dependency drift"). Prints the resolved versions that
# differ from requirements/dev.txt, then pytest's summary; exits as pytest did.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
RESOLUTION=${RESOLUTION:-highest}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$PYTHON" -m venv "$work/venv"
py=$work/venv/bin/python
uv_pin=$(grep -oE '^uv==[^ ]+' requirements/dev.txt)
"$py" -m pip install -q "$uv_pin" wheel  # wheel: source builds without isolation (DeepSpeed)
wheel_dir=${FIND_LINKS:-${PIP_FIND_LINKS:-$("$py" -m pip config get global.find-links 2>/dev/null || true)}}
links=()
[ -n "$wheel_dir" ] && links+=(--find-links "$wheel_dir")
[ -n "${TORCH_CPU_INDEX:-}" ] && links+=(--extra-index-url "$TORCH_CPU_INDEX")
"$work/venv/bin/uv" pip compile pyproject.toml --extra dev -c requirements/torch-cpu.in "${links[@]}" \
  --resolution "$RESOLUTION" --python-version 3.11 --no-header --no-annotate --quiet -o "$work/resolved.txt"
"$py" -m pip install -q --no-deps --no-build-isolation \
  -r <(awk '/^torch==/' "$work/resolved.txt") ${TORCH_CPU_INDEX:+--extra-index-url "$TORCH_CPU_INDEX"}
"$py" -m pip install -q --no-deps --no-build-isolation -r "$work/resolved.txt"
"$py" -m pip install -q --no-deps --no-build-isolation -e .
MAMBA_FORCE_BUILD=TRUE MAMBA_SKIP_CUDA_BUILD=TRUE "$py" -m pip install -q --no-build-isolation --no-deps \
  "mamba-ssm$([ "$RESOLUTION" = highest ] || grep -oE '==[^ ]+' requirements/mamba-ssm.txt)"
echo "drift check ($RESOLUTION) $(date -u +%Y-%m-%d), $("$py" --version); resolved vs requirements/dev.txt:"
"$py" -c '
import re, sys
pins = lambda path: {re.sub(r"[-_.]+", "-", n).lower(): v
                     for n, v in re.findall(r"^([A-Za-z0-9_.-]+)==([^ \\\n]+)", open(path).read(), re.M)}
locked, resolved = pins("requirements/dev.txt"), pins(sys.argv[1])
for name in sorted(resolved):
    if locked.get(name) != resolved[name]:
        print(f"  {name}: {locked.get(name)} -> {resolved[name]}")
' "$work/resolved.txt"
"$py" -m pytest -q -p no:cacheprovider -m "not slow" \
  tests/unit/test_hf_parity.py tests/unit/test_init_from.py tests/integration/test_export_hf.py \
  tests/unit/test_data_loader.py tests/unit/test_preprocess_inputs.py tests/unit/test_data_checks.py \
  tests/unit/test_eval_multiple_choice.py tests/integration/test_eval_lm_eval.py \
  tests/unit/test_parallel_config.py tests/integration/test_distributed.py \
  tests/unit/test_train_config.py tests/unit/test_cli_errors.py tests/unit/test_block_quant.py \
  tests/unit/test_ssd.py
