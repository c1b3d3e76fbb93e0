"""Mamba-2 SSD scan: a chunked pure-PyTorch implementation, its step-by-step reference, and dispatch.

The scan computes, per batch b, head h (group g = h // heads_per_group), position t::

    state_t = exp(dt_t * A_h) * state_{t-1} + dt_t * outer(x_t, B_t)     # [head_dim, state_size]
    y_t     = state_t @ C_t                                              # [head_dim]

Inputs are already processed: ``dt`` is the positive step size (softplus, bias and clamping are
the mixer's job) and ``A`` is the negative real diagonal. The D skip connection is added by the
mixer too, so every implementation here computes exactly the recurrence above.

Shape suffixes: B batch, L sequence, H heads, P head dim, G groups, N state size,
T chunks, Q chunk length, R heads per group.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


def _check_shapes(x_BLHP, dt_BLH, A_H, B_BLGN, C_BLGN, initial_state_BHPN):
    batch, seq_len, heads, head_dim = x_BLHP.shape
    groups, state_size = B_BLGN.shape[2], B_BLGN.shape[3]
    assert dt_BLH.shape == (batch, seq_len, heads), (dt_BLH.shape, x_BLHP.shape)
    assert A_H.shape == (heads,), A_H.shape
    assert B_BLGN.shape == C_BLGN.shape == (batch, seq_len, groups, state_size), (B_BLGN.shape, C_BLGN.shape)
    assert heads % groups == 0, f"heads={heads} not divisible by groups={groups}"
    if initial_state_BHPN is not None:
        assert initial_state_BHPN.shape == (batch, heads, head_dim, state_size), initial_state_BHPN.shape


def ssd_reference(
    x_BLHP: torch.Tensor,
    dt_BLH: torch.Tensor,
    A_H: torch.Tensor,
    B_BLGN: torch.Tensor,
    C_BLGN: torch.Tensor,
    initial_state_BHPN: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence, one step at a time, in float64. Slow and obviously correct: the oracle.

    Returns (y_BLHP, final_state_BHPN) in float64.
    """
    _check_shapes(x_BLHP, dt_BLH, A_H, B_BLGN, C_BLGN, initial_state_BHPN)
    batch, seq_len, heads, head_dim = x_BLHP.shape
    heads_per_group = heads // B_BLGN.shape[2]
    x, dt, A = x_BLHP.double(), dt_BLH.double(), A_H.double()
    B_BLHN = B_BLGN.double().repeat_interleave(heads_per_group, dim=2)
    C_BLHN = C_BLGN.double().repeat_interleave(heads_per_group, dim=2)
    state_BHPN = (
        initial_state_BHPN.double().clone()
        if initial_state_BHPN is not None
        else x.new_zeros(batch, heads, head_dim, B_BLGN.shape[3])
    )
    ys = []
    for t in range(seq_len):
        decay_BH = torch.exp(dt[:, t] * A)
        input_BHPN = (dt[:, t, :, None] * x[:, t])[..., None] * B_BLHN[:, t, :, None, :]
        state_BHPN = decay_BH[..., None, None] * state_BHPN + input_BHPN
        ys.append(torch.einsum("bhpn,bhn->bhp", state_BHPN, C_BLHN[:, t]))
    y_BLHP = torch.stack(ys, dim=1) if ys else x.new_zeros(x.shape)
    return y_BLHP, state_BHPN


