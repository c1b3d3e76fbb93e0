"""GPU benchmark: ceilings, FP4 quantization kernel throughput, and training-step throughput.

    python scripts/bench/bench_gpu.py [--json results.json] [--budget-s 300] [--quick]

1. Ceilings, measured here: device-to-device copy bandwidth (bytes read + written) and the
   BF16 matmul rate (8192^3, random operands).
2. Quantization throughput of each Triton kernel, in GB/s of BF16 input read, against the copy
   bandwidth (a kernel that reads its input once and writes ~0.56 B/element of codes can
   approach it), plus the PyTorch reference paths for comparison, and a small sweep of tile
   configurations for the main kernels.
3. Training-step throughput (tokens/s) of a 4-layer slice of nemotron_h_8b (pattern "M*M-":
   one layer of each type plus one more Mamba) at seq 8192, batch 1, under the bf16, nvfp4 and
   ue5m3 recipes: forward + backward of the four blocks and an AdamW step on their parameters
   (the embedding is frozen and the LM head unused, so the vocabulary-sized tensors that every
   recipe shares do not dilute the comparison). The FP4 recipes run with the Triton kernels
   (the default on CUDA) and again with ``kernels=eager``, the PyTorch
   quantization path.

Prints one table; ``--json`` also writes every number. Timings are CUDA-event medians after
warm-up. The whole run stops starting new sections once ``--budget-s`` has passed.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

ROWS: list[tuple[str, str, str]] = []  # (measurement, value, comparison) for the final table
RESULTS: dict = {"quantize": {}, "sweep": {}, "step": {}}


def add_row(measurement: str, value: str, comparison: str) -> None:
    """Record a table row and print it at once (a run cut short still shows what it measured)."""
    ROWS.append((measurement, value, comparison))
    print(f"  {measurement}: {value}  [{comparison}]", flush=True)


def cuda_time_ms(fn, *, warmup: int = 3, reps: int = 20) -> float:
    """Median milliseconds of ``fn()`` over ``reps`` CUDA-event-timed calls after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


# ------------------------------------------------------------------------------------ ceilings
def ceilings() -> tuple[float, float]:
    n = 1 << 29  # 1 GiB of bf16
    src = torch.randn(n, device="cuda", dtype=torch.float32).to(torch.bfloat16)
    dst = torch.empty_like(src)
    ms = cuda_time_ms(lambda: dst.copy_(src), reps=30)
    copy_gbs = 2 * src.numel() * src.element_size() / ms / 1e6
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = cuda_time_ms(lambda: a @ b, reps=20)
    tflops = 2 * 8192**3 / ms / 1e9
    RESULTS["ceilings"] = {"copy_gb_per_s": copy_gbs, "bf16_matmul_tflop_per_s": tflops}
    add_row("ceiling: device copy (read + write), 1 GiB bf16", f"{copy_gbs:,.0f} GB/s", "ceiling")
    add_row("ceiling: bf16 matmul 8192^3, random", f"{tflops:,.0f} TFLOP/s", "ceiling")
    return copy_gbs, tflops


