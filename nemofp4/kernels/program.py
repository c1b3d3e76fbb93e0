"""The one torch program that quantizes GEMM operands: run eagerly, or compiled by Inductor.

:func:`quantize` takes :class:`~nemofp4.kernels.request.OperandRequest`s and covers every scale
format (E4M3, UE5M3, UE8M0, per-tensor FP32) and payload rounding (RNE, TE's 8-bit ``sr``, the
paper's ``sr8``, ``sr_exact``) with 1-D blocks, 2-D tiles or blocks down the columns of a
token-major tensor (the wgrad operands X^T, dY^T, the wgrad Hadamard transform inside the loop).
Its cores, :func:`_quantize_core` (FP4) and :func:`_fp8_core`, are plain tensor code over the
shared formulas of :mod:`nemofp4.formats.scaling`; the :class:`~nemofp4.kernels.request.CoreRunner`
the call is given runs them: :data:`EAGER` op by op, :data:`COMPILED` through ``torch.compile``,
whose C++ backend fuses them into a block-amax reduction and one elementwise loop, all the
requests of a call as one graph (every compiled call pays Dynamo's wrapper and guards, which on a
small operand weigh as much as its kernel), or the native kernel's runner
(:class:`nemofp4.kernels.native.NativeCores`) for the operands it covers. Inductor compiles
without value-changing math flags (no reassociation, no contraction), so every runner gives the
same bits, equal to the float64-checked reference :func:`nemofp4.formats.quantize_blocks`; the
tests hold them to that.

Random bits follow the reference's contract: sr and sr8 draw one key per operand
(:func:`sr8_key`) and the core hashes each element's index with it (:func:`sr8_bytes_at`), inside
the loop that rounds (compiled, no random bytes are stored or read); sr_exact draws one float64
``torch.rand`` per element outside the core. The draws are made here, request after request, before
any core runs, so every runner consumes a generator identically.

Unlike the reference the program does not check for NaN/Inf (that would synchronize): a
non-finite input yields non-finite values, which the trainer's checks catch.

Compiling needs a C++ compiler (:func:`nemofp4.kernels.toolchain.cpu_compile_available`); a spec
whose build fails anyway warns once, naming the spec, and runs its core eagerly on the same inputs
from then on (the other specs still compile).
"""

from __future__ import annotations

import functools
import math
import types
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F

from nemofp4.formats import QuantizedBlocks, wgrad_hadamard_transform
from nemofp4.formats.minifloat import BYTE_DRAW_ROUNDINGS, sr8_bytes_at, sr8_key, sr_away
from nemofp4.formats.scaling import (
    FLT_MAX,
    FP4_MAX,
    element_grid,
    encode_scales,
    fp8_max,
    fp8_tensor_scale,
    global_scales,
    mx_floor_exponent,
    mx_fp8_encode,
    mx_fp8_scale_codes,
    round_scale_rne,
    scale_grid,
    scaled_target,
)
from nemofp4.formats.spec import (
    BLOCK_STATS,
    DEFAULT_SCALE_TARGET,
    ELEMENT_FORMATS,
    SCALE_FORMAT_TABLE,
    BlockSpec,
)

from .request import (
    TOKEN_MULTIPLE,
    CoreOperand,
    CoreRunner,
    CoreSpec,
    OperandRequest,
    tokens_transposed,
)

__all__ = [
    "COMPILED",
    "EAGER",
    "TOKEN_MULTIPLE",
    "compiled_hadamard_transform",
    "quantize",
    "quantize_operand",
    "quantize_operand_pair",
    "quantize_tokens_operand",
    "tokens_transposed",
]

_POW2_MIN = 2.0**-127  # the smallest UE8M0 scale, a float32 subnormal
_SCALE_GRIDS = {
    name: scale_grid(name) for name, row in SCALE_FORMAT_TABLE.items() if row.codes is not None and not row.power_of_two
}
"""Plain dict of named tuples: the compiled core reads them as constants."""
_FP8_GRIDS = {name: element_grid(name) for name in ELEMENT_FORMATS if name != "e2m1"}
_FP8_MAX_RECIPROCALS = {name: float(torch.tensor(1.0 / fp8_max(name), dtype=torch.float32)) for name in _FP8_GRIDS}
"""TE's ``Quantized_Limits::max_norm_rcp``: ``1.0 / max`` in double, stored as a float32."""
_FP8_EMAX = {name: int(math.floor(math.log2(fp8_max(name)))) for name in _FP8_GRIDS}
"""The FP8 payloads' largest exponents (8 for E4M3, 15 for E5M2): OCP MX's floor-mode offset."""


