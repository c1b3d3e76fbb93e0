#!/usr/bin/env bash
# One GPU check, bounded to about 8.5 minutes:
#   1. the wheelhouse (scripts/gpu/gpu_wheelhouse.sh: hydra-core, omegaconf, antlr4) installed with --no-deps
#      into a throwaway folder put on PYTHONPATH; nothing else is installed;
#   2. the GPU tests (tests/gpu, and the gpu-marked tests of tests/unit);
#   3. scripts/bench/bench_gpu.py: copy-bandwidth and BF16-matmul ceilings, quantize throughput of each
#      Triton kernel against the copy bandwidth, training-step throughput of a 4-layer nemotron_h_8b
#      slice (seq 8192) under bf16 / nvfp4 / ue5m3; its own table;
#   4. scripts/gpu/gpu_check_train.py: nemofp4-train experiment=tiny_ue5m3 for 30 steps with
#      train.sync_debug=error, a kill after step 20 and an exact resume to 30, and nemofp4-eval;
#   then one table of every stage. Needs python3 with torch (CUDA), triton, pytest, numpy and pip; the
#   project itself is imported from this checkout (PYTHONPATH). With OUT set, logs and JSON go there.
#
#   bash scripts/gpu/gpu_check.sh              # PYTHON=... picks the interpreter; WHEELHOUSE=dir (.wheelhouse)
#   bash scripts/gpu/gpu_check.sh --rehearse   # every stage on the CPU (or NEMOFP4_GPU_CHECK_REHEARSE=1)
#
# The rehearsal runs the same stages on the CPU: the wheelhouse installed the same way, with the Python
# packages the GPU image lacks hidden (scripts/gpu/gpu_image.py), Triton in its interpreter, the trainer
# and the evaluation on the CPU with smaller steps; the benchmark (CUDA events) is skipped. A few minutes.
set -uo pipefail
cd "$(dirname "$0")/../.."
REHEARSE=${NEMOFP4_GPU_CHECK_REHEARSE:-0}
[[ "${1:-}" == "--rehearse" ]] && REHEARSE=1
PY=${PYTHON:-python3}
WHEELS=${WHEELHOUSE:-.wheelhouse}
export PYTHONUNBUFFERED=1
OUT_DIR=${OUT:-}
SCRATCH=$(mktemp -d)
trap 'rm -rf "$SCRATCH"' EXIT
log() { if [[ -n "$OUT_DIR" ]]; then tee -a "$OUT_DIR/$1"; else cat; fi; }
start=$SECONDS
STAGES=()  # "stage|result|detail" rows of the final table
stage() { STAGES+=("$1|$2|$3"); }
verdict() { if [[ "$1" == 0 ]]; then echo ok; else echo "FAILED (exit $1)"; fi; }

echo "== machine"
if [[ "$REHEARSE" == 1 ]]; then
    echo "CPU rehearsal: $(nproc) cores, $(uname -m)"
    export TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES=""
else
    unset TRITON_INTERPRET
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,clocks.mem --format=csv,noheader || true
fi
machine=$("$PY" -c 'import torch, triton, platform
gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__, "gpu", gpu)') || exit 1
echo "$machine"
stage machine ok "$machine"

