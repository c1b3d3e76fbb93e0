"""The CPU fast path: QuantLinear's operand quantizer as one fused loop compiled by Inductor.

On CPU, :func:`nemofp4.quant.blocks.quantize_operand` runs as a dozen elementwise PyTorch ops,
each a pass over memory with its own dispatch; at the widths of small models that costs more
than the GEMMs it feeds. Here the same computation is written once as plain tensor code
(:func:`_quantize_core`) and handed to ``torch.compile``, whose C++ backend fuses it into a
block-amax reduction and one elementwise loop (the tiny model's ue5m3 step goes from 1.50x to
about 1.3x bf16: ``scripts/bench_recipes.py`` with and without ``--kernels reference``). The
formulas and their float32 order are those of the reference, and Inductor compiles without
value-changing math flags (no reassociation, no contraction), so the result is bitwise the
reference's; the tests hold it to that.

Stochastic rounding draws outside the compiled code (:func:`nemofp4.formats.sr8_words`, as
the reference does) and unpacks the bytes inside it, so both consume a generator
identically. Exact SR (``sr``) and UE8M0 scales are not compiled: those operands take the eager
path. Compilation needs a C++ compiler; without one (or with ``NEMOFP4_CPU_COMPILE=0``) the
dispatcher uses the eager path, which has the same numerics; a build that fails anyway warns once
and falls back to it.
"""

from __future__ import annotations

import functools
import os
import shutil
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nemofp4.formats.minifloat import sr8_bytes, sr8_words
from nemofp4.quant.blocks import BlockOperand, PackedOperand, encode_scales, round_scale_rne, scale_grid

__all__ = ["compiled_quantize_operand", "cpu_compile_available", "cpu_compile_supports"]

_FP4_MAX = 6.0
_FLT_MAX = torch.finfo(torch.float32).max
_COMPILED_SCALE_FORMATS = ("e4m3", "ue5m3", "ue5m3_cuda")
_COMPILED_ROUNDINGS = ("rne", "sr8")
_RECOMPILE_LIMIT = 128  # one graph per operand kind (format, blocks, rounding, outputs) in a process


_SCALE_GRIDS = {name: scale_grid(name) for name in _COMPILED_SCALE_FORMATS}


@dataclass(frozen=True)
class _Spec:
    """The static part of one quantization: one compiled graph per distinct spec."""

    scale_format: str
    block_size: int
    two_d: bool
    rounding: str
    pack: bool
    stats: bool


def cpu_compile_supports(op) -> bool:
    """Whether the compiled path implements this operand's scale format and rounding."""
    return op.scale_format in _COMPILED_SCALE_FORMATS and op.rounding in _COMPILED_ROUNDINGS


_compile_failed = False