# ------------------------------------------------------------------------------------ core
def _pow2(exponent: torch.Tensor) -> torch.Tensor:
    """Exactly 2^e in float32 for int32 e in [-127, 127], built from the bits."""
    normal = ((exponent + 127).clamp(min=1) << 23).view(torch.float32)
    return torch.where(exponent > -127, normal, _POW2_MIN)


_SIGN_BIT = -(2**31)
"""The float32 sign bit, as an int32 mask."""


def _copysign(magnitude: torch.Tensor, x: torch.Tensor, bitwise: bool) -> torch.Tensor:
    """``copysign(magnitude, x)`` for a non-negative float32 ``magnitude``, bit for bit either way
    (-0.0 included). ``bitwise`` ors x's sign bit into magnitude's bits: compiled with float32-wide
    vectors, integer instructions, where ``copysign`` is a call into a vector math library in the
    middle of the loop; with BF16-wide vectors (a BF16 operand in the loop) Inductor casts the bits
    one lane at a time, and ``copysign`` is the faster."""
    if bitwise:
        return (magnitude.view(torch.int32) | (x.view(torch.int32) & _SIGN_BIT)).view(torch.float32)
    return torch.copysign(magnitude, x)


def _materialized(t: torch.Tensor) -> torch.Tensor:
    """``t``, stored by Inductor to a buffer of its own instead of fused into every consumer: a
    per-block value (a block scale) recomputed in a vectorized loop over the elements would be
    computed once per element, with scalar code."""
    if not torch.compiler.is_compiling():
        return t
    return torch.ops.prims.inductor_force_stride_order(t, t.stride())


def _element_index(blocks: torch.Tensor, spec: CoreSpec) -> torch.Tensor:
    """int64 index of each element of ``blocks`` in the operand's element order (that of its random
    bytes): row-major over the padded ``x``, or with ``spec.columns`` over its transpose (element
    (t, d) of the token-major input is element d * Tp + t). Compiled, it is the loop's index
    arithmetic (down the columns, plus a buffer of each feature's first index), never a tensor of
    the operand's size."""
    if not spec.columns:
        return torch.arange(blocks.numel(), device=blocks.device).view(blocks.shape)
    rows = blocks.shape[0] * blocks.shape[1]
    tokens = torch.arange(rows, device=blocks.device).view(blocks.shape[0], blocks.shape[1], 1, 1)
    # each feature's first index, stored once (compiled): the loop over the elements runs along the
    # features, and Inductor computes an index with a symbolic stride there one lane at a time
    starts = _materialized(torch.arange(blocks.shape[2], device=blocks.device) * rows)
    return starts.view(1, 1, -1, 1) + tokens


