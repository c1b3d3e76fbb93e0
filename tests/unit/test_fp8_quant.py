"""The FP8 quantizers (per-tensor current scaling, MXFP8) held bit for bit to an independent reference
written from Transformer Engine's source, in NumPy with ml_dtypes' FP8 casts (not from our program):

* per-tensor scale: ``compute_scale_from_amax`` (``common/recipe/recipe_common.cuh``): amax 0, Inf or
  NaN -> 1; ``max / amax`` (``__fdiv_rn``); an infinite quotient -> FLT_MAX; power-of-two scales by
  ``bits & 0xFF800000``; ``scale_inv = 1 / scale``;
* MXFP8 scale: ``ptx::float_to_e8m0(amax * Quantized_Limits<OType>::max_norm_rcp)`` (the software path:
  round the exponent up unless the mantissa is zero, saturate at 0xFE, NaN 0xFF) and the payload
  multiplier ``ptx::exp2f_rcp`` (1 for code 0); OCP's floor rule ``floor(log2(amax)) - emax``;
* the cast: ``cvt.rn.satfinite`` (round to nearest even, clamp to the largest finite value, NaN kept);
  the amaxes skip NaN (``fmaxf``).
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from nemofp4.kernels import OperandRequest, program, x_and_tokens
from nemofp4.quant import GemmOperand, OperandQuant, QuantLinear, reference_gemm
from nemofp4.recipes import get_recipe

pytestmark = pytest.mark.usefixtures("one_thread")

FP8 = {"e4m3": (ml_dtypes.float8_e4m3fn, 448.0, 8), "e5m2": (ml_dtypes.float8_e5m2, 57344.0, 15)}
FLT_MAX = np.float32(np.finfo(np.float32).max)


# ------------------------------------------------------------------------------------ reference
def _f32_bits(v) -> int:
    return int(np.asarray(v, dtype=np.float32).view(np.uint32))


def _f32_from_bits(bits: int) -> np.float32:
    return np.asarray(bits & 0xFFFFFFFF, dtype=np.uint32).view(np.float32)[()]


def _cast_satfinite(y: np.ndarray, element: str) -> np.ndarray:
    """``cvt.rn.satfinite``: ml_dtypes' RNE cast of the value clamped to +-max (NaN stays NaN)."""
    dtype, top, _ = FP8[element]
    with np.errstate(invalid="ignore"):
        clamped = np.where(np.isnan(y), y, np.clip(y, -top, top)).astype(np.float32)
    return clamped.astype(dtype).astype(np.float32)


def _amax(a: np.ndarray) -> np.float32:
    """``fmaxf`` over |a|: NaN skipped."""
    magnitudes = np.abs(a.astype(np.float32))
    return np.float32(np.max(np.where(np.isnan(magnitudes), np.float32(0), magnitudes), initial=np.float32(0)))


def te_tensor_scale(amax: np.float32, element: str, power_of_two: bool) -> np.float32:
    top = np.float32(FP8[element][1])
    if amax == 0 or np.isinf(amax) or np.isnan(amax):
        return np.float32(1)
    with np.errstate(over="ignore", divide="ignore"):
        scale = np.float32(top / amax)
    if np.isinf(scale):
        scale = FLT_MAX
    if power_of_two:
        scale = _f32_from_bits(_f32_bits(scale) & 0xFF800000)
    return scale


def te_current_scaling(x: np.ndarray, element: str, power_of_two=False, amax=None):
    """(decoded FP8 values, scale_inv) of TE's per-tensor current-scaling cast of ``x``."""
    scale = te_tensor_scale(_amax(x) if amax is None else np.float32(amax), element, power_of_two)
    with np.errstate(invalid="ignore", over="ignore"):
        values = _cast_satfinite(x.astype(np.float32) * scale, element)
    return values, np.float32(1) / scale


def te_float_to_e8m0(v: np.float32) -> int:
    if np.isnan(v):
        return 0xFF
    if np.isinf(v):
        return 0xFE
    if v == 0:
        return 0
    bits = _f32_bits(v)
    exponent, mantissa = bits >> 23, bits & 0x7FFFFF
    if mantissa > 0 and exponent != 0xFE and not (exponent == 0 and mantissa <= 0x400000):
        exponent += 1
    return exponent


def te_exp2f_rcp(code: int) -> np.float32:
    return np.float32(1) if code == 0 else _f32_from_bits((254 - code) << 23)


