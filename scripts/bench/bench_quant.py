"""CPU FP4 quantize -> dequantize on the training step's path, against the copy floor and torchao.

    python scripts/bench/bench_quant.py [--size 4096] [--repeats 7] [--threads 1 2] [--dtype bfloat16]
                                  [--kernels auto]

Each case quantizes a bf16 (``--dtype``) [size, size] Gaussian tensor with the quantizer a training
step on CPU takes (``kernels.backend_for("auto", "cpu")``: where a C++ compiler is present, the
native kernel for the float32 operands it covers and the compiled program for the rest; current
scaling, so the amax is measured inside) and dequantizes it back to float32. ``--kernels`` adds the
cases on other settings to the same run (``--kernels native compiled``: the two CPU paths side by
side). The cases are
the issue's: NVFP4 in 1-D blocks of 16, in 16x16 weight tiles, and the wgrad operand after the 16x16
Hadamard transform (a ``tokens`` request); UE5M3 with RNE and with the paper's 8-bit stochastic
rounding. The floor is ``x.clone()`` of the same tensor (one read, one write); the baseline
torchao's NVFP4 reference (``NVFP4Tensor.to_nvfp4(x, per_tensor_scale)`` + ``dequantize``).

Every case and thread count runs interleaved, round after round, in one process, and the table
reports each case's median time (``ms``), that over the clone's median (``x floor``, lower is better) and
torchao's median over the case's (``vs torchao``, higher is better) at each thread count. The
machine is shared and absolute times drift: compare ratios from one run. The row "copy into a held
tensor" copies the same bytes into a tensor allocated once: the clone's time less its fresh pages.
The clone's own time depends on whether the allocator hands it fresh pages (2-3 ms or 5-6 ms at
one thread on the 2-core VM, from one process to the next), so each case is also given over the
held copy ("x held copy"), the steadier of the two.

Fresh large tensors are a large part of every case's time on a VM: each first touch of a 4 KiB page
faults. ``THP_MEM_ALLOC_ENABLE=1 python scripts/bench/bench_quant.py`` measures with PyTorch's CPU
allocator asking for transparent huge pages (``madvise``) for allocations of 2 MiB and more, which
it reads from the environment once, at its first allocation; the header says which.
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import statistics
import time
import warnings

import torch

from nemofp4.formats.spec import BlockSpec
from nemofp4.kernels import BACKENDS, OperandRequest, backend_for, resolve_backend


def _torchao_nvfp4():
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale

    def run(x: torch.Tensor) -> torch.Tensor:
        scale = per_tensor_amax_to_scale(torch.max(torch.abs(x)).float())
        return NVFP4Tensor.to_nvfp4(x, block_size=16, per_tensor_scale=scale).dequantize(torch.float32)

    return run


def _cases(backend) -> dict:
    """The issue's cases, each a function of x: quantize on the training step's path, then dequantize."""
    generator = torch.Generator().manual_seed(1)

    def operand(spec: BlockSpec):
        return lambda x: backend.quantize(OperandRequest(x, spec), generator=generator)[0].dequantize()

    def wgrad(spec: BlockSpec):
        return lambda x: backend.quantize(OperandRequest(x, spec, layout="tokens"), generator=generator)[0].dequantize()

    return {
        "nvfp4 1x16": operand(BlockSpec(scale_format="e4m3")),
        "nvfp4 16x16 tiles": operand(BlockSpec(scale_format="e4m3", two_d=True)),
        "nvfp4 1x16 + Hadamard": wgrad(BlockSpec(scale_format="e4m3", hadamard=True)),
        "ue5m3 1x16 rne": operand(BlockSpec(scale_format="ue5m3")),
        "ue5m3 1x16 sr8": operand(BlockSpec(scale_format="ue5m3", rounding="sr8")),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument(
        "--dtype",
        choices=["bfloat16", "float32"],
        default="bfloat16",
        help="the input's dtype (a CPU training step quantizes float32 operands)",
    )
    parser.add_argument(
        "--kernels",
        nargs="+",
        choices=list(BACKENDS),
        default=["auto"],
        help="the cases on each of these kernel settings, in the same run",
    )
    args = parser.parse_args()

    logging.disable(logging.WARNING)  # torchao logs about its optional CUDA extensions
    warnings.filterwarnings("ignore")
    dtype = getattr(torch, args.dtype)
    x = torch.randn(args.size, args.size, generator=torch.Generator().manual_seed(0)).to(dtype)
    held = torch.empty_like(x)
    variants = {
        "clone (floor)": lambda x: x.clone(),
        "copy into a held tensor": lambda x: held.copy_(x),  # the same bytes, no fresh pages
        "torchao NVFP4": _torchao_nvfp4(),
    }
    for kernels in args.kernels:
        suffix = f" ({kernels}: {resolve_backend(kernels, 'cpu')})" if len(args.kernels) > 1 else ""
        variants.update({name + suffix: case for name, case in _cases(backend_for(kernels, "cpu")).items()})
    for threads in args.threads:  # warm-up: builds (or loads) the compiled programs
        torch.set_num_threads(threads)
        for fn in variants.values():
            fn(x)
    times = {(name, t): [] for name in variants for t in args.threads}
    for _ in range(args.repeats):
        for threads in args.threads:
            torch.set_num_threads(threads)
            for name, fn in variants.items():
                start = time.perf_counter()
                fn(x)
                times[name, threads].append(time.perf_counter() - start)
    median = {key: statistics.median(values) for key, values in times.items()}
    paths = ", ".join(f"{kernels}: {resolve_backend(kernels, 'cpu')}" for kernels in args.kernels)

    print(
        f"quantize->dequantize, {args.dtype} [{args.size}, {args.size}], "
        f"paths {paths}, "
        f"torch {torch.__version__}, {platform.machine()}, median of {args.repeats} interleaved rounds, "
        f"load average {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f}, "
        f"THP_MEM_ALLOC_ENABLE={os.environ.get('THP_MEM_ALLOC_ENABLE', 'unset')}"
    )
    header = "".join(f" | {t} thr: ms | x floor | x held copy | vs torchao" for t in args.threads)
    print(f"| case{header} |")
    print("|---" + "|---:" * 4 * len(args.threads) + "|")
    for name in variants:
        cells = "".join(
            f" | {median[name, t] * 1e3:.2f} | {median[name, t] / median['clone (floor)', t]:.1f}x"
            f" | {median[name, t] / median['copy into a held tensor', t]:.1f}x"
            f" | {median['torchao NVFP4', t] / median[name, t]:.2f}x"
            for t in args.threads
        )
        print(f"| {name}{cells} |")


if __name__ == "__main__":
    main()
