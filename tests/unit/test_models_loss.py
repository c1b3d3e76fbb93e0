"""The chunked LM-head cross-entropy equals the plain FP32 one (loss and every gradient) and
never keeps full-vocabulary logits for backward."""

import pytest
import torch
import torch.nn.functional as F

from nemofp4.models.loss import chunked_cross_entropy, head_cross_entropy


def _tiny_parallelized(precision: str):
    """The default (tiny) job's model in ``precision``, seeded, wrapped as the trainer wraps it on CPU."""
    from nemofp4.cli.train import compose_job_config
    from nemofp4.models import build_model
    from nemofp4.recipes import apply_recipe, recipe_from_config
    from nemofp4.training.parallel import parallelize

    cfg = compose_job_config([f"precision={precision}"])
    torch.manual_seed(0)
    model = build_model(cfg.model, device="meta")
    apply_recipe(model, recipe_from_config(cfg.precision), log=False)
    model = parallelize(model, cfg.distributed, device_type="cpu")
    model.to_empty(device="cpu")
    model.init_weights()
    return cfg, model


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
    from nemofp4.models import lm_loss

    cfg, model = _tiny_parallelized(precision)
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
        lm_loss(
            torch.nn.Linear(4, 4),
            torch.zeros(1, 2, dtype=torch.long),
            torch.zeros(1, 2, dtype=torch.long),
            head_chunk_tokens=8,
        )


# ---------------------------------------------------------------------------------------------- head precision
def _bf16_reference(h, w, labels):
    """float64 loss and gradients of the head with BF16 GEMM operands: h and W rounded to BF16 for the
    logits, and the logits' gradient (softmax - onehot, over the counted tokens) rounded to BF16 for the
    two backward GEMMs, every product and sum in float64."""
    bf = lambda t: t.detach().to(torch.bfloat16).double()  # noqa: E731
    h_TD, w_VD, labels_T = bf(h.reshape(-1, h.shape[-1])), bf(w), labels.reshape(-1)
    logits = h_TD @ w_VD.t()
    valid = labels_T != -100
    loss = F.cross_entropy(logits, labels_T)
    grad = (torch.softmax(logits, -1) - F.one_hot(labels_T.clamp(min=0), w.shape[0]).double()) * valid[:, None]
    grad_bf16 = (grad / valid.sum()).float().to(torch.bfloat16).double()
    return loss, (grad_bf16 @ w_VD).reshape(h.shape), grad_bf16.t() @ h_TD, (grad / valid.sum()).float().double()


@pytest.mark.parametrize("chunk_tokens", [8, 4096])
def test_bf16_head_is_bf16_gemms_with_fp32_accumulation(chunk_tokens):
    """The bf16 head equals, to FP32 accumulation error, a float64 head whose GEMM operands are BF16 (h
    and W for the logits, the logits' gradient for both backward GEMMs). The tolerances fail an FP32
    head (its loss is 1e-4 away) and a backward that keeps the logits' gradient in FP32 (2e-3 away)."""
    h, w, _, labels = _problem(tokens=64, width=48, vocab=1000)
    ref_loss, ref_gh, ref_gw, grad_fp32 = _bf16_reference(h, w, labels)
    loss = chunked_cross_entropy(h, w, labels, chunk_tokens=chunk_tokens, precision="bf16")
    gh, gw = torch.autograd.grad(loss, [h, w])
    assert loss.dtype == torch.float32 and gh.dtype == h.dtype and gw.dtype == w.dtype
    assert abs(loss.item() - ref_loss.item()) <= 1e-6 * ref_loss.item()
    assert _rel(gh, ref_gh) <= 5e-4 and _rel(gw, ref_gw) <= 5e-4
    # the same tolerances catch what a wrong implementation would do
    fp32_loss = chunked_cross_entropy(h, w, labels, chunk_tokens=chunk_tokens)
    assert abs(fp32_loss.item() - ref_loss.item()) > 1e-5 * ref_loss.item()
    bf = lambda t: t.detach().to(torch.bfloat16).double()  # noqa: E731
    unrounded_gh = (grad_fp32 @ bf(w)).reshape(h.shape)
    assert _rel(unrounded_gh, ref_gh) > 1e-3


