"""mamba_ssm's Triton SSD kernels called from our scan, mixer and model, run by Triton's CPU interpreter
(stand-ins in tests/mamba_ssm_cpu.py), against the torch scan: outputs, final state, loss and every
gradient agree within 2e-5 of each tensor's largest magnitude (float32; measured: below 3e-7 for the
scan and the mixer, 6.4e-6 at most in the tiny model, an ``A_log`` gradient).

The real ``MambaChunkScanCombinedFn`` also measures the plan's stand-in
(:mod:`nemofp4.planning.standins`): what it saves for backward and the bytes it holds, byte for byte.
"""

from __future__ import annotations

import contextlib
import functools
import gc

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from nemofp4.models import get_model_config
from nemofp4.models.nemotron_h import build_model
from nemofp4.models.nemotron_h import model as mixer_module
from nemofp4.models.nemotron_h.model import Mamba2Mixer
from nemofp4.models.nemotron_h.ssd import ssd_scan
from nemofp4.planning.launches import NO_KERNEL
from nemofp4.planning.measure import LiveBytes
from nemofp4.planning.standins import SCAN_KERNELS, mamba_kernel_standins
from tests.conftest import needs_triton_interpreter
from tests.mamba_ssm_cpu import HAVE_MAMBA_SSM, mamba_ssm_kernels

pytestmark = [
    needs_triton_interpreter,
    pytest.mark.skipif(not HAVE_MAMBA_SSM, reason="needs the mamba-ssm package (its CUDA build not needed)"),
    pytest.mark.usefixtures("one_thread"),
]

RTOL = 2e-5
"""Largest |kernel - torch| allowed, relative to the largest |torch| of the same tensor."""


@pytest.fixture(scope="module")
def kernels():
    with mamba_ssm_kernels() as ssd_combined:
        yield ssd_combined


def assert_close(name: str, got: torch.Tensor, want: torch.Tensor, rtol: float = RTOL) -> None:
    assert (got.shape, got.dtype) == (want.shape, want.dtype), (name, got.shape, got.dtype, want.shape, want.dtype)
    err = (got.double() - want.double()).abs().max().item()
    scale = want.double().abs().max().item()
    assert err <= rtol * scale, f"{name}: max |diff| {err:.3g} > {rtol} * max |ref| {scale:.3g}"