def _quantize_core(
    blocks: torch.Tensor, g: torch.Tensor, target: torch.Tensor, draws: torch.Tensor | None, spec: CoreSpec
):
    """Quantize ``blocks``, padded ``x`` (float32, or the BF16/FP16 input itself, converted exactly in
    the loop that reads it: no float32 copy is made) viewed as [R, 1, C/b, b] (1-D blocks),
    [R/b, b, C/b, b] (2-D tiles) or [R/b, b, C, 1] (``spec.columns``: blocks down the columns), so
    that a block is dims 1 and 3.

    ``g`` is the tensor reference (None with ``spec.measure``) and ``target`` float32(T * 6), both
    0-d float32; ``draws`` the random bits: sr/sr8 the operand's 0-d int64 key (each element's byte is
    hashed from it and the element's index), sr_exact float64 uniforms shaped like ``blocks``; both in
    the element order of the operand: row-major over ``x``, or over ``x^T`` with ``spec.columns``.

    Returns (scaled values shaped like ``blocks`` | None (not ``spec.values``), tensor_scale, g,
    packed E2M1 codes (:func:`_packed`) | None, scale codes [R or R/b, C/b] or [C, R/b] | None,
    counts [3]: saturated, underflowed and zero blocks).
    """
    # float32-wide vectors in the compiled loops (see _copysign): a float32 input without the Hadamard
    # transform's BF16 buffer, or a BF16/FP16 input read along its rows
    bitwise_sign = not spec.hadamard and (blocks.dtype == torch.float32 or not spec.columns)
    blocks = blocks.float()
    if spec.hadamard:  # along the columns: groups of 16 consecutive rows
        # its values are BF16 (TE's rounding): compiled, the stored transform is a BF16 buffer
        dtype = torch.bfloat16 if torch.compiler.is_compiling() else torch.float32
        transformed = wgrad_hadamard_transform(blocks.view(-1, blocks.shape[2]), dim=0, dtype=dtype)
        blocks = _materialized(transformed.view(blocks.shape)).float()
    block_amax = blocks.abs().amax(dim=(1, 3), keepdim=True)
    if spec.measure:
        g = block_amax.amax()  # == max |x| (padding is zero), exactly

    if spec.power_of_two:  # OCP MX: power-of-two block scales, no tensor scale
        tensor_scale = torch.ones((), dtype=torch.float32, device=blocks.device)
        unclamped = mx_floor_exponent(block_amax)
        exponent = unclamped.clamp(-127, 127)
        block_scale, encode = _pow2(exponent), _pow2(-exponent)
        saturated, underflow = unclamped > 127, (unclamped < -127) & (block_amax > 0)
    else:
        grid = _SCALE_GRIDS[spec.scale_format]
        tensor_scale, code_multiplier = global_scales(spec.zero_code_to_one, g, target)
        ideal = torch.clamp(block_amax * code_multiplier, max=FLT_MAX)
        rounded_scale = round_scale_rne(torch.clamp(ideal, max=grid.max_finite), grid)
        # UE5M3 (the paper's emulator): a zero scale code becomes 1.0 before the reciprocal
        block_scale = rounded_scale + (rounded_scale == 0) if spec.zero_code_to_one else rounded_scale
        encode = torch.clamp(torch.reciprocal(block_scale * tensor_scale), max=FLT_MAX)
        saturated, underflow = ideal > grid.max_finite, (rounded_scale == 0) & (block_amax > 0)
    # one scale per block, computed in a vectorized loop over the blocks, not in scalar code per
    # block inside the loop over the elements (two divisions and the integer RNE per block)
    block_scale, encode = _materialized(block_scale), _materialized(encode)

    # Payload magnitude |y| = |x| * encode, saturating at 6, rounded onto the E2M1 grid, whose
    # binades [0,2), [2,4), [4,6] have spacings 1/2, 1, 2 (comparisons, not bit casts: they
    # vectorize).
    magnitude = torch.clamp(blocks.abs() * encode, max=FP4_MAX)
    upper, middle = magnitude >= 4.0, magnitude >= 2.0
    inv = torch.where(upper, 0.5, torch.where(middle, 1.0, 2.0))  # 1 / spacing
    if spec.rounding == "rne":
        magic = torch.where(upper, 1.5 * 2.0**24, torch.where(middle, 1.5 * 2.0**23, 1.5 * 2.0**22))  # ulp = spacing
        rounded = (magnitude + magic) - magic  # one IEEE addition rounds to the grid, ties to even
        steps = rounded * inv
    else:
        scaled_grid = magnitude * inv  # |y| / spacing: exact
        lower = torch.floor(scaled_grid)
        frac = scaled_grid - lower  # the exact fraction of a grid step
        if spec.rounding in BYTE_DRAW_ROUNDINGS:  # TE's cvt.rs (sr) or the paper's sr8, r the element's byte
            r = sr8_bytes_at(draws, _element_index(blocks, spec)).to(torch.float32)
            away = sr_away(frac, r, spec.rounding)
        else:  # sr_exact: away from zero iff u < frac, u uniform on [0, 1) in float64
            away = draws < frac.double()
        steps = torch.where(away, lower + 1.0, lower)
        rounded = steps * torch.where(upper, 2.0, torch.where(middle, 1.0, 0.5))  # exact: a power of two
    values = _copysign(rounded, blocks, bitwise_sign) * block_scale if spec.values else None

    codes = None
    if spec.pack:
        # E2M1 code = sign * 8 + the binade's first code (0, 2, 4 spacings) + steps.
        offset = torch.where(upper, 4.0, torch.where(middle, 2.0, 0.0))
        negative = _copysign(torch.ones_like(blocks), blocks, bitwise_sign) < 0  # -0.0 too (signbit does not vectorize)
        codes = _packed((torch.where(negative, 8.0, 0.0) + steps + offset).to(torch.uint8), spec)
    # scale codes always (one byte per block): NVFP4's dequantize (TE's order) needs the block scales
    if spec.power_of_two:
        scale_codes = (exponent + 127).to(torch.uint8)
    else:
        scale_codes = encode_scales(block_scale, grid)
    scale_codes = scale_codes.view(block_amax.shape[0], block_amax.shape[2])
    if spec.columns:  # the operand's layout, [D, Tp / b]
        scale_codes = scale_codes.t().contiguous()
    # three reductions fused into the loop over the blocks (stacked boolean masks would be stored
    # byte by byte first, a scalar loop as long as the vector one that quantizes)
    counts = torch.stack([mask.sum(dtype=torch.int32) for mask in (saturated, underflow, block_amax == 0)]).long()
    return values, tensor_scale, g, codes, scale_codes, counts


