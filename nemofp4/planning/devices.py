"""Peak numbers of the GPUs a plan can be made for (per GPU, dense, as NVIDIA's datasheets list them).

NVIDIA lists tensor-core throughput "with sparsity"; the dense figures here are half of those. The
sources (checked 2026):

* H100 SXM5: https://www.nvidia.com/en-us/data-center/h100/ (datasheet table "H100 SXM"): FP32
  67 TFLOPS, TF32 989 / BF16 1,979 / FP8 3,958 TFLOPS with sparsity, 80 GB HBM3 at 3.35 TB/s, NVLink
  900 GB/s. No FP4 tensor cores.
* H200 SXM: https://www.nvidia.com/en-us/data-center/h200/ ("H200 SXM"): the H100's compute, 141 GB
  HBM3e at 4.8 TB/s, NVLink 900 GB/s. No FP4 tensor cores.
* H100 SXM 96GB HBM2e at 500 W (TorchTitan's benchmark hardware, Meta's Grand Teton: pytorch/torchtitan
  benchmarks/llama3_h100_202412_torchtitan.md): 96 GB HBM2e at 2.4 TB/s, the default 500 W power limit,
  eight GPUs per host fully connected by NVLink, 400 Gb/s RDMA per GPU. Its peak "is between SXM and NVL" and
  unknown (the benchmark's footnote): the preset keeps the SXM5 datasheet's peaks, and its power limit
  enters through the GEMM fractions measured on a 500 W H100 (:mod:`nemofp4.planning.efficiency`).
* B200 (one GPU of an HGX B200, 1,000 W): https://www.nvidia.com/en-us/data-center/hgx/ ("HGX
  B200", eight GPUs): FP4 144, FP8 72, BF16 36, TF32 18 PFLOPS with sparsity, 1,440 GB HBM3e at
  64 TB/s, NVLink 1.8 TB/s per GPU; per GPU and dense: FP4 9, FP8 4.5, BF16 2.25, TF32 1.1 PFLOPS,
  180 GB at 8 TB/s. FP32 80 TFLOPS: NVIDIA's Blackwell architecture technical brief (HGX B200
  table, https://resources.nvidia.com/en-us-blackwell-architecture).
* GB200 (one Blackwell GPU of a GB200 NVL72, 1,200 W): https://www.nvidia.com/en-us/data-center/gb200-nvl72/
  (per GB200 Grace Blackwell Superchip, two GPUs): FP4 40, FP8 20, BF16 10, TF32 5 PFLOPS with
  sparsity, FP32 180 TFLOPS (6,480 per NVL72 rack), 372 GB HBM3e at 16 TB/s, NVLink 3.6 TB/s;
  halved per GPU: FP32 90 TFLOPS (the technical brief's GB200 table says the same; 80 is the
  1,000 W HGX B200's). The NVL72's NVLink domain is 72 GPUs.
* Scale-out between NVLink domains: one 400 Gb/s NDR InfiniBand NIC per GPU (ConnectX-7, the HGX
  H100/H200/B200 reference design: https://www.nvidia.com/en-us/data-center/hgx/), 50 GB/s per direction.

* Compute capability (https://developer.nvidia.com/cuda-gpus): H100 and H200 9.0 (Hopper), B200 and
  GB200 10.0 (Blackwell). It decides which Transformer Engine recipes run natively
  (:data:`nemofp4.quant.TE_RECIPES`): per-tensor FP8 on every preset, MXFP8 and NVFP4 on the Blackwells.

NVLink figures are bidirectional in the datasheets; a collective's per-direction bandwidth is half.
"""

from __future__ import annotations

from dataclasses import dataclass

from nemofp4.quant import TE_RECIPES
from nemofp4.quant.te_linear import fp8_gemm_any_layout

__all__ = ["DEVICES", "Device", "get_device"]

TERA = 1e12


