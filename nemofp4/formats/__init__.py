"""Minifloat formats, rounding and block scaling. Depends on torch alone.

from nemofp4.formats import get_format, quantize_blocks
fmt = get_format("e2m1")          # "e4m3", "e5m2", "ue8m0", "ue5m3" (paper), "ue5m3_cuda"
fmt.round(x, rounding="rne")      # float32 grid values, saturating; also "sr", "sr8", "sr_exact"
q = quantize_blocks(x, scale_format="ue5m3")   # "e4m3" (NVFP4), "ue5m3_cuda", "ue8m0" (MX)
q.dequantize()

The shared scaling formulas are in ``formats.scaling``; ``QuantizedBlocks`` is the one quantized
tensor type every quantizer returns and every GEMM consumes; ``formats.spec`` holds the scale-format
table and the frozen ``BlockSpec`` every quantizer is typed against.
"""

from .block import amax, quantize_blocks, quantize_with_spec
from .hadamard import (
    TE_WGRAD_SIGNS,
    hadamard_matrix,
    hadamard_transform,
    inverse_hadamard_transform,
    wgrad_hadamard_transform,
)
from .minifloat import (
    E2M1,
    E4M3,
    E5M2,
    FORMATS,
    ROUNDING_MODES,
    UE5M3,
    UE5M3_CUDA,
    UE8M0,
    FloatFormat,
    SpecialValues,
    get_format,
    pack_fp4,
    sr8_bytes_at,
    sr8_draws,
    sr8_key,
    unpack_fp4,
)
from .operand import QuantizedBlocks, tensor_scale_product
from .spec import ELEMENT_FORMATS, SCALE_FORMAT_TABLE, SCALE_FORMATS, BlockSpec, ScaleFormat

__all__ = [
    "ELEMENT_FORMATS",
    "E2M1",
    "E4M3",
    "E5M2",
    "FORMATS",
    "ROUNDING_MODES",
    "SCALE_FORMATS",
    "SCALE_FORMAT_TABLE",
    "TE_WGRAD_SIGNS",
    "UE5M3",
    "UE5M3_CUDA",
    "UE8M0",
    "BlockSpec",
    "FloatFormat",
    "QuantizedBlocks",
    "ScaleFormat",
    "tensor_scale_product",
    "SpecialValues",
    "amax",
    "get_format",
    "hadamard_matrix",
    "hadamard_transform",
    "inverse_hadamard_transform",
    "wgrad_hadamard_transform",
    "pack_fp4",
    "quantize_blocks",
    "quantize_with_spec",
    "sr8_bytes_at",
    "sr8_draws",
    "sr8_key",
    "unpack_fp4",
]