@functools.cache
def cpu_compile_available() -> bool:
    """``torch.compile`` can build CPU kernels here: a C++ compiler is on PATH (or in ``CXX``),
    ``NEMOFP4_CPU_COMPILE`` is not ``0``, and no compilation has failed in this process."""
    if os.environ.get("NEMOFP4_CPU_COMPILE", "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    if _compile_failed:
        return False
    compiler = os.environ.get("CXX") or "c++"
    return any(shutil.which(c) for c in (compiler, "g++", "clang++"))


def _run_compiled(spec: _Spec, *args):
    """The compiled core. If it cannot be built here (a broken toolchain, missing headers), warn
    once, switch the compiled path off for the process and run this call's core eagerly on the
    same inputs (the same numerics, and the random draws already made are the ones used)."""
    global _compile_failed
    if not _compile_failed:
        try:
            return _compiled(spec)(*args)
        except torch._dynamo.exc.BackendCompilerFailed as error:
            _compile_failed = True
            cpu_compile_available.cache_clear()
            warnings.warn(
                f"torch.compile could not build the CPU FP4 quantizer ({error}); quantizing with the "
                "eager PyTorch path instead (same numerics, slower). NEMOFP4_CPU_COMPILE=0 skips the attempt.",
                stacklevel=3,
            )
    return _quantize_core(*args, spec=spec)


# ------------------------------------------------------------------------------------ core
def _quantize_core(blocks: torch.Tensor, g: torch.Tensor, target: torch.Tensor, words: torch.Tensor | None, spec: _Spec):
    """Quantize ``blocks``, padded float32 ``x`` viewed as [R, 1, C/b, b] (1-D blocks) or
    [R/b, b, C/b, b] (2-D tiles), so that a block is dims 1 and 3.

    ``g`` is the tensor reference and ``target`` float32(T * 6), both 0-d float32. Returns
    (scaled values shaped like ``blocks``, tensor_scale, uint8 E2M1 codes shaped like ``blocks``
    | None, scale codes [R or R/b, C/b] | None, counts [3] | None). The formulas and their
    float32 order are those of :func:`nemofp4.quant.blocks.quantize_operand`.
    """
    grid = _SCALE_GRIDS[spec.scale_format]
    zero_becomes_one = spec.scale_format != "e4m3"  # UE5M3 emulation: a zero scale code becomes 1.0
    block_amax = blocks.abs().amax(dim=(1, 3), keepdim=True)

    # Tensor scale 1/G and the code multiplier G/6 (G maps the reference to T).
    multiplier = torch.clamp(target / g, max=_FLT_MAX)
    if zero_becomes_one:  # the UE5M3 emulator: g = 0 -> G = 1
        multiplier = torch.where(g == 0, 1.0, multiplier)
    else:  # TE: g = 0 gives FLT_MAX; only g = inf (multiplier 0) -> 1
        multiplier = torch.where(multiplier == 0, 1.0, multiplier)
    tensor_scale = torch.reciprocal(multiplier)
    code_multiplier = multiplier * (1.0 / _FP4_MAX)

    ideal = torch.clamp(block_amax * code_multiplier, max=_FLT_MAX)
    rounded_scale = round_scale_rne(torch.clamp(ideal, max=grid.max_finite), grid)
    block_scale = rounded_scale + (rounded_scale == 0) if zero_becomes_one else rounded_scale
    encode = torch.clamp(torch.reciprocal(block_scale * tensor_scale), max=_FLT_MAX)

    # Payload magnitude |y| = |x| * encode, saturating at 6, rounded onto the E2M1 grid, whose
    # binades [0,2), [2,4), [4,6] have spacings 1/2, 1, 2 (comparisons, not bit casts: they
    # vectorize).
    magnitude = torch.clamp(blocks.abs() * encode, max=_FP4_MAX)
    upper, middle = magnitude >= 4.0, magnitude >= 2.0
    inv = torch.where(upper, 0.5, torch.where(middle, 1.0, 2.0))  # 1 / spacing
    if spec.rounding == "rne":
        magic = torch.where(upper, 1.5 * 2.0**24, torch.where(middle, 1.5 * 2.0**23, 1.5 * 2.0**22))  # ulp = spacing
        rounded = (magnitude + magic) - magic  # one IEEE addition rounds to the grid, ties to even
        steps = rounded * inv
    else:  # sr8: away from zero iff frac >= 1 - (2r + 1)/512, r the element's random byte
        scaled_grid = magnitude * inv
        lower = torch.floor(scaled_grid)
        frac = scaled_grid - lower
        r = sr8_bytes(words, blocks.numel()).view(blocks.shape).to(torch.float32)
        threshold = r * (-2.0 / 512) + (511.0 / 512)
        steps = torch.where(frac >= threshold, lower + 1.0, lower)
        rounded = steps / inv
    values = torch.copysign(rounded, blocks) * block_scale

    codes = scale_codes = counts = None
    if spec.pack:
        # E2M1 code = sign * 8 + the binade's first code (0, 2, 4 spacings) + steps.
        offset = torch.where(upper, 4.0, torch.where(middle, 2.0, 0.0))
        negative = torch.copysign(torch.ones_like(blocks), blocks) < 0  # -0.0 too (signbit does not vectorize)
        codes = (torch.where(negative, 8.0, 0.0) + steps + offset).to(torch.uint8)
        scale_codes = encode_scales(block_scale, grid).view(block_scale.shape[0], block_scale.shape[2])
    if spec.stats:
        saturated = ideal > grid.max_finite
        underflow = (rounded_scale == 0) & (block_amax > 0)
        zero = block_amax == 0
        counts = torch.stack((saturated, underflow, zero)).view(3, -1).sum(1)
    return values, tensor_scale, codes, scale_codes, counts


@functools.lru_cache(maxsize=64)
def _scaled_target(scale_target: float) -> torch.Tensor:
    """float32(T * 6) as a 0-d CPU tensor: T * 6 in double, rounded once, as the reference does."""
    return torch.tensor(scale_target * _FP4_MAX, dtype=torch.float32)


@functools.cache
def _compiled(spec: _Spec):
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, _RECOMPILE_LIMIT)
    # The caller marks the block-count dims dynamic; the spec's numbers and the block size
    # stay compile-time constants.
    return torch.compile(functools.partial(_quantize_core, spec=spec), dynamic=False, fullgraph=True)