def _fp8_core(blocks: torch.Tensor, g: torch.Tensor, max_value: torch.Tensor, draws: None, spec: CoreSpec):
    """Quantize ``blocks`` (laid out as for :func:`_quantize_core`) to an FP8 payload as Transformer
    Engine's cast kernels do: per-tensor current scaling (``fp32``: ``x * scale`` with TE's
    :func:`~nemofp4.formats.scaling.fp8_tensor_scale`, decode factor ``1 / scale``) or MXFP8
    (``ue8m0``: a power-of-two scale per block, TE's round-up code in 'ceil' mode, OCP's floor
    exponent in 'floor' mode), then ``cvt.rn.satfinite``: round to nearest even, magnitudes beyond
    the format's largest clamped to it, NaN kept. The amaxes skip NaN (``fmaxf``), so a NaN element
    quantizes to NaN without changing the others' scale.

    ``max_value`` is the format's largest value (float32 0-d). Returns what
    :func:`_quantize_core` does; codes are one byte per element (sign, then the magnitude's code;
    NaN is 0x7F), scale codes the blocks' biased exponents (MX) or an empty tensor (per tensor).
    """
    grid = _FP8_GRIDS[spec.element]
    blocks = blocks.float()
    magnitude = blocks.abs()
    block_amax = torch.where(torch.isnan(magnitude), 0.0, magnitude).amax(dim=(1, 3), keepdim=True)
    block_scale = None
    if spec.per_tensor:
        if spec.measure:
            g = block_amax.amax()
        encode = fp8_tensor_scale(g, max_value, spec.power_of_two_scale)
        tensor_scale = torch.reciprocal(encode)
        scale_codes = torch.empty(0, dtype=torch.uint8, device=blocks.device)
    else:
        tensor_scale = torch.ones((), dtype=torch.float32, device=blocks.device)
        if spec.mx_scale_mode == "ceil":
            code = mx_fp8_scale_codes(block_amax, _FP8_MAX_RECIPROCALS[spec.element])
            encode = mx_fp8_encode(code)
        else:  # OCP's floor exponent, as torchao's default MXFP8 cast
            exponent = mx_floor_exponent(block_amax, _FP8_EMAX[spec.element]).clamp(-127, 127)
            code, encode = exponent + 127, _pow2(-exponent)
        block_scale = _materialized(_pow2(code - 127))
        encode = _materialized(encode)
        scale_codes = code.to(torch.uint8).view(block_amax.shape[0], block_amax.shape[2])
        if spec.columns:
            scale_codes = scale_codes.t().contiguous()
        g = block_amax.amax() if g is None else g
    peak = block_amax * encode
    scaled = blocks * encode
    clamped = torch.clamp(scaled.abs(), max=grid.max_finite)  # NaN stays NaN
    nan = torch.isnan(clamped)
    rounded = round_scale_rne(torch.where(nan, 0.0, clamped), grid)
    signed = torch.where(nan, clamped, _copysign(rounded, blocks, True))
    values = None
    if spec.values:
        values = signed if block_scale is None else signed * block_scale
    codes = None
    if spec.pack:
        negative = _copysign(torch.ones_like(blocks), blocks, True) < 0
        magnitude_code = torch.where(nan, 0x7F, encode_scales(rounded, grid).int())
        codes = _materialized((magnitude_code | torch.where(negative, 0x80, 0)).to(torch.uint8))
        codes = codes.view(-1, codes.shape[2]).t().contiguous() if spec.columns else codes
    underflow = (peak < grid.min_subnormal / 2) & (block_amax > 0)
    counts = torch.stack(
        [mask.sum(dtype=torch.int32) for mask in (peak > grid.max_finite, underflow, block_amax == 0)]
    ).long()
    return values, tensor_scale, g, codes, scale_codes, counts


