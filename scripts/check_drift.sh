#!/usr/bin/env bash
# Drift check (`make drift`): a throwaway virtual environment with the newest releases that
# pyproject.toml's ranges admit (PyTorch kept at the lock's CPU build: it is the platform, chosen apart),
# then the tests that touch outside packages: transformers (parity, export, import), datasets and
# tokenizers (loading), lm-eval, DeepSpeed, Hydra composition, torchao, mamba_ssm. It needs the
# registries, so it is not part of CI; its last result goes in docs/benchmarks.md ("Dependency drift").
# Prints the versions that differ from requirements/dev.txt, then pytest's summary; exits as pytest did.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$PYTHON" -m venv "$work/venv"
py=$work/venv/bin/python
torch=$(grep -oE '^torch==[^ ]+' requirements/dev.txt)
"$py" -m pip install -q "$torch" ${TORCH_CPU_INDEX:+--extra-index-url "$TORCH_CPU_INDEX"}
"$py" -m pip install -q -e ".[dev]"
MAMBA_FORCE_BUILD=TRUE MAMBA_SKIP_CUDA_BUILD=TRUE "$py" -m pip install -q --no-build-isolation --no-deps mamba-ssm
echo "drift check $(date -u +%Y-%m-%d), $("$PYTHON" --version); newest allowed vs requirements/dev.txt:"
"$py" -m pip list --format=freeze 2>/dev/null | "$py" -c '
import re, sys
locked = dict(re.findall(r"^([A-Za-z0-9_.-]+)==([^ \\]+)", open("requirements/dev.txt").read(), re.M))
norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()
locked = {norm(k): v for k, v in locked.items()}
for line in sys.stdin:
    name, _, version = line.strip().partition("==")
    if norm(name) in locked and locked[norm(name)] != version:
        print(f"  {name}: {locked[norm(name)]} -> {version}")
'
"$py" -m pytest -q -p no:cacheprovider -m "not slow" \
  tests/unit/test_hf_parity.py tests/unit/test_init_from.py tests/integration/test_export_hf.py \
  tests/unit/test_data_loader.py tests/unit/test_preprocess_inputs.py tests/unit/test_data_checks.py \
  tests/unit/test_eval_multiple_choice.py tests/integration/test_eval_lm_eval.py \
  tests/unit/test_parallel_config.py tests/integration/test_distributed.py \
  tests/unit/test_train_config.py tests/unit/test_cli_errors.py tests/unit/test_block_quant.py \
  tests/unit/test_ssd.py