def ocp_floor_code(amax: np.float32, emax: int) -> int:
    if amax == 0:
        return 0
    _, exponent = math.frexp(float(amax))  # amax = m * 2^exponent, m in [0.5, 1)
    return min(max(exponent - 1 - emax, -127), 127) + 127


def mxfp8(x: np.ndarray, element: str, mode: str, block=32):
    """(scaled values: FP8 value x 2^(code - 127), codes) of ``x`` [R, C] in blocks along its rows."""
    _, top, emax = FP8[element]
    rows, cols = x.shape
    padded = np.zeros((rows, cols + -cols % block), dtype=np.float32)
    padded[:, :cols] = x
    blocks = padded.reshape(rows, -1, block)
    rcp = np.float32(1.0 / top)  # Quantized_Limits::max_norm_rcp: a double quotient stored as float
    codes = np.zeros(blocks.shape[:2], dtype=np.int64)
    scaled = np.zeros_like(blocks)
    for r in range(blocks.shape[0]):
        for b in range(blocks.shape[1]):
            amax = _amax(blocks[r, b])
            if mode == "ceil":
                code = te_float_to_e8m0(np.float32(amax * rcp))
                encode = te_exp2f_rcp(code)
            else:
                code = ocp_floor_code(amax, emax)
                encode = np.float32(2.0 ** (127 - code))
            with np.errstate(invalid="ignore", over="ignore"):
                values = _cast_satfinite(blocks[r, b] * encode, element)
                scaled[r, b] = values * np.float32(2.0 ** (code - 127))
            codes[r, b] = code
    return scaled.reshape(padded.shape), codes


# ------------------------------------------------------------------------------------ helpers
def _spec(element="e4m3", scaling="fp32", **kw):
    block = 32 if scaling == "ue8m0" else 16
    return OperandQuant(scale_format=scaling, element_format=element, block_size=block, **kw)


def _same(actual: torch.Tensor, expected: np.ndarray):
    """Bit for bit, NaNs at the same places."""
    expected = torch.from_numpy(np.ascontiguousarray(expected, dtype=np.float32))
    actual = actual.detach().float().contiguous()
    assert actual.shape == expected.shape
    assert torch.equal(torch.isnan(actual), torch.isnan(expected))
    finite = ~torch.isnan(expected)
    assert torch.equal(actual[finite].view(torch.int32), expected[finite].view(torch.int32))


def _padded(x: np.ndarray, multiple: int) -> np.ndarray:
    return np.pad(x, ((0, 0), (0, -x.shape[1] % multiple)))


CASES = [
    ("e4m3", "fp32", {}),
    ("e5m2", "fp32", {}),
    ("e4m3", "fp32", {"power_of_two_scale": True}),
    ("e5m2", "fp32", {"power_of_two_scale": True}),
    ("e4m3", "ue8m0", {"mx_scale_mode": "ceil"}),
    ("e4m3", "ue8m0", {"mx_scale_mode": "floor"}),
    ("e5m2", "ue8m0", {"mx_scale_mode": "ceil"}),
]


def _reference(x: np.ndarray, element, scaling, kw, amax=None):
    """(expected scaled values padded like the operand, expected tensor scale, expected scale codes)."""
    if scaling == "fp32":
        values, scale_inv = te_current_scaling(x, element, kw.get("power_of_two_scale", False), amax)
        return _padded(values, 16), scale_inv, None
    scaled, codes = mxfp8(x, element, kw.get("mx_scale_mode", "floor"))
    return scaled, np.float32(1), codes


def _check(x: torch.Tensor, element, scaling, kw, *, compiled=False, amax=None):
    op = _spec(element, scaling, **kw)
    tensor_amax = None if amax is None else torch.tensor(amax, dtype=torch.float32)
    q = program.quantize_operand(
        x, op, pack=True, cores=program.COMPILED if compiled else program.EAGER, tensor_amax=tensor_amax
    )
    expected, scale_inv, codes = _reference(x.numpy(), element, scaling, kw, amax)
    _same(q.scaled, expected)
    _same(q.packed.scaled_values(), expected)  # the packed form (one byte a code) decodes to the same
    assert q.codes.dtype == torch.uint8 and q.codes.shape == expected.shape
    assert float(q.tensor_scale) == scale_inv
    if codes is not None:
        assert torch.equal(q.scale_codes.long(), torch.from_numpy(codes))
    else:
        assert q.scale_codes.numel() == 0
    _same(q.dequantize(), (expected * scale_inv)[:, : x.shape[1]])
    return q


