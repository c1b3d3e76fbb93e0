"""Multiple-choice scoring: lm-eval's request encoding, log-likelihoods against a float64
reference, order independence, the metrics, and the task files."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from nemofp4.data import load_tokenizer
from nemofp4.evaluation import (
    InferencePolicy,
    LoglikelihoodRequest,
    MultipleChoiceItem,
    PolicyForward,
    encode_request,
    load_task,
    run_task,
    score_requests,
)
from nemofp4.models import build_model, get_model_config
from nemofp4.recipes import apply_recipe, get_recipe

ROOT = Path(__file__).resolve().parents[2]
TASK = ROOT / "data" / "tasks" / "austen_cloze.jsonl"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(ROOT / "data" / "tokenizer")


def _model(recipe: str):
    model = build_model(get_model_config("tiny"), device="meta")
    apply_recipe(model, get_recipe(recipe), log=False)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    return model.eval()


def test_encode_request_follows_lm_eval(tokenizer):
    req = encode_request(tokenizer, "It is a truth universally", " acknowledged")
    whole = tokenizer.encode("It is a truth universally acknowledged")
    assert req.context_ids == tuple(tokenizer.encode("It is a truth universally"))
    assert req.context_ids + req.continuation_ids == tuple(whole)
    # Trailing spaces of the context move into the continuation.
    moved = encode_request(tokenizer, "It is a truth universally ", "acknowledged")
    assert moved == req
    # An empty context is the end-of-document token.
    empty = encode_request(tokenizer, "", "Emma")
    assert empty.context_ids == (tokenizer.eod_id,) and empty.continuation_ids == tuple(tokenizer.encode("Emma"))
    with pytest.raises(ValueError, match="empty continuation"):
        encode_request(tokenizer, "x", "")


def _reference_loglikelihood(model, req: LoglikelihoodRequest, max_length: int) -> float:
    """Step by step: one request alone, float64 log-softmax, token by token."""
    tokens = list(req.context_ids + req.continuation_ids)[-(max_length + 1) :]
    with torch.no_grad():
        logits = model(torch.tensor([tokens[:-1]])).double()[0]
    logprobs = torch.log_softmax(logits, dim=-1)
    n = min(len(req.continuation_ids), len(tokens) - 1)
    total = 0.0
    for k in range(n):
        position = len(tokens) - 1 - n + k
        total += logprobs[position, tokens[position + 1]].item()
    return total


def test_batched_scores_match_a_float64_single_request_reference(tokenizer):
    model = _model("bf16")
    texts = [
        ("Mr. Darcy", " was proud."),
        ("Emma Woodhouse, handsome, clever", " and rich"),
        ("The family of Dashwood", " had long been settled in Sussex."),
    ]
    requests = [encode_request(tokenizer, c, x) for c, x in texts]
    scores = score_requests(model, requests, batch_size=3, max_length=6)  # max_length=6 truncates the long ones
    for req, (ll, greedy) in zip(requests, scores):
        assert ll == pytest.approx(_reference_loglikelihood(model, req, 6), abs=1e-4)
        assert isinstance(greedy, bool)
    long_scores = score_requests(model, requests, batch_size=1, max_length=2048)
    for req, (ll, _) in zip(requests, long_scores):
        assert ll == pytest.approx(_reference_loglikelihood(model, req, 2048), abs=1e-4)


def test_scores_do_not_depend_on_request_order_even_with_batch_coupled_fp4(tokenizer):
    model = _model("ue5m3")
    items = load_task(TASK, limit=2)
    requests = [encode_request(tokenizer, it.context, " " + c) for it in items for c in it.choices]
    shuffled = list(range(len(requests)))
    random.Random(0).shuffle(shuffled)
    with PolicyForward(model, InferencePolicy(name="current")) as forward:
        base = score_requests(forward, requests, batch_size=3)
        again = score_requests(forward, [requests[i] for i in shuffled], batch_size=3)
    assert [again[shuffled.index(i)] for i in range(len(requests))] == base


class _UnigramForward:
    """A context-free 'model': the same next-token log-probabilities at every position."""

    def __init__(self, logprob_V: torch.Tensor):
        self.logprob_V = logprob_V

    def __call__(self, input_ids_BL):
        return self.logprob_V.expand(*input_ids_BL.shape, -1).clone()


def test_acc_and_acc_norm_pick_the_argmax_of_total_and_per_character_loglikelihood(tokenizer):
    vocab = tokenizer.vocab_size
    logprob_V = torch.log_softmax(torch.randn(vocab, generator=torch.Generator().manual_seed(3)), dim=-1)
    forward = _UnigramForward(logprob_V)
    items = load_task(TASK, limit=12)
    result = run_task(forward, tokenizer, items, batch_size=4, return_loglikelihoods=True)
    correct = correct_norm = 0
    for item, lls in zip(items, result["loglikelihoods"]):
        expected = []
        for choice in item.choices:
            req = encode_request(tokenizer, item.context, " " + choice)
            expected.append(sum(logprob_V[t].item() for t in req.continuation_ids))
        assert lls == pytest.approx(expected, abs=1e-4)
        correct += int(np.argmax(lls) == item.label)
        correct_norm += int(np.argmax(np.array(lls) / [len(c) for c in item.choices]) == item.label)
    assert result["acc"] == correct / 12 and result["acc_norm"] == correct_norm / 12
    # log p(" the") = -1 at every position: "the" scores -1 (-1/3 per character), "the the" -2 (-2/7 per
    # character), so acc picks the first choice and acc_norm the second.
    token = tokenizer.encode(" the")
    assert len(token) == 1 and tokenizer.encode(" the the") == token * 2
    p_V = torch.full((vocab,), (1 - math.exp(-1)) / (vocab - 1), dtype=torch.float64)
    p_V[token[0]] = math.exp(-1)
    item = MultipleChoiceItem(context="Yes", choices=("the", "the the"), label=1)
    scores = run_task(_UnigramForward(p_V.log().float()), tokenizer, [item], return_loglikelihoods=True)
    assert scores["loglikelihoods"][0] == pytest.approx([-1.0, -2.0], abs=1e-4)
    assert scores["acc"] == 0.0 and scores["acc_norm"] == 1.0


@pytest.mark.parametrize(
    "line, match",
    [
        ({"context": "a", "choices": ["x", "y"], "label": 2}, "label"),
        ({"context": "a", "choices": ["x"], "label": 0}, "at least 2"),
        ({"context": 3, "choices": ["x", "y"], "label": 0}, "context"),
        ({"context": "a", "choices": ["x", ""], "label": 0}, "non-empty"),
    ],
)
def test_bad_task_lines_are_named(tmp_path, line, match):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"context": "ok", "choices": ["a", "b"], "label": 0}) + "\n" + json.dumps(line) + "\n")
    with pytest.raises(ValueError, match=rf"bad.jsonl:2: .*{match}"):
        load_task(path)
    with pytest.raises(FileNotFoundError):
        load_task(tmp_path / "missing.jsonl")


def test_shipped_task_is_well_formed_and_rebuilds_byte_for_byte():
    items = load_task(TASK)
    assert len(items) == 120 and all(len(item.choices) == 4 for item in items)
    assert all(item.choices[item.label] not in item.choices[: item.label] for item in items)
    from tests.conftest import load_script

    builder = load_script("data/tasks/build_austen_cloze.py")
    rebuilt = "".join(json.dumps(item, ensure_ascii=False) + "\n" for item in builder.build())
    assert rebuilt == TASK.read_text(encoding="utf-8")
