"""The mamba_ssm stand-ins the plan measures a GPU run's Mamba blocks with: same outputs (shape and
dtype) as the torch path, saves exactly what ``mamba_chunk_scan_combined`` and ``causal_conv1d_fn``
save for our mixer's call (tests/gpu checks them against the kernels where they are installed), and
the plan counts far less for a Mamba block with them than with the torch scan."""

from __future__ import annotations

import torch

from nemofp4.models import get_model_config
from nemofp4.models.nemotron_h import model as mixer_module
from nemofp4.planning.measure import fake_run, measure_blocks
from nemofp4.planning.standins import mamba_kernel_standins, mamba_scan_path
from nemofp4.recipes import get_recipe


def _saved(fn, *args):
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append((tuple(t.shape), t.dtype)) or t, lambda t: t):
        out = fn(*args)
    return out, saved


def test_the_scan_stand_in_returns_what_the_torch_scan_returns_and_saves_what_the_kernel_saves():
    b, length, h, p, g, n, chunk = 1, 512, 8, 16, 2, 32, 128
    with fake_run(quantizer="eager", mamba_ssm=False):
        x = torch.empty(b, length, h, p, dtype=torch.bfloat16, requires_grad=True)
        dt = torch.empty(b, length, h, requires_grad=True)
        A = torch.empty(h, requires_grad=True)
        B = torch.empty(b, length, g, n, dtype=torch.bfloat16, requires_grad=True)
        C = torch.empty(b, length, g, n, dtype=torch.bfloat16, requires_grad=True)
        (y_ref, state_ref), _ = _saved(mixer_module.ssd_scan, x, dt, A, B, C, chunk)
        with mamba_kernel_standins():
            (y, state), saved = _saved(mixer_module.ssd_scan, x, dt, A, B, C, chunk)
        assert (y.shape, y.dtype, state.shape) == (y_ref.shape, y_ref.dtype, state_ref.shape)
        # MambaChunkScanCombinedFn.forward: save_for_backward(out, x, dt, dA_cumsum, A, B, C, ...)
        assert saved == [
            ((b, length, h, p), torch.bfloat16),
            ((b, length, h, p), torch.bfloat16),
            ((b, length, h), torch.float32),
            ((b, h, length // chunk, chunk), torch.float32),
            ((h,), torch.float32),
            ((b, length, g, n), torch.bfloat16),
            ((b, length, g, n), torch.bfloat16),
        ]
        y.float().sum().backward()
        assert x.grad.shape == x.shape and dt.grad.shape == dt.shape and B.grad.dtype == B.dtype
    assert mixer_module.ssd_scan.__name__ == "ssd_scan"  # restored


def test_the_conv_stand_in_saves_the_input_view_and_weights():
    with fake_run(quantizer="eager", mamba_ssm=False):
        proj = torch.empty(1, 64, 96, dtype=torch.bfloat16, requires_grad=True)
        x = proj[..., 16:80]  # a view of the in_proj output, as the mixer passes it
        weight, bias = torch.empty(64, 4, dtype=torch.bfloat16), torch.empty(64, dtype=torch.bfloat16)
        ref = mixer_module.causal_depthwise_conv1d(x, weight, bias)
        with mamba_kernel_standins():
            out, saved = _saved(mixer_module.causal_depthwise_conv1d, x, weight, bias)
        assert out.shape == ref.shape and out.dtype == ref.dtype
        assert saved == [((1, 64, 64), torch.bfloat16), ((64, 4), torch.bfloat16), ((64,), torch.bfloat16)]


def test_the_plan_counts_the_scan_the_run_uses():
    model = get_model_config("nemotron_h_8b_paper", hybrid_layer_pattern="M")
    saves = {
        scan: measure_blocks(
            model, get_recipe("bf16"), seq_len=2048, micro_batch=1, dtype=torch.bfloat16, mamba_ssm=scan == "mamba_ssm"
        )[0].saved_bytes
        for scan in ("torch", "mamba_ssm")
    }
    assert saves["mamba_ssm"] < 0.6 * saves["torch"]  # the torch scan saves every chunk's decay matrix
    from nemofp4.models.nemotron_h.ssd import mamba_ssm_available

    assert mamba_scan_path("auto") == ("mamba_ssm" if mamba_ssm_available() else "torch")