# ------------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("element,scaling,kw", CASES)
@pytest.mark.parametrize("scale", [1.0, 3e-5, 2e4])
def test_random_tensors_equal_the_te_reference(element, scaling, kw, scale):
    torch.manual_seed(0)
    x = torch.randn(24, 90) * scale  # 90: not a whole number of blocks
    x[3, :5] *= 300  # an outlier row: the other blocks' scales are independent of it (MX)
    _check(x, element, scaling, kw)


@pytest.mark.parametrize("element,scaling,kw", CASES)
def test_zeros_and_an_all_zero_tensor(element, scaling, kw):
    q = _check(torch.zeros(8, 64), element, scaling, kw)  # amax 0: scale 1 (per tensor), code 0 (MX)
    assert float(q.tensor_scale) == 1.0 and not q.scaled.any()
    x = torch.randn(8, 64)
    x[:, :32] = 0.0
    x[0, 0] = -0.0
    q = _check(x, element, scaling, kw)
    assert torch.signbit(q.scaled[0, 0])  # -0 keeps its sign (code 0x80)
    assert int(q.counts["zero_blocks"]) > 0


@pytest.mark.parametrize("element", ["e4m3", "e5m2"])
def test_a_held_amax_below_the_tensor_saturates_at_the_format_max(element):
    torch.manual_seed(1)
    x = torch.randn(16, 64)
    amax = float(x.abs().max()) / 4  # everything above amax/4 clamps to the format's max
    q = _check(x, element, "fp32", {}, amax=amax)
    top = FP8[element][1]
    assert float(q.scaled.abs().max()) == top and int((q.scaled.abs() == top).sum()) > 1
    assert int(q.counts["saturated_blocks"]) > 0


def test_mx_floor_mode_saturates_a_block_whose_amax_exceeds_448_times_its_scale():
    x = torch.full((1, 32), 1.0)
    x[0, 0] = 1.9 * 2**8  # floor(log2) - 8 = 0: the scale is 1 and 486.4 clamps to 448; ceil mode rescales
    floor = _check(x, "e4m3", "ue8m0", {"mx_scale_mode": "floor"})
    ceil = _check(x, "e4m3", "ue8m0", {"mx_scale_mode": "ceil"})
    assert float(floor.scaled[0, 0]) == 448.0 and int(floor.scale_codes[0, 0]) == 127
    assert float(ceil.scaled[0, 0]) == 480.0 and int(ceil.scale_codes[0, 0]) == 128  # 240 x 2


def test_e5m2_subnormals():
    x = torch.zeros(2, 32)
    x[0, 0] = 1.0  # amax 1: scale 57,344 (2^15.8)
    x[0, 1:9] = torch.tensor([2**-31, 2**-32, 3 * 2**-33, 2**-33, 2**-34, 1.5 * 2**-32, 2**-35, -(2**-32)])
    q = _check(x, "e5m2", "fp32", {})
    payload = q.scaled[0, 1:9] * 1.0
    assert (payload.abs() < 2**-14).all() and (payload[:3] != 0).all()  # below E5M2's smallest normal, not flushed
    assert (payload[3:5] == 0).all()  # below half the smallest subnormal: 0


@pytest.mark.parametrize("element,scaling,kw", CASES)
def test_non_finite_policy(element, scaling, kw):
    """NaN is skipped by the amax and quantizes to NaN; +-Inf: per tensor, an Inf amax gives scale 1 and
    Inf saturates to the format's max; MX: the block's code is 254, its multiplier 0, so Inf * 0 = NaN and
    the block's finite elements become 0 (TE's kernels, element for element)."""
    torch.manual_seed(2)
    x = torch.randn(4, 64)
    x[0, 3] = float("nan")
    _check(x, element, scaling, kw)  # the other elements' scale is that of the finite ones
    x[2, 40] = float("-inf")
    q = _check(x, element, scaling, kw)
    assert torch.isnan(q.scaled[0, 3])