def _quantize_cores(specs: tuple[CoreSpec, ...], *args):
    """The core of each spec in turn (:func:`_fp8_core` for an FP8 payload, :func:`_quantize_core`
    otherwise), on its four arguments (``args`` holds them in the order of ``specs``): the operands
    that one call quantizes, in one graph when compiled."""
    return tuple(
        (_fp8_core if spec.is_fp8 else _quantize_core)(*args[4 * i : 4 * i + 4], spec) for i, spec in enumerate(specs)
    )


@functools.cache
def _compiled(specs: tuple[CoreSpec, ...]):
    """The cores compiled for ``specs`` as one graph (the caller marks the block-count dims dynamic;
    the specs and the block sizes stay constants). Dynamo keeps its graphs per code object and stops
    compiling one after ``recompile_limit`` graphs, so each key gets a code object of its own: its
    one graph is not counted against the other keys', and no limit needs raising, for the process or
    a call."""

    import torch._inductor.inductor_prims  # noqa: F401 (registers the prim _materialized uses)

    def core(*args):
        return _quantize_cores(specs, *args)

    name = f"quantize_core_{len(_SPEC_NAMES)}"
    _SPEC_NAMES[specs] = name
    own = types.FunctionType(core.__code__.replace(co_name=name), core.__globals__, name, None, core.__closure__)
    return torch.compile(own, dynamic=False, fullgraph=True)


_SPEC_NAMES: dict[tuple[CoreSpec, ...], str] = {}


_failed_builds: set = set()
"""The specs (and ``"hadamard"``) whose compiled form could not be built in this process."""


def _compiled_or_eager(key, build, eager, args: tuple, what: Callable[[], str]):
    """``build(key)(*args)``, the compiled form. If it cannot be built here (a broken toolchain,
    missing headers), warn once naming ``what()`` (made only then), and run ``eager(*args)`` for this
    key from then on (the same numerics; the random draws already made are the ones used). Other
    keys still compile."""
    if key not in _failed_builds:
        try:
            return build(key)(*args)
        except torch._dynamo.exc.BackendCompilerFailed as error:
            _failed_builds.add(key)
            warnings.warn(
                f"torch.compile could not build the CPU FP4 quantizer for {what()} ({error}); quantizing it with "
                "the eager PyTorch path instead (same numerics, slower). kernels=eager skips the attempt.",
                stacklevel=4,
            )
    return eager(*args)


def _run_compiled(specs: tuple[CoreSpec, ...], *args):
    """The compiled cores of ``specs`` (eager where the build failed)."""

    def what() -> str:
        return " and ".join(spec.describe() for spec in specs)

    return _compiled_or_eager(specs, _compiled, functools.partial(_quantize_cores, specs), args, what)


@functools.cache
def _compiled_hadamard(_key: str = "hadamard"):
    return torch.compile(wgrad_hadamard_transform, dynamic=False, fullgraph=True)