def ssd_chunked(
    x_BLHP: torch.Tensor,
    dt_BLH: torch.Tensor,
    A_H: torch.Tensor,
    B_BLGN: torch.Tensor,
    C_BLGN: torch.Tensor,
    chunk_size: int,
    initial_state_BHPN: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked SSD algorithm (Mamba-2 paper, Listing 1) in pure PyTorch, differentiable.

    Differences from the paper's listing that matter for speed and memory on CPU:
      * B and C are never repeated to heads: C.B^T is computed once per group and shared by the
        heads of that group (the 8B has 16 heads per group);
      * the inter-chunk recurrence is a loop over chunks on [B, H, P, N] states, O(T) rather than
        the O(T^2) segment-sum matrix;
      * the decay inside a chunk is exp(cumsum_l - cumsum_s), as in mamba_ssm's kernels.

    Works for any number of groups, any sequence length (the tail is padded with dt = 0, which
    leaves the state untouched), and an optional initial state. Computes in float32 for
    lower-precision inputs and returns y in x's dtype and the final state in float32 (or
    float64 for float64 inputs).
    """
    _check_shapes(x_BLHP, dt_BLH, A_H, B_BLGN, C_BLGN, initial_state_BHPN)
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    batch, seq_len, heads, head_dim = x_BLHP.shape
    groups, state_size = B_BLGN.shape[2], B_BLGN.shape[3]
    per_group = heads // groups
    compute_dtype = torch.float64 if x_BLHP.dtype == torch.float64 else torch.float32

    chunk = min(chunk_size, max(seq_len, 1))
    pad = (-seq_len) % chunk
    num_chunks = (seq_len + pad) // chunk

    x = x_BLHP.to(compute_dtype)
    dt = dt_BLH.to(compute_dtype)
    B_mat = B_BLGN.to(compute_dtype)
    C_mat = C_BLGN.to(compute_dtype)
    if pad:
        x = F.pad(x, (0, 0, 0, 0, 0, pad))
        dt = F.pad(dt, (0, 0, 0, pad))
        B_mat = F.pad(B_mat, (0, 0, 0, 0, 0, pad))
        C_mat = F.pad(C_mat, (0, 0, 0, 0, 0, pad))

    # Log-decay per step and its running sum inside each chunk: [B, H, T, Q].
    log_decay_BHTQ = (dt * A_H.to(compute_dtype)).permute(0, 2, 1).reshape(batch, heads, num_chunks, chunk)
    cum_BHTQ = torch.cumsum(log_decay_BHTQ, dim=-1)

    # Discretized input x * dt laid out per group: [B, T, G, R, Q, P].
    xdt_BTGRQP = (
        (x * dt[..., None]).reshape(batch, num_chunks, chunk, groups, per_group, head_dim).permute(0, 1, 3, 4, 2, 5)
    )
    B_BTGQN = B_mat.reshape(batch, num_chunks, chunk, groups, state_size).transpose(2, 3)
    C_BTGQN = C_mat.reshape(batch, num_chunks, chunk, groups, state_size).transpose(2, 3)
    cum_BTGRQ = cum_BHTQ.reshape(batch, groups, per_group, num_chunks, chunk).permute(0, 3, 1, 2, 4)

    # 1. Within each chunk: y_l += sum_{s<=l} (C_l . B_s) exp(cum_l - cum_s) x_s dt_s.
    scores_BTGQQ = C_BTGQN @ B_BTGQN.transpose(-1, -2)
    causal_QQ = torch.ones(chunk, chunk, dtype=torch.bool, device=x.device).tril()
    segment_BTGRQQ = (cum_BTGRQ[..., :, None] - cum_BTGRQ[..., None, :]).masked_fill(~causal_QQ, -torch.inf)
    weights_BTGRQQ = scores_BTGQQ[:, :, :, None] * torch.exp(segment_BTGRQQ)
    y_BTGRQP = weights_BTGRQQ @ xdt_BTGRQP

    # 2. State each chunk adds, decayed to the chunk's end: [B, T, G, R*P, N].
    decay_to_end_BTGRQ = torch.exp(cum_BTGRQ[..., -1:] - cum_BTGRQ)
    chunk_input_BTGRPN = (
        (xdt_BTGRQP * decay_to_end_BTGRQ[..., None])
        .transpose(-1, -2)
        .reshape(batch, num_chunks, groups, per_group * head_dim, chunk)
        @ B_BTGQN
    ).reshape(batch, num_chunks, heads, head_dim, state_size)

    # 3. Pass states across chunks: the state entering chunk t, and the final state.
    chunk_decay_BTH = torch.exp(cum_BHTQ[..., -1]).transpose(1, 2)
    state_BHPN = (
        initial_state_BHPN.to(compute_dtype)
        if initial_state_BHPN is not None
        else x.new_zeros(batch, heads, head_dim, state_size)
    )
    entering = []
    for t in range(num_chunks):
        entering.append(state_BHPN)
        state_BHPN = chunk_decay_BTH[:, t, :, None, None] * state_BHPN + chunk_input_BTGRPN[:, t]
    entering_BTGNRP = (
        torch.stack(entering, dim=1)
        .reshape(batch, num_chunks, groups, per_group * head_dim, state_size)
        .transpose(-1, -2)
    )

    # 4. Contribution of the entering state: y_l += exp(cum_l) C_l . state_in.
    y_off_BTGQRP = (C_BTGQN @ entering_BTGNRP).reshape(batch, num_chunks, groups, chunk, per_group, head_dim)
    y_BTGRQP = y_BTGRQP + y_off_BTGQRP.permute(0, 1, 2, 4, 3, 5) * torch.exp(cum_BTGRQ)[..., None]

    y_BLHP = y_BTGRQP.permute(0, 1, 4, 2, 3, 5).reshape(batch, num_chunks * chunk, heads, head_dim)
    return y_BLHP[:, :seq_len].to(x_BLHP.dtype), state_BHPN


@functools.cache
def _import_chunk_scan_kernel():
    """(mamba_ssm's ``mamba_chunk_scan_combined`` or None, why it did not import). Imported on first
    use, not with the model: the import loads triton, whose first import fixes for the process
    whether kernels compile or run in the interpreter."""
    try:  # optional CUDA kernels; never required
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
    except Exception as exc:  # noqa: BLE001 - any failure means "not available", e.g. ImportError, or
        # mamba-ssm built without CUDA (its __init__ imports the selective_scan_cuda extension)
        return None, f"{type(exc).__name__}: {exc}"
    return mamba_chunk_scan_combined, ""


def _chunk_scan_kernel():
    return _import_chunk_scan_kernel()[0]


def mamba_ssm_available() -> bool:
    """True when mamba_ssm's Triton SSD kernel imports (it still needs CUDA tensors)."""
    return _chunk_scan_kernel() is not None


def ssd_scan(
    x_BLHP: torch.Tensor,
    dt_BLH: torch.Tensor,
    A_H: torch.Tensor,
    B_BLGN: torch.Tensor,
    C_BLGN: torch.Tensor,
    chunk_size: int,
    initial_state_BHPN: torch.Tensor | None = None,
    impl: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatch: mamba_ssm's ``mamba_chunk_scan_combined`` on CUDA when importable, else :func:`ssd_chunked`.

    ``impl`` is "auto", "torch" or "mamba_ssm". Returns (y_BLHP, final_state_BHPN).
    """
    if impl not in ("auto", "torch", "mamba_ssm"):
        raise ValueError(f"impl must be 'auto', 'torch' or 'mamba_ssm', got {impl!r}")
    use_kernel = impl == "mamba_ssm" or (impl == "auto" and x_BLHP.is_cuda and mamba_ssm_available())
    if not use_kernel:
        return ssd_chunked(x_BLHP, dt_BLH, A_H, B_BLGN, C_BLGN, chunk_size, initial_state_BHPN)
    kernel = _chunk_scan_kernel()
    if kernel is None:
        why = _import_chunk_scan_kernel()[1]
        raise ValueError(f"impl='mamba_ssm' needs mamba_ssm's Triton SSD kernel, which did not import: {why}")
    # The kernel takes dt already processed (no softplus, no bias, no limit) exactly like ours.
    y_BLHP, final_state_BHPN = kernel(
        x_BLHP,
        dt_BLH,
        A_H.float(),
        B_BLGN,
        C_BLGN,
        chunk_size,
        initial_states=initial_state_BHPN,
        return_final_states=True,
    )
    return y_BLHP, final_state_BHPN
