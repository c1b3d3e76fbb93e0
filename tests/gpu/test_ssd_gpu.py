"""CUDA paths of the model: mamba_ssm's SSD kernel and causal_conv1d against our torch path."""

import pytest
import torch

from nemofp4.models import build_model, get_model_config
from nemofp4.models.nemotron_h import model as model_module
from nemofp4.models.nemotron_h.ssd import mamba_ssm_available, ssd_chunked, ssd_reference, ssd_scan

pytestmark = pytest.mark.gpu


def _inputs(device, seq_len=300, heads=8, head_dim=64, groups=2, state=64):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, seq_len, heads, head_dim, generator=g)
    dt = torch.exp(torch.empty(2, seq_len, heads).uniform_(-7.0, -2.3, generator=g))
    A = -torch.linspace(1.0, 16.0, heads)
    B = torch.randn(2, seq_len, groups, state, generator=g)
    C = torch.randn(2, seq_len, groups, state, generator=g)
    s0 = torch.randn(2, heads, head_dim, state, generator=g)
    return [t.to(device) for t in (x, dt, A, B, C, s0)]


@pytest.mark.skipif(not mamba_ssm_available(), reason="mamba_ssm not installed")
def test_mamba_ssm_kernel_matches_reference():
    x, dt, A, B, C, s0 = _inputs("cuda")
    y, state = ssd_scan(x, dt, A, B, C, 128, s0, impl="mamba_ssm")
    y_ref, state_ref = ssd_reference(*(t.cpu() for t in (x, dt, A, B, C, s0)))
    assert (y.cpu().double() - y_ref).abs().max() / y_ref.abs().max() <= 1e-3
    assert (state.cpu().double() - state_ref).abs().max() / state_ref.abs().max() <= 1e-3


def test_torch_scan_on_cuda_matches_cpu():
    inputs = _inputs("cuda")
    y, state = ssd_chunked(*inputs[:5], 128, inputs[5])
    y_cpu, state_cpu = ssd_chunked(*(t.cpu() for t in inputs[:5]), 128, inputs[5].cpu())
    assert (y.cpu() - y_cpu).abs().max() / y_cpu.abs().max() <= 1e-4


def test_model_on_cuda_matches_cpu():
    torch.manual_seed(0)
    cpu = build_model(get_model_config("tiny"))
    gpu = build_model(get_model_config("tiny"), device="cuda")
    gpu.load_state_dict(cpu.state_dict())
    ids = torch.randint(0, cpu.config.vocab_size, (2, 200))
    with torch.no_grad():
        out_cpu, out_gpu = cpu(ids), gpu(ids.cuda()).cpu()
    assert (out_cpu - out_gpu).abs().max() <= 1e-3 * out_cpu.abs().max()
    print(
        "causal_conv1d kernel:",
        model_module._causal_conv1d_fn is not None,
        "mamba_ssm:",
        mamba_ssm_available(),
    )
