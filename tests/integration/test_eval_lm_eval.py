"""The lm-eval adapter: the shipped local task through lm_eval's own Python API (offline) gives
the built-in runner's log-likelihoods and accuracies exactly."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from nemofp4.data import load_tokenizer
from nemofp4.evaluation import InferencePolicy, PolicyForward, load_task, run_task
from nemofp4.models import build_model, get_model_config
from nemofp4.recipes import apply_recipe, get_recipe

lm_eval = pytest.importorskip("lm_eval")

ROOT = Path(__file__).resolve().parents[2]
TASK = ROOT / "data" / "tasks" / "austen_cloze.jsonl"
LIMIT = 6


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def fp4_model():
    model = build_model(get_model_config("tiny"), device="meta")
    apply_recipe(model, get_recipe("ue5m3"), log=False)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    return model.eval()


def _lm_eval_run(lm, task_dir: Path, task: str, limit: int = LIMIT):
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(
        model=lm,
        tasks=[task],
        task_manager=TaskManager(include_path=str(task_dir), include_defaults=False),
        limit=limit,
        bootstrap_iters=0,
        log_samples=True,
    )


def test_local_task_through_lm_eval_matches_the_builtin_runner(fp4_model):
    from nemofp4.evaluation.lm_eval_adapter import LOCAL_TASKS_DIR, NemoFP4LM

    tokenizer = load_tokenizer(ROOT / "data" / "tokenizer")
    items = load_task(TASK, LIMIT)
    # Delayed replay depends on the order of the batches: both paths must run the same ones.
    inference = InferencePolicy(name="delayed", delay=3)
    with PolicyForward(fp4_model, inference) as forward:
        builtin = run_task(forward, tokenizer, items, batch_size=6, return_loglikelihoods=True)
    with PolicyForward(fp4_model, inference) as forward:
        out = _lm_eval_run(
            NemoFP4LM(forward=forward, tokenizer=tokenizer, batch_size=6), LOCAL_TASKS_DIR, "austen_cloze"
        )
    metrics = out["results"]["austen_cloze"]
    assert metrics["acc,none"] == builtin["acc"] and metrics["acc_norm,none"] == builtin["acc_norm"]
    samples = sorted(out["samples"]["austen_cloze"], key=lambda s: s["doc_id"])
    assert len(samples) == LIMIT
    for sample, lls in zip(samples, builtin["loglikelihoods"]):
        assert [float(resp[0]) for resp in sample["filtered_resps"]] == lls  # bit for bit


def test_registered_as_nemofp4_and_rejects_generation(tmp_path, fp4_model):
    from lm_eval.api.registry import get_model

    from nemofp4.evaluation.lm_eval_adapter import NemoFP4LM, write_local_task_config

    assert get_model("nemofp4") is NemoFP4LM
    tokenizer = load_tokenizer(ROOT / "data" / "tokenizer")
    lm = NemoFP4LM(forward=fp4_model, tokenizer=tokenizer, batch_size=12)
    with pytest.raises(NotImplementedError, match="does not generate"):
        lm.generate_until([])
    # A user's own jsonl task, through a generated config, scores like the shipped one.
    name = write_local_task_config(TASK, tmp_path, name="my_cloze")
    out = _lm_eval_run(lm, tmp_path, name, limit=3)
    builtin = run_task(fp4_model, tokenizer, load_task(TASK, 3), batch_size=12)
    assert out["results"]["my_cloze"]["acc,none"] == builtin["acc"]
    assert os.environ["HF_DATASETS_OFFLINE"] == "1"
