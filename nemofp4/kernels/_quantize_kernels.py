"""Triton kernels of :mod:`nemofp4.kernels.quantize` (imported on first launch, never eagerly).

One launch reads a ``[BM, BK]`` tile of the input once and writes, for the row-wise blocks
(along the last dim, or 16x16 tiles) and, when asked, for the column-wise blocks of the same
tile (the quantization of ``x.T`` that wgrad consumes): packed E2M1 codes, block-scale codes,
optionally the scaled values (E2M1 value x block scale), the statistics counters, and the
stochastic-rounding draws for debugging. Every formula follows
:func:`nemofp4.formats.quantize_blocks` in the same FP32 order; the comments name the
reference line each step reproduces. Divisions use ``div_rn`` (IEEE round-to-nearest):
Triton's ``/`` on float32 is an approximate division on NVIDIA GPUs.

Random bits (``sr``/``sr8``/``sr_exact``) come from Philox (``tl.randint4x``), one call per 16 elements:
element ``(r, c)`` of the (padded) row-wise tensor uses byte ``c % 4`` of word ``(c % 16) // 4``
of ``philox(seed, counter = r * ceil(cols_padded / 16) + c // 16)``; the transposed tensor uses
counters offset by ``2**40``, so the two quantizations of one launch draw independent bits.
``sr`` and ``sr8`` take those bytes; ``sr_exact`` uses 53 bits per element (two words of ``philox(seed, 2 * (r * cols_padded + c))``).
"""

import triton
import triton.language as tl

FLT_MAX = tl.constexpr(3.4028234663852886e38)
ONE_SIXTH = tl.constexpr(1.0 / 6.0)  # rounded to float32 where used, as torch.tensor(1/6) is
TWO_POW_64 = tl.constexpr(18446744073709551616.0)
TWO_POW_53 = tl.constexpr(9007199254740992.0)
TWO_POW_23 = tl.constexpr(8388608.0)
TRANSPOSED_STREAM = tl.constexpr(1 << 40)

ROUND_RNE = tl.constexpr(0)
ROUND_SR8 = tl.constexpr(1)
ROUND_SR_EXACT = tl.constexpr(2)
ROUND_SR = tl.constexpr(3)  # TE's cvt.rs rule on the sr8 bytes


@triton.jit
def _e2m1_rne(a):
    """Magnitude code 0..7 of |y| under RNE, saturating: the number of tie-adjusted midpoints
    below |y| (ties 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4 go to the even code)."""
    return (
        (a > 0.25).to(tl.int32)
        + (a >= 0.75).to(tl.int32)
        + (a > 1.25).to(tl.int32)
        + (a >= 1.75).to(tl.int32)
        + (a > 2.5).to(tl.int32)
        + (a >= 3.5).to(tl.int32)
        + (a > 5.0).to(tl.int32)
    )


@triton.jit
def _e2m1_grid_position(a):
    """(|y| clamped to 6) / spacing of its binade (exact), and the code of the binade's first point
    minus that point / spacing: spacing 1/2 on [0, 2), 1 on [2, 4), 2 on [4, 6]."""
    a = tl.minimum(a, 6.0)
    inv = tl.where(a < 2.0, 2.0, tl.where(a < 4.0, 1.0, 0.5))
    offset = tl.where(a < 2.0, 0, tl.where(a < 4.0, 2, 4))
    return a * inv, offset


@triton.jit
def _e2m1_sr8(a, r):
    """The paper's 8-bit midpoint SR: away from zero iff fp32(frac + (2r + 1) / 512) >= 1."""
    t, offset = _e2m1_grid_position(a)
    lower = tl.floor(t)
    frac = t - lower
    return lower.to(tl.int32) + (frac + (2 * r + 1).to(tl.float32) * (1.0 / 512.0) >= 1.0).to(tl.int32) + offset


@triton.jit
def _e2m1_rs(a, r):
    """TE's cvt.rs SR (8 random bits): away from zero iff 256 * frac >= 256 - r (exact)."""
    t, offset = _e2m1_grid_position(a)
    lower = tl.floor(t)
    frac = t - lower
    return lower.to(tl.int32) + (frac * 256.0 >= 256.0 - r.to(tl.float32)).to(tl.int32) + offset