def compiled_hadamard_transform(x: torch.Tensor) -> torch.Tensor:
    """:func:`nemofp4.formats.wgrad_hadamard_transform` (TE's wgrad signs, BF16 output) fused by
    Inductor into one loop instead of a dozen eager passes: the same sign flips, scaling, butterfly
    additions and BF16 rounding in the same order, so the same bits. Eager where its build failed."""
    if torch.compiler.is_compiling():
        return wgrad_hadamard_transform(x)
    torch._dynamo.maybe_mark_dynamic(x, tuple(range(x.dim())))  # a 16-token dim specializes
    return _compiled_or_eager(
        "hadamard", _compiled_hadamard, wgrad_hadamard_transform, (x,), lambda: "the wgrad Hadamard transform"
    )


# ------------------------------------------------------------------------------------ runners
class EagerCores:
    """The cores op by op (inside a compiled region: traced into the caller's graph)."""

    name = "eager"

    def run(self, operands: tuple[CoreOperand, ...], args: list[tuple]) -> list[tuple]:
        return list(_quantize_cores(tuple(o.spec for o in operands), *(a for arg in args for a in arg)))


class CompiledCores:
    """The cores of a call as one ``torch.compile`` graph, the block-count dims dynamic (one graph for
    every operand shape); inlined when the caller is already being compiled."""

    name = "compiled"

    def run(self, operands: tuple[CoreOperand, ...], args: list[tuple]) -> list[tuple]:
        if torch.compiler.is_compiling():
            return EAGER.run(operands, args)
        for operand, arg in zip(operands, args):
            torch._dynamo.mark_dynamic(operand.blocks, (0, 2))
            if operand.op.rounding == "sr_exact":
                torch._dynamo.mark_dynamic(arg[3], (0, 2))
        return list(_run_compiled(tuple(o.spec for o in operands), *(a for arg in args for a in arg)))


EAGER = EagerCores()
COMPILED = CompiledCores()


# ------------------------------------------------------------------------------------ entry
def quantize(
    requests: tuple[OperandRequest, ...] | list[OperandRequest],
    *,
    generator: torch.Generator | None = None,
    stats: bool = True,
    cores: CoreRunner = EAGER,
) -> tuple[QuantizedBlocks, ...]:
    """Quantize ``requests`` as one call: each operand's random bits drawn in request order (in its
    element order: row-major over the padded operand, over the padded transpose for ``tokens``),
    then ``cores`` runs the cores; one :class:`QuantizedBlocks` per request.

    A ``rows`` request equals ``quantize_blocks(x, op.scale_format, op.block_size, two_d,
    op.scale_target, tensor_amax, op.rounding, generator)`` bitwise (``scaled`` == its
    ``scaled_values()``); a ``tokens`` request equals the ``rows`` request of ``tokens_transposed(x)``
    (after ``wgrad_hadamard_transform`` when ``op.hadamard``), its values a transposed view
    ([D, Tp], strides (1, D)), its packed and scale codes row-major [D, ...]. ``stats`` keeps the
    saturation/underflow/zero block counts (on the device, no synchronization)."""
    operands = tuple(_prepared(request) for request in requests)
    args = [_core_args(operand, generator) for operand in operands]
    outputs = cores.run(operands, args)
    return tuple(_result(operand, output, stats) for operand, output in zip(operands, outputs))


def quantize_operand(
    x: torch.Tensor,
    op: BlockSpec,
    *,
    tensor_amax: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    two_d: bool | None = None,
    pack: bool = False,
    values: bool = True,
    stats: bool = True,
    cores: CoreRunner = EAGER,
) -> QuantizedBlocks:
    """:func:`quantize` of one ``rows`` request: a 2-D ``x`` along its last dim (or in tiles)."""
    request = OperandRequest(x, op, pack=pack, values=values, two_d=two_d, tensor_amax=tensor_amax)
    return quantize((request,), generator=generator, stats=stats, cores=cores)[0]


