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

__all__ = ["ACHIEVED", "EFFICIENCY_MODES", "SOURCES", "Efficiency", "get_efficiency"]

EFFICIENCY_MODES = ("achieved", "peak")
"""``plan.efficiency``: achieved (the measured fractions below, the prediction) or peak (every kernel at its
peak: the roofline, a lower bound on the step time)."""


@dataclass(frozen=True, kw_only=True)
class Efficiency:
    """Fractions of peak a device's kernels reach, by kernel class."""

    gemm: tuple[tuple[int, float], ...]
    """(square-equivalent GEMM side, fraction of the dense peak), increasing sides. The same fraction for
    every precision: the one FP8 point measured matches the BF16 curve at its size (:data:`SOURCES`)."""
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

    def gemm_fraction(self, m: float, k: float, n: float) -> float:
        """The fraction of peak of an (m, k) x (k, n) GEMM."""
        side = (m * k * n) ** (1 / 3)
        points = self.gemm
        if side <= points[0][0]:
            return points[0][1] * side / points[0][0]  # below the smallest measured size: fixed cost dominates
        for (s0, f0), (s1, f1) in zip(points, points[1:]):
            if side <= s1:
                t = (math.log2(side) - math.log2(s0)) / (math.log2(s1) - math.log2(s0))
                return f0 + t * (f1 - f0)
        return points[-1][1]


PEAK = Efficiency(gemm=((1, 1.0),), attention={"sdpa": 1.0, "cudnn": 1.0}, scan=1.0, hbm=1.0, link=1.0,
                  scale_out=1.0, launch_s=0.0)  # fmt: skip
"""Every kernel at its peak: the roofline."""

_HOPPER = Efficiency(
    # torch.matmul BF16, square N, H100 80GB HBM3 (torch 2.7, cu128): 176.6 / 676.6 / 788.7 / 797.5 TFLOPS
    # at N = 1024 / 2048 / 4096 / 8192, of 989.5 dense
    gemm=((1024, 0.178), (2048, 0.684), (4096, 0.797), (8192, 0.806)),
    # FlashAttention-3 paper: FlashAttention-2 reaches 35% of the H100's peak; cuDNN's forward, head dim 128,
    # seq 8k: 600 TFLOPS (its figure "Attention forward speed, head dim 128 (H100 80GB SXM5)")
    attention={"sdpa": 0.35, "cudnn": 0.606},
    scan=0.35,  # no published SSD-kernel TFLOPS found: FlashAttention-2's fraction, the kernel family it is written like
    hbm=0.90,  # Calculon's h100_80g_nvl8.json mem1 efficiency at >= 100 MB
    link=0.60,  # Calculon's h100_80g_nvl8.json NVLink network efficiency
    scale_out=0.90,  # Calculon's h100_80g_nvl8.json InfiniBand network efficiency
    launch_s=5e-6,
)
ACHIEVED: dict[str, Efficiency] = {"h100": _HOPPER, "h200": _HOPPER, "b200": _HOPPER, "gb200": _HOPPER}
"""By device preset. No kernel-level measurement of the Blackwells' GEMMs, attention or collectives was
found: they take the H100's fractions (docs/planning.md says so in its table)."""

SOURCES: tuple[tuple[str, str, str], ...] = (
    ("GEMM, BF16, by size (H100)", "0.178 / 0.684 / 0.797 / 0.806 at N = 1024 / 2048 / 4096 / 8192",
     "https://github.com/zzc0721/torch-performance-test-data/issues/79 (torch.matmul, H100 80GB HBM3)"),
    ("GEMM, FP8 (H100)", "0.813 at N = 8192 (1,609 of 1,979 TFLOPS): the BF16 curve's fraction",
     "https://gitea.d-robotics.cc/han.zhao/test_gpu_scripts/raw/commit/7ec2da18bc66f5199b97863ea8e4dea01dd801f0/"
     "reports_cublaslt_fp8_crosscheck_20260524.md (cuBLASLt E4M3, TN)"),
    ("GEMM, FP4 (Blackwell)", "none found: the BF16 curve's fraction", ""),
    ("attention, SDPA (FlashAttention-2)", "0.35", "FlashAttention-3 paper, arXiv:2407.08608, abstract"),
    ("attention, cuDNN", "0.606 (600 TFLOPS forward, head dim 128, seq 8k)",
     "FlashAttention-3 paper, arXiv:2407.08608, forward-speed figure, head dim 128 (H100 SXM5)"),
    ("SSD scan (mamba-ssm)", "0.35: none found, FlashAttention-2's", ""),
    ("elementwise and quantizer passes", "0.90 of HBM", "calculon-ai/calculon systems/h100_80g_nvl8.json (mem1)"),
    ("collectives, NVLink / scale-out", "0.60 / 0.90 of link bandwidth",
     "calculon-ai/calculon systems/h100_80g_nvl8.json (networks)"),
    ("kernel launch", "5 us a kernel", "none found: an assumption, small against these steps"),
    ("Blackwell (b200, gb200)", "the H100's fractions", "no kernel-level Blackwell measurement found"),
)  # fmt: skip
"""(kernel class, the figure, its source) as docs/planning.md's table lists them."""


def get_efficiency(mode: str, device: str) -> Efficiency:
    """The efficiencies of ``device`` (a preset name) in ``mode`` (:data:`EFFICIENCY_MODES`)."""
    if mode not in EFFICIENCY_MODES:
        raise ValueError(f"plan.efficiency={mode!r}; valid: {', '.join(EFFICIENCY_MODES)}")
    return PEAK if mode == "peak" else ACHIEVED[device]
