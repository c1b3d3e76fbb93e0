"""Memory stand-ins for the CUDA kernels of the Mamba mixer, so a CPU plan counts what a GPU run keeps.

On CUDA with mamba-ssm and causal-conv1d installed the mixer runs ``mamba_chunk_scan_combined`` and
``causal_conv1d_fn`` (:mod:`nemofp4.models.nemotron_h.ssd`, ``model.causal_depthwise_conv1d``); on
CPU it runs the pure-PyTorch scan, which saves far more for backward (every chunk's decay matrix).
Neither kernel runs on CPU, so the planner measures the GPU path with the stand-ins here: autograd
Functions that allocate, free and save exactly the tensors the kernels do, in the same order (read from
mamba-ssm 2.3.2 ``ssd_combined.py`` ``MambaChunkScanCombinedFn`` / ``_mamba_chunk_scan_combined_fwd`` /
``_bwd`` and causal-conv1d ``CausalConv1dFn``, as called by our mixer: no D, no z, no dt bias, no
initial state), with empty values. They are memory models for FakeTensorMode, not computations.
``tests/unit/test_ssd_mamba_ssm.py`` holds the scan's stand-in to the real kernels, run by Triton's
interpreter: the same saved tensors, and the same bytes alive at every peak, byte for byte.
"""

from __future__ import annotations

import contextlib
import math
from typing import NamedTuple

import torch

__all__ = ["CONV_KERNELS", "MAMBA_SCANS", "SCAN_KERNELS", "KernelLaunches", "mamba_scan_path", "mamba_kernel_standins"]

MAMBA_SCANS = ("auto", "torch", "mamba_ssm")


class KernelLaunches(NamedTuple):
    """Kernels a CUDA op launches per call, forward and backward."""

    forward: int
    backward: int


SCAN_KERNELS = KernelLaunches(forward=5, backward=33)
"""What ``MambaChunkScanCombinedFn`` launches for our call: forward its five Triton kernels (chunk cumsum, chunk
state, state passing, chunk bmm, chunk scan); backward 14 Triton kernels (the forward's first four again, then
the gradients') and 19 torch ops on the device (fills, a clone, copies, the partial sums, ddA's flip-cumsum-flip).
``tests/unit/test_ssd_mamba_ssm.py`` counts them on the real kernels in Triton's interpreter."""
CONV_KERNELS = KernelLaunches(forward=1, backward=1)
"""causal-conv1d's ``CausalConv1dFn``: one CUDA kernel each way (``causal_conv1d_fwd``, ``causal_conv1d_bwd``);
the casts of its FP32 weight and bias gradients are the stand-in's own torch ops."""


def mamba_scan_path(mamba_scan: str) -> str:
    """The scan a plan counts: ``torch`` (the pure-PyTorch SSD, what CPU runs use) or ``mamba_ssm``
    (its CUDA kernels); ``auto`` is what a CUDA run on this installation takes: mamba_ssm when it
    imports here, else the torch scan."""
    if mamba_scan not in MAMBA_SCANS:
        raise ValueError(f"mamba_scan={mamba_scan!r}; valid: {', '.join(MAMBA_SCANS)}")
    if mamba_scan != "auto":
        return mamba_scan
    from nemofp4.models.nemotron_h.ssd import mamba_ssm_available

    return "mamba_ssm" if mamba_ssm_available() else "torch"