def quantize_tokens_operand(
    x_TD: torch.Tensor,
    op: BlockSpec,
    *,
    tensor_amax: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    pack: bool = False,
    values: bool = True,
    stats: bool = True,
    cores: CoreRunner = EAGER,
) -> QuantizedBlocks:
    """:func:`quantize` of one ``tokens`` request: the wgrad operand [D, Tp] of a token-major ``x_TD``."""
    request = OperandRequest(x_TD, op, layout="tokens", pack=pack, values=values, tensor_amax=tensor_amax)
    return quantize((request,), generator=generator, stats=stats, cores=cores)[0]


def quantize_operand_pair(
    x_TK: torch.Tensor,
    op_x: BlockSpec,
    op_xt: BlockSpec,
    *,
    tensor_amax: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    pack_x: bool = False,
    pack_xt: bool = True,
    values_xt: bool = True,
    stats: bool = True,
    cores: CoreRunner = EAGER,
) -> tuple[QuantizedBlocks, QuantizedBlocks]:
    """(X along K, X^T [K, Tp] along the tokens) with one tensor reference: :func:`quantize` of the
    two requests (X's random bits drawn first)."""
    qx, qxt = quantize(
        x_and_tokens(x_TK, op_x, op_xt, tensor_amax=tensor_amax, pack_x=pack_x, pack_xt=pack_xt, values_xt=values_xt),
        generator=generator,
        stats=stats,
        cores=cores,
    )
    return qx, qxt


def x_and_tokens(
    x_TK: torch.Tensor,
    op_x: BlockSpec,
    op_xt: BlockSpec,
    *,
    tensor_amax: torch.Tensor | None,
    pack_x: bool = False,
    pack_xt: bool = True,
    values_xt: bool = True,
) -> tuple[OperandRequest, OperandRequest]:
    """The requests of X along K and its wgrad operand X^T, sharing one tensor reference (which a
    Hadamard transform on X^T would change: refused)."""
    if op_xt.hadamard:
        raise ValueError("X and X^T share one tensor reference only without a Hadamard transform on X^T")
    return (
        OperandRequest(x_TK, op_x, pack=pack_x, tensor_amax=tensor_amax),
        OperandRequest(x_TK, op_xt, layout="tokens", pack=pack_xt, values=values_xt, tensor_amax=tensor_amax),
    )


def _prepared(request: OperandRequest) -> CoreOperand:
    """The request's padded input viewed as blocks, and its core spec."""
    x, op, amax = request.tensor, request.spec, request.tensor_amax
    if request.layout == "tokens":
        return _down_columns(x, op, request.pack, amax, request.values)
    return _along_rows(x, op, request.tiles, request.pack, amax, request.values)


