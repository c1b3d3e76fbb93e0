"""Issue-17 numerics against re-derivations written from the upstream sources, not from our code.

Each oracle below restates one rule as Transformer Engine (``NVFP4BlockScaling``) or the UE5M3
paper's code computes it, in plain float32 numpy/Python steps, and the tests compare our paths
bitwise with it (eager, compiled and the Triton interpreter where the path exists).
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch
from torch import nn

from nemofp4.formats import quantize_blocks
from nemofp4.formats.block import amax
from nemofp4.kernels import cpu_compile_available
from nemofp4.kernels.program import COMPILED, EAGER, quantize_operand
from nemofp4.quant import QuantLinear
from nemofp4.recipes import get_recipe
from tests.conftest import TRITON_INTERPRETER, needs_triton_interpreter

pytestmark = pytest.mark.usefixtures("one_thread")

f32 = np.float32


def _fp4_config(recipe: str):
    return get_recipe(recipe).parts["fp4"]


def _paths():
    return [False, True] if cpu_compile_available() else [False]


# ----------------------------------------------------------------------- item 1: -0 amax
@pytest.mark.parametrize("recipe", ["nvfp4_all_fp4_no_rht", "nvfp4", "ue5m3", "mxfp4"])
def test_negative_zero_operand_gives_zero_output_and_gradients(recipe):
    """TE's amax is max|x| = +0; a -0 amax made G = 2688/-0 = -inf pass the zero guard (NaN)."""
    layer = nn.Linear(32, 16, bias=False)
    QuantLinear.from_linear(layer, _fp4_config(recipe), index=3)
    layer.quant_backend = "eager"  # the compiled program's -0 handling: the test below
    layer.set_step(1, seed=7, rank=0)
    x = (-torch.zeros(16, 32)).requires_grad_()
    y = layer(x)
    y.backward(-torch.zeros_like(y))
    for t in (y, x.grad, layer.weight.grad):
        assert torch.isfinite(t).all() and (t == 0).all()


@pytest.mark.parametrize("scale_format", ["e4m3", "ue5m3"])
@pytest.mark.parametrize("compiled", _paths())
def test_negative_zero_amax_is_positive_zero_on_every_path(scale_format, compiled):
    x = -torch.zeros(16, 32)
    assert not torch.signbit(amax(x))
    q = quantize_blocks(x, scale_format)
    assert not torch.signbit(q.tensor_amax) and torch.isfinite(q.tensor_scale) and q.tensor_scale > 0
    assert (q.dequantize() == 0).all()
    op = _fp4_config("nvfp4_all_fp4_no_rht" if scale_format == "e4m3" else "ue5m3").x
    # a held reference measured by amax() of a -0 tensor
    p = quantize_operand(x, op, tensor_amax=amax(x), cores=COMPILED if compiled else EAGER)
    assert torch.isfinite(p.tensor_scale) and p.tensor_scale > 0 and (p.dequantize() == 0).all()


# ----------------------------------------------------------------------- items 3, 7: SR rules
# cvt.rs (PTX ISA, "cvt" rounding modifiers): the result is rounded toward or away from zero by
# the carry out of the integer addition of the random bits to the discarded significand bits;
# for .e2m1x4 each element gets 8 bits of rbits (TE's ``stochastic_round_fp4_e2m1``, ptx.cuh,
# says the same). With the 8 bits at the top of the discarded field the carry happens iff
# frac + r/256 >= 1, for an exact fraction frac of a grid step: a count over r, in Fractions.
# sr8 (the paper's _rounding.py ``_round_finite_float``): midpoint = (2r+1) * 2^-9 in float32,
# round away iff float32(delta + midpoint) >= 1.0.
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _oracle_away_count(frac: Fraction, rounding: str) -> int:
    if rounding == "sr":
        return sum(1 for r in range(256) if frac + Fraction(r, 256) >= 1)
    assert rounding == "sr8"
    return sum(1 for r in range(256) if f32(frac) + f32((2 * r + 1) / 512) >= f32(1))


