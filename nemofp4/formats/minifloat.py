"""Minifloat formats as data, with bit-exact rounding, encoding and decoding.

A format is a frozen dataclass of its fields (exponent/mantissa bits, bias, sign,
subnormals, special-value encoding). Everything else (the value of every code, the
largest finite value, the rounding boundaries) is derived from those fields once and
cached, so adding a format is adding one instance, not a code path.

How rounding works (the whole numerics of this module):

* Inputs are rounded from float32. bfloat16/float16 inputs convert to float32 exactly;
  float64 inputs are first rounded to float32 (a documented double rounding).
* Every finite non-negative value of a format is listed in ascending order; for all
  formats here the code of the i-th value is ``i`` (sign bit added for negatives).
* Round-to-nearest-even (``rne``) compares ``|x|`` with the midpoints between
  neighbouring values. Midpoints of formats of at most 8 bits are exact float32 numbers,
  so the comparison is exact. At a tie the value with the even code wins (for formats
  with mantissa bits that is the even significand). UE8M0 has no fraction bits, so
  "even significand" is undefined; ties there round up, as ``ml_dtypes`` and torch's
  ``float8_e8m0fnu`` cast do.
* Saturation: magnitudes beyond ``max_finite`` (and +-Inf) become ``max_finite``; a
  format without zero (UE8M0) maps magnitudes below its smallest value to that value.
* Stochastic rounding works on the fractional position ``frac = (|x| - lo) / (hi - lo)``
  between the two neighbouring values ``lo <= |x| < hi``. The subtraction is exact
  (Sterbenz: ``lo >= |x| / 2``) and ``hi - lo`` is a power of two, so ``frac`` is the
  exact float32 fraction. Three rules, each with an integer ``r`` uniform on {0..255} or
  ``u`` uniform on [0, 1):

  - ``sr`` (Transformer Engine's NVFP4 stochastic rounding, PTX ``cvt.rs.satfinite.e2m1x4.f32``):
    the 8 random bits are added to the top of the discarded significand bits and the carry
    out rounds away from zero, i.e. away iff ``frac + r/256 >= 1``, evaluated exactly as
    ``256 * frac >= 256 - r``. P(away) = floor(256 frac) / 256: biased toward zero by less
    than 2^-8 of a step (TE's ``stochastic_round_fp4_e2m1``, ``common/util/ptx.cuh``).
  - ``sr8`` (the UE5M3 paper's "StochasticFast"): away iff ``fp32(frac + (2r+1)/512) >= 1``,
    the sum rounded to float32 as the paper's code evaluates it (``_round_finite_float`` in
    its ``backends/triton/_rounding.py``). Unbiased to within 2^-9 of a step.
  - ``sr_exact``: ``u`` drawn in float64 (53 random bits), away iff ``u < frac``, so the
    expected value is ``x`` up to 2^-53 relative.

  Random bits come only from the ``generator`` passed in (torch's default generator when it
  is None): ``sr`` and ``sr8`` one 32-bit key per tensor, each element's byte a hash of the key
  and its index in element order (:func:`sr8_draws`); ``sr_exact`` one float64 draw per element.
"""

from __future__ import annotations

import enum
import functools
import math
from dataclasses import dataclass
from typing import Literal, get_args

import torch

__all__ = [
    "SpecialValues",
    "FloatFormat",
    "E2M1",
    "E4M3",
    "E5M2",
    "UE8M0",
    "UE5M3",
    "UE5M3_CUDA",
    "FORMATS",
    "ROUNDING_MODES",
    "Rounding",
    "get_format",
    "check_rounding",
    "pack_fp4",
    "unpack_fp4",
]

Rounding = Literal["rne", "sr8", "sr", "sr_exact"]
ROUNDING_MODES: tuple[str, ...] = get_args(Rounding)
BYTE_DRAW_ROUNDINGS: tuple[str, ...] = ("sr8", "sr")
"""Roundings that take one random byte per element (:func:`sr8_draws`)."""


