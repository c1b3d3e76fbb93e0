#!/usr/bin/env bash
# One GPU check, bounded to about 7.5 minutes, installing nothing:
#   1. the GPU tests (tests/gpu, and the gpu-marked tests of tests/unit that need no extra packages);
#   2. scripts/bench_gpu.py: copy-bandwidth and BF16-matmul ceilings, quantize throughput of each
#      Triton kernel against the copy bandwidth, training-step throughput of a 4-layer nemotron_h_8b
#      slice (seq 8192) under bf16 / nvfp4 / ue5m3; one table at the end.
# Needs python3 with torch (CUDA) and triton, plus pytest and numpy; the project itself is imported
# from this checkout (PYTHONPATH), nothing is installed. With OUT set, logs and the JSON of results
# go there.
#
#   bash scripts/gpu_check.sh                  # PYTHON=... to pick the interpreter
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
OUT_DIR=${OUT:-}
log() { if [[ -n "$OUT_DIR" ]]; then tee -a "$OUT_DIR/$1"; else cat; fi; }
start=$SECONDS

echo "== machine"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,clocks.mem --format=csv,noheader || true
"$PY" -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__, "gpu", torch.cuda.get_device_name(0))' || exit 1

echo "== GPU tests (their own process: the interpreter tests in tests/unit must not share it)"
unit_gpu=$(grep -l "mark.gpu" tests/unit/*.py | grep -v "tests/unit/test_kernels")
timeout 200 "$PY" -m pytest -q -m gpu -p no:cacheprovider --continue-on-collection-errors \
    tests/gpu $unit_gpu 2>&1 | log gpu_tests.log
tests_rc=${PIPESTATUS[0]}
echo "GPU tests exit code: $tests_rc ($((SECONDS - start)) s so far)"

echo "== benchmark"
json=()
[[ -n "$OUT_DIR" ]] && json=(--json "$OUT_DIR/bench_gpu.json")
timeout 270 "$PY" scripts/bench_gpu.py --budget-s 200 ${json[@]+"${json[@]}"} 2>&1 | log bench_gpu.log
bench_rc=${PIPESTATUS[0]}
echo "== done in $((SECONDS - start)) s: tests rc=$tests_rc, bench rc=$bench_rc"
exit $(( tests_rc != 0 || bench_rc != 0 ))