def _positions() -> list[tuple[float, float, Fraction]]:
    """(|y|, lower grid point, exact fraction of the step): a grid of fractions in every binade,
    the issue's cases, and fractions with bits below 2^-24 (where sr8's float32 sum rounds)."""
    fracs = [Fraction(k, 64) for k in range(64)] + [
        Fraction(1, 512),
        Fraction(1, 512) - Fraction(1, 2**26),
        Fraction(1, 256) - Fraction(1, 2**20),
        Fraction(255, 256),
        Fraction(511, 512),
        Fraction(1, 2**9),
        Fraction(1, 2**12),
        Fraction(3, 2**10),
    ]
    out = []
    for lo, hi in zip(E2M1_GRID, E2M1_GRID[1:]):
        for f in fracs:
            y = Fraction(lo) + f * Fraction(hi - lo)
            if float(np.float32(float(y))) == y:  # exactly representable: the fraction is exact
                out.append((float(y), lo, f))
    out.append((0.5 + 2**-10, 0.5, Fraction(1, 2**9)))  # the nvfp4 case
    out.append((4.002, 4.0, (Fraction(float(f32(4.002))) - 4) / 2))  # the sr8 case
    return out


def _bytes_at(byte_values: np.ndarray):
    """In place of :func:`sr8_bytes_at`'s hash: element ``i`` draws ``byte_values[i]``."""
    table = torch.from_numpy(byte_values.astype(np.int64))
    return lambda key, index: table[index]


def _enumerated_inputs(values: list[float]):
    """x [256 * rows, 16]: each row is one block (6.0, then 15 test values, signs alternating),
    repeated for r = 0..255, and the bytes that give every element of copy r the draw r."""
    per_row = 15
    values = values + [values[-1]] * (-len(values) % per_row)
    rows = np.array(values, dtype=np.float32).reshape(-1, per_row)
    rows = rows * np.where(np.arange(per_row) % 2, -1, 1).astype(np.float32)
    block = np.concatenate([np.full((rows.shape[0], 1), 6.0, np.float32), rows], axis=1)  # [B, 16]
    x = np.repeat(block[None], 256, axis=0).reshape(-1, 16)  # row = r * B + b
    r = np.repeat(np.arange(256), block.size)
    return torch.from_numpy(x), r, block.shape[0]