@pytest.mark.parametrize("mode", ["ceil", "floor"])
def test_the_mx_scale_of_blocks_whose_amax_is_a_power_of_two(mode):
    """amax = 2^k and 448 x 2^k: TE multiplies by fp32(1/448) (not exactly 1/448) and rounds the exponent up,
    so the code depends on that product's last bits; the floor rule reads the exponent alone."""
    exponents = list(range(-140, 120, 7)) + [-127, -126, 0, 8, 9]
    amaxes = [2.0**k for k in exponents] + [448.0 * 2.0**k for k in exponents if 448.0 * 2.0**k < 3e38]
    x = torch.zeros(len(amaxes), 32)
    x[:, 5] = torch.tensor(amaxes, dtype=torch.float32)
    x[:, 6] = x[:, 5] * 0.3
    q = _check(x, "e4m3", "ue8m0", {"mx_scale_mode": mode})
    if mode == "floor":  # OCP: a power-of-two amax 2^k gets scale 2^(k - 8), payload 256
        powers = torch.tensor([2.0**k for k in exponents], dtype=torch.float32)
        normal = powers > 2**-119  # the code is not clamped at -127
        assert torch.equal(q.scaled[: len(exponents)][normal, 5], powers[normal])


COMPILED_IN_CI = (0, 3, 4)
"""Of :data:`CASES`, the ones CI compiles (each case costs a cold compile of 10 to 25 s): per-tensor E4M3, a
power-of-two per-tensor E5M2, MX E4M3; the others run under ``-m slow``."""


@pytest.mark.parametrize(
    "element,scaling,kw",
    [case if i in COMPILED_IN_CI else pytest.param(*case, marks=pytest.mark.slow) for i, case in enumerate(CASES)],
)
def test_compiled_equals_eager_and_every_layout_equals_the_rows_one(element, scaling, kw):
    torch.manual_seed(3)
    x = torch.randn(37, 70)
    x[5, 5] = float("nan")
    op = _spec(element, scaling, **kw)
    eager = program.quantize_operand(x, op, pack=True)
    compiled = program.quantize_operand(x, op, pack=True, cores=program.COMPILED)
    for a, b in (
        (eager.scaled, compiled.scaled),
        (eager.codes, compiled.codes),
        (eager.scale_codes, compiled.scale_codes),
        (eager.tensor_scale, compiled.tensor_scale),
    ):
        assert torch.equal(torch.nan_to_num(a.float(), 7.0), torch.nan_to_num(b.float(), 7.0))
    # X^T along the tokens (read down the columns of X) == the rows quantization of padded X^T
    t = F.pad(x, (0, 0, 0, -x.shape[0] % 16)).t().contiguous()
    rows = program.quantize_operand(t, op, pack=True)
    for cores in (program.EAGER, program.COMPILED):
        cols = program.quantize_tokens_operand(x, op, pack=True, cores=cores)
        assert torch.equal(cols.codes, rows.codes) and torch.equal(cols.scale_codes, rows.scale_codes)
        assert torch.equal(torch.nan_to_num(cols.scaled, 7.0), torch.nan_to_num(rows.scaled, 7.0))
    # the forward's one call (X, X^T, W) == its operands one by one
    w = torch.randn(24, 70)
    qx, qxt, qw = program.quantize(
        (OperandRequest(x, op), OperandRequest(x, op, layout="tokens", pack=True), OperandRequest(w, op, pack=True)),
        cores=program.COMPILED,
    )
    assert torch.equal(torch.nan_to_num(qx.scaled, 7.0), torch.nan_to_num(eager.scaled, 7.0))
    assert torch.equal(qxt.codes, rows.codes)
    assert torch.equal(qw.codes, program.quantize_operand(w, op, pack=True).codes)


def test_per_tensor_x_transpose_is_the_transpose_of_x():
    """One scale for the tensor: quantizing X^T along the tokens gives X's codes transposed (TE's
    cast-transpose), which is why fp8 saves X^T from the forward's one amax."""
    torch.manual_seed(4)
    x = torch.randn(32, 48)
    op = _spec("e4m3", "fp32")
    qx = program.quantize_operand(x, op, pack=True)
    qxt = program.quantize_tokens_operand(x, op, pack=True)
    assert torch.equal(qxt.codes, qx.codes.t()) and torch.equal(qxt.tensor_scale, qx.tensor_scale)