def _along_rows(x: torch.Tensor, op: BlockSpec, two_d: bool, pack: bool, tensor_amax, values: bool) -> CoreOperand:
    """``x`` [rows, cols] in blocks along its rows (or 2-D tiles)."""
    if x.dim() != 2:
        raise ValueError(f"quantize_operand takes a 2-D tensor, got shape {tuple(x.shape)}")
    b = op.block_size
    rows, cols = x.shape
    xp = _padded(x, -rows % b if two_d else 0, -cols % b)
    rows_p, cols_p = xp.shape
    row_block = b if two_d else 1
    blocks = xp.view(rows_p // row_block, row_block, cols_p // b, b)
    spec = CoreSpec.of(op, pack, tensor_amax is None, values, two_d=two_d)
    return CoreOperand(op, spec, blocks, (rows, cols), (rows_p, cols_p), tensor_amax)


def _down_columns(x_TD: torch.Tensor, op: BlockSpec, pack: bool, tensor_amax, values: bool) -> CoreOperand:
    """The padded transpose of ``x_TD`` [T, D] in blocks along the tokens, read as blocks down the
    columns of ``x_TD``."""
    if x_TD.dim() != 2:
        raise ValueError(
            f"quantize_tokens_operand takes a 2-D [tokens, features] tensor, got shape {tuple(x_TD.shape)}"
        )
    if op.two_d:
        raise ValueError("a wgrad operand is quantized in 1-D blocks along the tokens, not in 2-D tiles")
    b = op.block_size
    tokens, features = x_TD.shape
    padded_tokens = tokens + -tokens % TOKEN_MULTIPLE
    xp = _padded(x_TD, padded_tokens - tokens + -padded_tokens % b, 0)
    rows_p = xp.shape[0]  # tokens padded to 16, then to the block
    blocks = xp.view(rows_p // b, b, features, 1)
    spec = CoreSpec.of(op, pack, tensor_amax is None, values, columns=True)
    return CoreOperand(op, spec, blocks, (features, padded_tokens), (features, rows_p), tensor_amax)


def _padded(x: torch.Tensor, pad_rows: int, pad_cols: int) -> torch.Tensor:
    """``x`` zero-padded at the end of both dims, contiguous, in its own dtype (the core converts it
    to float32 exactly where it reads it)."""
    x = x.detach()
    if pad_rows or pad_cols:
        x = F.pad(x, (0, pad_cols, 0, pad_rows))
    return x.contiguous()


def _core_args(operand: CoreOperand, generator) -> tuple:
    """The core's (blocks, g, target, draws) for ``operand``, its random bits drawn here."""
    spec, op, blocks = operand.spec, operand.op, operand.blocks
    device = blocks.device
    g = None if operand.tensor_amax is None else operand.tensor_amax.detach().float().reshape(())
    if spec.is_fp8:  # the core's "target" is the payload's largest value
        return blocks, g, _fp8_max_tensor(spec.element, device), None
    target = scaled_target(DEFAULT_SCALE_TARGET if spec.power_of_two else op.scale_target, device)
    draws = None
    if op.rounding in BYTE_DRAW_ROUNDINGS:
        draws = sr8_key(blocks.numel(), generator, device)
    elif op.rounding == "sr_exact":
        draws = torch.rand(operand.padded_shape, generator=generator, device=device, dtype=torch.float64)
        draws = (draws.t() if spec.columns else draws).view(blocks.shape)
    return blocks, g, target, draws


@functools.lru_cache(maxsize=16)
def _fp8_max_tensor(element: str, device: torch.device) -> torch.Tensor:
    return torch.tensor(fp8_max(element), dtype=torch.float32, device=device)


def _packed(codes: torch.Tensor, spec: CoreSpec) -> torch.Tensor:
    """Two E2M1 codes per byte, the first in the low nibble, laid out as the operand's rows: pairs
    along a row, or with ``spec.columns`` pairs of consecutive tokens, [D, Tp / 2]. The codes are
    stored first (compiled, a loop of its own): packing in the vectorized loop that computes them
    would compute every element twice, once per nibble."""
    codes = _materialized(codes)  # [Tp / b, b, D, 1] with spec.columns
    pairs = codes.view(-1, 2, codes.shape[2]).transpose(1, 2) if spec.columns else codes.view(-1, 2)
    packed = torch.bitwise_or(pairs[..., 1] << 4, pairs[..., 0])
    return packed.t().contiguous() if spec.columns else packed


def _result(operand: CoreOperand, outputs: tuple, stats: bool) -> QuantizedBlocks:
    """The core's outputs for ``operand`` as its :class:`QuantizedBlocks` (a wgrad operand's values are
    a transposed view of the token-major result)."""
    values, tensor_scale, g, codes, scale_codes, counts = outputs
    op, spec = operand.op, operand.spec
    b = op.block_size
    rows_p, cols_p = operand.padded_shape
    if values is not None:  # over x [Tp, D] for a wgrad operand
        values = values.view(cols_p, rows_p).t() if spec.columns else values.view(rows_p, cols_p)
    if codes is not None:
        codes = codes.view(rows_p, cols_p if spec.is_fp8 else cols_p // 2)
    return QuantizedBlocks(
        element_format=spec.element,
        shape=operand.shape,
        padded_shape=operand.padded_shape,
        block_size=b,
        two_d=spec.two_d,
        scale_format=op.scale_format,
        tensor_scale=tensor_scale,
        tensor_amax=g,
        scale_target=float(op.scale_target),
        codes=codes,
        scale_codes=scale_codes,
        scaled=values,
        counts=dict(zip(BLOCK_STATS, counts.unbind())) if stats else {},
        num_blocks=(rows_p // (b if spec.two_d else 1)) * (cols_p // b),
        num_elements=operand.shape[0] * operand.shape[1],
    )