# ------------------------------------------------------------------------------------ quantize
def quantize_section(copy_gbs: float, quick: bool) -> None:
    from nemofp4.formats import quantize_blocks
    from nemofp4.kernels.program import quantize_operand
    from nemofp4.kernels.quantize import triton_amax, triton_quantize
    from nemofp4.quant.config import OperandQuant

    rows, cols = (8192, 8192) if quick else (16384, 8192)  # 128 / 256 MiB of bf16: >> the 60 MB L2
    x = torch.randn(rows, cols, device="cuda") * torch.exp(torch.randn(rows, 1, device="cuda"))
    x = x.to(torch.bfloat16)
    g = triton_amax(x)
    read_gb = x.numel() * x.element_size() / 1e9
    seed = torch.tensor([7], device="cuda")

    def q(**kw):
        return lambda: triton_quantize(x, seed=seed, **kw)

    variants = [
        ("amax reduction (current scaling's extra pass)", lambda: triton_amax(x)),
        ("NVFP4 e4m3 1x16, current amax: amax + quantize", q(scale_format="e4m3")),
        ("NVFP4 e4m3 1x16, quantize pass alone", q(scale_format="e4m3", tensor_amax=g)),
        ("UE5M3 1x16, held reference (1 pass)", q(scale_format="ue5m3", tensor_amax=g)),
        ("UE5M3 1x16, held, no statistics", q(scale_format="ue5m3", tensor_amax=g, stats=False)),
        ("UE5M3 1x16 sr8 (dY), held", q(scale_format="ue5m3", tensor_amax=g, rounding="sr8")),
        ("UE5M3 1x16 + x.T (X and X^T, one launch)", q(scale_format="ue5m3", tensor_amax=g, transposed=True)),
        (
            "UE5M3 sr8 + x.T (dY and dY^T, one launch)",
            q(scale_format="ue5m3", tensor_amax=g, rounding="sr8", transposed=True),
        ),
        ("NVFP4 e4m3 16x16 tiles (weights), amax given", q(scale_format="e4m3", tensor_amax=g, two_d=True)),
        ("MXFP4 ue8m0 1x32", q(scale_format="ue8m0")),
        (
            "UE5M3 1x16 held + fp32 scaled values (QuantLinear operand)",
            q(scale_format="ue5m3", tensor_amax=g, scaled_dtype=torch.float32),
        ),
    ]
    for name, fn in variants:
        ms = cuda_time_ms(fn)
        gbs = read_gb / ms * 1e3
        RESULTS["quantize"][name] = {"ms": ms, "read_gb_per_s": gbs, "fraction_of_copy": gbs / copy_gbs}
        add_row(
            f"quantize: {name}",
            f"{gbs:,.0f} GB/s read ({ms:.3f} ms)",
            f"{100 * gbs / copy_gbs:.0f}% of copy",
        )
    torch_variants = [
        ("PyTorch reference quantize_blocks, UE5M3 held", lambda: quantize_blocks(x, "ue5m3", tensor_amax=g)),
        (
            "torch program quantize_operand (eager), UE5M3 held",
            lambda: quantize_operand(x, OperandQuant(scale_format="ue5m3"), tensor_amax=g),
        ),
    ]
    for name, fn in torch_variants:
        ms = cuda_time_ms(fn, warmup=1, reps=5)
        gbs = read_gb / ms * 1e3
        RESULTS["quantize"][name] = {"ms": ms, "read_gb_per_s": gbs, "fraction_of_copy": gbs / copy_gbs}
        add_row(
            f"quantize: {name}",
            f"{gbs:,.0f} GB/s read ({ms:.3f} ms)",
            f"{100 * gbs / copy_gbs:.0f}% of copy",
        )
    # a small sweep of tile shapes (BM x BK, warps) for the main kernels
    sweeps = {
        "UE5M3 1x16 held": (
            dict(scale_format="ue5m3", tensor_amax=g),
            [(16, 128, 4), (32, 128, 8), (32, 128, 4), (16, 256, 8), (8, 256, 4), (64, 128, 8)],
        ),
        "UE5M3 + x.T held": (
            dict(scale_format="ue5m3", tensor_amax=g, transposed=True),
            [(16, 128, 4), (32, 64, 8), (16, 256, 8), (32, 128, 8), (64, 64, 8)],
        ),
        "UE5M3 sr8 held": (
            dict(scale_format="ue5m3", tensor_amax=g, rounding="sr8"),
            [(16, 128, 4), (32, 128, 8), (16, 256, 8), (32, 64, 4)],
        ),
        "e4m3 16x16 tiles": (
            dict(scale_format="e4m3", tensor_amax=g, two_d=True),
            [(16, 128, 4), (32, 128, 4), (16, 256, 8)],
        ),
    }
    for name, (kwargs, configs) in sweeps.items():
        best = None
        for bm, bk, warps in configs[: 2 if quick else None]:
            config = {"BM": bm, "BK": bk, "num_warps": warps, "enable_fp_fusion": False}
            ms = cuda_time_ms(
                lambda config=config, kwargs=kwargs: triton_quantize(x, seed=seed, _config=config, **kwargs),
                warmup=2,
                reps=10,
            )
            gbs = read_gb / ms * 1e3
            RESULTS["sweep"][f"{name} BM={bm} BK={bk} warps={warps}"] = gbs
            if best is None or gbs > best[0]:
                best = (gbs, bm, bk, warps)
        gbs, bm, bk, warps = best
        add_row(
            f"sweep best: {name}",
            f"{gbs:,.0f} GB/s at BM={bm} BK={bk} warps={warps}",
            f"{100 * gbs / copy_gbs:.0f}% of copy",
        )


# ------------------------------------------------------------------------------------ training step
STEP_RUNS = [
    # (label, recipe, knobs, kernels backend)
    ("bf16", "bf16", {}, "auto"),
    ("ue5m3 (Triton quantization)", "ue5m3", {}, "triton"),
    ("nvfp4 (Triton quantization)", "nvfp4", {"num_bf16_last_layers": 0}, "triton"),
    ("ue5m3 (PyTorch quantization)", "ue5m3", {}, "eager"),
    ("nvfp4 (PyTorch quantization)", "nvfp4", {"num_bf16_last_layers": 0}, "eager"),
    ("ue5m3, gemm=hardware (Triton)", "ue5m3", {"gemm": "hardware"}, "triton"),
]


