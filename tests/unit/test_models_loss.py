"""The chunked LM-head cross-entropy equals the plain FP32 one (loss and every gradient) and
never keeps full-vocabulary logits for backward."""

import pytest
import torch
import torch.nn.functional as F

from nemofp4.models.loss import chunked_cross_entropy, head_cross_entropy


def _problem(tokens=37, width=24, vocab=101, dtype=torch.float32, seed=0, bias=False):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(1, tokens, width, generator=g) * 2).to(dtype).requires_grad_()
    w = (torch.randn(vocab, width, generator=g) * 0.5).requires_grad_()
    b = (torch.randn(vocab, generator=g)).requires_grad_() if bias else None
    labels = torch.randint(0, vocab, (1, tokens), generator=g)
    labels[0, ::5] = -100  # some positions are ignored
    return h, w, b, labels


def _reference(h, w, b, labels):
    logits = F.linear(h.float(), w, b).float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("chunk_tokens", [1, 8, 37, 4096])
@pytest.mark.parametrize("bias", [False, True])
def test_equals_unchunked_loss_and_gradients(chunk_tokens, bias):
    h, w, b, labels = _problem(bias=bias)
    ref = _reference(h, w, b, labels)
    ref_grads = torch.autograd.grad(ref, [t for t in (h, w, b) if t is not None])
    loss = chunked_cross_entropy(h, w, labels, bias_V=b, chunk_tokens=chunk_tokens)
    grads = torch.autograd.grad(loss, [t for t in (h, w, b) if t is not None])
    assert abs(loss.item() - ref.item()) <= 1e-6 * abs(ref.item())
    for got, want in zip(grads, ref_grads):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert _rel(got, want) <= 1e-6


def test_bf16_hidden_under_autocast_runs_an_fp32_head():
    """Under autocast the head still multiplies in FP32 (the paper's head); gradients come back in
    the hidden states' dtype."""
    h, w, _, labels = _problem(dtype=torch.bfloat16)
    ref = _reference(h, w, None, labels)
    ref_gh, ref_gw = torch.autograd.grad(ref, [h, w])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = chunked_cross_entropy(h, w, labels, chunk_tokens=8)
    gh, gw = torch.autograd.grad(loss, [h, w])
    assert loss.dtype == torch.float32 and abs(loss.item() - ref.item()) <= 1e-6 * ref.item()
    assert gh.dtype == torch.bfloat16 and _rel(gh, ref_gh) <= 1e-2  # one bf16 rounding of the same values
    assert _rel(gw, ref_gw) <= 1e-6


def test_head_module_form_matches_and_keeps_no_logits_for_backward():
    torch.manual_seed(0)
    head = torch.nn.Linear(32, 512, bias=False)
    h = torch.randn(2, 64, 32, requires_grad=True)
    labels = torch.randint(0, 512, (2, 64))
    saved: list[torch.Tensor] = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = head_cross_entropy(head, h, labels, chunk_tokens=16)
    plain = F.cross_entropy(head(h).reshape(-1, 512), labels.reshape(-1))
    assert abs(loss.item() - plain.item()) <= 1e-6 * plain.item()
    logits_bytes = 2 * 64 * 512 * 4
    not_params = [t for t in saved if t is not head.weight]
    saved_bytes = sum(t.numel() * t.element_size() for t in not_params)
    # hidden states, labels, one FP32 log-sum-exp per token and the count; nothing of vocabulary width
    assert saved_bytes == h.numel() * 4 + labels.numel() * 8 + 2 * 64 * 4 + 8  # + the token count
    assert saved_bytes < logits_bytes / 8
    assert all(512 not in t.shape for t in not_params)


def test_bad_arguments_are_named():
    h, w, _, labels = _problem()
    with pytest.raises(ValueError, match="chunk_tokens=0"):
        chunked_cross_entropy(h, w, labels, chunk_tokens=0)
    with pytest.raises(ValueError, match="do not match"):
        chunked_cross_entropy(h, w, labels[:, :-1])


def test_tf32_option_is_scoped_to_the_head():
    """allow_tf32 changes CUDA's FP32 matmul precision only inside the head and restores it after;
    the default keeps true FP32 (on CPU both give the same values)."""
    h, w, _, labels = _problem()
    before = torch.backends.cuda.matmul.fp32_precision
    loss = chunked_cross_entropy(h, w, labels, chunk_tokens=8, allow_tf32=True)
    loss.backward()
    assert torch.backends.cuda.matmul.fp32_precision == before
    assert loss.item() == chunked_cross_entropy(h, w, labels, chunk_tokens=8).item()


@pytest.mark.parametrize("precision", ["bf16", "ue5m3"])
def test_lm_loss_with_head_chunks_equals_the_full_logits_loss(precision):
    """The trainer's lm_loss with train.head_chunk_tokens: same loss and parameter gradients as the
    unchunked head on the tiny model, through the head method that parallelize() attaches. Under
    ue5m3 the gradients below the head pass FP4-quantized GEMMs, where a last-bit difference in dY can
    move a code, so there the head's and the final norm's gradients are compared."""
    from nemofp4.cli.train import compose_job_config
    from nemofp4.models import build_model, lm_loss
    from nemofp4.recipes import apply_recipe, recipe_from_config
    from nemofp4.training.parallel import parallelize

    cfg = compose_job_config([f"precision={precision}"])
    torch.manual_seed(0)
    model = build_model(cfg.model, device="meta")
    apply_recipe(model, recipe_from_config(cfg.precision), log=False)
    model = parallelize(model, cfg.distributed, device_type="cpu")
    model.to_empty(device="cpu")
    model.init_weights()
    ids = torch.randint(0, cfg.model.vocab_size, (2, 48), generator=torch.Generator().manual_seed(1))
    labels = ids.roll(-1, dims=1)

    def loss_and_grads(chunk):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(2)
        loss = lm_loss(model, ids, labels, head_chunk_tokens=chunk)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    full_loss, full_grads = loss_and_grads(0)
    chunk_loss, chunk_grads = loss_and_grads(32)
    assert abs(chunk_loss.item() - full_loss.item()) <= 1e-6 * abs(full_loss.item())
    compared = [n for n in full_grads if precision == "bf16" or n.startswith(("lm_head", "norm_f"))]
    assert len(compared) >= 2
    for name in compared:
        assert _rel(chunk_grads[name], full_grads[name]) <= 1e-5, name


def test_lm_loss_with_head_chunks_needs_the_head_method():
    from nemofp4.models import lm_loss

    with pytest.raises(ValueError, match="head_chunk_tokens=8 needs a model whose lm_head"):
        lm_loss(torch.nn.Linear(4, 4), torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 2, dtype=torch.long),
                head_chunk_tokens=8)
