#!/usr/bin/env bash
# Installs a committed lock (requirements/LOCK.txt) and then nemofp4 itself into a virtual environment:
#   scripts/install_lock.sh VENV_PYTHON dev|gpu|cpu
# Hash-checked and without resolving anything: what is installed is what the lock lists. PyTorch goes in
# first; the source distributions that build against it (on a GPU mamba-ssm, causal-conv1d and
# Transformer Engine's extension) last, without build isolation. On a CPU, mamba-ssm's Triton kernels are added
# without their CUDA build, for the tests that run them under Triton's interpreter.
set -euo pipefail
py=$1 lock=$2
cd "$(dirname "$0")/.."
file=requirements/$lock.txt
[ -f "$file" ] || { echo "no lock $file: choose one of cpu, dev, gpu" >&2; exit 2; }
version=$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
if [ "$version" != 3.11 ]; then
  echo "the locks in requirements/ are for CPython 3.11; $py is $version. Use a 3.11 interpreter" \
       "(make PYTHON=python3.11), or install the ranges with pip install -e '.[dev]' (not tested)" >&2
  exit 2
fi
# The lock's requirement blocks (a pin and its hash lines) whose names match (or, with -v, do not match) $1.
blocks() {
  awk -v pattern="^($1)==" -v invert="${2:-}" '
    /^[A-Za-z0-9_.-]+==/ { keep = ($0 ~ pattern) != (invert == "-v") }
    /^[A-Za-z0-9_.-]+==/ || /^ +--hash/ { if (keep) print }' "$file"
}
install=("$py" -m pip install --require-hashes --no-deps)
# Built against the installed PyTorch, so without build isolation, after everything else.
against_torch='mamba-ssm|causal-conv1d|transformer-engine-torch'
"${install[@]}" -r <(blocks torch) || {
  echo "could not install the lock's $(grep -oE '^torch==[^ ]+' "$file"): where no configured index or wheel" \
       "folder serves it, point TORCH_CPU_INDEX at one (make TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu)" >&2
  exit 1
}
"${install[@]}" -r <(blocks "torch|$against_torch" -v)
"${install[@]}" --no-build-isolation -r <(blocks "$against_torch")
if [ "$lock" = dev ]; then
  MAMBA_FORCE_BUILD=TRUE MAMBA_SKIP_CUDA_BUILD=TRUE "${install[@]}" --no-build-isolation -r requirements/mamba-ssm.txt
fi
"$py" -m pip install --no-deps --no-build-isolation -e .
