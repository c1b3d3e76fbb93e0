"""CUDA paths of the LM head's precisions (``model.head_precision``): the bf16 head's BF16 GEMMs with FP32
accumulation (both ways of accumulating the weight gradient), the tf32 head's TF32 products, and the fp32
head's strict FP32 whatever the process-wide matmul precision."""

import pytest
import torch

from nemofp4.models import loss as loss_module
from nemofp4.models.loss import chunked_cross_entropy
from tests.unit.test_models_loss import _bf16_reference, _problem, _rel

pytestmark = pytest.mark.gpu


def _cuda_problem():
    h, w, _, labels = _problem(tokens=256, width=128, vocab=4096)
    return h.detach().cuda().requires_grad_(), w.detach().cuda().requires_grad_(), labels.cuda(), (h, w, labels)


def _run(h, w, labels, precision, chunk_tokens=64):
    loss = chunked_cross_entropy(h, w, labels, chunk_tokens=chunk_tokens, precision=precision)
    return (loss, *torch.autograd.grad(loss, [h, w]))


@pytest.mark.parametrize("fused", [True, False], ids=["addmm-out-dtype", "fp32-product-added"])
def test_bf16_head_on_cuda_is_bf16_gemms_with_fp32_accumulation(monkeypatch, fused):
    """The CUDA bf16 head (BF16 GEMMs, FP32 output) against the float64 head of BF16 operands, with the bounds
    the CPU test holds its emulation to, and against that CPU emulation to FP32 summation-order error."""
    h, w, labels, cpu = _cuda_problem()
    if not fused:
        monkeypatch.setattr(loss_module, "_fused_bf16_addmm", False)
    loss, gh, gw = _run(h, w, labels, "bf16")
    ref_loss, ref_gh, ref_gw, _ = _bf16_reference(*cpu)
    assert loss.dtype == torch.float32 and gh.dtype == torch.float32 and gw.dtype == torch.float32
    assert abs(loss.item() - ref_loss.item()) <= 1e-6 * ref_loss.item()
    assert _rel(gh.cpu(), ref_gh) <= 5e-4 and _rel(gw.cpu(), ref_gw) <= 5e-4
    emulated = _run(*(t.detach().requires_grad_() if t.is_floating_point() else t for t in cpu), "bf16")
    for got, want in zip((loss, gh, gw), emulated):
        assert _rel(got.cpu(), want) <= 1e-5


def test_tf32_head_uses_tf32_and_fp32_head_stays_strict_under_a_global_tf32_setting():
    h, w, labels, cpu = _cuda_problem()
    reference = _run(*(t.detach().requires_grad_() if t.is_floating_point() else t for t in cpu), "fp32")  # CPU
    previous = torch.backends.cuda.matmul.fp32_precision
    try:
        torch.backends.cuda.matmul.fp32_precision = "tf32"  # a process-wide setting the fp32 head must ignore
        fp32 = _run(h, w, labels, "fp32")
        assert torch.backends.cuda.matmul.fp32_precision == "tf32"
    finally:
        torch.backends.cuda.matmul.fp32_precision = previous
    tf32 = _run(h, w, labels, "tf32")
    assert torch.backends.cuda.matmul.fp32_precision == previous
    for got, want in zip(fp32, reference):
        assert _rel(got.cpu(), want) <= 1e-5  # strict FP32
    gaps = [_rel(got.cpu(), want) for got, want in zip(tf32, reference)]
    assert max(gaps) <= 5e-3  # TF32 products: 10-bit mantissas
    if torch.cuda.get_device_capability() >= (8, 0):
        assert max(gaps[1:]) > 1e-5  # the TF32 tensor cores did run