def scan_inputs(batch=1, seq_len=10, heads=4, head_dim=8, groups=2, state=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    tensors = {
        "x": torch.randn(batch, seq_len, heads, head_dim, generator=g),
        "dt": torch.rand(batch, seq_len, heads, generator=g) * 0.5 + 0.05,
        "A": -(torch.rand(heads, generator=g) + 0.5),
        "B": torch.randn(batch, seq_len, groups, state, generator=g),
        "C": torch.randn(batch, seq_len, groups, state, generator=g),
        "initial_state": torch.randn(batch, heads, head_dim, state, generator=g),
    }
    return {k: v.requires_grad_() for k, v in tensors.items()}


def run_scan(impl, inputs, chunk_size):
    leaves = {k: v.detach().clone().requires_grad_() for k, v in inputs.items()}
    y, final = ssd_scan(
        leaves["x"], leaves["dt"], leaves["A"], leaves["B"], leaves["C"], chunk_size, leaves["initial_state"], impl=impl
    )
    g = torch.Generator().manual_seed(1)
    weights = torch.randn(y.shape, generator=g), torch.randn(final.shape, generator=g)
    loss = (y * weights[0]).sum() + (final * weights[1]).sum()
    loss.backward()
    return {"y": y, "final_state": final, **{f"grad {k}": v.grad for k, v in leaves.items()}}


def test_the_kernel_scan_matches_the_torch_scan_with_an_initial_state_and_a_partial_last_chunk(kernels):
    inputs = scan_inputs(seq_len=10)  # chunks of 4: the last one holds 2 positions
    kernel, torch_scan = run_scan("mamba_ssm", inputs, 4), run_scan("torch", inputs, 4)
    assert kernel.keys() == torch_scan.keys() and len(kernel) == 8
    for name in kernel:
        assert_close(name, kernel[name], torch_scan[name])


def _mixer_config(**overrides):
    widths = dict(
        hidden_size=16,
        mamba_num_heads=4,
        mamba_head_dim=8,
        ssm_state_size=8,
        mamba_num_groups=2,
        chunk_size=4,
        vocab_size=64,
    )
    return get_model_config("tiny", **{**widths, **overrides})


def _with_scan(impl, monkeypatch, fn):
    monkeypatch.setattr(mixer_module, "ssd_scan", functools.partial(ssd_scan, impl=impl))
    return fn()


def test_the_mixer_through_the_kernel_matches_the_mixer_through_the_torch_scan(kernels, monkeypatch):
    torch.manual_seed(0)
    mixer = Mamba2Mixer(_mixer_config())
    mixer.reset_parameters(_mixer_config())
    with torch.no_grad():
        for p in mixer.parameters():
            p.add_(torch.randn(p.shape) * 0.1)
    x = torch.randn(1, 10, 16)

    def step():
        mixer.zero_grad()
        xi = x.clone().requires_grad_()
        out = mixer(xi)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        return {
            "out": out.detach(),
            "grad x": xi.grad,
            **{f"grad {n}": p.grad.clone() for n, p in mixer.named_parameters()},
        }

    kernel, torch_scan = _with_scan("mamba_ssm", monkeypatch, step), _with_scan("torch", monkeypatch, step)
    assert len(kernel) == 2 + len(list(mixer.parameters()))
    for name in kernel:
        assert_close(name, kernel[name], torch_scan[name])


@pytest.mark.slow
def test_the_tiny_model_through_the_kernel_matches_the_torch_scan(kernels, monkeypatch):
    """The tiny preset at its own widths (chunk 64), 100 tokens: loss and every parameter gradient."""
    cfg = get_model_config("tiny")
    torch.manual_seed(0)
    model = build_model(cfg, device="cpu")
    ids = torch.randint(0, cfg.vocab_size, (2, 101))

    def step():
        model.zero_grad()
        loss = F.cross_entropy(model(ids[:, :-1]).flatten(0, 1).float(), ids[:, 1:].flatten())
        loss.backward()
        return {"loss": loss.detach(), **{f"grad {n}": p.grad.clone() for n, p in model.named_parameters()}}

    kernel, torch_scan = _with_scan("mamba_ssm", monkeypatch, step), _with_scan("torch", monkeypatch, step)
    assert len(kernel) == 1 + len(list(model.parameters()))
    for name in kernel:
        assert_close(name, kernel[name], torch_scan[name])


class _LiveBytesCollected(LiveBytes):
    """LiveBytes on real tensors that runs Python's cycle collector before counting a new storage: the
    interpreter leaves reference cycles holding views of kernel arguments, which a GPU launch does not."""

    def _track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        if storage.nbytes() and id(storage) not in self._storages and id(storage) not in self._existing_ids:
            gc.collect()
        super()._track(t)


def _scan_memory(scan, batch, seq_len, heads, head_dim, groups, state, chunk_size, count_bytes):
    """What ``scan`` saves for backward (shape, dtype, strides, storage bytes, which input it is, if
    one), and with ``count_bytes`` the bytes alive: at the forward's peak and after it, at the
    backward's peak and after it."""
    g = torch.Generator().manual_seed(0)
    bf16 = dict(dtype=torch.bfloat16)
    inputs = [
        torch.randn(batch, seq_len, heads, head_dim, generator=g).to(**bf16),
        torch.rand(batch, seq_len, heads, generator=g) * 0.5 + 0.05,
        -(torch.rand(heads, generator=g) + 0.5),
        torch.randn(batch, seq_len, groups, state, generator=g).to(**bf16),
        torch.randn(batch, seq_len, groups, state, generator=g).to(**bf16),
    ]
    for t in inputs:
        t.requires_grad_()
    storages = [t.untyped_storage().data_ptr() for t in inputs]
    saved = []

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        saved.append(
            (
                tuple(t.shape),
                t.dtype,
                t.stride(),
                t.untyped_storage().nbytes(),
                storages.index(ptr) if ptr in storages else None,
            )
        )
        return t

    live = _LiveBytesCollected(*inputs) if count_bytes else contextlib.nullcontext()
    with live, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y, _ = scan(*inputs, chunk_size)
    if not count_bytes:
        return saved, None, None
    gc.collect()
    forward = (live.peak, sum(live.live.values()))
    live.label = "temp"
    live.reset_peak()
    with live:
        y.float().sum().backward()
    gc.collect()
    return saved, forward, (live.peak, sum(live.live.values()))


SPLIT_SHAPE = (1, 10, 4, 8, 2, 8, 4)
"""batch, seq, heads, head dim, groups, state, chunk: two heads per group run as two splits (dB, dC
and dCB summed over them), the last chunk partial."""
BLOCKS_SHAPE = (2, 70, 2, 16, 2, 8, 64)
"""p*n and the chunk each span two of the backward's reduction blocks; one head per group."""


def _kernel_and_stand_in(shape, count_bytes):
    real = _scan_memory(functools.partial(ssd_scan, impl="mamba_ssm"), *shape, count_bytes=count_bytes)
    with mamba_kernel_standins():
        stand_in = _scan_memory(mixer_module.ssd_scan, *shape, count_bytes=count_bytes)
    return real, stand_in


def test_the_plans_stand_in_saves_what_the_kernel_saves(kernels):
    real, stand_in = _kernel_and_stand_in(SPLIT_SHAPE, count_bytes=False)
    assert stand_in[0] == real[0]  # MambaChunkScanCombinedFn: out, x, dt, dA_cumsum, A, B, C
    assert [s[4] for s in real[0]] == [None, 0, 1, None, 2, 3, 4]


@pytest.mark.slow
@pytest.mark.parametrize("shape", [SPLIT_SHAPE, BLOCKS_SHAPE], ids=["split-heads", "reduction-blocks"])
def test_the_plans_stand_in_keeps_what_the_kernel_keeps_byte_for_byte(kernels, shape):
    """About 40 s a shape: the cycle collector runs before every allocation."""
    real, stand_in = _kernel_and_stand_in(shape, count_bytes=True)
    assert stand_in == real  # saved tensors; (peak, after) of forward and of backward


class _DeviceOps(TorchDispatchMode):
    """Counts the torch ops that launch a kernel (not views or allocations), outside Triton's launches."""

    def __init__(self) -> None:
        super().__init__()
        self.inside_launch = 0
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.inside_launch and func.overloadpacket.__name__ not in NO_KERNEL:
            self.count += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _kernels_launched():
    """Inside: every Triton launch (the interpreter's grid call) and every other device op, counted."""
    from triton.runtime.interpreter import GridExecutor

    ops, launches, call = _DeviceOps(), [], GridExecutor.__call__

    def counted(self, *args, **kwargs):
        launches.append(self)
        ops.inside_launch += 1
        try:
            return call(self, *args, **kwargs)
        finally:
            ops.inside_launch -= 1

    GridExecutor.__call__ = counted
    try:
        with ops:
            yield lambda: len(launches) + ops.count
    finally:
        GridExecutor.__call__ = call


@pytest.mark.parametrize("shape", [SPLIT_SHAPE, BLOCKS_SHAPE], ids=["split-heads", "reduction-blocks"])
def test_the_plans_kernel_count_is_what_the_scan_launches(kernels, shape):
    batch, seq_len, heads, head_dim, groups, state, chunk = shape
    inputs = scan_inputs(batch, seq_len, heads, head_dim, groups, state)
    inputs.pop("initial_state")  # the mixer's call
    with _kernels_launched() as forward:
        y, _ = ssd_scan(*inputs.values(), chunk, impl="mamba_ssm")
    grad = torch.ones_like(y)
    with _kernels_launched() as backward:
        y.backward(grad)
    assert (forward(), backward()) == SCAN_KERNELS
