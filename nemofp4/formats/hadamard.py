"""The 16x16 random Hadamard transform NVFP4 applies to wgrad operands.

NVFP4 (arXiv 2509.25149, and Transformer Engine's reference quantizer) multiplies each
contiguous group of 16 elements along the last dim by ``M = diag(s) @ H16 / 4``, where
``H16`` is the Sylvester Hadamard matrix and ``s`` one fixed sign vector shared by every
layer for the whole run. ``M`` is orthogonal (``H16 @ H16 = 16 I``), so the inverse is
``M.T``. Spreading an outlier over 16 elements lowers the block amax that sets the FP4
scale; because both wgrad operands get the same ``M`` along the contraction (token) dim,
their product is unchanged.
"""

from __future__ import annotations

import torch

__all__ = [
    "HADAMARD_SIZE",
    "TE_WGRAD_SIGNS",
    "hadamard_matrix",
    "hadamard_transform",
    "inverse_hadamard_transform",
    "wgrad_hadamard_transform",
]

HADAMARD_SIZE = 16
TE_WGRAD_SIGNS: tuple[float, ...] = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)
"""Transformer Engine's fixed wgrad sign vector (``get_wgrad_sign_vector``)."""


def hadamard_matrix(sign: torch.Tensor | None = None, device: torch.device | str | None = None) -> torch.Tensor:
    """``diag(sign) @ H16 / 4`` in float32 (entries +-1/4, exact)."""
    h = torch.ones(1, 1, dtype=torch.float32)
    while h.shape[0] < HADAMARD_SIZE:
        h = torch.cat((torch.cat((h, h), dim=1), torch.cat((h, -h), dim=1)), dim=0)
    signs = _check_sign(sign)
    return (signs[:, None] * h * 0.25).to(device)


def hadamard_transform(x: torch.Tensor, sign: torch.Tensor | None = None, *, dim: int = -1) -> torch.Tensor:
    """Apply ``diag(sign) @ H16 / 4`` to each group of 16 along ``dim``; float32 result.

    Row vector convention, as TE's reference: ``y = x @ (diag(sign) @ H16 / 4)``. Computed
    in float32 with a butterfly (exact sign flips and 1/4 scaling, then 4 add/subtract
    stages), not a matmul, so GPU TF32 settings cannot change it. The result stays float32
    because it feeds the FP4 quantizer directly. ``sign`` defaults to TE's wgrad vector.
    ``dim`` is the last dim (-1) or the first (0): ``hadamard_transform(x, dim=0)`` is
    ``hadamard_transform(x.t()).t()`` for a 2-D ``x``, bit for bit (the same operations on the
    same values), without the transposed copy: the wgrad operands are token-major tensors
    transformed along their tokens.
    """
    return _transform(x, sign, dim, to_bf16=False)


