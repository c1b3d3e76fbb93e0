"""Fused Triton FP4 block quantization, bit-identical to :func:`nemofp4.formats.quantize_blocks`.

One launch reads the input once and writes packed E2M1 codes, block-scale codes and the tensor
scale, and with ``also_transposed=True`` the quantization of ``x.T`` too (blocks along the first
dim, the tokens: the wgrad operand), from the same tile. The tensor amax is a separate
reduction (:func:`triton_amax`) and runs only when no held reference is passed: between
refreshes of the UE5M3 recipe's sample-and-hold reference the input is read exactly once.

For ``rounding="rne"`` every output equals the PyTorch reference bit for bit (codes, scale
codes, tensor scale, tensor amax, statistics). ``"sr"``/``"sr8"``/``"sr_exact"`` use the same rounding rule
with Philox random bits (``tl.randint4x``) instead of the torch generator, so the bits differ
from the reference; :func:`triton_quantize_with_draws` returns the draws so a test can check
the rule exactly. The stream layout is documented in ``_quantize_kernels``.

Two deliberate differences from the reference: no NaN/Inf check (it would synchronize the
host; a NaN input makes the amax, and so every scale, NaN, which the trainer's non-finite
checks catch), and a tensor ``tensor_amax`` is not validated for the same reason.
"""

from __future__ import annotations

import math
import os
import warnings

import torch

from nemofp4.formats import QuantizedBlocks
from nemofp4.formats.spec import INPUT_DTYPES, SCALE_FORMAT_TABLE, STAT_NAMES, BlockSpec

__all__ = [
    "triton_amax",
    "triton_quantize",
    "triton_quantize_blocks",
    "triton_quantize_with_draws",
]

SUPPORTED_BLOCK_SIZES = (2, 4, 8, 16, 32, 64)
"""Block sizes the kernel is built for (the torch program takes any even size)."""
_ROUNDING_CODES = {"rne": 0, "sr8": 1, "sr_exact": 2, "sr": 3}
"""The kernel's ``ROUNDING`` constants (``_quantize_kernels.ROUND_*``)."""


# ------------------------------------------------------------------------------------ amax
def triton_amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| as a float32 0-d tensor on x's device (exact; NaN if x has a NaN); no host sync."""
    if not isinstance(x, torch.Tensor) or x.dtype not in INPUT_DTYPES:
        raise ValueError(f"triton_amax: expected a float32/bfloat16/float16 tensor, got {_describe(x)}")
    if x.numel() == 0:
        raise ValueError("amax of an empty tensor is undefined")
    return torch.ops.nemofp4.triton_amax(x.detach().contiguous().view(-1)).reshape(())


@torch.library.custom_op("nemofp4::triton_amax", mutates_args=(), device_types=("cuda", "cpu"))
def _amax_op(flat: torch.Tensor) -> torch.Tensor:
    """The amax launch as an op (``[1]`` float32), so compiled graphs hold it without a break."""
    out = torch.zeros(1, dtype=torch.float32, device=flat.device)
    block = 4096
    programs = triton_cdiv(flat.numel(), block)
    if interpreting(flat.device):
        programs = min(programs, 4)
    else:
        programs = min(programs, 4 * torch.cuda.get_device_properties(flat.device).multi_processor_count)
    iterations = triton_cdiv(triton_cdiv(flat.numel(), block), programs)
    # non-negative floats order as their int32 bits: the kernel max-reduces the bits atomically
    _kernels().amax_kernel[(programs,)](flat, flat.numel(), out.view(torch.int32), programs, iterations, BLOCK=block)
    return out


@_amax_op.register_fake
def _(flat: torch.Tensor) -> torch.Tensor:
    return flat.new_empty(1, dtype=torch.float32)


# ------------------------------------------------------------------------------------ quantize
def triton_quantize_blocks(
    x: torch.Tensor, *, also_transposed: bool = False, **kwargs
) -> QuantizedBlocks | tuple[QuantizedBlocks, QuantizedBlocks]:
    """Quantize ``x`` as ``quantize_blocks(x, scale_format, block_size, two_d, scale_target,
    tensor_amax, rounding)`` does, in one Triton launch (plus the amax reduction when
    ``tensor_amax`` is None and the format has a tensor scale). Keyword arguments: those of
    :func:`triton_quantize` (``scale_format``, ``block_size``, ``two_d``, ``scale_target``,
    ``tensor_amax``, ``rounding``, ``seed``, ``transposed_scale_target``, ``mx_scale_mode``).

    Args:
        seed: Philox seed for the stochastic roundings (an int, or an int64 one-element device tensor, e.g.
            drawn from a torch generator on the GPU, which avoids a host sync).
        also_transposed: also quantize ``x.T`` (2-D ``x``; blocks along dim 0, zero-padded to the
            block) in the same launch, with the same tensor reference; returns ``(q, q_t)`` where
            ``q_t`` equals ``quantize_blocks(x.T, ...)``. Its random bits are independent of ``q``'s.
        transposed_scale_target: T for ``x.T`` when it differs (the UE5M3 recipe's T = 2048 for
            the wgrad dY of some layers); default ``scale_target``.
    """
    rows, cols = triton_quantize(x, transposed=also_transposed, **kwargs)
    return (rows, cols) if also_transposed else rows