echo "== wheelhouse: $WHEELS -> a throwaway --target folder"
shopt -s nullglob
wheels=("$WHEELS"/*.whl)
if [[ ${#wheels[@]} -eq 0 ]]; then
    echo "no wheels in $WHEELS: run bash scripts/gpu/gpu_wheelhouse.sh on the CPU machine and carry $WHEELS" >&2
    exit 1
fi
"$PY" -m pip install -q --no-deps --no-index --no-compile --no-cache-dir --target "$SCRATCH/site" "${wheels[@]}" 2>&1
wheel_rc=${PIPESTATUS[0]}
export PYTHONPATH="$SCRATCH/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [[ "$REHEARSE" == 1 ]]; then  # this Python as the GPU image: what it lacks imports from the wheelhouse only
    "$PY" scripts/gpu/gpu_image.py hide "$SCRATCH/image" "$SCRATCH/site" && export PYTHONPATH="$SCRATCH/image:$PYTHONPATH"
fi
stage wheelhouse "$(verdict "$wheel_rc")" "$(basename -a "${wheels[@]}" | tr '\n' ' ')"
[[ "$wheel_rc" == 0 ]] || exit 1

echo "== GPU tests (their own process: the interpreter tests in tests/unit must not share it)"
unit_gpu=$(grep -l "mark.gpu" tests/unit/*.py | grep -v "tests/unit/test_kernels")
timeout 150 "$PY" -m pytest -q -m gpu -p no:cacheprovider --continue-on-collection-errors \
    tests/gpu $unit_gpu 2>&1 | log gpu_tests.log | tee "$SCRATCH/gpu_tests.log"
tests_rc=${PIPESTATUS[0]}
[[ "$REHEARSE" == 1 && "$tests_rc" == 5 ]] && tests_rc=0  # no test ran: without CUDA every one skips
stage "GPU tests" "$(verdict "$tests_rc")" "$(grep -E '(passed|failed|skipped|error)' "$SCRATCH/gpu_tests.log" | tail -1 | tr -d '=' | xargs)"
echo "GPU tests exit code: $tests_rc ($((SECONDS - start)) s so far)"

echo "== benchmark"
if [[ "$REHEARSE" == 1 ]]; then
    bench_rc=0
    stage benchmark skipped "needs CUDA (events, device timings)"
else
    json=()
    [[ -n "$OUT_DIR" ]] && json=(--json "$OUT_DIR/bench_gpu.json")
    timeout 170 "$PY" scripts/bench/bench_gpu.py --budget-s 120 ${json[@]+"${json[@]}"} 2>&1 | log bench_gpu.log
    bench_rc=${PIPESTATUS[0]}
    stage benchmark "$(verdict "$bench_rc")" "its table above"
fi
echo "benchmark exit code: $bench_rc ($((SECONDS - start)) s so far)"

echo "== trainer: train, kill + exact resume, evaluate"
rehearse=() train_budget=180
[[ "$REHEARSE" == 1 ]] && rehearse=(--rehearse) train_budget=480  # a shared CPU can be 6x slower than an idle one
timeout $((train_budget + 10)) "$PY" scripts/gpu/gpu_check_train.py "$SCRATCH/train" --json "$SCRATCH/train.json" --budget-s $train_budget \
    ${rehearse[@]+"${rehearse[@]}"} 2>&1 | log train.log
train_rc=${PIPESTATUS[0]}
if [[ -n "$OUT_DIR" ]]; then
    cp "$SCRATCH/train.json" "$OUT_DIR/train.json" 2>/dev/null
    tail -n 40 "$SCRATCH"/train/*.log >"$OUT_DIR/train_processes.log" 2>/dev/null
fi
[[ "$train_rc" == 0 ]] || tail -n 15 "$SCRATCH"/train/*.log 2>/dev/null

echo "== done in $((SECONDS - start)) s: wheelhouse rc=$wheel_rc, tests rc=$tests_rc, bench rc=$bench_rc, train rc=$train_rc"
"$PY" - "$SCRATCH/train.json" "${OUT_DIR:+$OUT_DIR/gpu_check.json}" "${STAGES[@]}" <<'EOF'
import json, sys
from pathlib import Path

train_json, out, stages = Path(sys.argv[1]), sys.argv[2], [s.split("|", 2) for s in sys.argv[3:]]
train = json.loads(train_json.read_text()) if train_json.exists() else {"rows": [["trainer", "FAILED", "no result"]]}
rows = stages + [list(r) for r in train["rows"]]
widths = [max(len(r[i]) for r in rows + [["check", "result", "detail"]]) for i in range(3)]
line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"
print(line(["check", "result", "detail"]))
print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
print("\n".join(line(r) for r in rows))
if out:
    Path(out).write_text(json.dumps({"rows": rows, "train": train}, indent=2, default=str))
EOF
exit $(( tests_rc != 0 || bench_rc != 0 || train_rc != 0 ))