def wgrad_hadamard_transform(x: torch.Tensor, *, dim: int = -1, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The wgrad operand as NVFP4 quantizes it: :func:`hadamard_transform` (TE's signs) rounded to
    BF16 (RNE), returned as float32 (or ``dtype``). TE's fused RHT-cast kernel downcasts the
    transform to BF16 before its amax and quantization ("for bit-wise compatibility",
    ``common/hadamard_transform/hadamard_transform_cast_fusion.cu``; the amax kernel in
    ``hadamard_transform.cu`` reduces the same BF16 values), and the UE5M3 paper's TE-settings
    recipe materializes it with a BF16 matmul (``_te_settings_rht_last_dim_b16``), which on BF16
    inputs is the same rounding of the same exact sums. ``dim`` as in :func:`hadamard_transform`.
    ``dtype=torch.bfloat16`` returns the same values in BF16 (half the bytes, for a caller that
    stores them; the bits of ``wgrad_hadamard_transform(x).bfloat16()``)."""
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"the wgrad transform's values are BF16: dtype float32 or bfloat16, got {dtype}")
    return _transform(x, None, dim, to_bf16=True, dtype=dtype)


def round_to_bf16(x: torch.Tensor) -> torch.Tensor:
    """float32 ``x`` rounded to BF16 (RNE, overflow to +-Inf, NaN kept), as float32. Integer
    operations on the bits, not ``.to(torch.bfloat16)``: Inductor drops an fp32->bf16->fp32 round
    trip inside a fused kernel, and this must round identically eagerly and compiled."""
    bits = x.view(torch.int32)
    rounded = ((bits + (0x7FFF + ((bits >> 16) & 1))) & -65536).view(torch.float32)
    return torch.where(x != x, x, rounded)  # NaN kept (x != x vectorizes where isnan does not)


def inverse_hadamard_transform(y: torch.Tensor, sign: torch.Tensor | None = None) -> torch.Tensor:
    """Undo ``hadamard_transform``: ``x = y @ (H16 @ diag(sign) / 4)``; float32 result."""
    groups = _groups(y, -1)
    signs = _check_sign(sign).to(groups.device).view(HADAMARD_SIZE, 1)
    return (_walsh_hadamard(groups * 0.25) * signs).reshape(y.shape)


def _transform(
    x: torch.Tensor, sign: torch.Tensor | None, dim: int, *, to_bf16: bool, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    groups = _groups(x, dim)
    signs = _check_sign(sign).to(groups.device).view(HADAMARD_SIZE, 1) * 0.25
    finish = None
    if to_bf16:  # into BF16 itself the conversion is the same rounding (RNE), and it vectorizes
        finish = round_to_bf16 if dtype == torch.float32 else lambda r: r.to(dtype)
    return _walsh_hadamard(groups * signs, finish=finish).reshape(x.shape)


def _groups(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``x`` as float32 ``[groups, 16, inner]``: the 16 elements of a group along dim 1, ``inner``
    1 for groups along the last dim, the row length for groups along dim 0 of a 2-D tensor."""
    if dim not in (0, -1) or (dim == 0 and x.dim() != 2):
        raise ValueError(f"the Hadamard transform runs along the last dim, or dim 0 of a 2-D tensor; got dim={dim}")
    if x.dim() == 0 or x.shape[dim] % HADAMARD_SIZE:
        raise ValueError(
            f"the Hadamard transform works on groups of {HADAMARD_SIZE} along dim {dim}; got shape {tuple(x.shape)}"
        )
    x = x.float()
    if dim == 0:
        return x.reshape(-1, HADAMARD_SIZE, x.shape[1])
    return x.reshape(-1, HADAMARD_SIZE, 1)


def _walsh_hadamard(groups: torch.Tensor, finish=None) -> torch.Tensor:
    """``groups @ H16`` along dim 1 of ``[groups, 16, inner]`` (Sylvester order, unnormalized) by
    the fast Walsh-Hadamard butterfly: stage ``h`` replaces each pair ``(i, i + h)`` (``i & h == 0``)
    by ``(a + b, a - b)``. Spelled out element by element, so that a compiler fuses the four stages
    into one loop over the contiguous inner dim (a stacked form makes it gather). ``finish`` (an
    elementwise function, the BF16 rounding) is applied to each output before they are assembled:
    the same values, written once."""
    rows = list(groups.unbind(1))
    half = 1
    while half < HADAMARD_SIZE:
        stage = list(rows)
        for i in range(HADAMARD_SIZE):
            if not i & half:
                stage[i], stage[i + half] = rows[i] + rows[i + half], rows[i] - rows[i + half]
        rows = stage
        half *= 2
    return torch.stack(rows if finish is None else [finish(r) for r in rows], dim=1)


def _check_sign(sign: torch.Tensor | None) -> torch.Tensor:
    if sign is None:
        return torch.tensor(TE_WGRAD_SIGNS, dtype=torch.float32)
    sign = torch.as_tensor(sign, dtype=torch.float32).cpu()
    if sign.shape != (HADAMARD_SIZE,) or not bool(((sign == 1) | (sign == -1)).all()):
        raise ValueError(f"sign must be {HADAMARD_SIZE} entries of +-1, got {sign.tolist()}")
    return sign