class _ChunkScanStandIn(torch.autograd.Function):
    """``mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, return_final_states=True)``."""

    @staticmethod
    def forward(ctx, x, dt, A, B, C, chunk_size: int):
        batch, seq_len, heads, head_dim = x.shape
        groups, state = B.shape[2], B.shape[3]
        chunks = math.ceil(seq_len / chunk_size)
        f32 = dict(dtype=torch.float32, device=x.device)
        dA_cumsum = torch.empty(batch, heads, chunks, chunk_size, **f32)
        dt_out = torch.empty(batch, heads, chunks, chunk_size, **f32)
        states = torch.empty(batch, chunks, heads, head_dim, state, **f32)  # _chunk_state_fwd, fp32
        passed = torch.empty(batch, chunks, heads, head_dim * state, dtype=C.dtype, device=x.device)
        final_states = torch.empty(batch, heads, head_dim, state, **f32)
        del states
        CB = torch.empty(batch, chunks, groups, chunk_size, chunk_size, **f32)
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        del dt_out, passed, CB
        ctx.save_for_backward(out, x, dt, dA_cumsum, A, B, C)
        ctx.chunk_size = chunk_size
        ctx.mark_non_differentiable(final_states)
        return out, final_states

    @staticmethod
    def backward(ctx, dout, _dfinal):
        # _mamba_chunk_scan_combined_bwd, allocation by allocation (non-deterministic reductions, the
        # default); a name rebound or deleted where the kernel's code drops its last reference.
        out, x, dt, dA_cumsum, A, B, C = ctx.saved_tensors
        batch, seq_len, heads, head_dim = x.shape
        groups, state = B.shape[2], B.shape[3]
        chunk = ctx.chunk_size
        chunks = math.ceil(seq_len / chunk)
        f32 = dict(dtype=torch.float32, device=x.device)
        per_chunk = (batch, heads, chunks, chunk)
        dB_given, dC_given, ddt_given = torch.empty_like(B), torch.empty_like(C), torch.empty_like(dt)
        dt_in = torch.empty_like(dt)  # dt.clone()
        # the forward recomputed: _chunk_cumsum_fwd, _bmm_chunk_fwd, _chunk_state_fwd, _state_passing_fwd
        dt_c, dA_cs = torch.empty(per_chunk, **f32), torch.empty(per_chunk, **f32)
        CB = torch.empty(batch, chunks, groups, chunk, chunk, **f32)
        chunk_states = torch.empty(batch, chunks, heads, head_dim, state, **f32)
        states = torch.empty(batch, chunks, heads, head_dim * state, **f32)
        unused_final = torch.empty(batch, heads, head_dim * state, **f32)  # bound to `_` until the end
        del chunk_states
        dstates = torch.empty(batch, chunks, heads, head_dim, state, **f32)  # _chunk_scan_bwd_dstates
        # _state_passing_bwd: dstates and states in x's dtype; ddA per 64-wide block of p*n, then summed
        dstates_x, states_x = (
            torch.empty(batch, chunks, heads, head_dim * state, dtype=x.dtype, device=x.device) for _ in range(2)
        )
        ddA_blocks = torch.empty(batch, heads, chunks, math.ceil(head_dim * state / 64), **f32)
        ddA_chunk = torch.empty(batch, heads, chunks, **f32)
        del ddA_blocks
        dstates, states = dstates_x, states_x
        dx, ddt = torch.empty_like(x), torch.empty(per_chunk, **f32)  # _chunk_scan_chunk_state_bwd_dx
        splits = _head_splits(batch, chunks, heads, groups)
        # _chunk_state_bwd_db, _chunk_scan_bwd_dC, _chunk_scan_bwd_dcb: partial sums per split of a
        # group's heads, then their sum
        ddA_next = torch.empty(per_chunk, **f32)
        parts = torch.empty(batch, seq_len, splits, groups, state, **f32)
        dB = torch.empty(batch, seq_len, groups, state, **f32)
        del parts
        ddA_cumsum_prev = torch.empty(per_chunk, **f32)
        parts = torch.empty(batch, seq_len, splits, groups, state, **f32)
        dC = torch.empty(batch, seq_len, groups, state, **f32)
        del parts
        parts = torch.empty(batch, chunks, splits, groups, chunk, chunk, **f32)
        dCB = torch.empty(batch, chunks, groups, chunk, chunk, **f32)
        del parts
        flipped = torch.empty(per_chunk, **f32)  # ddA_prev = ddA_cumsum_prev.flip(-1).cumsum(-1).flip(-1)
        summed = torch.empty(per_chunk, **f32)
        del flipped
        ddA_prev = torch.empty(per_chunk, **f32)
        del summed
        # _chunk_scan_bwd_ddAcs_stable
        blocks = torch.empty(*per_chunk[:3], math.ceil(chunk / 32), chunk, **f32)
        ddA = torch.empty(per_chunk, **f32)
        del blocks
        ddA_sum = torch.empty(per_chunk, **f32)  # ddA += ddA_next + ddA_prev
        del ddA_sum
        dA = torch.empty_like(A)  # _chunk_cumsum_bwd, into ddt_given
        del dt_in, dt_c, dA_cs, CB, unused_final, dstates, states, ddA_chunk, ddt, ddA_next
        del dB, ddA_cumsum_prev, dC, dCB, ddA_prev, ddA
        return dx, ddt_given, dA, dB_given, dC_given, None


