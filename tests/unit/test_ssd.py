"""The chunked SSD scan against the step-by-step float64 recurrence, and its own invariants."""

import importlib.util
import math

import pytest
import torch

from nemofp4.models.nemotron_h.ssd import mamba_ssm_available, ssd_chunked, ssd_reference, ssd_scan


def make_inputs(
    batch=2, seq_len=37, heads=6, head_dim=4, groups=3, state=5, dtype=torch.float64, seed=0, with_state=False
):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, seq_len, heads, head_dim, generator=g, dtype=dtype)
    # Realistic step sizes (softplus outputs around Nemotron-H's init range) and decays A in [-8, -0.5].
    dt = torch.rand(batch, seq_len, heads, generator=g, dtype=dtype) * 0.2 + 1e-3
    A = -(torch.rand(heads, generator=g, dtype=dtype) * 7.5 + 0.5)
    B = torch.randn(batch, seq_len, groups, state, generator=g, dtype=dtype)
    C = torch.randn(batch, seq_len, groups, state, generator=g, dtype=dtype)
    s0 = torch.randn(batch, heads, head_dim, state, generator=g, dtype=dtype) if with_state else None
    return x, dt, A, B, C, s0


@pytest.mark.parametrize(
    "groups,seq_len,chunk,with_state",
    [(1, 32, 8, False), (3, 37, 8, True), (6, 5, 16, True), (2, 64, 64, False), (3, 1, 4, True)],
)
def test_chunked_matches_step_by_step_reference_float64(groups, seq_len, chunk, with_state):
    x, dt, A, B, C, s0 = make_inputs(seq_len=seq_len, groups=groups, with_state=with_state)
    y_ref, state_ref = ssd_reference(x, dt, A, B, C, s0)
    y, state = ssd_chunked(x, dt, A, B, C, chunk, s0)
    assert y.dtype == state.dtype == torch.float64
    assert (y - y_ref).abs().max() <= 1e-10
    assert (state - state_ref).abs().max() <= 1e-10


@pytest.mark.parametrize("chunk,nemotron_8b_like", [(32, False), (256, True)])
def test_chunked_float32_within_1e4_relative_of_reference(chunk, nemotron_8b_like):
    x, dt, A, B, C, s0 = make_inputs(batch=2, seq_len=280, heads=8, head_dim=16, groups=2, state=32, with_state=True)
    if nemotron_8b_like:  # A = -(1..128) as initialized, dt around the init range [1e-3, 1e-1]
        A = -torch.linspace(1.0, 128.0, 8, dtype=torch.float64)
        dt = torch.exp(torch.empty_like(dt).uniform_(-7.0, -2.3, generator=torch.Generator().manual_seed(3)))
    y_ref, state_ref = ssd_reference(x, dt, A, B, C, s0)
    x32, dt32, A32, B32, C32, s032 = (t.float() for t in (x, dt, A, B, C, s0))
    y, state = ssd_chunked(x32, dt32, A32, B32, C32, chunk, s032)
    assert y.dtype == torch.float32
    assert ((y.double() - y_ref).abs().max() / y_ref.abs().max()) <= 1e-4
    assert ((state.double() - state_ref).abs().max() / state_ref.abs().max()) <= 1e-4