@triton.jit
def _e2m1_sr(a, u53):
    """Exact stochastic rounding: away iff u < frac with u = u53 / 2^53 (compared exactly in fp64)."""
    t, offset = _e2m1_grid_position(a)
    lower = tl.floor(t)
    frac = t - lower
    away = u53.to(tl.float64) < frac.to(tl.float64) * TWO_POW_53
    return lower.to(tl.int32) + away.to(tl.int32) + offset


@triton.jit
def _e2m1_value(mag):
    """E2M1 magnitude code 0..7 -> value {0, .5, 1, 1.5, 2, 3, 4, 6} (float32, exact)."""
    m = mag.to(tl.float32)
    return tl.where(mag < 4, m * 0.5, tl.where(mag < 6, m - 2.0, 2.0 * m - 8.0))


@triton.jit
def _global_scales(g, numerator, ZERO_AMAX_GIVES_ONE: tl.constexpr):
    """(tensor_scale, code_multiplier) = (1/G, G * fp32(1/6)) with G = min(fp32(T*6) / g, FLT_MAX);
    e4m3 (TE) replaces only G == 0 by 1, the UE5M3 emulator replaces g == 0 by G = 1."""
    # g = 0 gives +inf -> FLT_MAX (written without dividing by zero)
    multiplier = tl.minimum(tl.math.div_rn(numerator, tl.where(g == 0.0, 1.0, g)), FLT_MAX)
    multiplier = tl.where(g == 0.0, FLT_MAX, multiplier)
    if ZERO_AMAX_GIVES_ONE:
        multiplier = tl.where(g == 0.0, 1.0, multiplier)
    else:
        multiplier = tl.where(multiplier == 0.0, 1.0, multiplier)
    tensor_scale = tl.math.div_rn(1.0, multiplier)
    return tensor_scale, multiplier * ONE_SIXTH


@triton.jit
def _minifloat_scale(
    block_amax,
    code_multiplier,
    tensor_scale,
    SCALE_MAX: tl.constexpr,
    SCALE_BIAS: tl.constexpr,
    SCALE_MANT: tl.constexpr,
    SCALE_MIN_NORMAL: tl.constexpr,
    SCALE_SUB_STEP: tl.constexpr,
    ZERO_CODE_TO_ONE: tl.constexpr,
):
    """Block-scale code, decoded scale, payload multiplier, saturated and underflow flags for an
    (U)E?M3 scale: code = rne(min(amax * G/6, max_finite)) (0 -> code of 1.0 for UE5M3) and
    enc = min(1 / (scale * tensor_scale), FLT_MAX)."""
    DROP: tl.constexpr = 23 - SCALE_MANT
    MANT_MASK: tl.constexpr = (1 << SCALE_MANT) - 1
    ideal = tl.minimum(block_amax * code_multiplier, FLT_MAX)
    saturated = ideal > SCALE_MAX
    v = tl.minimum(ideal, SCALE_MAX)
    # normals: round the float32 significand to SCALE_MANT bits, ties to even (integer RNE on the bits)
    vb = v.to(tl.int32, bitcast=True)
    rb = (vb + ((1 << (DROP - 1)) - 1) + ((vb >> DROP) & 1)) >> DROP  # exponent and kept mantissa
    code_normal = ((((rb >> SCALE_MANT) & 0xFF) - 127 + SCALE_BIAS) << SCALE_MANT) | (rb & MANT_MASK)
    # subnormals: v / min_subnormal < 2^SCALE_MANT, rounded to an integer by one fp32 addition (RNE)
    steps = tl.minimum(v, SCALE_MIN_NORMAL) * (1.0 / SCALE_SUB_STEP)  # the min only tames the unused lanes
    code_sub = ((steps + TWO_POW_23) - TWO_POW_23).to(tl.int32)
    code = tl.where(v < SCALE_MIN_NORMAL, code_sub, code_normal)
    underflow = (code == 0) & (block_amax > 0.0)
    if ZERO_CODE_TO_ONE:
        code = tl.where(code == 0, SCALE_BIAS << SCALE_MANT, code)
    exponent_field = code >> SCALE_MANT
    normal_bits = ((exponent_field - SCALE_BIAS + 127) << 23) | ((code & MANT_MASK) << DROP)
    scale = tl.where(
        exponent_field == 0,
        (code & MANT_MASK).to(tl.float32) * SCALE_SUB_STEP,
        normal_bits.to(tl.float32, bitcast=True),
    )
    denominator = scale * tensor_scale  # a zero scale (e4m3) gives 1/0 = inf -> FLT_MAX
    encode = tl.minimum(tl.math.div_rn(1.0, tl.where(denominator == 0.0, 1.0, denominator)), FLT_MAX)
    encode = tl.where(denominator == 0.0, FLT_MAX, encode)
    return code, scale, encode, saturated, underflow