def test_the_fp4_reference_refuses_fp8_and_specs_refuse_what_te_does_not_do():
    from nemofp4.formats import quantize_with_spec

    with pytest.raises(ValueError, match="kernels.quantize_operand"):
        quantize_with_spec(torch.randn(4, 16), _spec())
    for bad, match in (
        (dict(rounding="sr"), "rounding='rne'"),
        (dict(scale_format="e4m3"), "takes scale_format"),
        (dict(element_format="e3m4"), "unknown element_format"),
        (dict(scale_format="ue8m0", power_of_two_scale=True), "power_of_two_scale"),
    ):
        kw = dict(scale_format="fp32", element_format="e4m3", block_size=16) | bad
        with pytest.raises(ValueError, match=match):
            OperandQuant(**kw)
    with pytest.raises(ValueError, match="hardware"):
        get_recipe("fp8", gemm="hardware")


# ------------------------------------------------------------------------------------ the linear
def _te_operands(name, x_TK, w_NK, dy_TN):
    """Each GEMM's two operands from the reference, each quantized from the high-precision tensor along
    its own GEMM's reduction dim (X^T and dY^T with the tokens zero-padded to 16)."""
    config = get_recipe(name).parts["fp8"]

    def q(t, role):
        op = config.operand(role)
        if op.scale_format == "fp32":
            values, scale_inv = te_current_scaling(t.numpy(), op.element_format)
            return _padded(values, 16), scale_inv
        return mxfp8(t.numpy(), op.element_format, op.mx_scale_mode)[0], np.float32(1)

    def tokens_t(t):
        return F.pad(t, (0, 0, 0, -t.shape[0] % 16)).t().contiguous()

    return {
        "fprop": (q(x_TK, "x"), q(w_NK, "w")),
        "dgrad": (q(dy_TN, "dy_dgrad"), q(w_NK.t().contiguous(), "w")),
        "wgrad": (q(tokens_t(dy_TN), "dy_wgrad"), q(tokens_t(x_TK), "x_wgrad")),
    }


@pytest.mark.parametrize("name", ["fp8", "mxfp8"])
def test_each_gemm_of_an_fp8_linear_multiplies_the_reference_operands(name):
    """Every operand bit for bit the reference's (E4M3 X and W, E5M2 dY for fp8's HYBRID), each product
    ``(A @ B^T) * (scale_inv_a * scale_inv_b)`` in float32 and within 1e-6 of the float64 product."""
    config = get_recipe(name).parts["fp8"]
    torch.manual_seed(5)
    layer = torch.nn.Linear(96, 80)
    QuantLinear.from_linear(layer, config, index=0)
    layer.set_step(1)
    layer._capture = []
    x = torch.randn(39, 96, requires_grad=True)
    dy = torch.randn(39, 80) * 1e-3
    y = layer(x)
    y.backward(dy)
    captured = {gemm: (qa, qb, b_t, out) for gemm, qa, qb, b_t, out in layer._capture}
    expected = _te_operands(name, x.detach(), layer.weight.detach(), dy)
    assert captured["dgrad"][0].element_format == ("e5m2" if name == "fp8" else "e4m3")
    for gemm, (qa, qb, b_t, out) in captured.items():
        (ref_a, s_a), (ref_b, s_b) = expected[gemm]
        a, b = GemmOperand(qa), GemmOperand(qb, transposed=b_t)
        _same(a.scaled(), ref_a)
        _same(b.scaled(), ref_b)
        assert float(qa.tensor_scale) == s_a and float(qb.tensor_scale) == s_b
        k = min(ref_a.shape[1], ref_b.shape[1])
        product = torch.from_numpy(ref_a[:, :k]) @ torch.from_numpy(ref_b[:, :k]).t()
        assert torch.equal(out, product * torch.tensor(s_a * s_b))
        exact = reference_gemm(a, b)
        assert float((out.double() - exact).norm() / exact.norm()) <= 1e-6
    assert torch.equal(y.detach(), captured["fprop"][3] + layer.bias.detach())