def test_reference_is_the_recurrence_on_a_hand_checked_case():
    # One head, one state, head_dim 1: state_t = exp(dt A) state_{t-1} + dt x B; y = C state.
    x = torch.tensor([1.0, 2.0, -1.0]).view(1, 3, 1, 1)
    dt = torch.tensor([0.5, 1.0, 0.25]).view(1, 3, 1)
    A = torch.tensor([-2.0])
    B = torch.tensor([1.0, 0.5, 2.0]).view(1, 3, 1, 1)
    C = torch.tensor([3.0, 1.0, -1.0]).view(1, 3, 1, 1)
    s = 0.0
    expected = []
    for t in range(3):
        s = (
            math.exp(dt[0, t, 0].item() * A[0].item()) * s
            + dt[0, t, 0].item() * x[0, t, 0, 0].item() * B[0, t, 0, 0].item()
        )
        expected.append(C[0, t, 0, 0].item() * s)
    y, state = ssd_reference(x, dt, A, B, C)
    torch.testing.assert_close(y.flatten(), torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    assert state.item() == pytest.approx(s, rel=1e-12)


def test_chunk_size_invariance():
    x, dt, A, B, C, s0 = make_inputs(seq_len=50, with_state=True)
    y_one, state_one = ssd_chunked(x, dt, A, B, C, 1, s0)
    for chunk in (3, 7, 16, 50, 128):
        y, state = ssd_chunked(x, dt, A, B, C, chunk, s0)
        assert (y - y_one).abs().max() <= 1e-12, chunk
        assert (state - state_one).abs().max() <= 1e-12, chunk


@pytest.mark.parametrize("split", [16, 21])  # on and off a chunk boundary
def test_state_passing_two_halves_equal_one_pass(split):
    x, dt, A, B, C, s0 = make_inputs(seq_len=48, with_state=True)
    y_full, state_full = ssd_chunked(x, dt, A, B, C, 8, s0)
    y_a, state_a = ssd_chunked(x[:, :split], dt[:, :split], A, B[:, :split], C[:, :split], 8, s0)
    y_b, state_b = ssd_chunked(x[:, split:], dt[:, split:], A, B[:, split:], C[:, split:], 8, state_a)
    assert (torch.cat([y_a, y_b], dim=1) - y_full).abs().max() <= 1e-12
    assert (state_b - state_full).abs().max() <= 1e-12


def test_gradcheck_small_case():
    x, dt, A, B, C, s0 = make_inputs(batch=1, seq_len=7, heads=4, head_dim=2, groups=2, state=3, with_state=True)
    inputs = tuple(t.clone().requires_grad_(True) for t in (x, dt, A, B, C, s0))
    assert torch.autograd.gradcheck(lambda *a: ssd_chunked(*a[:5], 3, a[5]), inputs)


def test_gradients_match_reference():
    x, dt, A, B, C, s0 = make_inputs(seq_len=19, with_state=True)
    a = [t.clone().requires_grad_(True) for t in (x, dt, A, B, C, s0)]
    b = [t.clone().requires_grad_(True) for t in (x, dt, A, B, C, s0)]
    weight = torch.randn(x.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    y, state = ssd_chunked(*a[:5], 4, a[5])
    ((y * weight).sum() + state.sum()).backward()
    y_ref, state_ref = ssd_reference(*b[:5], b[5])
    ((y_ref * weight).sum() + state_ref.sum()).backward()
    for ours, ref in zip(a, b):
        assert (ours.grad - ref.grad).abs().max() <= 1e-9


@pytest.mark.parametrize("t", [0, 5, 8, 23])
def test_scan_is_causal_exactly(t):
    x, dt, A, B, C, _ = make_inputs(seq_len=24, dtype=torch.float32)
    y, _ = ssd_chunked(x, dt, A, B, C, 8)
    x2, dt2, B2, C2 = x.clone(), dt.clone(), B.clone(), C.clone()
    x2[:, t:] += 1.0
    dt2[:, t:] *= 3.0
    B2[:, t:] = -B2[:, t:]
    C2[:, t:] += 2.0
    y2, _ = ssd_chunked(x2, dt2, A, B2, C2, 8)
    assert torch.equal(y[:, :t], y2[:, :t])
    assert not torch.equal(y[:, t:], y2[:, t:])


def test_low_precision_inputs_compute_in_float32():
    x, dt, A, B, C, _ = make_inputs(seq_len=16, dtype=torch.float32)
    y_bf16, _ = ssd_chunked(x.bfloat16(), dt, A, B.bfloat16(), C.bfloat16(), 8)
    y_ref, _ = ssd_chunked(x.bfloat16().float(), dt, A, B.bfloat16().float(), C.bfloat16().float(), 8)
    assert y_bf16.dtype == torch.bfloat16
    assert torch.equal(y_bf16, y_ref.bfloat16())


def test_dispatch():
    x, dt, A, B, C, s0 = make_inputs(seq_len=10, with_state=True)
    y, state = ssd_scan(x, dt, A, B, C, 4, s0)  # CPU: always the torch path
    y_t, state_t = ssd_chunked(x, dt, A, B, C, 4, s0)
    assert torch.equal(y, y_t) and torch.equal(state, state_t)
    with pytest.raises(ValueError, match="impl"):
        ssd_scan(x, dt, A, B, C, 4, impl="triton")
    if not mamba_ssm_available():
        with pytest.raises(ValueError, match="mamba_ssm"):
            ssd_scan(x, dt, A, B, C, 4, impl="mamba_ssm")
    with pytest.raises(ValueError, match="chunk_size"):
        ssd_chunked(x, dt, A, B, C, 0)


@pytest.mark.skipif(
    importlib.util.find_spec("mamba_ssm") is None or importlib.util.find_spec("selective_scan_cuda") is not None,
    reason="needs mamba-ssm installed without its CUDA build",
)
def test_mamba_ssm_without_its_cuda_build_is_as_available_as_its_import_and_forcing_it_names_why():
    """Without the CUDA extension, whether mamba_ssm's Triton SSD kernel imports depends on the release (the
    locked one's ``__init__`` imports ``selective_scan_cuda``; newer ones import the kernel without it):
    ``mamba_ssm_available()`` says what the import did, ``auto`` on CPU tensors takes the torch scan either
    way, and forcing the kernel where it does not import is one error naming why."""
    from nemofp4.models.nemotron_h import ssd

    kernel, why = ssd._import_chunk_scan_kernel()
    assert mamba_ssm_available() == (kernel is not None)
    x, dt, A, B, C, _ = make_inputs(seq_len=10)
    y, _ = ssd_scan(x, dt, A, B, C, 4)  # auto: the torch scan
    assert torch.equal(y, ssd_chunked(x, dt, A, B, C, 4)[0])
    if kernel is None:
        assert "selective_scan_cuda" in why
        with pytest.raises(ValueError, match="impl='mamba_ssm' needs .*selective_scan_cuda"):
            ssd_scan(x, dt, A, B, C, 4, impl="mamba_ssm")