class SpecialValues(enum.Enum):
    """How a format spends codes on non-finite values."""

    NONE = "none"
    """Every code is finite (E2M1)."""
    IEEE = "ieee"
    """The all-ones exponent field is reserved: mantissa 0 is Inf, the rest NaN (E5M2, paper UE5M3)."""
    ALL_ONES_NAN = "all_ones_nan"
    """Only the all-ones magnitude code is NaN; no Inf ("fn"/"fnu" formats: E4M3, UE8M0, CUDA UE5M3)."""


@dataclass(frozen=True, kw_only=True)
class FloatFormat:
    """A binary minifloat format of at most 8 bits, described by its fields.

    Values: with exponent field ``e`` and mantissa field ``m`` (``M = mantissa_bits``),
    a normal code is ``(1 + m / 2^M) * 2^(e - bias)``; when ``has_subnormals``, ``e = 0``
    codes are ``m / 2^M * 2^(1 - bias)`` (which includes zero). Without subnormals
    ``e = 0`` is an ordinary normal binade and the format has no zero (UE8M0).
    """

    name: str
    exponent_bits: int
    mantissa_bits: int
    bias: int
    signed: bool
    has_subnormals: bool
    special_values: SpecialValues

    def __post_init__(self) -> None:
        if not 1 <= self.total_bits <= 8:
            raise ValueError(f"{self.name}: formats of 1..8 bits are supported, got {self.total_bits}")
        # Invariant the codecs rely on: the i-th non-negative finite value has code i.
        values = self._magnitude_values_f64
        assert all(a < b for a, b in zip(values, values[1:])), f"{self.name}: codes not monotonic"

    # ----------------------------------------------------------------- derived fields
    @property
    def total_bits(self) -> int:
        return int(self.signed) + self.exponent_bits + self.mantissa_bits

    @property
    def num_codes(self) -> int:
        return 1 << self.total_bits

    @property
    def sign_bit(self) -> int:
        """The code bit that marks a negative value (0 for unsigned formats)."""
        return (1 << (self.total_bits - 1)) if self.signed else 0

    @property
    def max_finite(self) -> float:
        return self._magnitude_values_f64[-1]

    @property
    def min_normal(self) -> float:
        """Smallest positive normal value, 2^(1 - bias) (2^-bias without subnormals)."""
        return 2.0 ** ((1 if self.has_subnormals else 0) - self.bias)

    @property
    def min_subnormal(self) -> float:
        """Smallest positive value; equals ``min_normal`` for a format without subnormals."""
        return next(v for v in self._magnitude_values_f64 if v > 0)

    @property
    def has_zero(self) -> bool:
        return self.has_subnormals

    @property
    def nan_code(self) -> int | None:
        """The canonical positive NaN code, or None when the format has no NaN."""
        if self.special_values is SpecialValues.NONE:
            return None
        return (1 << (self.exponent_bits + self.mantissa_bits)) - 1

    def code_value(self, code: int) -> float:
        """The exact value of one code (float64), NaN/Inf for special codes."""
        if not 0 <= code < self.num_codes:
            raise ValueError(f"{self.name}: code {code} outside 0..{self.num_codes - 1}")
        negative = bool(code & self.sign_bit)
        magnitude_code = code & ~self.sign_bit if self.signed else code
        mantissa = magnitude_code & ((1 << self.mantissa_bits) - 1)
        exponent = magnitude_code >> self.mantissa_bits
        top_exponent = (1 << self.exponent_bits) - 1
        all_ones = (1 << (self.exponent_bits + self.mantissa_bits)) - 1
        if self.special_values is SpecialValues.IEEE and exponent == top_exponent:
            value = math.inf if mantissa == 0 else math.nan
        elif self.special_values is SpecialValues.ALL_ONES_NAN and magnitude_code == all_ones:
            value = math.nan
        elif exponent == 0 and self.has_subnormals:
            value = math.ldexp(mantissa, 1 - self.bias - self.mantissa_bits)
        else:
            value = math.ldexp((1 << self.mantissa_bits) + mantissa, exponent - self.bias - self.mantissa_bits)
        return -value if negative else value

    @functools.cached_property
    def _magnitude_values_f64(self) -> tuple[float, ...]:
        """Finite non-negative values, ascending; index == code."""
        limit = self.num_codes >> 1 if self.signed else self.num_codes
        values = []
        for code in range(limit):
            value = self.code_value(code)
            if not math.isfinite(value):
                break
            values.append(value)
        return tuple(values)

    def __repr__(self) -> str:
        return f"FloatFormat({self.name}, max_finite={self.max_finite:g})"

    # ----------------------------------------------------------------- public codecs
    def round(
        self, x: torch.Tensor, rounding: Rounding = "rne", generator: torch.Generator | None = None
    ) -> torch.Tensor:
        """Round ``x`` to the nearest values of this format (saturating); float32 result.

        NaN stays NaN (ValueError if the format has none); +-Inf saturates to +-max_finite.
        """
        x32 = self._prepare(x)
        index, negative = self._round_to_index(x32, rounding, generator)
        tables = _tables(self, x32.device)
        magnitude = tables.magnitudes[index.long()]
        out = torch.where(negative, -magnitude, magnitude) if self.signed else magnitude
        if tables.has_nan:
            out = torch.where(torch.isnan(x32), torch.nan, out)
        return out

    def encode(
        self, x: torch.Tensor, rounding: Rounding = "rne", generator: torch.Generator | None = None
    ) -> torch.Tensor:
        """Round ``x`` and return the uint8 codes (sign bit is the top bit of the format)."""
        x32 = self._prepare(x)
        index, negative = self._round_to_index(x32, rounding, generator)
        codes = index.to(torch.uint8)
        if self.signed:
            codes = codes | (negative.to(torch.uint8) << (self.total_bits - 1))
        if self.nan_code is not None:
            codes = torch.where(torch.isnan(x32), torch.tensor(self.nan_code, dtype=torch.uint8), codes)
        return codes

    def code_values(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """[num_codes] float32: the value of every code (NaN/Inf for special codes), built from the
        format's definition. Unlike :meth:`decode` it reads no tensor data (decode checks its codes'
        range, a host read), so lookup tables built in a training step take no host sync."""
        return _tables(self, torch.device(device)).values

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """uint8 codes -> float32 values (NaN/Inf for special codes)."""
        if codes.dtype != torch.uint8:
            raise ValueError(f"{self.name}.decode expects uint8 codes, got {codes.dtype}")
        if codes.numel() and int(codes.max()) >= self.num_codes:
            raise ValueError(f"{self.name}.decode: code {int(codes.max())} is outside 0..{self.num_codes - 1}")
        table = _tables(self, codes.device).values
        return torch.index_select(table, 0, codes.reshape(-1).int()).view(codes.shape)

    # ----------------------------------------------------------------- internals
    def _prepare(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            raise ValueError(f"{self.name}: expected a floating-point tensor, got {type(x).__name__}")
        x32 = x.float()
        if torch.isnan(x32).any() and self.nan_code is None:
            raise ValueError(f"{self.name} has no NaN encoding; input has {int(torch.isnan(x32).sum())} NaN")
        if not self.signed and (x32 < 0).any():
            raise ValueError(f"{self.name} is unsigned; input has {int((x32 < 0).sum())} negative values")
        return x32

    def _round_to_index(
        self, x32: torch.Tensor, rounding: str, generator: torch.Generator | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """uint8 magnitude index (== magnitude code) and sign of each element of float32 ``x32``."""
        check_rounding(rounding)
        magnitude = x32.abs().nan_to_num(nan=0.0)
        negative = torch.signbit(x32) if self.signed else torch.zeros((), dtype=torch.bool)
        return round_magnitude_to_index(self, magnitude, rounding, generator), negative


def check_rounding(rounding: str) -> None:
    if rounding not in ROUNDING_MODES:
        raise ValueError(f"unknown rounding {rounding!r}; valid: {', '.join(ROUNDING_MODES)}")


HASH_MULTIPLIER = 0x45D9F3B
"""The multiplier of :func:`sr8_bytes_at`'s rounds (T. Mueller's integer hash)."""
HASH_ROUNDS = 3
"""Three: with two, the bytes of elements 16 apart are measurably dependent (beyond the 6-sigma
bound of ``test_sr8_draws_layout_and_uniformity``'s chi-square over byte pairs, which three pass
at lags 1, 2, 16 and 17)."""


def sr8_key(numel: int, generator: torch.Generator | None, device: torch.device | str) -> torch.Tensor:
    """The 0-d int64 key of the random bytes of an operand of ``numel`` elements, uniform on [0, 2^32):
    the operand's only generator draw, so every path (eager, compiled, reference) consumes a generator
    identically. More than 2^32 elements are refused: their 32-bit indices would repeat bytes."""
    if numel > 1 << 32:
        raise ValueError(f"stochastic rounding indexes its random bytes in 32 bits: {numel} elements is more than 2^32")
    return torch.randint(0, 1 << 32, (), generator=generator, device=device, dtype=torch.int64)


def sr8_bytes_at(key: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """int32 random bytes (0..255) of the elements at ``index`` (int64, in [0, 2^32)) under ``key``
    (:func:`sr8_key`): the top byte of a 32-bit integer hash of ``index ^ key``, three
    xorshift-multiply rounds. Counter-based, so a compiled quantizer computes each element's byte in
    the loop that rounds it, from its index: no draws are stored or read.

    The 32-bit words live in int32: the multiplies wrap modulo 2^32 (two's complement, as eager
    PyTorch and Inductor's vector loops multiply) and each right shift is masked to its low bits, so
    it shifts in zeros as an unsigned shift would. In a compiled loop an int32 vector holds twice the
    lanes of an int64 one and multiplies in one instruction."""
    x = index.to(torch.int32) ^ key.to(torch.int32)  # the low 32 bits of each, wrapped into int32
    for _ in range(HASH_ROUNDS):  # in place on the fresh x: eagerly no new tensor per operation
        x ^= (x >> 16).bitwise_and_(0xFFFF)
        x.mul_(HASH_MULTIPLIER)
    return x.bitwise_right_shift_(24).bitwise_and_(0xFF)


def sr8_draws(shape: tuple[int, ...], generator: torch.Generator | None, device: torch.device | str) -> torch.Tensor:
    """uint8 tensor of ``shape``: the random integers ``r`` of ``sr8``/``sr`` rounding, element ``i``
    (in element order) taking ``sr8_bytes_at(sr8_key(numel, generator), i)``."""
    n = math.prod(shape)
    key = sr8_key(n, generator, device)
    return sr8_bytes_at(key, torch.arange(n, device=device, dtype=torch.int64)).to(torch.uint8).view(shape)


def round_magnitude_to_index(
    fmt: FloatFormat, magnitude: torch.Tensor, rounding: str, generator: torch.Generator | None
) -> torch.Tensor:
    """uint8 index (== magnitude code) of the rounded non-negative float32 ``magnitude`` (no NaN).

    The fast path shared by ``FloatFormat`` and block quantization; it does no input checks.
    """
    tables = _tables(fmt, magnitude.device)
    if rounding == "rne":
        # Number of boundaries strictly below |x|; boundaries of ties that round up were
        # moved down one float32 ulp, so |x| == midpoint counts as above them.
        return _count_greater(magnitude, tables.rne_boundaries, tables.rne_boundary_floats)
    grid = tables.magnitudes
    clamped = magnitude.clamp(min=fmt._magnitude_values_f64[0], max=fmt.max_finite)
    # largest i with grid[i] <= |x|: the number of grid[1:] values strictly below nextafter(|x|)
    lower = _count_greater(clamped, tables.lower_boundaries, tables.lower_boundary_floats).long()
    upper = (lower + 1).clamp_(max=grid.numel() - 1)
    lower_value = grid[lower]
    spacing = grid[upper] - lower_value
    frac = (clamped - lower_value) / torch.where(spacing > 0, spacing, 1.0)
    if rounding in BYTE_DRAW_ROUNDINGS:
        r = sr8_draws(tuple(magnitude.shape), generator, magnitude.device).float()
        away = sr_away(frac, r, rounding)
    else:
        u = torch.rand(magnitude.shape, generator=generator, device=magnitude.device, dtype=torch.float64)
        away = u < frac.double()
    return (lower + away).to(torch.uint8)


def sr_away(frac: torch.Tensor, r: torch.Tensor, rounding: str) -> torch.Tensor:
    """Whether a byte-draw stochastic rounding goes away from zero, from the exact float32
    fraction ``frac`` of a grid step and the float32 random byte ``r`` (0..255).

    ``sr``: ``256 * frac >= 256 - r`` (both sides exact); ``sr8``: ``fp32(frac + (2r+1)/512) >= 1``
    (``(2r+1)/512`` is exact; the one float32 addition rounds as the paper's code does)."""
    if rounding == "sr":
        return frac * 256.0 >= 256.0 - r
    return frac + (r * (2.0 / 512) + (1.0 / 512)) >= 1.0


_COMPARE_SUM_MAX_BOUNDARIES = 16


def _count_greater(x: torch.Tensor, boundaries: torch.Tensor, boundary_floats: tuple[float, ...]) -> torch.Tensor:
    """uint8 count of ``boundaries`` strictly below each element of ``x``.

    With few boundaries (E2M1 has 7) a vectorized compare-and-add per boundary is 2-3x
    faster on CPU than ``torch.bucketize``'s per-element binary search; both are exact.
    """
    if boundaries.numel() > _COMPARE_SUM_MAX_BOUNDARIES:
        return torch.bucketize(x, boundaries, out_int32=True).to(torch.uint8)
    count = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for boundary in boundary_floats:  # python floats: exact float32 values, no device sync
        count += torch.gt(x, boundary).view(torch.uint8)
    return count


@dataclass(frozen=True)
class _Tables:
    values: torch.Tensor  # [num_codes] float32 value of every code
    magnitudes: torch.Tensor  # [n] float32 finite non-negative values, ascending
    rne_boundaries: torch.Tensor  # [n - 1] float32: |x| > boundary[i] means "above midpoint i"
    lower_boundaries: torch.Tensor  # [n - 1] float32: |x| > boundary[i] means |x| >= magnitudes[i + 1]
    rne_boundary_floats: tuple[float, ...]
    lower_boundary_floats: tuple[float, ...]
    has_nan: bool


@functools.lru_cache(maxsize=64)
def _tables(fmt: FloatFormat, device: torch.device) -> _Tables:
    values_f64 = [fmt.code_value(c) for c in range(fmt.num_codes)]
    magnitudes_f64 = fmt._magnitude_values_f64
    boundaries = []
    for lower_code, (lo, hi) in enumerate(zip(magnitudes_f64, magnitudes_f64[1:])):
        midpoint = (lo + hi) / 2
        assert float(torch.tensor(midpoint, dtype=torch.float32)) == midpoint, "midpoint not exact in fp32"
        upper_code = lower_code + 1
        tie_rounds_up = fmt.mantissa_bits == 0 or upper_code % 2 == 0
        boundary = torch.tensor(midpoint, dtype=torch.float32)
        if tie_rounds_up:
            boundary = torch.nextafter(boundary, torch.tensor(-math.inf))
        boundaries.append(boundary)
    values = torch.tensor(values_f64, dtype=torch.float64).float()
    magnitudes = torch.tensor(magnitudes_f64, dtype=torch.float32)
    assert all((math.isnan(a) and math.isnan(b)) or a == b for a, b in zip(values.tolist(), values_f64)), (
        "value not exact in float32"
    )
    rne_boundaries = torch.stack(boundaries)
    lower_boundaries = torch.nextafter(magnitudes[1:], torch.tensor(-math.inf))
    return _Tables(
        values=values.to(device),
        magnitudes=magnitudes.to(device),
        rne_boundaries=rne_boundaries.to(device),
        lower_boundaries=lower_boundaries.to(device),
        rne_boundary_floats=tuple(rne_boundaries.tolist()),
        lower_boundary_floats=tuple(lower_boundaries.tolist()),
        has_nan=fmt.nan_code is not None,
    )


E2M1 = FloatFormat(
    name="e2m1",
    exponent_bits=2,
    mantissa_bits=1,
    bias=1,
    signed=True,
    has_subnormals=True,
    special_values=SpecialValues.NONE,
)
"""OCP FP4: +-{0, 0.5, 1, 1.5, 2, 3, 4, 6}, no Inf/NaN."""

E4M3 = FloatFormat(
    name="e4m3",
    exponent_bits=4,
    mantissa_bits=3,
    bias=7,
    signed=True,
    has_subnormals=True,
    special_values=SpecialValues.ALL_ONES_NAN,
)
"""OCP e4m3fn: max 448, NaN only at S.1111.111, no Inf."""

E5M2 = FloatFormat(
    name="e5m2",
    exponent_bits=5,
    mantissa_bits=2,
    bias=15,
    signed=True,
    has_subnormals=True,
    special_values=SpecialValues.IEEE,
)
"""OCP/IEEE-style e5m2: max 57,344, Inf and NaN in the top exponent."""

UE8M0 = FloatFormat(
    name="ue8m0",
    exponent_bits=8,
    mantissa_bits=0,
    bias=127,
    signed=False,
    has_subnormals=False,
    special_values=SpecialValues.ALL_ONES_NAN,
)
"""OCP MX scale: powers of two 2^-127..2^127, 0xFF = NaN, no zero, no sign."""

UE5M3 = FloatFormat(
    name="ue5m3",
    exponent_bits=5,
    mantissa_bits=3,
    bias=15,
    signed=False,
    has_subnormals=True,
    special_values=SpecialValues.IEEE,
)
"""UE5M3 as the paper defines it (arXiv 2609.02846): unsigned, bias 15, subnormals down to
2^-17, top exponent reserved (as in E5M2), so max finite = 1.875 * 2^15 = 61,440."""

UE5M3_CUDA = FloatFormat(
    name="ue5m3_cuda",
    exponent_bits=5,
    mantissa_bits=3,
    bias=15,
    signed=False,
    has_subnormals=True,
    special_values=SpecialValues.ALL_ONES_NAN,
)
"""The CUDA/PTX ``__nv_fp8x2_ue5m3`` encoding: no Inf, NaN only at 0xFF, so max finite is
0xFE = 1.75 * 2^16 = 114,688. Same grid as UE5M3 below 61,440."""

FORMATS: dict[str, FloatFormat] = {f.name: f for f in (E2M1, E4M3, E5M2, UE8M0, UE5M3, UE5M3_CUDA)}


def get_format(name: str) -> FloatFormat:
    """The format called ``name`` (case-insensitive)."""
    key = name.lower() if isinstance(name, str) else name
    if key not in FORMATS:
        raise ValueError(f"unknown format {name!r}; valid names: {', '.join(FORMATS)}")
    return FORMATS[key]


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """Pack 4-bit codes two per byte along the last dim; the even element goes in the low nibble."""
    if codes.dtype != torch.uint8:
        raise ValueError(f"pack_fp4 expects uint8 codes, got {codes.dtype}")
    if codes.dim() == 0 or codes.shape[-1] % 2:
        raise ValueError(f"pack_fp4 needs an even last dimension, got shape {tuple(codes.shape)}")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack_fp4``: [..., n] bytes -> [..., 2n] codes in 0..15."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"unpack_fp4 expects uint8, got {packed.dtype}")
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)
