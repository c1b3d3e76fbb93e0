"""Multiple-choice tasks scored by log-likelihood, in lm-eval's conventions.

A request is a (context, continuation) pair of strings. Encoding follows lm-eval's causal
models: trailing spaces of the context move to the continuation, the whole string is encoded
and split at the length of the encoded context, and an empty context is the EOD token. An
item's continuations are ``" " + choice`` (lm-eval's default ``target_delimiter``); ``acc``
picks the choice of highest log-likelihood and ``acc_norm`` the highest per character of the
choice (``np.argmax``, first of equals), as lm-eval's multiple_choice tasks do. The built-in
runner and the lm-eval adapter share :func:`score_requests`, so both give the same numbers.

A local task file is jsonl, one item per line: ``{"context": str, "choices": [str, ...], "label": int}``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from nemofp4.data import LoadedTokenizer

__all__ = [
    "TARGET_DELIMITER",
    "LoglikelihoodRequest",
    "MultipleChoiceItem",
    "encode_request",
    "load_task",
    "run_task",
    "score_requests",
]

TARGET_DELIMITER = " "


@dataclass(frozen=True, kw_only=True)
class MultipleChoiceItem:
    context: str
    choices: tuple[str, ...]
    label: int


@dataclass(frozen=True, kw_only=True)
class LoglikelihoodRequest:
    """Token ids of one (context, continuation) pair; the continuation is what is scored."""

    context_ids: tuple[int, ...]
    continuation_ids: tuple[int, ...]


def load_task(path: str | Path, limit: int = 0) -> list[MultipleChoiceItem]:
    """Read a jsonl task (the first ``limit`` items when > 0), checking every item."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"task file {path} not found (expected jsonl with context/choices/label)")
    items = []
    for line_no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{line_no}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{where}: not valid JSON ({err})") from err
        context, choices, label = row.get("context"), row.get("choices"), row.get("label")
        if not isinstance(context, str):
            raise ValueError(f"{where}: 'context' must be a string, got {type(context).__name__}")
        if not isinstance(choices, list) or len(choices) < 2 or not all(isinstance(c, str) and c for c in choices):
            raise ValueError(f"{where}: 'choices' must be a list of at least 2 non-empty strings, got {choices!r}")
        if isinstance(label, bool) or not isinstance(label, int) or not 0 <= label < len(choices):
            raise ValueError(f"{where}: 'label' must be an int in [0, {len(choices)}), got {label!r}")
        items.append(MultipleChoiceItem(context=context, choices=tuple(choices), label=label))
        if limit and len(items) == limit:
            break
    if not items:
        raise ValueError(f"task file {path} holds no items")
    return items


def encode_request(tokenizer: LoadedTokenizer, context: str, continuation: str) -> LoglikelihoodRequest:
    """Token ids of a (context, continuation) pair, by lm-eval's rules for causal models."""
    if not continuation:
        raise ValueError(f"empty continuation for context {context[:60]!r}: nothing to score")
    if context == "":
        ids = tokenizer.encode(continuation)
        return LoglikelihoodRequest(context_ids=(tokenizer.eod_id,), continuation_ids=tuple(ids))
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
    whole = tokenizer.encode(context + continuation)
    context_ids = tokenizer.encode(context)
    return LoglikelihoodRequest(context_ids=tuple(context_ids), continuation_ids=tuple(whole[len(context_ids) :]))


@torch.no_grad()
def score_requests(
    forward,
    requests: list[LoglikelihoodRequest],
    *,
    batch_size: int = 1,
    max_length: int = 2048,
    pad_id: int = 0,
    device: torch.device | str = "cpu",
) -> list[tuple[float, bool]]:
    """(log-likelihood of the continuation, whether it is the greedy continuation) per request.

    ``forward(input_ids [B, L]) -> logits [B, L, V]``. Inputs longer than ``max_length`` keep
    their last ``max_length`` tokens. Requests run in a canonical order (longest first, then by
    token ids) in batches of ``batch_size``, right-padded with ``pad_id``: the results depend only
    on the set of requests, not on the order they come in. With batch_size=1 each request is
    scored alone; with more, under current scaling, the sequences of a batch share each
    activation's tensor amax (padding included), as any batched FP4 inference would.
    """
    if batch_size < 1 or max_length < 2:
        raise ValueError(f"batch_size={batch_size} must be >= 1 and max_length={max_length} >= 2")
    inputs, n_scored = [], []
    for req in requests:
        if not req.continuation_ids or not req.context_ids:
            raise ValueError("every request needs a non-empty context and continuation (encode with encode_request)")
        tokens = (req.context_ids + req.continuation_ids)[-(max_length + 1) :]
        inputs.append(tokens[:-1])
        n_scored.append(min(len(req.continuation_ids), len(tokens) - 1))
    order = sorted(range(len(requests)), key=lambda i: (-len(inputs[i]), inputs[i], requests[i].continuation_ids))
    results: list[tuple[float, bool] | None] = [None] * len(requests)
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        width = len(inputs[chunk[0]])
        batch_BL = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        for row, i in enumerate(chunk):
            batch_BL[row, : len(inputs[i])] = torch.tensor(inputs[i])
        logprobs_BLV = F.log_softmax(forward(batch_BL.to(device)).float(), dim=-1).cpu()
        for row, i in enumerate(chunk):
            n, length = n_scored[i], len(inputs[i])
            target = torch.tensor(requests[i].continuation_ids[-n:])
            logprobs_NV = logprobs_BLV[row, length - n : length]
            ll = logprobs_NV.gather(-1, target[:, None]).squeeze(-1).double().sum().item()
            greedy = bool((logprobs_NV.argmax(-1) == target).all())
            results[i] = (ll, greedy)
    return results  # type: ignore[return-value]


def run_task(
    forward,
    tokenizer: LoadedTokenizer,
    items: list[MultipleChoiceItem],
    *,
    batch_size: int = 1,
    max_length: int = 2048,
    device: torch.device | str = "cpu",
    return_loglikelihoods: bool = False,
) -> dict:
    """The built-in runner: accuracy and length-normalized accuracy of ``items`` (and, with
    ``return_loglikelihoods``, every choice's log-likelihood, item by item)."""
    requests = [
        encode_request(tokenizer, item.context, TARGET_DELIMITER + choice) for item in items for choice in item.choices
    ]
    scores = score_requests(
        forward, requests, batch_size=batch_size, max_length=max_length, pad_id=tokenizer.eod_id, device=device
    )
    correct = correct_norm = 0
    k = 0
    per_item = []
    for item in items:
        lls = np.array([ll for ll, _ in scores[k : k + len(item.choices)]])
        per_item.append(lls.tolist())
        k += len(item.choices)
        lengths = np.array([float(len(choice)) for choice in item.choices])
        correct += int(np.argmax(lls) == item.label)
        correct_norm += int(np.argmax(lls / lengths) == item.label)
    n = len(items)
    result = {"acc": correct / n, "acc_norm": correct_norm / n, "num_items": n}
    if return_loglikelihoods:
        result["loglikelihoods"] = per_item
    return result