if TRITON_INTERPRETER:
    import triton
    import triton.language as tl

    @triton.jit
    def _byte_of_copy(seed, row_counter_base, col0, BM: tl.constexpr, BK: tl.constexpr):
        """In place of the kernel's Philox bytes: every element of row ``r * B + b`` draws ``r``
        (the row's counter base is its index for 16 columns; ``seed`` carries B)."""
        return tl.broadcast_to(((row_counter_base // seed) % 256)[:, None], (BM, BK)).to(tl.int32)


@pytest.mark.parametrize("rounding,scale_format", [("sr", "e4m3"), ("sr8", "ue5m3")])
@pytest.mark.parametrize(
    "path", ["minifloat", "eager", "compiled", pytest.param("triton", marks=needs_triton_interpreter)]
)
def test_rounding_probability_is_the_exact_count_over_all_random_bytes(rounding, scale_format, path, monkeypatch):
    if path == "compiled" and not cpu_compile_available():
        pytest.skip("needs a C++ compiler for torch.compile")
    positions = _positions()
    x, r, blocks = _enumerated_inputs([p[0] for p in positions])
    bytes_at = _bytes_at(r)
    if path == "minifloat":
        import nemofp4.formats.minifloat as minifloat

        monkeypatch.setattr(minifloat, "sr8_bytes_at", bytes_at)
        from nemofp4.formats import E2M1

        out = E2M1.round(x, rounding=rounding)
    elif path == "triton":  # the kernel's rounding rule, fed the bytes r = 0..255 instead of Philox's
        from nemofp4.kernels import _quantize_kernels
        from nemofp4.kernels.quantize import triton_quantize

        monkeypatch.setattr(_quantize_kernels, "_sr8_draws_along_cols", _byte_of_copy)
        q, _ = triton_quantize(
            x,
            scale_format=scale_format,
            block_size=16,
            tensor_amax=2688.0,
            rounding=rounding,
            seed=blocks,
            _config={"BM": 512, "BK": 16},
        )
        assert float(q.tensor_scale) == 1.0
        out = q.dequantize()
    else:
        import nemofp4.kernels.program as program

        monkeypatch.setattr(program, "sr8_bytes_at", bytes_at)
        op = _fp4_config("nvfp4" if scale_format == "e4m3" else "ue5m3").dy_dgrad
        assert op.rounding == rounding and op.scale_format == scale_format
        # g = 448 * 6: G = 1 and every block scale is 1, so the payload is x itself
        q = quantize_operand(x, op, tensor_amax=torch.tensor(2688.0), cores=COMPILED if path == "compiled" else EAGER)
        assert float(q.tensor_scale) == 1.0
        out = q.dequantize()
    mags = out.abs().numpy().reshape(256, blocks, 16)[:, :, 1:].reshape(256, -1)
    for i, (y, lo, frac) in enumerate(positions):
        column = mags[:, i]
        assert set(np.unique(column)) <= {lo, E2M1_GRID[E2M1_GRID.index(lo) + 1]}, y
        assert int((column != lo).sum()) == _oracle_away_count(frac, rounding), (y, float(frac))


def test_te_sr_rounding_probability_is_floor_256_frac_and_sr_exact_is_kept():
    """The issue's case: at |y| = 0.5 + 2^-10 cvt.rs never rounds up (exact SR: p = 2^-9)."""
    assert _oracle_away_count(Fraction(1, 2**9), "sr") == 0
    assert _oracle_away_count(Fraction(255, 256), "sr") == 255
    assert _oracle_away_count(Fraction(1, 512), "sr8") == 1  # the +1/512 bias extreme
    assert _oracle_away_count(Fraction(1, 512) - Fraction(1, 2**26), "sr8") == 1  # float32 sum rounds up
    assert _oracle_away_count((Fraction(float(f32(4.002))) - 4) / 2, "sr8") == 0
    x = torch.full((4096, 16), 0.5 + 2**-10)
    x[:, 0] = 6.0  # block scale 1: the payload is x
    q = quantize_operand(x, _fp4_config("nvfp4").dy_dgrad, tensor_amax=torch.tensor(2688.0))
    assert (q.dequantize()[:, 1:] == 0.5).all()


def test_nvfp4_sr_end_to_end_bias_is_the_truncation_bias_toward_zero():
    """Mean rounding error over 2^22 elements at fractions just below k/256 (k = 1..255): TE's rule
    rounds them up with probability (k - 1)/256, a bias of -(1/256 - 2^-20) of a step toward zero;
    exact SR (or sr8) would be unbiased there. The bound, 4 standard errors (1e-3 of a step), is
    less than half that bias, so a rule without it fails."""
    k = np.arange(1, 256)
    frac = k / 256 - 2.0**-20
    lo, spacing = 2.0, 1.0  # the [2, 4) binade: y = 2 + frac exactly in float32
    y = np.resize((lo + frac * spacing).astype(np.float32), 2**22 // 16 * 15)
    x, n = _bias_blocks(y)
    gen = torch.Generator().manual_seed(3)
    q = quantize_operand(x, _fp4_config("nvfp4").dy_dgrad, tensor_amax=torch.tensor(2688.0), generator=gen)
    out = q.dequantize().numpy()[:, 1:].reshape(-1)[:n].astype(np.float64)
    err_steps = (np.abs(out) - y.astype(np.float64)) / spacing
    se = 0.5 / np.sqrt(n)
    assert abs(err_steps.mean() - (-(1 / 256 - 2.0**-20))) <= 4 * se
    assert 8 * se < 1 / 256 - 2.0**-20  # a rule with zero bias here fails the bound above


def _bias_blocks(y: np.ndarray):
    per_row = 15
    rows = y.reshape(-1, per_row)
    block = np.concatenate([np.full((rows.shape[0], 1), 6.0, np.float32), rows], axis=1)
    return torch.from_numpy(np.ascontiguousarray(block)), y.size


# ----------------------------------------------------------------------- item 2: RHT in BF16
def _oracle_wgrad_rht(x: torch.Tensor) -> torch.Tensor:
    """TE's reference RHT (reference_nvfp4.py ``_apply_rht``: x @ (diag(signs) @ H16 * 1/4)) with
    the BF16 downcast of its fused kernel. The sums are computed exactly in float64 (bf16 inputs of
    moderate range), then rounded once to float32 (exact here) and to BF16."""
    signs = np.array([1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1], dtype=np.float64)
    h = np.ones((1, 1))
    while h.shape[0] < 16:
        h = np.block([[h, h], [h, -h]])
    m = (signs[:, None] * h) * 0.25
    groups = x.double().numpy().reshape(-1, 16)
    out = torch.from_numpy((groups @ m).reshape(x.shape)).float()
    return out.to(torch.bfloat16).float()


def _rht_inputs():
    g = torch.Generator().manual_seed(17)
    yield "issue bf16 48x64", torch.randn(64, 48, generator=g).to(torch.bfloat16)  # X^T [K, T]
    yield (
        "wide range",
        (torch.randn(32, 64, generator=g) * torch.exp2(torch.randint(-4, 5, (32, 64), generator=g))).to(torch.bfloat16),
    )  # noqa: E501
    yield "tie-heavy", torch.randint(-300, 301, (32, 64), generator=g).to(torch.bfloat16)


@pytest.mark.parametrize("backend", ["eager", "compiled"])
def test_wgrad_rht_is_rounded_to_bf16_as_te_does(backend):
    from nemofp4 import kernels

    if backend == "compiled" and not cpu_compile_available():
        pytest.skip("needs a C++ compiler for torch.compile")
    changed = 0
    for label, x in _rht_inputs():
        ours = kernels.hadamard_transform(x.float(), backend=backend)
        expected = _oracle_wgrad_rht(x)
        assert torch.equal(ours.view(torch.int32), expected.view(torch.int32)), label
        for scale_format in ("e4m3", "ue5m3"):  # the quantized wgrad operand follows
            q = quantize_blocks(ours, scale_format)
            assert torch.equal(q.codes, quantize_blocks(expected, scale_format).codes), label
        changed += int((quantize_blocks(_fp32_rht(x), "e4m3").codes != quantize_blocks(ours, "e4m3").codes).sum())
    assert changed > 0  # the FP32 transform would quantize differently on these inputs


def _fp32_rht(x: torch.Tensor) -> torch.Tensor:
    from nemofp4.formats import hadamard_transform

    return hadamard_transform(x.float())


# ----------------------------------------------------------------------- item 4: tensor scales
def _oracle_te_alpha(g_a: float, g_b: float, t_a: float = 448.0, t_b: float = 448.0) -> np.float32:
    """TE compute_nvfp4_per_tensor_scale_kernel: factor_inv = 1.0f / (6 * 6 * fp8_max_A * fp8_max_B);
    alpha = alpha_in (1) * amax_A * amax_B * factor_inv, left to right in float32."""
    factor_inv = f32(1) / (f32(6) * f32(6) * f32(t_a) * f32(t_b))
    return f32(1) * f32(g_a) * f32(g_b) * factor_inv


def _oracle_paper_alpha(g_a: float, g_b: float, t_a: float, t_b: float) -> np.float32:
    """The paper's _encoded_global_alpha: (amax_a * amax_b).float() / ((T_a * 6.0) * (T_b * 6.0)), a
    float32 tensor over a Python float, which torch evaluates on CUDA as a * (1.0f / float(b))."""
    divisor = (t_a * 6.0) * (t_b * 6.0)  # Python (double) arithmetic
    return (f32(g_a) * f32(g_b)) * (f32(1) / f32(divisor))


def _oracle_te_dequantize(q) -> np.ndarray:
    """TE dequantize_fp4_kernel: factor_inv = 1.0f / (6.0f * E4M3_MAX); final_scale = scale * amax *
    factor_inv; out = value * final_scale, per element in float32."""
    values = q.values().numpy().astype(f32)
    scales = q.block_scales().numpy().astype(f32)
    final = scales * f32(q.tensor_amax) * (f32(1) / (f32(6) * f32(448)))
    b = q.block_size
    per_elem = np.repeat(np.repeat(final, b, 0), b, 1) if q.two_d else np.repeat(final, b, -1)
    out = values * per_elem
    return out[: q.shape[0], : q.shape[1]]


def _gemm_inputs():
    g = torch.Generator().manual_seed(23)
    yield "issue 32x16", torch.randn(32, 64, generator=g), torch.randn(16, 64, generator=g)
    wide = lambda r: torch.randn(r, 64, generator=g) * torch.exp2(torch.randint(-20, 21, (r, 1), generator=g).float())  # noqa: E731
    yield "wide range", wide(48), wide(32)
    yield (
        "tie-heavy",
        torch.randint(-6, 7, (32, 64), generator=g).float() * 0.75,
        torch.randint(-6, 7, (16, 64), generator=g).float(),
    )


def test_nvfp4_gemm_tensor_scale_product_is_te_order():
    from nemofp4.quant import GemmOperand
    from nemofp4.quant.gemm import scaled_gemm

    differ = []
    for label, a, b in _gemm_inputs():
        qa, qb = quantize_blocks(a, "e4m3"), quantize_blocks(b, "e4m3", two_d=True)
        alpha = _oracle_te_alpha(float(qa.tensor_amax), float(qb.tensor_amax))
        acc = (qa.scaled_values() @ qb.scaled_values().t()).numpy()
        ours = scaled_gemm(GemmOperand(qa), GemmOperand(qb), torch.float32).numpy()
        np.testing.assert_array_equal(ours.view(np.int32), (acc * alpha).view(np.int32), err_msg=label)
        old = acc * (qa.tensor_scale * qb.tensor_scale).numpy()
        differ.append(float((old != ours).mean()))
    assert max(differ) > 0.5  # the product of the two rounded reciprocals is another number


@pytest.mark.parametrize("t_b", [448.0, 2048.0])
def test_ue5m3_gemm_tensor_scale_product_is_the_papers_encoded_alpha(t_b):
    from nemofp4.quant import GemmOperand
    from nemofp4.quant.gemm import scaled_gemm

    for label, a, b in _gemm_inputs():
        qa, qb = quantize_blocks(a, "ue5m3"), quantize_blocks(b, "ue5m3", scale_target=t_b)
        alpha = _oracle_paper_alpha(float(qa.tensor_amax), float(qb.tensor_amax), 448.0, t_b)
        acc = (qa.scaled_values() @ qb.scaled_values().t()).numpy()
        ours = scaled_gemm(GemmOperand(qa), GemmOperand(qb), torch.float32).numpy()
        np.testing.assert_array_equal(ours.view(np.int32), (acc * alpha).view(np.int32), err_msg=label)


@pytest.mark.parametrize("two_d", [False, True])
@pytest.mark.parametrize("path", ["reference", "eager", "compiled"])
def test_nvfp4_dequantize_is_te_order(two_d, path):
    if path == "compiled" and not cpu_compile_available():
        pytest.skip("needs a C++ compiler for torch.compile")
    op = _fp4_config("nvfp4").w if two_d else _fp4_config("nvfp4").x
    for label, a, _ in _gemm_inputs():
        packed = quantize_blocks(a, "e4m3", two_d=two_d)
        expected = _oracle_te_dequantize(packed)
        if path == "reference":
            q = packed
        else:  # the program's scaled form (no E2M1 codes), as the scaled GEMM path keeps it
            q = quantize_operand(a, op, two_d=two_d, cores=COMPILED if path == "compiled" else EAGER)
            assert q.codes is None
        np.testing.assert_array_equal(q.dequantize().numpy().view(np.int32), expected.view(np.int32), err_msg=label)


# ----------------------------------------------------------------------- item 5: 1/1024 snap
@pytest.mark.parametrize("scale_format", ["ue5m3", "e4m3"])
def test_hardware_gemm_ends_with_the_papers_1_over_1024_snap(scale_format):
    """probe_matched_fp4_gemm: issue_rz_bf16_gemm(..., snap_to_1_over_1024=True) returns
    torch.round(C * 1024.0) / 1024.0 (half to even), then * alpha. The unsnapped C comes from the
    same operands with alpha = 1 (g = 2688: fl(2688^2) * fl(1/2688^2) == 1)."""
    import dataclasses

    from nemofp4.kernels.hardware_gemm import hardware_gemm_torch
    from nemofp4.quant import GemmOperand
    from nemofp4.quant.gemm import gemm

    g = torch.Generator().manual_seed(29)
    # gradient-like: an outlier sets the amax, most encoded values are small, and so are many outputs
    x, w = torch.randn(40, 128, generator=g) * 0.01, torch.randn(24, 128, generator=g) * 0.01
    x[0, 0], w[0, 0] = 300.0, 300.0
    qa, qb = quantize_blocks(x, scale_format), quantize_blocks(w, scale_format, two_d=True)
    unit = lambda q: dataclasses.replace(q, tensor_amax=torch.tensor(2688.0), tensor_scale=torch.tensor(1 / 2688.0))  # noqa: E731
    acc = hardware_gemm_torch(unit(qa), unit(qb)).numpy()
    te_or_paper = (
        _oracle_te_alpha if scale_format == "e4m3" else lambda ga, gb: _oracle_paper_alpha(ga, gb, 448.0, 448.0)
    )
    alpha = te_or_paper(float(qa.tensor_amax), float(qb.tensor_amax))
    expected = (np.round(acc * f32(1024)) / f32(1024)).astype(f32) * alpha
    ours = gemm(GemmOperand(qa), GemmOperand(qb), mode="hardware", compute_dtype=torch.float32).numpy()
    np.testing.assert_array_equal(ours.view(np.int32), expected.view(np.int32))
    assert (expected != acc * alpha).mean() > 0.01  # the snap moves outputs here


# ----------------------------------------------------------------------- item 6: te_settings RHT amax
def test_ue5m3_te_settings_measures_the_transformed_wgrad_amaxes_at_every_call():
    """The paper (_ProbeMatchedUE5M3LinearFunction): activation_rht_reference = amax of the
    transformed X^T in every forward, wgrad_dy_reference = amax of the transformed dY^T in every
    backward; the X reference keeps its D = 1 hold. Two micro-batches of one step, the second 10x
    larger: its wgrad operands use their own amaxes, its fprop X the first micro-batch's."""
    import torch.nn.functional as F

    layer = nn.Linear(32, 16, bias=False)
    QuantLinear.from_linear(layer, _fp4_config("ue5m3_te_settings"), index=3)
    layer.quant_backend = "eager"
    layer.set_step(1, seed=7, rank=0)
    g = torch.Generator().manual_seed(31)
    batches = [(torch.randn(40, 32, generator=g).bfloat16(), torch.randn(40, 16, generator=g).bfloat16())]
    batches.append((batches[0][0] * 10, batches[0][1] * 10))
    for x, dy in batches:
        layer._capture = []
        x = x.float().requires_grad_()
        layer(x).backward(dy.float())
        captured = {name: (qa, qb) for name, qa, qb, _, _ in layer._capture}
        pad_t = lambda t: F.pad(t.float(), (0, 0, 0, -t.shape[0] % 16)).t()  # noqa: E731
        assert float(captured["wgrad"][1].tensor_amax) == float(_oracle_wgrad_rht(pad_t(x.detach())).abs().max())
        assert float(captured["wgrad"][0].tensor_amax) == float(_oracle_wgrad_rht(pad_t(dy)).abs().max())
        assert float(captured["fprop"][0].tensor_amax) == float(batches[0][0].float().abs().max())  # held