def test_tf32_head_on_cpu_is_the_fp32_head_and_is_scoped():
    """CPU matmuls have no TF32 mode: a tf32 head computes what the fp32 head does, bit for bit, and CUDA's
    matmul precision is set only inside the head (what a CPU test can check; the TF32 products
    themselves need a GPU)."""
    h, w, _, labels = _problem()
    before = torch.backends.cuda.matmul.fp32_precision
    loss = chunked_cross_entropy(h, w, labels, chunk_tokens=8, precision="tf32")
    grads = torch.autograd.grad(loss, [h, w])
    assert torch.backends.cuda.matmul.fp32_precision == before
    want = chunked_cross_entropy(h, w, labels, chunk_tokens=8)
    assert loss.item() == want.item()
    assert all(torch.equal(a, b) for a, b in zip(grads, torch.autograd.grad(want, [h, w])))


def test_head_precision_is_checked_by_name():
    h, w, _, labels = _problem()
    with pytest.raises(ValueError, match=r"precision='fp16'; valid: fp32, tf32, bf16"):
        chunked_cross_entropy(h, w, labels, precision="fp16")
    with pytest.raises(ValueError, match="allow_tf32=True asks for a TF32 head but precision='bf16'"):
        chunked_cross_entropy(h, w, labels, precision="bf16", allow_tf32=True)
    from nemofp4.models import get_model_config

    with pytest.raises(ValueError, match="head_precision='half' must be one of fp32, tf32, bf16"):
        get_model_config("tiny", head_precision="half")


def _tiny_model_grads(precisions, *, chunk=32):
    from nemofp4.models import lm_loss

    cfg, model = _tiny_parallelized("bf16")
    ids = torch.randint(0, cfg.model.vocab_size, (2, 64), generator=torch.Generator().manual_seed(1))
    labels = ids.roll(-1, dims=1)
    out = {}
    for precision, chunk_tokens in precisions:
        model.zero_grad(set_to_none=True)
        loss = lm_loss(model, ids, labels, head_chunk_tokens=chunk_tokens, head_precision=precision)
        loss.backward()
        out[precision, chunk_tokens] = loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}
    return out


def test_tiny_model_gradient_parity_of_tf32_and_bf16_heads_against_fp32():
    """Every parameter gradient of the tiny model under each head precision, against the fp32 head:
    tf32 equal bit for bit on CPU (no TF32 there); bf16 within 1e-2 relative (norm-wise) per parameter,
    about 2.5 BF16 rounding steps (measured: 4.7e-3 at most, loss 2e-6 apart). Without chunks
    (head_chunk_tokens=0) a bf16 head runs the same fused head as one chunk of every token."""
    runs = _tiny_model_grads([("fp32", 32), ("tf32", 32), ("bf16", 32), ("bf16", 0), ("bf16", 128)])
    fp32_loss, fp32 = runs["fp32", 32]
    tf32_loss, tf32 = runs["tf32", 32]
    assert tf32_loss == fp32_loss and all(torch.equal(tf32[n], fp32[n]) for n in fp32)
    bf16_loss, bf16 = runs["bf16", 32]
    assert abs(bf16_loss - fp32_loss) <= 1e-5 * fp32_loss and bf16_loss != fp32_loss
    gaps = {n: _rel(bf16[n], fp32[n]) for n in fp32}
    assert max(gaps.values()) <= 1e-2, max(gaps.items(), key=lambda kv: kv[1])
    assert gaps["lm_head.weight"] > 0  # the bf16 head did run in BF16
    one_chunk_loss, one_chunk = runs["bf16", 0]
    all_tokens_loss, all_tokens = runs["bf16", 128]
    assert one_chunk_loss == all_tokens_loss and all(torch.equal(one_chunk[n], all_tokens[n]) for n in one_chunk)
