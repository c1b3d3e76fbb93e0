"""Throughput of FP4 block quantize -> dequantize on CPU, next to torchao's NVFP4 reference.

    python scripts/bench_quant.py [--size 4096] [--repeats 7]

Each variant quantizes a bf16 [size, size] Gaussian tensor (measuring its amax) and
dequantizes it back to float32. Variants run interleaved, round after round, and the
median time is reported, because the CPU is shared and timings drift. Ratios are against
torchao's ``NVFP4Tensor.to_nvfp4(..., per_tensor_scale)`` + ``dequantize`` measured in the
same run. SQNR (dB) of the round trip is printed alongside as a sanity check.
"""

from __future__ import annotations

import argparse
import logging
import platform
import statistics
import time
import warnings

import torch

from nemofp4.formats import quantize_blocks


def _torchao_nvfp4():
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale

    def run(x: torch.Tensor) -> torch.Tensor:
        scale = per_tensor_amax_to_scale(torch.max(torch.abs(x)).float())
        return NVFP4Tensor.to_nvfp4(x, block_size=16, per_tensor_scale=scale).dequantize(torch.float32)

    return run


def _ours(scale_format: str, block_size: int):
    def run(x: torch.Tensor) -> torch.Tensor:
        return quantize_blocks(x, scale_format=scale_format, block_size=block_size).dequantize()

    return run


def sqnr_db(reference: torch.Tensor, approx: torch.Tensor) -> float:
    ref = reference.double()
    return float(10 * torch.log10(ref.pow(2).mean() / (ref - approx.double()).pow(2).mean()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()

    logging.disable(logging.WARNING)  # torchao logs about its optional CUDA extensions
    warnings.filterwarnings("ignore")
    variants = {
        "torchao NVFP4 (reference)": _torchao_nvfp4(),
        "nemofp4 NVFP4 (e4m3, 1x16)": _ours("e4m3", 16),
        "nemofp4 UE5M3 (1x16)": _ours("ue5m3", 16),
        "nemofp4 MXFP4 (ue8m0, 1x32)": _ours("ue8m0", 32),
    }
    x = torch.randn(args.size, args.size, generator=torch.Generator().manual_seed(0)).bfloat16()
    quality = {name: sqnr_db(x.float(), fn(x)) for name, fn in variants.items()}  # also warms up
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.repeats):
        for name, fn in variants.items():
            start = time.perf_counter()
            fn(x)
            times[name].append(time.perf_counter() - start)

    base = statistics.median(times["torchao NVFP4 (reference)"])
    print(
        f"quantize->dequantize, bf16 [{args.size}, {args.size}], {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}, {platform.machine()}, median of {args.repeats} interleaved rounds"
    )
    print(f"{'variant':<30} {'median s':>9} {'Melem/s':>9} {'vs torchao':>11} {'SQNR dB':>8}")
    for name in variants:
        median = statistics.median(times[name])
        print(
            f"{name:<30} {median:9.3f} {x.numel() / median / 1e6:9.1f} {base / median:10.2f}x "
            f"{quality[name]:8.2f}"
        )


if __name__ == "__main__":
    main()
