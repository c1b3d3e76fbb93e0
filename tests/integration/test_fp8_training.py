"""The FP8 recipes through the whole trainer: a tiny run per recipe next to bf16, exact resume after a
SIGKILL, FSDP2 on two ranks against one process, DeepSpeed, the weight cache, evaluation and the
Hugging Face export."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from nemofp4.evaluation import load_checkpoint_model
from nemofp4.training.metrics import read_metrics
from tests.conftest import launch, losses, relative_gap, train_here

from .test_eval_cli import ROOT
from .test_train import run_train, train_curve


@pytest.mark.parametrize("recipe", ["fp8", pytest.param("mxfp8", marks=pytest.mark.slow)])  # the same mechanism
def test_a_tiny_run_trains_next_to_bf16_and_resumes_bitwise_after_sigkill(tmp_path, recipe):
    """Loss falls within 2% of bf16's at every step (8-bit operands on the tiny model), and a run killed at
    step 4 and resumed with the same command repeats the uninterrupted run's losses and grad norms bit for
    bit: FP8 has no held reference and no random rounding, so the weights and optimizer are the state."""
    common = ["train.max_steps=8", "checkpoint.interval=4", "train.kernels=eager"]
    run_train(tmp_path / "bf16", "precision=bf16", *common)
    run_train(tmp_path / "straight", f"precision={recipe}", *common)
    run_train(tmp_path / "killed", f"precision={recipe}", *common, "debug.sigkill_at_step=4", expect_rc=-9)
    run_train(tmp_path / "killed", f"precision={recipe}", *common)
    bf16, straight, again = (train_curve(tmp_path / r) for r in ("bf16", "straight", "killed"))
    assert sorted(again) == list(range(1, 9))
    assert all(again[s] == straight[s] for s in range(5, 9))
    gap = relative_gap({s: v[0] for s, v in straight.items()}, {s: v[0] for s, v in bf16.items()}, range(1, 9))
    assert 0 < gap < 2e-2, gap
    assert straight[8][0] < straight[1][0]


def test_fsdp_two_ranks_match_one_process_with_fp8(tmp_path):
    """FP8's scales are per tensor (every rank quantizes its own micro-batch with its amax, as TE does
    without amax reduction), so two ranks of 2 sequences and one process of 4 see other scales for X and
    dY: the curves agree to that quantization difference, not bitwise."""
    common = ["precision=fp8", "train.max_steps=4", "checkpoint.interval=4", "train.kernels=eager"]
    launch(1, tmp_path / "one", *common, "train.micro_batch=4")
    launch(2, tmp_path / "two", *common, "distributed=fsdp", "train.micro_batch=2")
    one, two = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert sorted(two) == [1, 2, 3, 4]
    assert relative_gap(two, one, range(1, 5)) < 1e-2


# slow (two two-rank DeepSpeed launches, about a minute): FSDP2 carries the distributed path in CI
@pytest.mark.slow
def test_deepspeed_zero2_trains_and_resumes_fp8_exactly(tmp_path):
    pytest.importorskip("deepspeed")
    common = [
        "precision=mxfp8",
        "train.max_steps=4",
        "checkpoint.interval=2",
        "train.micro_batch=2",
        "distributed=deepspeed_zero2",
        "train.kernels=eager",
    ]
    launch(2, tmp_path / "straight", *common)
    launch(2, tmp_path / "resumed", *common, "debug.sigkill_at_step=2", expect_rc=1)
    launch(2, tmp_path / "resumed", *common)
    straight, resumed = losses(tmp_path / "straight"), losses(tmp_path / "resumed")
    assert [resumed[s] for s in (3, 4)] == [straight[s] for s in (3, 4)]


def test_weight_cache_evaluation_and_export_of_an_fp8_run(tmp_path):
    """Gradient accumulation with the step's weight cache equals the run without it bit for bit; the
    checkpoint evaluates under the recipe (the trainer's own validation loss) and exports to transformers."""
    transformers = pytest.importorskip("transformers")
    common = ["precision=fp8", "train.max_steps=2", "train.micro_batch=1", "train.kernels=eager"]
    cached = train_here(tmp_path / "cached", *common, "train.weight_cache=true")
    plain = train_here(tmp_path / "plain", *common, "train.weight_cache=false")
    assert cached["stop_reason"] == plain["stop_reason"] == "budget"
    assert losses(tmp_path / "cached") == losses(tmp_path / "plain")

    model, _, _ = load_checkpoint_model(tmp_path / "cached")
    assert sum(type(m).__name__ == "QuantLinear" for m in model.modules()) > 0
    out = tmp_path / "hf"
    proc = subprocess.run(
        [sys.executable, "-m", "nemofp4.cli.export", f"checkpoint={tmp_path / 'cached'}", f"out={out}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    ours, _, _ = load_checkpoint_model(tmp_path / "cached", precision="bf16")
    hf = transformers.NemotronHForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.randint(0, ours.config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (hf(ids).logits.float() - ours(ids)).abs().max().item() <= 1e-4
    assert read_metrics(tmp_path / "cached", "train")