@pytest.mark.parametrize("name", ["eager", "compiled", "native", "triton"])
def test_every_backend_quantizes_fp8_with_the_program(name):
    """The native and Triton kernels are FP4's: each backend hands FP8 operands to the torch program (the
    Triton backend's methods are called directly here, on CPU tensors, where their fallback runs)."""
    from nemofp4.kernels.backend import _BACKENDS

    backend = _BACKENDS[name]
    torch.manual_seed(6)
    x, w = torch.randn(40, 64), torch.randn(24, 64)
    for op in (_spec("e4m3", "fp32"), _spec("e5m2", "ue8m0", mx_scale_mode="ceil")):
        expected_x = program.quantize_operand(x, op, pack=True)
        expected_xt = program.quantize_tokens_operand(x, op, pack=True)
        qx, qxt = backend.quantize(*x_and_tokens(x, op, op, tensor_amax=None, pack_x=True))
        _, qw = backend.quantize(OperandRequest(x, op), OperandRequest(w, op, pack=True))
        assert torch.equal(qx.codes, expected_x.codes) and torch.equal(qxt.codes, expected_xt.codes)
        assert torch.equal(backend.quantize(OperandRequest(x, op, pack=True))[0].scaled, expected_x.scaled)
        assert torch.equal(
            backend.quantize(OperandRequest(x, op, layout="tokens", pack=True))[0].codes, expected_xt.codes
        )
        assert torch.equal(qw.codes, program.quantize_operand(w, op, pack=True).codes)


# SQNR in dB of (y, dX, dW) against an unquantized linear, Gaussian data, K = N = 256, 512 tokens (the
# FP4 recipes' measurement in test_quant_linear.py): one E4M3 operand gives ~31.6 dB, the product of two
# ~28.6; E5M2's two mantissa bits put fp8's gradients at ~24.6; MXFP8's E4M3 gradients at ~28.4-29.0.
# The floors sit 1 dB under these seeded measurements; the ceilings say the operands are 8-bit.
FP8_SQNR = {"fp8": ((27.6, 23.6, 23.5), 31.0), "mxfp8": ((27.9, 27.9, 27.4), 31.0)}


@pytest.mark.parametrize("name", sorted(FP8_SQNR))
def test_fp8_linear_outputs_and_gradients_reach_their_sqnr(name):
    from tests.unit.test_quant_linear import _layer, _run, _sqnr_db

    ref, layer = _layer(get_recipe(name).parts["fp8"], in_features=256, out_features=256, bias=False)
    g = torch.Generator().manual_seed(5)
    x, dy = torch.randn(512, 256, generator=g), torch.randn(512, 256, generator=g)
    floors, ceiling = FP8_SQNR[name]
    for what, e, a, floor in zip(("y", "dX", "dW"), _run(ref, x, dy), _run(layer, x, dy), floors):
        assert floor <= _sqnr_db(e, a) < ceiling, (name, what, _sqnr_db(e, a))


def test_the_fp4_program_refuses_the_mx_ceil_mode_it_does_not_implement():
    op = OperandQuant(scale_format="ue8m0", block_size=32, mx_scale_mode="ceil")
    with pytest.raises(ValueError, match="floor rule only"):
        program.quantize_operand(torch.randn(4, 32), op)
    program.quantize_operand(torch.randn(4, 32), _spec("e4m3", "ue8m0", mx_scale_mode="ceil"))  # FP8: TE's rule


@pytest.mark.parametrize("element", ["e4m3", "e5m2"])
def test_scales_of_many_amaxes_equal_te_bit_for_bit(element):
    """The scale formulas over 20,000 amaxes across float32's range (subnormals, whose quotient overflows
    to FLT_MAX, included), one by one against the reference: ``max / amax`` and ``max * (1 / amax)``
    differ in the last bit for a share of them, and TE's round-up E8M0 code depends on the product's
    last bits."""
    from nemofp4.formats.scaling import fp8_max, fp8_tensor_scale, mx_fp8_scale_codes

    g = torch.Generator().manual_seed(7)
    amaxes = torch.exp2(torch.empty(20_000, dtype=torch.float64).uniform_(-149, 127, generator=g)).float()
    amaxes = torch.cat([amaxes, torch.tensor([0.0, float("inf"), float("nan"), 1e-45, 448.0, 57344.0])])
    top = torch.tensor(fp8_max(element))
    for pow2 in (False, True):
        ours = fp8_tensor_scale(amaxes, top, pow2)
        expected = np.array([te_tensor_scale(np.float32(a), element, pow2) for a in amaxes.numpy()], dtype=np.float32)
        assert torch.equal(ours.view(torch.int32), torch.from_numpy(expected).view(torch.int32))
    rcp = float(np.float32(1.0 / FP8[element][1]))
    codes = mx_fp8_scale_codes(amaxes, rcp)
    expected = [te_float_to_e8m0(np.float32(a * np.float32(rcp))) for a in amaxes.numpy()]
    assert codes.tolist() == expected
