"""Peak numbers of the GPUs a plan can be made for (per GPU, dense, as NVIDIA's datasheets list them).

NVIDIA lists tensor-core throughput "with sparsity"; the dense figures here are half of those. The
sources (checked 2026):

* H100 SXM5: https://www.nvidia.com/en-us/data-center/h100/ (datasheet table "H100 SXM"): FP32
  67 TFLOPS, TF32 989 / BF16 1,979 TFLOPS with sparsity, 80 GB HBM3 at 3.35 TB/s, NVLink 900 GB/s.
* H200 SXM: https://www.nvidia.com/en-us/data-center/h200/ ("H200 SXM"): the H100's compute, 141 GB
  HBM3e at 4.8 TB/s, NVLink 900 GB/s.
* GB200 (one Blackwell GPU of a GB200 NVL72): https://www.nvidia.com/en-us/data-center/gb200-nvl72/
  (per GB200 Grace Blackwell Superchip, two GPUs): FP4 40, BF16 10, TF32 5 PFLOPS with sparsity,
  FP32 160 TFLOPS, 372 GB HBM3e at 16 TB/s, NVLink 3.6 TB/s; halved per GPU. The NVL72's NVLink
  domain is 72 GPUs.
* Scale-out between NVLink domains: one 400 Gb/s NDR InfiniBand NIC per GPU (ConnectX-7, the HGX
  H100/H200 reference design: https://www.nvidia.com/en-us/data-center/hgx/), 50 GB/s per direction.

NVLink figures are bidirectional in the datasheets; a collective's per-direction bandwidth is half.
"""

from __future__ import annotations

from dataclasses import dataclass

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
    """0: no FP4 tensor cores (FP4 recipes run their GEMMs in BF16 on dequantized operands)."""
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

    def matmul_tflops(self, precision: str) -> float:
        """Dense peak of a GEMM computed in ``precision`` ('bf16', 'tf32', 'fp32' or 'fp4')."""
        peaks = {"bf16": self.bf16_tflops, "tf32": self.tf32_tflops, "fp32": self.fp32_tflops,
                 "fp4": self.fp4_tflops or self.bf16_tflops}  # fmt: skip
        if precision not in peaks:
            raise ValueError(f"precision={precision!r}; valid: {tuple(peaks)}")
        return peaks[precision]


DEVICES: dict[str, Device] = {
    "h100": Device(name="H100 SXM5 80GB", memory_gib=80, bf16_tflops=989.5, tf32_tflops=494.5, fp32_tflops=67,
                   fp4_tflops=0, hbm_tb_s=3.35, nvlink_gb_s=450, scale_out_gb_s=50, nvlink_domain=8, gpus_per_node=8,
                   source="https://www.nvidia.com/en-us/data-center/h100/"),
    "h200": Device(name="H200 SXM 141GB", memory_gib=141, bf16_tflops=989.5, tf32_tflops=494.5, fp32_tflops=67,
                   fp4_tflops=0, hbm_tb_s=4.8, nvlink_gb_s=450, scale_out_gb_s=50, nvlink_domain=8, gpus_per_node=8,
                   source="https://www.nvidia.com/en-us/data-center/h200/"),
    "gb200": Device(name="GB200 (NVL72) 186GB", memory_gib=186, bf16_tflops=2500, tf32_tflops=1250, fp32_tflops=80,
                    fp4_tflops=10000, hbm_tb_s=8.0, nvlink_gb_s=900, scale_out_gb_s=50, nvlink_domain=72, gpus_per_node=4,
                    source="https://www.nvidia.com/en-us/data-center/gb200-nvl72/"),
}  # fmt: skip


def get_device(name: str) -> Device:
    """The preset ``name`` (case-insensitive): h100, h200 or gb200."""
    key = name.strip().lower()
    if key not in DEVICES:
        raise ValueError(f"device={name!r}; valid presets: {', '.join(DEVICES)}")
    return DEVICES[key]