def triton_quantize_with_draws(x: torch.Tensor, **kwargs):
    """:func:`triton_quantize` with the random draws written out, for testing the stochastic
    rounding rule exactly: ``((rows, rows_draws), (cols | None, cols_draws | None))``, draws int64
    per padded element. Same keyword arguments as :func:`triton_quantize`."""
    if kwargs.get("rounding", "rne") == "rne":
        raise ValueError(
            "triton_quantize_with_draws needs a stochastic rounding ('sr', 'sr8' or 'sr_exact'; rne draws nothing)"
        )
    return triton_quantize(x, _write_draws=True, **kwargs)


def triton_quantize(
    x: torch.Tensor,
    spec: BlockSpec | None = None,
    *,
    tensor_amax: torch.Tensor | float | None = None,
    seed: int | torch.Tensor = 0,
    rowwise: bool = True,
    transposed: bool = False,
    transposed_scale_target: float | None = None,
    scaled_dtype: torch.dtype | None = None,
    stats: bool = True,
    _write_draws: bool = False,
    _config: dict | None = None,
    **spec_fields,
) -> tuple[QuantizedBlocks | None, QuantizedBlocks | None]:
    """The full launch: ``(row-wise result or None, transposed result or None)``.

    ``spec`` is the quantization (its ``hadamard`` is the caller's), or ``spec_fields`` are its
    fields as keywords (:class:`~nemofp4.formats.BlockSpec`'s ``scale_format``, default 'ue5m3',
    ``block_size``, ``two_d``, ``scale_target``, ``rounding``, ``mx_scale_mode``).
    ``scaled_dtype`` (float32 or bfloat16) also writes E2M1 value x block scale, padded, which
    is exact in either dtype: what a GEMM on block-scaled operands consumes directly.
    ``stats=False`` skips the four statistics counters (their atomics). ``_config`` overrides
    the tile sizes and launch options (``BM``, ``BK``, ``num_warps``; for benchmarks).
    """
    if spec is None:
        spec = BlockSpec(**{"scale_format": "ue5m3", **spec_fields})
    elif spec_fields:
        raise ValueError(
            f"triton_quantize takes the quantization as a spec or as keywords, not both: {sorted(spec_fields)}"
        )
    target_t = _check_launch(x, spec, tensor_amax, rowwise, transposed, transposed_scale_target, scaled_dtype)
    device = x.device
    is_mx = spec.format.power_of_two
    b = spec.block_size
    scale_format, two_d, rounding = spec.scale_format, spec.two_d, spec.rounding
    scale_target = spec.scale_target
    shape = x.shape
    cols = shape[-1]
    x2d = x.detach().reshape(-1, cols)
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    rows = x2d.shape[0]
    cols_p = cols + (-cols % b)
    rows_p = rows + (-rows % b)

    # ---- the tensor reference g (a measured one for MX comes back from the launch)
    measure_amax = is_mx and tensor_amax is None
    if measure_amax:
        g = None
    elif tensor_amax is None:
        g = triton_amax(x2d).reshape(1)
    else:
        g = _reference_tensor(tensor_amax, device)
    seed_t = _seed_tensor(seed, device, rounding)
    config = _config or _tile_config(b, two_d, transposed, interpreting(device))
    outs = torch.ops.nemofp4.triton_quantize(
        x2d,
        g,
        seed_t,
        scale_format,
        b,
        two_d,
        _fp32(scale_target * 6.0),
        _fp32(target_t * 6.0),
        _ROUNDING_CODES[rounding],
        spec.mx_scale_mode == "ceil",
        rowwise,
        transposed,
        _SCALED_DTYPE_CODES[scaled_dtype],
        _write_draws,
        stats,
        config["BM"],
        config["BK"],
        config.get("num_warps", 0),
        config.get("enable_fp_fusion", True),
    )
    r = dict(zip(_SIDE_OUTPUTS, outs[:6]))
    t = dict(zip(_SIDE_OUTPUTS, outs[6:12]))
    if measure_amax:
        g = outs[12].view(torch.float32)

    g0 = g.reshape(())
    row_result = col_result = None
    if rowwise:
        padded = torch.Size([*shape[:-1], cols_p])
        row_result = QuantizedBlocks(
            codes=r["codes"] if two_d else r["codes"].view(*shape[:-1], cols_p // 2),
            scale_codes=r["scales"] if two_d else r["scales"].view(*shape[:-1], cols_p // b),
            tensor_scale=r["ts"].reshape(()),
            tensor_amax=g0,
            scale_target=float(scale_target),
            counts=dict(zip(STAT_NAMES, r["counts"].unbind())) if stats else {},
            shape=shape,
            padded_shape=torch.Size([rows_p, cols_p]) if two_d else padded,
            block_size=b,
            two_d=two_d,
            scale_format=scale_format,
            num_blocks=r["scales"].numel(),
            num_elements=math.prod(shape),
            scaled=None if scaled_dtype is None else r["scaled"].view(*(padded if not two_d else (rows_p, cols_p))),
        )
    if transposed:
        col_result = QuantizedBlocks(
            codes=t["codes"],
            scale_codes=t["scales"],
            tensor_scale=t["ts"].reshape(()),
            tensor_amax=g0,
            scale_target=float(target_t),
            counts=dict(zip(STAT_NAMES, t["counts"].unbind())) if stats else {},
            shape=torch.Size([cols, rows]),
            padded_shape=torch.Size([cols, rows_p]),
            block_size=b,
            two_d=False,
            scale_format=scale_format,
            num_blocks=t["scales"].numel(),
            num_elements=math.prod(shape),
            scaled=t["scaled"] if scaled_dtype is not None else None,
        )
    if _write_draws:
        return (row_result, r["draws"] if rowwise else None), (col_result, t["draws"] if transposed else None)
    return row_result, col_result


# ------------------------------------------------------------------------------------ the op
_SCALED_DTYPE_CODES = {None: 0, torch.float32: 1, torch.bfloat16: 2}
_SCALED_DTYPES = {code: dtype for dtype, code in _SCALED_DTYPE_CODES.items()}
_SIDE_OUTPUTS = ("codes", "scales", "scaled", "draws", "counts", "ts")


def _launch_outputs(
    x2d: torch.Tensor,
    block_size: int,
    two_d: bool,
    rowwise: bool,
    transposed: bool,
    scaled_dtype: int,
    write_draws: bool,
    measure_amax: bool,
) -> list[torch.Tensor]:
    """The launch's 13 outputs, allocated: (codes, scales, scaled, draws, counts, ts) row-wise, the
    same for x.T, and the measured MX amax bits. An output the launch does not write is empty."""
    rows, cols = x2d.shape
    b = block_size
    cols_p, rows_p = cols + (-cols % b), rows + (-rows % b)
    scaled = _SCALED_DTYPES[scaled_dtype]

    def empty(dtype: torch.dtype) -> torch.Tensor:
        return x2d.new_empty(0, dtype=dtype)

    def side(on: bool, n_rows: int, n_cols: int, scale_shape: tuple[int, ...]) -> list[torch.Tensor]:
        if not on:
            return [
                empty(torch.uint8),
                empty(torch.uint8),
                empty(torch.float32),
                empty(torch.int64),
                empty(torch.int32),
                empty(torch.float32),
            ]
        return [
            x2d.new_empty(n_rows, n_cols // 2, dtype=torch.uint8),
            x2d.new_empty(scale_shape, dtype=torch.uint8),
            x2d.new_empty(n_rows, n_cols, dtype=scaled) if scaled is not None else empty(torch.float32),
            x2d.new_empty(n_rows, n_cols, dtype=torch.int64) if write_draws else empty(torch.int64),
            x2d.new_zeros(4, dtype=torch.int32),
            x2d.new_ones(1, dtype=torch.float32),
        ]

    row_scales = (rows_p // b, cols_p // b) if two_d else (rows, cols_p // b)
    return [
        *side(rowwise, rows_p if two_d else rows, cols_p, row_scales),
        *side(transposed, cols, rows_p, (cols, rows_p // b)),
        x2d.new_zeros(1, dtype=torch.int32) if measure_amax else empty(torch.int32),
    ]


@torch.library.custom_op("nemofp4::triton_quantize", mutates_args=(), device_types=("cuda", "cpu"))
def _quantize_op(
    x2d: torch.Tensor,
    g: torch.Tensor | None,
    seed: torch.Tensor,
    scale_format: str,
    block_size: int,
    two_d: bool,
    numerator: float,
    numerator_t: float,
    rounding: int,
    mx_ceil: bool,
    rowwise: bool,
    transposed: bool,
    scaled_dtype: int,
    write_draws: bool,
    stats: bool,
    bm: int,
    bk: int,
    num_warps: int,
    enable_fp_fusion: bool,
) -> list[torch.Tensor]:
    """One quantization launch as an op (``g`` None: an MX launch measures its own amax), so that
    torch.compile and FSDP2 see a node with a fake implementation rather than a graph break."""
    device = x2d.device
    row = SCALE_FORMAT_TABLE[scale_format]
    fmt, is_mx = row.codes, row.power_of_two
    measure_amax = g is None
    outs = _launch_outputs(x2d, block_size, two_d, rowwise, transposed, scaled_dtype, write_draws, measure_amax)
    dummies = {
        "codes": torch.uint8,
        "scales": torch.uint8,
        "scaled": torch.float32,
        "draws": torch.int64,
        "counts": torch.int32,
        "ts": torch.float32,
    }

    def pointers(side: list[torch.Tensor]) -> list[torch.Tensor]:
        # a one-element buffer for every pointer the launch does not write
        return [o if o.numel() else _dummy(device, dt) for o, dt in zip(side, dummies.values())]

    amax_out = outs[12] if measure_amax else _dummy(device, torch.int32)
    g_in = amax_out.view(torch.float32) if measure_amax else g
    rows, cols = x2d.shape
    cols_p, rows_p = cols + (-cols % block_size), rows + (-rows % block_size)
    rows_out = rows_p if two_d else rows
    grid_rows = max(rows_out if rowwise else 0, rows_p if transposed else 0)
    grid = (triton_cdiv(grid_rows, bm), triton_cdiv(cols_p if rowwise else cols, bk))
    options = {"num_warps": num_warps, "enable_fp_fusion": enable_fp_fusion} if num_warps else {}
    _kernels().quantize_kernel[grid](
        x2d,
        g_in,
        seed,
        amax_out,
        *pointers(outs[:6]),
        *pointers(outs[6:12]),
        rows,
        cols,
        x2d.stride(0),
        rows_out,
        cols_p,
        rows_p,
        numerator,
        numerator_t,
        BS=block_size,
        IS_MX=is_mx,
        MX_CEIL=mx_ceil,
        SCALE_MAX=0.0 if is_mx else fmt.max_finite,
        SCALE_BIAS=fmt.bias,
        SCALE_MANT=fmt.mantissa_bits,
        SCALE_MIN_NORMAL=fmt.min_normal,
        SCALE_SUB_STEP=fmt.min_subnormal,
        ZERO_CODE_TO_ONE=row.zero_code_to_one,
        ROUNDING=rounding,
        TWO_D=two_d,
        ROWWISE=rowwise,
        TRANSPOSED=transposed,
        WRITE_SCALED=scaled_dtype != 0,
        WRITE_DRAWS=write_draws,
        STATS=stats,
        MEASURE_AMAX=measure_amax,
        BM=bm,
        BK=bk,
        **options,
    )
    return outs


@_quantize_op.register_fake
def _(
    x2d,
    g,
    seed,
    scale_format,
    block_size,
    two_d,
    numerator,
    numerator_t,
    rounding,
    mx_ceil,
    rowwise,
    transposed,
    scaled_dtype,
    write_draws,
    stats,
    bm,
    bk,
    num_warps,
    enable_fp_fusion,
):
    return _launch_outputs(x2d, block_size, two_d, rowwise, transposed, scaled_dtype, write_draws, g is None)


# ------------------------------------------------------------------------------------ helpers
def _kernels():
    """The kernel module, imported on first use: importing triton decides, once per process, whether
    kernels compile or run in the interpreter (``TRITON_INTERPRET``), so nothing imports it early."""
    from . import _quantize_kernels

    return _quantize_kernels


def interpreting(device: torch.device) -> bool:
    """True when Triton kernels run in its CPU interpreter (CPU tensors, or TRITON_INTERPRET=1)."""
    return device.type != "cuda" or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _reference_tensor(tensor_amax: torch.Tensor | float, device: torch.device) -> torch.Tensor:
    """float32 [1] on ``device``; a Python number is filled in on the device (no host copy)."""
    if isinstance(tensor_amax, torch.Tensor):
        return tensor_amax.detach().to(device=device, dtype=torch.float32).reshape(1)
    return torch.full((1,), _fp32(tensor_amax), dtype=torch.float32, device=device)


def _fp32(value: float) -> float:
    """``value`` rounded to float32 (RNE), as ``torch.tensor(value, dtype=float32)`` rounds it."""
    return float(torch.tensor(value, dtype=torch.float32))


_DUMMIES: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def _dummy(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A one-element buffer for pointer arguments a launch does not use, kept per device and dtype
    unless it is made under a fake mode (the planner's): a kept fake buffer would make every later
    real launch's outputs fake."""
    key = (device, dtype)
    dummy = _DUMMIES.get(key)
    if dummy is None:
        dummy = torch.zeros(1, dtype=dtype, device=device)
        if type(dummy) is torch.Tensor:
            _DUMMIES[key] = dummy
    return dummy


def _seed_tensor(seed: int | torch.Tensor, device: torch.device, rounding: str) -> torch.Tensor:
    """The seed as a one-element int64 device tensor, made without a host-to-device copy (a copy
    from pageable memory would wait for the stream: one synchronization per quantization)."""
    if isinstance(seed, torch.Tensor):
        if seed.dtype != torch.int64 or seed.numel() != 1:
            raise ValueError(f"seed tensor must hold one int64, got dtype {seed.dtype}, shape {tuple(seed.shape)}")
        return seed.reshape(1).to(device)
    if isinstance(seed, bool) or not isinstance(seed, int) or not -(2**63) <= seed < 2**63:
        raise ValueError(f"seed must be an int in the int64 range or an int64 tensor, got {seed!r}")
    if rounding == "rne":  # draws nothing
        return _dummy(device, torch.int64)
    return torch.full((1,), seed, dtype=torch.int64, device=device)


def _tile_config(block_size: int, two_d: bool, transposed: bool, interpret: bool) -> dict:
    """Tile sizes and warps. Rows per tile are a multiple of the block (and of 16, the SR lane
    group) when tiles or the transposed blocks run along rows. On the GPU each thread holds 16
    elements (two 16-byte loads of bf16); ptxas (sm_90, sizes divisible by 16) reports 58
    registers for the row-wise kernel (64 with sr8), 48 for 16x16 tiles and 96 for the fused
    transposed kernel, without spills, so 5-10 blocks of 128 threads fit on an SM and keep
    20-40 KB of loads in flight per SM. scripts/bench/bench_gpu.py sweeps alternatives on a GPU."""
    if interpret:  # the interpreter's cost is per program: few, large tiles (same results)
        return {
            "BM": max(64 if transposed else 32, block_size) if (two_d or transposed) else 128,
            "BK": max(64 if transposed else 128, block_size),
        }
    bm = max(16, block_size) if (two_d or transposed) else 16
    # no multiply-add contraction: every product in the kernels is exact anyway, but the numerics
    # should not depend on a compiler default (Triton 3.10 changes it)
    return {"BM": bm, "BK": max(128, block_size), "num_warps": 4, "enable_fp_fusion": False}


def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"tensor of dtype {x.dtype}"
    return type(x).__name__


def _check_launch(
    x, spec: BlockSpec, tensor_amax, rowwise: bool, transposed: bool, transposed_scale_target, scaled_dtype
) -> float:
    """The checks of :meth:`BlockSpec.check_input` and what only the kernel needs; returns the scale
    target of the transposed side."""
    spec.check_input(x, tensor_amax, stacklevel=5)
    if spec.block_size not in SUPPORTED_BLOCK_SIZES:
        raise ValueError(
            f"block_size {spec.block_size!r} is not supported by the Triton kernels; valid: {SUPPORTED_BLOCK_SIZES} "
            "(the PyTorch reference nemofp4.formats.quantize_blocks takes any even size)"
        )
    if transposed and (x.dim() != 2 or spec.two_d):
        raise ValueError(
            f"also_transposed needs a 2-D x with 1-D blocks (16x16 tiles are their own transpose); "
            f"got shape {tuple(x.shape)}, two_d={spec.two_d}"
        )
    if not (rowwise or transposed):
        raise ValueError("nothing to do: rowwise=False and transposed=False")
    if scaled_dtype not in _SCALED_DTYPE_CODES:
        raise ValueError(f"scaled_dtype must be None, torch.float32 or torch.bfloat16, got {scaled_dtype}")
    if transposed_scale_target is None:
        return spec.scale_target
    target = transposed_scale_target
    if isinstance(target, bool) or not isinstance(target, (int, float)) or not (math.isfinite(target) and target > 0):
        raise ValueError(f"transposed_scale_target must be a finite positive number, got {target!r}")
    if spec.format.power_of_two:
        warnings.warn(
            f"scale_target has no effect with scale_format={spec.scale_format!r} (no tensor scale)", stacklevel=5
        )
    return target