@triton.jit
def _pow2_scale(block_amax, MX_CEIL: tl.constexpr):
    """UE8M0 (MX) block exponent e, exact from the float32 bits: floor mode e = floor(log2 amax) - 2
    (amax = 0 -> -127); ceil mode e = ceil(log2(fp32(amax / 6))) (0 -> -127, underflow -> -128);
    clamped to [-127, 127]. Returns code, 2^e, 2^-e, saturated, underflow."""
    if MX_CEIL:
        d = tl.math.div_rn(block_amax, 6.0)
    else:
        d = block_amax
    db = d.to(tl.int32, bitcast=True)
    is_subnormal = db < 0x00800000
    sb = (tl.minimum(d, 1.0) * TWO_POW_64).to(tl.int32, bitcast=True)  # subnormals become normal, exactly
    exponent = tl.where(is_subnormal, ((sb >> 23) & 0xFF) - 191, ((db >> 23) & 0xFF) - 127)
    if MX_CEIL:
        mantissa = tl.where(is_subnormal, sb & 0x7FFFFF, db & 0x7FFFFF)
        unclamped = exponent + (mantissa != 0).to(tl.int32)
        unclamped = tl.where(d > 0.0, unclamped, tl.where(block_amax > 0.0, -128, -127))
    else:
        unclamped = tl.where(block_amax > 0.0, exponent - 2, -127)
    e = tl.minimum(tl.maximum(unclamped, -127), 127)
    scale = tl.where(e == -127, 1 << 22, (e + 127) << 23).to(tl.float32, bitcast=True)
    encode = tl.where(e == 127, 1 << 22, (127 - e) << 23).to(tl.float32, bitcast=True)
    return e + 127, scale, encode, unclamped > 127, (unclamped < -127) & (block_amax > 0.0)


@triton.jit
def _block_scales(
    block_amax,
    code_multiplier,
    tensor_scale,
    IS_MX: tl.constexpr,
    MX_CEIL: tl.constexpr,
    SCALE_MAX: tl.constexpr,
    SCALE_BIAS: tl.constexpr,
    SCALE_MANT: tl.constexpr,
    SCALE_MIN_NORMAL: tl.constexpr,
    SCALE_SUB_STEP: tl.constexpr,
    ZERO_CODE_TO_ONE: tl.constexpr,
):
    if IS_MX:
        return _pow2_scale(block_amax, MX_CEIL)
    else:
        return _minifloat_scale(
            block_amax,
            code_multiplier,
            tensor_scale,
            SCALE_MAX,
            SCALE_BIAS,
            SCALE_MANT,
            SCALE_MIN_NORMAL,
            SCALE_SUB_STEP,
            ZERO_CODE_TO_ONE,
        )


@triton.jit
def _lane_bytes(w0, w1, w2, w3, lane):
    """Byte ``lane % 4`` of word ``lane // 4`` of one Philox call (w0..w3 broadcast against ``lane``)."""
    word = tl.where(lane < 8, tl.where(lane < 4, w0, w1), tl.where(lane < 12, w2, w3))
    return (word >> ((lane & 3) * 8).to(tl.uint32)) & 255