# ------------------------------------------------------------------------------------ entry
def compiled_quantize_operand(
    x: torch.Tensor,
    op,
    *,
    tensor_amax: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    two_d: bool | None = None,
    pack: bool = False,
    stats: bool = True,
    compile: bool = True,
):
    """Same contract and result as :func:`nemofp4.quant.blocks.quantize_operand`.

    ``compile=False`` runs the same core eagerly (for tests of the core itself).
    """
    if x.dim() != 2:
        raise ValueError(f"quantize_operand takes a 2-D tensor, got shape {tuple(x.shape)}")
    if not cpu_compile_supports(op):
        raise ValueError(
            f"the compiled quantizer implements scale formats {_COMPILED_SCALE_FORMATS} and roundings "
            f"{_COMPILED_ROUNDINGS}, got {op.scale_format!r} with {op.rounding!r}"
        )
    two_d = op.two_d if two_d is None else two_d
    b = op.block_size
    rows, cols = x.shape
    x32 = x.detach().float()
    pad_r, pad_c = (-rows % b if two_d else 0), -cols % b
    if pad_r or pad_c:
        x32 = F.pad(x32, (0, pad_c, 0, pad_r))
    rows_p, cols_p = x32.shape
    row_block = b if two_d else 1
    blocks = x32.contiguous().view(rows_p // row_block, row_block, cols_p // b, b)
    # Current scaling: the tensor's own amax, one reduction before the fused pass (it is exact).
    g = x32.abs().amax() if tensor_amax is None else tensor_amax.detach().float().reshape(())
    target = _scaled_target(float(op.scale_target))
    words = sr8_words(rows_p * cols_p, generator, x.device) if op.rounding == "sr8" else None
    spec = _Spec(op.scale_format, b, two_d, op.rounding, pack, stats)
    if compile and not torch.compiler.is_compiling():  # inside a compiled region dynamo inlines the core
        core = functools.partial(_run_compiled, spec)
        torch._dynamo.mark_dynamic(blocks, (0, 2))  # one graph for every operand shape
        if words is not None:
            torch._dynamo.mark_dynamic(words, 0)
    else:
        core = functools.partial(_quantize_core, spec=spec)
    values, tensor_scale, codes, scale_codes, counts = core(blocks, g, target, words)
    if codes is not None:  # two per byte, even element in the low nibble (outside the fused loop,
        # whose vectorized body would otherwise compute every element twice, once per nibble)
        pairs = codes.view(-1, 2)
        codes = torch.bitwise_or(pairs[:, 1] << 4, pairs[:, 0]).view(rows_p, cols_p // 2)

    packed = None
    if pack:
        packed = PackedOperand(
            codes=codes,
            scale_codes=scale_codes,
            tensor_scale=tensor_scale,
            tensor_amax=g,
            scale_format=op.scale_format,
            shape=(rows, cols),
            padded_shape=(rows_p, cols_p),
            block_size=b,
            two_d=two_d,
        )
    names = ("saturated_blocks", "underflow_blocks", "zero_blocks")
    return BlockOperand(
        scaled=values.view(rows_p, cols_p),
        tensor_scale=tensor_scale,
        tensor_amax=g,
        shape=(rows, cols),
        block_size=b,
        two_d=two_d,
        counts=dict(zip(names, counts.unbind())) if stats else {},
        num_blocks=(rows_p // (b if two_d else 1)) * (cols_p // b),
        packed=packed,
    )
