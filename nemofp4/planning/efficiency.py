"""Achieved efficiency per kernel class: what fraction of a device's peak each kind of work reaches,
from published kernel-level measurements (never from end-to-end training runs, which are the test of
the step-cost model: :mod:`nemofp4.planning.published`). The sources, and where none was found, are in
:data:`SOURCES` and the table of docs/planning.md.

As Calculon (calculon-ai/calculon, ``systems/*.json``) does, an efficiency is a curve of the work's size:
a GEMM's fraction of its dense peak by its size (the cube root of M K N, the side of the square GEMM of
the same FLOPs), interpolated in log2 of the size between measured points and held flat beyond them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["ACHIEVED", "EFFICIENCY_MODES", "LAUNCH_S", "SOURCES", "Curve", "Efficiency", "get_efficiency"]

EFFICIENCY_MODES = ("achieved", "peak")
"""``plan.efficiency``: achieved (the measured fractions below, the prediction) or peak (every kernel at its
peak: the roofline, a lower bound on the step time)."""


Curve = tuple[tuple[int, float], ...]
"""(square-equivalent GEMM side, fraction of the dense peak), increasing sides."""


def _interpolate(points: Curve, side: float) -> float:
    """The fraction at ``side``: linear in log2 of the side between measured points, flat beyond the last,
    and falling linearly to zero below the first (where a GEMM's fixed cost dominates)."""
    if side <= points[0][0]:
        return points[0][1] * side / points[0][0]
    for (s0, f0), (s1, f1) in zip(points, points[1:]):
        if side <= s1:
            t = (math.log2(side) - math.log2(s0)) / (math.log2(s1) - math.log2(s0))
            return f0 + t * (f1 - f0)
    return points[-1][1]


@dataclass(frozen=True, kw_only=True)
class Efficiency:
    """Fractions of peak a device's kernels reach, by kernel class."""

    gemm: Curve
    """BF16 GEMMs: fraction of the BF16 dense peak by size."""
    gemm_fp8: Curve | None = None
    """FP8 GEMMs: fraction of the FP8 dense peak by size; None: the BF16 curve (where no FP8 measurement
    differs from it)."""
    gemm_fp4: Curve | None = None
    """FP4 GEMMs: fraction of the FP4 dense peak by size; None: the BF16 curve."""
    attention: dict[str, float]
    """Fraction of the BF16 peak a causal attention kernel's forward and backward reach at head dim 128 and
    sequence 8k, by kernel: ``sdpa`` (PyTorch's flash SDPA, FlashAttention-2's kernel, what our trainer
    runs) and ``cudnn`` (cuDNN's fused attention, which Transformer Engine and Megatron run)."""
    scan: float
    """Fraction of the BF16 peak of mamba-ssm's chunked SSD kernels."""
    hbm: float
    """Fraction of HBM bandwidth a large elementwise or quantizer pass reaches."""
    link: float
    """Fraction of NVLink bandwidth a large NCCL collective's bus bandwidth reaches."""
    scale_out: float
    """Fraction of the scale-out NIC's bandwidth the same reaches."""
    launch_s: float
    """Fixed cost of one kernel launch (host and device), seconds."""

    def gemm_curve(self, precision: str = "bf16") -> Curve:
        """The measured curve of GEMMs computed in ``precision`` (bf16, tf32 and fp32 take the BF16 one)."""
        own = {"fp8": self.gemm_fp8, "fp4": self.gemm_fp4}.get(precision)
        return own if own is not None else self.gemm

    def gemm_fraction(self, m: float, k: float, n: float, precision: str = "bf16") -> float:
        """The fraction of its precision's peak an (m, k) x (k, n) GEMM reaches."""
        return _interpolate(self.gemm_curve(precision), (m * k * n) ** (1 / 3))


PEAK = Efficiency(
    gemm=((1, 1.0),), attention={"sdpa": 1.0, "cudnn": 1.0}, scan=1.0, hbm=1.0, link=1.0, scale_out=1.0, launch_s=0.0
)
"""Every kernel at its peak: the roofline."""

LAUNCH_S = 5e-6
"""Fixed cost of one kernel launch, 5 us: a direct ``cuLaunchKernel`` of a 24 us kernel on a B200 measured 28.3 us
end to end (:data:`SOURCES`). PyTorch's eager dispatch adds host time per op, which the GPU hides while its
kernels are longer than it (these steps' are); the model adds the launch cost serially for every kernel, an
upper bound."""

_HOPPER = Efficiency(
    # torch.matmul BF16, square N, H100 80GB HBM3 (torch 2.7, cu128): 176.6 / 676.6 / 788.7 / 797.5 TFLOPS
    # at N = 1024 / 2048 / 4096 / 8192, of 989.5 dense
    gemm=((1024, 0.178), (2048, 0.684), (4096, 0.797), (8192, 0.806)),
    # causal, head dim 128, seq 8192, forward and backward together, on an H200 (the H100's GH100 compute) at
    # 700 W: PyTorch's flash SDPA 289.6 TFLOPS at batch 2 x 16 heads (cuDNN frontend's first SDPA benchmark);
    # cuDNN 9.19 at Llama 3.1's 64 query / 8 KV heads: forward 1.708 ms (644 TFLOPS), backward 5.083 ms
    # (541 TFLOPS), together 566.8
    attention={"sdpa": 0.293, "cudnn": 0.573},
    scan=0.35,  # no published SSD-kernel TFLOPS found: FlashAttention-2's fraction, the kernel family it is written like
    hbm=0.90,  # Calculon's h100_80g_nvl8.json mem1 efficiency at >= 100 MB
    link=0.60,  # Calculon's h100_80g_nvl8.json NVLink network efficiency
    scale_out=0.90,  # Calculon's h100_80g_nvl8.json InfiniBand network efficiency
    launch_s=LAUNCH_S,
)
_HOPPER_500W = Efficiency(
    # FBGEMM's fp8 GEMM benchmark on an "H100 500W": BF16 585.2 / 546.3 / 575.1 TFLOPS at (8192, 8192, 8192),
    # (65536, 3584, 8192), (65536, 8192, 7168) (sides 8192 / 12,440 / 15,670), of the SXM5's 989.5; below 8192
    # the 700 W part's curve, capped at the 500 W part's fraction at 8192
    gemm=((1024, 0.178), (2048, 0.591), (8192, 0.591), (12440, 0.552), (15670, 0.581)),
    # the same benchmark's row-wise scaled FP8 GEMM alone: 1,125.5 / 1,141.4 / 1,082.8 TFLOPS of 1,979
    gemm_fp8=((1024, 0.178), (2048, 0.569), (8192, 0.569), (12440, 0.577), (15670, 0.547)),
    attention=_HOPPER.attention,
    scan=_HOPPER.scan,  # none found at 500 W: the 700 W part's
    hbm=_HOPPER.hbm,
    link=_HOPPER.link,
    scale_out=_HOPPER.scale_out,
    launch_s=LAUNCH_S,
)
_B200 = Efficiency(
    # torch BF16 linear (cuBLAS), square N, B200 (torchao's bench_matmul.py): 0.188 / 0.410 / 0.503 / 0.672 /
    # 0.627 / 0.646 / 0.631 of 2,250 at N = 1024 / 1536 / 2048 / 3072 / 4096 / 6144 / 8192
    gemm=((1024, 0.188), (1536, 0.410), (2048, 0.503), (3072, 0.672), (4096, 0.627), (6144, 0.646), (8192, 0.631)),
    # tensor-scaled FP8 (vLLM's CUTLASS kernel, quantization excluded), Llama-3.1-8B's N=6144 K=4096 at
    # M = 1024 / 16384: 2,341.4 / 2,544.7 TFLOPS of 4,500
    gemm_fp8=((2954, 0.520), (7442, 0.565)),
    # NVFP4 torch._scaled_mm, square N (the same torchao benchmark), of 9,000
    gemm_fp4=((1024, 0.041), (1536, 0.120), (2048, 0.187), (3072, 0.390), (4096, 0.495), (6144, 0.611), (8192, 0.597)),
    # cuDNN frontend's SDPA training benchmark on B200, causal, 128 query / 8 KV heads of 128, seq 8192,
    # forward and backward together: cuDNN 998 TFLOPS, PyTorch's flash SDPA 317 TFLOPS, of 2,250
    attention={"sdpa": 0.141, "cudnn": 0.444},
    scan=_HOPPER.scan,  # none found
    hbm=_HOPPER.hbm,  # none found
    link=0.92,  # nccl-tests all_reduce_perf on 8 B200: bus bandwidth 830 GB/s of NVLink 5's 900 per direction
    scale_out=_HOPPER.scale_out,  # the same 400 Gb/s NIC
    launch_s=LAUNCH_S,
)
_GB200 = Efficiency(
    gemm=_B200.gemm,  # none found for the GB200: the B200's (the same GPU at 1,200 W)
    # Azure ND GB200 v6, cuBLASLt FP8, square N: 489.2 / 2,243.6 / 2,834.6 / 2,876.6 / 2,906.9 TFLOPS at
    # N = 1024 / 2048 / 4096 / 8192 / 16384, of 5,000
    gemm_fp8=((1024, 0.098), (2048, 0.449), (4096, 0.567), (8192, 0.575), (16384, 0.581)),
    # the same, FP4: 287.2 / 1,677.7 / 5,177.3 / 7,535.6 / 7,627.6 TFLOPS of 10,000
    gemm_fp4=((1024, 0.029), (2048, 0.168), (4096, 0.518), (8192, 0.754), (16384, 0.763)),
    # cuDNN 9.18 on GB200 (cuDNN frontend's llama3.1 config: 64 query / 8 KV heads of 128, causal, seq 8192):
    # forward 1,563 and backward 1,279 TFLOPS, together 1,349 of 2,500; FlashAttention-2 on Azure's GB200 (head
    # dim 128, batch 2, seq 8192): 373.9 TFLOPS
    attention={"sdpa": 0.150, "cudnn": 0.540},
    scan=_HOPPER.scan,  # none found
    hbm=_HOPPER.hbm,  # none found
    link=0.755,  # Azure ND GB200 v6, NCCL all-reduce (ring) over its 4 GPUs at 8 GB: 679.6 GB/s of 900
    scale_out=_HOPPER.scale_out,
    launch_s=LAUNCH_S,
)
ACHIEVED: dict[str, Efficiency] = {
    "h100": _HOPPER,
    "h200": _HOPPER,
    "h100_hbm2e_500w": _HOPPER_500W,
    "b200": _B200,
    "gb200": _GB200,
}
"""By device preset. The H200 takes the H100's fractions (the same compute; no kernel-level H200 measurement
used); every class without a measurement of its own is marked in :data:`SOURCES`."""

SOURCES: tuple[tuple[str, str, str], ...] = (
    (
        "GEMM, BF16, by size (H100)",
        "0.178 / 0.684 / 0.797 / 0.806 at N = 1024 / 2048 / 4096 / 8192",
        "https://github.com/zzc0721/torch-performance-test-data/issues/79 (torch.matmul, H100 80GB HBM3)",
    ),
    (
        "GEMM, FP8 (H100)",
        "0.813 at N = 8192 (1,609 of 1,979 TFLOPS): the BF16 curve's fraction",
        "https://gitea.d-robotics.cc/han.zhao/test_gpu_scripts/raw/commit/7ec2da18bc66f5199b97863ea8e4dea01dd801f0/"
        "reports_cublaslt_fp8_crosscheck_20260524.md (cuBLASLt E4M3, TN)",
    ),
    (
        "GEMM, BF16 / FP8 (H100 at 500 W)",
        "BF16 0.591 / 0.552 / 0.581, row-wise FP8 0.569 / 0.577 / 0.547 at sides "
        "8192 / 12,440 / 15,670 (below: the 700 W curve capped at 0.591 / 0.569)",
        'https://github.com/pytorch/FBGEMM/pull/2546 ("H100 500W", BF16 and FP8 GEMM TFLOPS)',
    ),
    (
        "GEMM, BF16 / FP4, by size (B200)",
        "BF16 0.188 / 0.503 / 0.627 / 0.631, NVFP4 0.041 / 0.187 / 0.495 / 0.597 at N = 1024 / 2048 / 4096 / 8192",
        "https://github.com/pytorch/ao/pull/2427 (bench_matmul.py, NVIDIA B200)",
    ),
    (
        "GEMM, FP8 (B200)",
        "0.520 / 0.565 at M = 1024 / 16384, N = 6144, K = 4096 (tensor-scaled, CUTLASS)",
        "https://github.com/vllm-project/vllm/pull/19566 (bench_fp8_gemm.py, SM100 CUTLASS tunings for B200)",
    ),
    (
        "GEMM, FP8 / FP4, by size (GB200)",
        "FP8 0.098 / 0.449 / 0.567 / 0.575 / 0.581, FP4 0.029 / 0.168 / 0.518 / "
        "0.754 / 0.763 at N = 1024 / 2048 / 4096 / 8192 / 16384; BF16: none found, the B200's",
        "https://github.com/Azure/AI-benchmarking-guide Azure_Results/ND_GB200_v6_results.md (cuBLASLt)",
    ),
    (
        "attention, SDPA (FlashAttention-2), H100",
        "0.293 (289.6 TFLOPS: causal, batch 2 x 16 heads of 128, seq 8192, forward and backward; H200, 700 W)",
        "https://github.com/NVIDIA/cudnn-frontend benchmark/benchmark_results.csv at commit 505fcfe "
        "(PyTorch's flash SDPA)",
    ),
    (
        "attention, cuDNN, H100",
        "0.573 (cuDNN 9.19, llama3.1: 64 query / 8 KV heads of 128, causal, seq 8192, forward and backward; H200)",
        "https://github.com/NVIDIA/cudnn-frontend benchmark/sdpa_benchmark_training/results/h200_919_only_cudnn/"
        "llama3.1_20260227_034703.csv",
    ),
    (
        "attention, cuDNN / SDPA, B200",
        "0.444 / 0.141 (causal, head dim 128, seq 8192, forward and backward)",
        "https://github.com/NVIDIA/cudnn-frontend benchmark/sdpa_benchmark_training/artifacts/"
        "sdpa_bf16_benchmark_results_NVIDIA_B200.csv",
    ),
    (
        "attention, cuDNN / SDPA, GB200",
        "0.540 (cuDNN 9.18, llama3.1, causal, seq 8192, forward and backward) / "
        "0.150 (FlashAttention-2, head dim 128, seq 8192)",
        "https://github.com/NVIDIA/cudnn-frontend benchmark/sdpa_benchmark_training/results/gb200_918_only_cudnn/"
        "llama3.1_20260126_110503.csv; Azure ND_GB200_v6_results.md",
    ),
    ("SSD scan (mamba-ssm)", "0.35: none found, FlashAttention-2's H100 fraction, on every device", ""),
    (
        "elementwise and quantizer passes",
        "0.90 of HBM on every device (none found for the Blackwells)",
        "calculon-ai/calculon systems/h100_80g_nvl8.json (mem1)",
    ),
    (
        "collectives, NVLink / scale-out (H100)",
        "0.60 / 0.90 of link bandwidth",
        "calculon-ai/calculon systems/h100_80g_nvl8.json (networks)",
    ),
    (
        "collectives, NVLink (B200 / GB200)",
        "0.92 (all-reduce bus bandwidth 830 of 900 GB/s, 8 GPUs) / 0.755 (679.6 of 900 GB/s, ring, 4 GPUs, 8 GB)",
        "https://github.com/NVIDIA/nccl/issues/1807; Azure ND_GB200_v6_results.md (NCCL bandwidth)",
    ),
    (
        "kernel launch",
        "5 us a kernel (a 24 us kernel launched directly: 28.3 us on a B200), every device; kernels "
        "counted from our code path (nemofp4/planning/launches.py)",
        "https://dogacel.github.io/my-agent-blog/performance/2026/03/14/"
        "four-counter-intuitive-lessons-from-deep-diving-gpu-kernel-dispatch-overhead",
    ),
)
"""(kernel class, the figure, its source) as docs/planning.md's table lists them."""


def get_efficiency(mode: str, device: str) -> Efficiency:
    """The efficiencies of ``device`` (a preset name) in ``mode`` (:data:`EFFICIENCY_MODES`)."""
    if mode not in EFFICIENCY_MODES:
        raise ValueError(f"plan.efficiency={mode!r}; valid: {', '.join(EFFICIENCY_MODES)}")
    return PEAK if mode == "peak" else ACHIEVED[device]
