"""The plan's mamba_ssm stand-ins save what the CUDA kernels save: the tensors the real
``mamba_chunk_scan_combined`` and ``causal_conv1d_fn`` keep for backward, for the mixer's own call,
have the stand-ins' shapes and dtypes (skipped without the kernels)."""

import pytest
import torch

from nemofp4.models.nemotron_h import model as mixer_module
from nemofp4.models.nemotron_h.ssd import mamba_ssm_available
from nemofp4.planning.standins import mamba_kernel_standins

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (torch.cuda.is_available() and mamba_ssm_available()), reason="needs CUDA and mamba_ssm"),
]


def _saved(fn, *args):
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append((tuple(t.shape), t.dtype)) or t, lambda t: t):
        fn(*args)
    return sorted(saved, key=str)


def test_the_stand_ins_save_what_the_kernels_save():
    b, length, h, p, g, n, chunk, width = 1, 1024, 16, 64, 2, 64, 256, 4
    conv_dim = h * p + 2 * g * n
    proj = torch.randn(b, length, conv_dim + 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(conv_dim, width, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(conv_dim, device="cuda", dtype=torch.bfloat16)
    x = proj[..., 32 : 32 + conv_dim]
    real = _saved(mixer_module.causal_depthwise_conv1d, x, weight, bias)
    with mamba_kernel_standins():
        assert _saved(mixer_module.causal_depthwise_conv1d, x, weight, bias) == real
    xs = torch.randn(b, length, h, p, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dt = torch.rand(b, length, h, device="cuda", requires_grad=True)
    A = -torch.rand(h, device="cuda", requires_grad=True)
    B = torch.randn(b, length, g, n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    C = torch.randn(b, length, g, n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    real = _saved(mixer_module.ssd_scan, xs, dt, A, B, C, chunk)
    with mamba_kernel_standins():
        assert _saved(mixer_module.ssd_scan, xs, dt, A, B, C, chunk) == real