SM_COUNT = 132
"""Streaming multiprocessors of the GPU a plan is for (H100 and H200: 132). mamba_ssm's backward splits
each group's heads over programs by it, and keeps a partial dB, dC and dCB per split."""


def _head_splits(batch: int, chunks: int, heads: int, groups: int) -> int:
    """``nsplits`` of ``_chunk_state_bwd_db`` / ``_chunk_scan_bwd_dC`` / ``_chunk_scan_bwd_dcb``."""
    per_group = heads // groups
    per_program = max(min(math.ceil(batch * chunks * heads / SM_COUNT), per_group), 1)
    return math.ceil(per_group / per_program)


def _scan_standin(x_BLHP, dt_BLH, A_H, B_BLGN, C_BLGN, chunk_size, initial_state_BHPN=None, impl="auto"):
    if initial_state_BHPN is not None:
        raise NotImplementedError("the mamba_ssm stand-in models the training call (no initial state)")
    return _ChunkScanStandIn.apply(x_BLHP, dt_BLH, A_H.float(), B_BLGN, C_BLGN, chunk_size)


class _CausalConvStandIn(torch.autograd.Function):
    """``causal_conv1d_fn(x_BCL, weight, bias, activation="silu")`` (channel-last x: no copy)."""

    @staticmethod
    def forward(ctx, x_BCL, weight_CK, bias_C):
        out = torch.empty_like(x_BCL)
        ctx.save_for_backward(x_BCL, weight_CK, bias_C)
        return out

    @staticmethod
    def backward(ctx, dout):
        x_BCL, weight_CK, bias_C = ctx.saved_tensors
        dx = torch.empty_like(x_BCL)
        dweight = torch.empty(weight_CK.shape, dtype=torch.float32, device=x_BCL.device).to(weight_CK.dtype)
        dbias = (
            None
            if bias_C is None
            else torch.empty(bias_C.shape, dtype=torch.float32, device=x_BCL.device).to(bias_C.dtype)
        )
        return dx, dweight, dbias


def _conv_standin(x_BLC, weight_CK, bias_C):
    return _CausalConvStandIn.apply(x_BLC.transpose(1, 2), weight_CK, bias_C).transpose(1, 2)


@contextlib.contextmanager
def mamba_kernel_standins(enabled: bool = True):
    """Inside: the Mamba mixer calls the stand-ins of mamba_ssm's scan and causal-conv1d's conv instead
    of the torch path (for measuring under FakeTensorMode only: their values are empty)."""
    if not enabled:
        yield
        return
    from nemofp4.models.nemotron_h import model as mixer_module

    saved = mixer_module.ssd_scan, mixer_module.causal_depthwise_conv1d
    mixer_module.ssd_scan, mixer_module.causal_depthwise_conv1d = _scan_standin, _conv_standin
    try:
        yield
    finally:
        mixer_module.ssd_scan, mixer_module.causal_depthwise_conv1d = saved