class _Step:
    """One training step of a 4-layer nemotron_h_8b slice under ``recipe``."""

    def __init__(self, recipe: str, knobs: dict, seq: int, backend: str) -> None:
        from nemofp4.models import build_model, get_model_config
        from nemofp4.quant import set_quant_backend
        from nemofp4.recipes import apply_recipe, get_recipe

        config = get_model_config("nemotron_h_8b", hybrid_layer_pattern="M*M-")
        torch.manual_seed(0)
        self.model = build_model(config, device="meta")
        apply_recipe(self.model, get_recipe(recipe, **knobs), log=False)
        set_quant_backend(self.model, backend)
        self.model.to_empty(device="cuda")
        self.model.init_weights()
        self.model.embeddings.weight.requires_grad_(False)  # shared by every recipe: left out
        self.model.lm_head.weight.requires_grad_(False)  # unused: the loss reads the hidden states
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=1e-5, fused=True)
        self.ids = torch.randint(0, config.vocab_size, (1, seq), device="cuda")
        self.step_index = 0

    def __call__(self) -> None:
        from nemofp4.quant import set_step

        self.step_index += 1
        set_step(self.model, self.step_index, seed=0)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            hidden = self.model(self.ids, return_hidden=True)
        hidden.float().square().mean().backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def step_section(seq: int, steps: int, deadline: float) -> None:
    for label, recipe, knobs, backend in STEP_RUNS:
        if time.monotonic() > deadline:
            add_row(f"step: {label}", "skipped (time budget)", "")
            continue
        step = None
        try:
            step = _Step(recipe, knobs, seq, backend)
            torch.cuda.reset_peak_memory_stats()
            ms = cuda_time_ms(step, warmup=2, reps=steps)
            peak_gib = torch.cuda.max_memory_allocated() / 2**30
            RESULTS["step"][label] = {"ms": ms, "tokens_per_s": seq / ms * 1e3, "peak_gib": peak_gib}
        except Exception as error:  # record and go on: one recipe failing must not hide the rest
            RESULTS["step"][label] = {"error": f"{type(error).__name__}: {error}"}
            add_row(f"step: {label}", f"FAILED {type(error).__name__}: {str(error)[:80]}", "")
        finally:
            del step
            torch.cuda.empty_cache()
    base = RESULTS["step"].get("bf16", {}).get("ms")
    for label, result in RESULTS["step"].items():
        if "ms" not in result:
            continue
        ratio = f"{result['ms'] / base:.2f}x bf16 step time" if base else ""
        value = f"{result['tokens_per_s']:,.0f} tok/s ({result['ms']:.1f} ms, peak {result['peak_gib']:.1f} GiB)"
        add_row(f"step: {label}", value, ratio)


# ------------------------------------------------------------------------------------ main
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=None, help="write all results here")
    parser.add_argument("--budget-s", type=float, default=300.0, help="stop starting sections after this")
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=5, help="timed training steps per recipe")
    parser.add_argument("--quick", action="store_true", help="smaller tensors, shorter sweeps")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_gpu.py needs a CUDA device", file=sys.stderr)
        return 2
    start = time.monotonic()
    deadline = start + args.budget_s
    import triton

    props = torch.cuda.get_device_properties(0)
    RESULTS["machine"] = {
        "gpu": props.name,
        "sms": props.multi_processor_count,
        "memory_gib": props.total_memory / 2**30,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
    }
    print(f"# {props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, triton {triton.__version__}")
    copy_gbs, _ = ceilings()
    sections = [
        ("quantize", lambda: quantize_section(copy_gbs, args.quick)),
        ("step", lambda: step_section(args.seq, args.steps, deadline)),
    ]
    for name, run in sections:
        if time.monotonic() > deadline:
            add_row(name, "skipped (time budget)", "")
            continue
        t = time.monotonic()
        run()
        print(f"# section {name}: {time.monotonic() - t:.0f} s", flush=True)
        write_json(args.json)
    RESULTS["elapsed_s"] = time.monotonic() - start
    width = max(len(r[0]) for r in ROWS)
    value_width = max(len(r[1]) for r in ROWS)
    print(f"\n| {'measurement'.ljust(width)} | {'value'.ljust(value_width)} | comparison |")
    print(f"|{'-' * (width + 2)}|{'-' * (value_width + 2)}|------------|")
    for measurement, value, comparison in ROWS:
        print(f"| {measurement.ljust(width)} | {value.ljust(value_width)} | {comparison} |")
    write_json(args.json)
    return 0


def write_json(path: Path | None) -> None:
    if path is not None:
        path.write_text(json.dumps(RESULTS, indent=2, default=str))


if __name__ == "__main__":
    sys.exit(main())