@triton.jit
def _sr8_draws_along_cols(seed, row_counter_base, col0, BM: tl.constexpr, BK: tl.constexpr):
    """[BM, BK] bytes: 16 consecutive columns share one Philox call (4 words x 4 bytes).
    ``row_counter_base`` [BM] int64 is each row's first counter; ``col0`` the tile's first column."""
    counters = row_counter_base[:, None] + (col0 // 16 + tl.arange(0, BK // 16))[None, :]
    w0, w1, w2, w3 = tl.randint4x(seed, counters)
    byte = _lane_bytes(w0[:, :, None], w1[:, :, None], w2[:, :, None], w3[:, :, None], tl.arange(0, 16)[None, None, :])
    return tl.reshape(byte, (BM, BK)).to(tl.int32)


@triton.jit
def _sr8_draws_along_rows(seed, col_counter_base, row0, BM: tl.constexpr, BK: tl.constexpr):
    """[BM, BK] bytes for the transposed tensor: 16 consecutive rows of a column share a call."""
    counters = (row0 // 16 + tl.arange(0, BM // 16))[:, None] + col_counter_base[None, :]
    w0, w1, w2, w3 = tl.randint4x(seed, counters)
    byte = _lane_bytes(w0[:, None, :], w1[:, None, :], w2[:, None, :], w3[:, None, :], tl.arange(0, 16)[None, :, None])
    return tl.reshape(byte, (BM, BK)).to(tl.int32)


@triton.jit
def _sr53_draws(seed, flat_index):
    """53-bit integers for exact SR: two words of one Philox call per element."""
    w0, w1, _, _ = tl.randint4x(seed, flat_index * 2)
    return ((w0 & 0x1FFFFF).to(tl.int64) << 32) | w1.to(tl.int64)


@triton.jit
def _payload(y, draws, ROUNDING: tl.constexpr):
    """4-bit E2M1 code (sign in bit 3, from the sign bit of y, so -0 -> 8) of y = x * enc."""
    a = tl.abs(y)
    if ROUNDING == ROUND_RNE:
        mag = _e2m1_rne(a)
    elif ROUNDING == ROUND_SR8:
        mag = _e2m1_sr8(a, draws)
    elif ROUNDING == ROUND_SR:
        mag = _e2m1_rs(a, draws)
    else:
        mag = _e2m1_sr(a, draws)
    sign = (y.to(tl.int32, bitcast=True) >> 31) & 1
    return mag, sign


@triton.jit
def _count(flags, valid):
    return tl.sum(tl.sum((flags & valid).to(tl.int32), axis=1), axis=0)


@triton.jit
def _side_tensor_scales(g_ptr, numerator, ts_ptr, IS_MX: tl.constexpr, ZERO_CODE_TO_ONE: tl.constexpr):
    """(tensor_scale, code multiplier) of one side; the first program stores the tensor scale."""
    tensor_scale = 1.0
    code_multiplier = 1.0
    if not IS_MX:
        tensor_scale, code_multiplier = _global_scales(tl.load(g_ptr), numerator, ZERO_CODE_TO_ONE)
        if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
            tl.store(ts_ptr, tensor_scale)
    return tensor_scale, code_multiplier


@triton.jit
def _side_stats(counts_ptr, saturated, underflow, block_amax, y, block_ok, elem_ok):
    """The four statistics counters of one side: saturated, underflowed and zero blocks, clipped elements."""
    tl.atomic_add(counts_ptr + 0, _count(saturated, block_ok))
    tl.atomic_add(counts_ptr + 1, _count(underflow, block_ok))
    tl.atomic_add(counts_ptr + 2, _count(block_amax == 0.0, block_ok))
    tl.atomic_add(counts_ptr + 3, _count(tl.abs(y) > 6.0, elem_ok))


@triton.jit
def _signed_value(mag, sign, scale_e):
    """The scaled value: E2M1 value (sign applied) x its block scale (exact)."""
    value = _e2m1_value(mag)
    return tl.where(sign == 1, -value, value) * scale_e


@triton.jit
def _quantize_rows(
    x,
    abits,
    seed_ptr,
    g_ptr,
    numerator,
    codes_ptr,
    scales_ptr,
    scaled_ptr,
    draws_ptr,
    counts_ptr,
    ts_ptr,
    row0,
    col0,
    rows_out,
    cols_p,
    BM: tl.constexpr,
    BK: tl.constexpr,
    BS: tl.constexpr,
    IS_MX: tl.constexpr,
    MX_CEIL: tl.constexpr,
    SCALE_MAX: tl.constexpr,
    SCALE_BIAS: tl.constexpr,
    SCALE_MANT: tl.constexpr,
    SCALE_MIN_NORMAL: tl.constexpr,
    SCALE_SUB_STEP: tl.constexpr,
    ZERO_CODE_TO_ONE: tl.constexpr,
    ROUNDING: tl.constexpr,
    TWO_D: tl.constexpr,
    WRITE_SCALED: tl.constexpr,
    WRITE_DRAWS: tl.constexpr,
    STATS: tl.constexpr,
):
    """The row-wise side of a tile: blocks along the last dim (or BS x BS tiles with TWO_D). Writes codes
    [rows_out, cols_p/2], scales [rows_out, cols_p/BS] (2-D: [rows_p/BS, cols_p/BS]), scaled [rows_out, cols_p]."""
    offs_m = row0 + tl.arange(0, BM)
    m2 = offs_m[:, None]
    k2 = col0 + tl.arange(0, BK)[None, :]
    tensor_scale, code_multiplier = _side_tensor_scales(g_ptr, numerator, ts_ptr, IS_MX, ZERO_CODE_TO_ONE)
    NB: tl.constexpr = BK // BS
    if TWO_D:
        tiles = tl.reshape(abits, (BM // BS, BS, NB, BS))
        block_amax = tl.max(tl.max(tiles, axis=3), axis=1).to(tl.float32, bitcast=True)
    else:
        block_amax = tl.max(tl.reshape(abits, (BM, NB, BS)), axis=2).to(tl.float32, bitcast=True)
    code, scale, encode, saturated, underflow = _block_scales(
        block_amax,
        code_multiplier,
        tensor_scale,
        IS_MX,
        MX_CEIL,
        SCALE_MAX,
        SCALE_BIAS,
        SCALE_MANT,
        SCALE_MIN_NORMAL,
        SCALE_SUB_STEP,
        ZERO_CODE_TO_ONE,
    )
    if TWO_D:
        enc_e = tl.reshape(tl.broadcast_to(encode[:, None, :, None], (BM // BS, BS, NB, BS)), (BM, BK))
    else:
        enc_e = tl.reshape(tl.broadcast_to(encode[:, :, None], (BM, NB, BS)), (BM, BK))
    y = x * enc_e  # payload = e2m1(x * enc_b), reciprocal-then-multiply
    draws = 0
    if ROUNDING == ROUND_SR8 or ROUNDING == ROUND_SR:
        row_base = offs_m.to(tl.int64) * ((cols_p + 15) // 16)
        draws = _sr8_draws_along_cols(tl.load(seed_ptr), row_base, col0, BM, BK)
    elif ROUNDING == ROUND_SR_EXACT:
        draws = _sr53_draws(tl.load(seed_ptr), m2.to(tl.int64) * cols_p + k2)
    mag, sign = _payload(y, draws, ROUNDING)
    elem_ok = (m2 < rows_out) & (k2 < cols_p)
    packed_lo, packed_hi = tl.split(tl.reshape(mag | (sign << 3), (BM, BK // 2, 2)))
    offs_byte = col0 // 2 + tl.arange(0, BK // 2)[None, :]
    tl.store(
        codes_ptr + m2.to(tl.int64) * (cols_p // 2) + offs_byte,
        (packed_lo | (packed_hi << 4)).to(tl.uint8),
        mask=(m2 < rows_out) & (offs_byte < cols_p // 2),
    )
    offs_blk = col0 // BS + tl.arange(0, NB)[None, :]
    if TWO_D:
        offs_tile = row0 // BS + tl.arange(0, BM // BS)[:, None]
        block_ok = (offs_tile < rows_out // BS) & (offs_blk < cols_p // BS)
        tl.store(scales_ptr + offs_tile * (cols_p // BS) + offs_blk, code.to(tl.uint8), mask=block_ok)
    else:
        block_ok = (m2 < rows_out) & (offs_blk < cols_p // BS)
        tl.store(scales_ptr + m2.to(tl.int64) * (cols_p // BS) + offs_blk, code.to(tl.uint8), mask=block_ok)
    if WRITE_SCALED:
        if TWO_D:
            scale_e = tl.reshape(tl.broadcast_to(scale[:, None, :, None], (BM // BS, BS, NB, BS)), (BM, BK))
        else:
            scale_e = tl.reshape(tl.broadcast_to(scale[:, :, None], (BM, NB, BS)), (BM, BK))
        value = _signed_value(mag, sign, scale_e)
        tl.store(scaled_ptr + m2.to(tl.int64) * cols_p + k2, value.to(scaled_ptr.dtype.element_ty), mask=elem_ok)
    if WRITE_DRAWS:
        tl.store(draws_ptr + m2.to(tl.int64) * cols_p + k2, draws.to(tl.int64), mask=elem_ok)
    if STATS:
        _side_stats(counts_ptr, saturated, underflow, block_amax, y, block_ok, elem_ok)


@triton.jit
def _quantize_cols(
    x,
    abits,
    seed_ptr,
    g_ptr,
    numerator,
    codes_ptr,
    scales_ptr,
    scaled_ptr,
    draws_ptr,
    counts_ptr,
    ts_ptr,
    row0,
    col0,
    cols,
    rows_p,
    BM: tl.constexpr,
    BK: tl.constexpr,
    BS: tl.constexpr,
    IS_MX: tl.constexpr,
    MX_CEIL: tl.constexpr,
    SCALE_MAX: tl.constexpr,
    SCALE_BIAS: tl.constexpr,
    SCALE_MANT: tl.constexpr,
    SCALE_MIN_NORMAL: tl.constexpr,
    SCALE_SUB_STEP: tl.constexpr,
    ZERO_CODE_TO_ONE: tl.constexpr,
    ROUNDING: tl.constexpr,
    WRITE_SCALED: tl.constexpr,
    WRITE_DRAWS: tl.constexpr,
    STATS: tl.constexpr,
):
    """The transposed side of the same tile: x.T [cols, rows_p], blocks of BS consecutive rows, one per
    column. Writes codes [cols, rows_p/2], scales [cols, rows_p/BS], scaled [cols, rows_p]."""
    offs_k = col0 + tl.arange(0, BK)
    m2 = row0 + tl.arange(0, BM)[:, None]
    k2 = offs_k[None, :]
    tensor_scale, code_multiplier = _side_tensor_scales(g_ptr, numerator, ts_ptr, IS_MX, ZERO_CODE_TO_ONE)
    MB: tl.constexpr = BM // BS
    block_amax = tl.max(tl.reshape(abits, (MB, BS, BK)), axis=1).to(tl.float32, bitcast=True)
    code, scale, encode, saturated, underflow = _block_scales(
        block_amax,
        code_multiplier,
        tensor_scale,
        IS_MX,
        MX_CEIL,
        SCALE_MAX,
        SCALE_BIAS,
        SCALE_MANT,
        SCALE_MIN_NORMAL,
        SCALE_SUB_STEP,
        ZERO_CODE_TO_ONE,
    )
    y = x * tl.reshape(tl.broadcast_to(encode[:, None, :], (MB, BS, BK)), (BM, BK))
    draws = 0
    if ROUNDING == ROUND_SR8 or ROUNDING == ROUND_SR:
        col_base = TRANSPOSED_STREAM + offs_k.to(tl.int64) * ((rows_p + 15) // 16)
        draws = _sr8_draws_along_rows(tl.load(seed_ptr), col_base, row0, BM, BK)
    elif ROUNDING == ROUND_SR_EXACT:
        draws = _sr53_draws(tl.load(seed_ptr), TRANSPOSED_STREAM + k2.to(tl.int64) * rows_p + m2)
    mag, sign = _payload(y, draws, ROUNDING)
    # store transposed: [BK, BM] with pairs of consecutive rows packed into one byte
    packed_lo, packed_hi = tl.split(tl.reshape(tl.trans(mag | (sign << 3)), (BK, BM // 2, 2)))
    kt = offs_k[:, None]
    offs_byte = row0 // 2 + tl.arange(0, BM // 2)[None, :]
    tl.store(
        codes_ptr + kt.to(tl.int64) * (rows_p // 2) + offs_byte,
        (packed_lo | (packed_hi << 4)).to(tl.uint8),
        mask=(kt < cols) & (offs_byte < rows_p // 2),
    )
    offs_blk = row0 // BS + tl.arange(0, MB)[:, None]
    block_ok = (offs_blk < rows_p // BS) & (k2 < cols)
    tl.store(scales_ptr + k2.to(tl.int64) * (rows_p // BS) + offs_blk, code.to(tl.uint8), mask=block_ok)
    elem_ok = (m2 < rows_p) & (k2 < cols)
    if WRITE_SCALED:
        value = _signed_value(mag, sign, tl.reshape(tl.broadcast_to(scale[:, None, :], (MB, BS, BK)), (BM, BK)))
        tl.store(scaled_ptr + k2.to(tl.int64) * rows_p + m2, value.to(scaled_ptr.dtype.element_ty), mask=elem_ok)
    if WRITE_DRAWS:
        tl.store(draws_ptr + k2.to(tl.int64) * rows_p + m2, draws.to(tl.int64), mask=elem_ok)
    if STATS:
        _side_stats(counts_ptr, saturated, underflow, block_amax, y, block_ok, elem_ok)


@triton.jit
def quantize_kernel(
    x_ptr,
    g_ptr,
    seed_ptr,
    amax_out_ptr,
    codes_ptr,
    scales_ptr,
    scaled_ptr,
    draws_ptr,
    counts_ptr,
    ts_ptr,
    codes_t_ptr,
    scales_t_ptr,
    scaled_t_ptr,
    draws_t_ptr,
    counts_t_ptr,
    ts_t_ptr,
    rows,
    cols,
    stride_x,
    rows_out,
    cols_p,
    rows_p,
    numerator,
    numerator_t,
    BM: tl.constexpr,
    BK: tl.constexpr,
    BS: tl.constexpr,
    IS_MX: tl.constexpr,
    MX_CEIL: tl.constexpr,
    SCALE_MAX: tl.constexpr,
    SCALE_BIAS: tl.constexpr,
    SCALE_MANT: tl.constexpr,
    SCALE_MIN_NORMAL: tl.constexpr,
    SCALE_SUB_STEP: tl.constexpr,
    ZERO_CODE_TO_ONE: tl.constexpr,
    ROUNDING: tl.constexpr,
    TWO_D: tl.constexpr,
    ROWWISE: tl.constexpr,
    TRANSPOSED: tl.constexpr,
    WRITE_SCALED: tl.constexpr,
    WRITE_DRAWS: tl.constexpr,
    STATS: tl.constexpr,
    MEASURE_AMAX: tl.constexpr,
):
    """One [BM, BK] tile of x, read once: its row-wise quantization (:func:`_quantize_rows`) and/or
    that of x.T (:func:`_quantize_cols`), and with MEASURE_AMAX its share of the MX tensor amax."""
    row0 = tl.program_id(0) * BM
    col0 = tl.program_id(1) * BK
    m2 = (row0 + tl.arange(0, BM))[:, None]
    k2 = (col0 + tl.arange(0, BK))[None, :]
    x = tl.load(x_ptr + m2.to(tl.int64) * stride_x + k2, mask=(m2 < rows) & (k2 < cols), other=0.0)
    x = x.to(tl.float32)
    # |x| as int32 bits: exact, order-preserving for non-negative floats, and NaN-propagating
    abits = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    if MEASURE_AMAX:
        tl.atomic_max(amax_out_ptr, tl.max(tl.max(abits, axis=1), axis=0))
    if ROWWISE:
        _quantize_rows(
            x,
            abits,
            seed_ptr,
            g_ptr,
            numerator,
            codes_ptr,
            scales_ptr,
            scaled_ptr,
            draws_ptr,
            counts_ptr,
            ts_ptr,
            row0,
            col0,
            rows_out,
            cols_p,
            BM,
            BK,
            BS,
            IS_MX,
            MX_CEIL,
            SCALE_MAX,
            SCALE_BIAS,
            SCALE_MANT,
            SCALE_MIN_NORMAL,
            SCALE_SUB_STEP,
            ZERO_CODE_TO_ONE,
            ROUNDING,
            TWO_D,
            WRITE_SCALED,
            WRITE_DRAWS,
            STATS,
        )
    if TRANSPOSED:
        _quantize_cols(
            x,
            abits,
            seed_ptr,
            g_ptr,
            numerator_t,
            codes_t_ptr,
            scales_t_ptr,
            scaled_t_ptr,
            draws_t_ptr,
            counts_t_ptr,
            ts_t_ptr,
            row0,
            col0,
            cols,
            rows_p,
            BM,
            BK,
            BS,
            IS_MX,
            MX_CEIL,
            SCALE_MAX,
            SCALE_BIAS,
            SCALE_MANT,
            SCALE_MIN_NORMAL,
            SCALE_SUB_STEP,
            ZERO_CODE_TO_ONE,
            ROUNDING,
            WRITE_SCALED,
            WRITE_DRAWS,
            STATS,
        )


@triton.jit
def amax_kernel(x_ptr, n, out_ptr, num_programs, iterations, BLOCK: tl.constexpr):
    """max |x| over a flat tensor as float32 bits, atomically max-reduced into ``out_ptr`` (int32,
    zero-initialized). Integer max of the |x| bits is exact and lets NaN win (its bits are largest).
    Program p reads chunks p, p + num_programs, ... (``iterations`` of them, the last masked)."""
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for i in range(iterations):
        offs = (pid + i * num_programs).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
        acc = tl.maximum(acc, x.to(tl.int32, bitcast=True) & 0x7FFFFFFF)
    tl.atomic_max(out_ptr, tl.max(acc, axis=0))