@dataclass(frozen=True, kw_only=True)
class Device:
    """One GPU's peak numbers (dense) and where it sits."""

    name: str
    memory_gib: float
    """Memory a process can use, GiB (the datasheet's GB are GiB of HBM; the CUDA context and the
    allocator's reserve come out of the plan's headroom)."""
    bf16_tflops: float
    tf32_tflops: float
    fp32_tflops: float
    fp4_tflops: float
    """Dense NVFP4 tensor-core peak; 0: no FP4 tensor cores (FP4 recipes run their GEMMs in BF16 on
    dequantized operands)."""
    fp8_tflops: float = 0.0
    """Dense FP8 tensor-core peak; 0: none (FP8 GEMMs run at the BF16 peak)."""
    compute_capability: tuple[int, int]
    """CUDA compute capability (major, minor): which Transformer Engine recipes run natively
    (:meth:`runs`)."""
    hbm_tb_s: float
    nvlink_gb_s: float
    """Per direction, per GPU."""
    scale_out_gb_s: float
    """Per direction, per GPU, between NVLink domains."""
    nvlink_domain: int
    """GPUs that share one NVLink domain (a node of 8, or an NVL72 rack)."""
    gpus_per_node: int
    """GPUs per host (SLURM node): the shard group of the launcher's HSDP layout."""
    source: str

    def runs(self, te_recipe: str) -> bool:
        """Whether Transformer Engine runs ``te_recipe`` (its class name) natively here
        (:data:`nemofp4.quant.TE_RECIPES`, TE's own rule by compute capability)."""
        return TE_RECIPES[te_recipe].supports(self.compute_capability)

    @property
    def fp8_gemm_any_layout(self) -> bool:
        """FP8 GEMMs take any operand layout (TE's ``nvte_is_non_tn_fp8_gemm_supported``): no FP8 transposes."""
        return fp8_gemm_any_layout(self.compute_capability)

    def matmul_tflops(self, precision: str) -> float:
        """Dense peak of a GEMM computed in ``precision`` ('bf16', 'tf32', 'fp32', 'fp8' or 'fp4'); a
        device without FP8 or FP4 tensor cores runs those GEMMs at its BF16 peak."""
        peaks = {
            "bf16": self.bf16_tflops,
            "tf32": self.tf32_tflops,
            "fp32": self.fp32_tflops,
            "fp8": self.fp8_tflops or self.bf16_tflops,
            "fp4": self.fp4_tflops or self.bf16_tflops,
        }
        if precision not in peaks:
            raise ValueError(f"precision={precision!r}; valid: {tuple(peaks)}")
        return peaks[precision]


DEVICES: dict[str, Device] = {
    "h100": Device(
        name="H100 SXM5 80GB",
        memory_gib=80,
        bf16_tflops=989.5,
        tf32_tflops=494.5,
        fp32_tflops=67,
        fp4_tflops=0,
        fp8_tflops=1979,
        hbm_tb_s=3.35,
        nvlink_gb_s=450,
        scale_out_gb_s=50,
        nvlink_domain=8,
        gpus_per_node=8,
        compute_capability=(9, 0),
        source="https://www.nvidia.com/en-us/data-center/h100/",
    ),
    "h200": Device(
        name="H200 SXM 141GB",
        memory_gib=141,
        bf16_tflops=989.5,
        tf32_tflops=494.5,
        fp32_tflops=67,
        fp4_tflops=0,
        fp8_tflops=1979,
        hbm_tb_s=4.8,
        nvlink_gb_s=450,
        scale_out_gb_s=50,
        nvlink_domain=8,
        gpus_per_node=8,
        compute_capability=(9, 0),
        source="https://www.nvidia.com/en-us/data-center/h200/",
    ),
    "h100_hbm2e_500w": Device(
        name="H100 SXM 96GB HBM2e, 500 W",
        memory_gib=96,
        bf16_tflops=989.5,
        tf32_tflops=494.5,
        fp32_tflops=67,
        fp4_tflops=0,
        fp8_tflops=1979,
        hbm_tb_s=2.4,
        nvlink_gb_s=450,
        scale_out_gb_s=50,
        nvlink_domain=8,
        gpus_per_node=8,
        compute_capability=(9, 0),
        source="https://github.com/pytorch/torchtitan/blob/main/benchmarks/llama3_h100_202412_torchtitan.md",
    ),
    "b200": Device(
        name="B200 (HGX) 180GB",
        memory_gib=180,
        bf16_tflops=2250,
        tf32_tflops=1100,
        fp32_tflops=80,
        fp4_tflops=9000,
        fp8_tflops=4500,
        hbm_tb_s=8.0,
        nvlink_gb_s=900,
        scale_out_gb_s=50,
        nvlink_domain=8,
        gpus_per_node=8,
        compute_capability=(10, 0),
        source="https://www.nvidia.com/en-us/data-center/hgx/",
    ),
    "gb200": Device(
        name="GB200 (NVL72) 186GB",
        memory_gib=186,
        bf16_tflops=2500,
        tf32_tflops=1250,
        fp32_tflops=90,
        fp4_tflops=10000,
        fp8_tflops=5000,
        hbm_tb_s=8.0,
        nvlink_gb_s=900,
        scale_out_gb_s=50,
        nvlink_domain=72,
        gpus_per_node=4,
        compute_capability=(10, 0),
        source="https://www.nvidia.com/en-us/data-center/gb200-nvl72/",
    ),
}


def get_device(name: str) -> Device:
    """The preset ``name`` (case-insensitive): h100, h200, h100_hbm2e_500w, b200 or gb200."""
    key = name.strip().lower()
    if key not in DEVICES:
        raise ValueError(f"device={name!r}; valid presets: {', '.join(DEVICES)}")
    return DEVICES[key]
