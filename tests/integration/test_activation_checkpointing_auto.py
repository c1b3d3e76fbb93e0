"""distributed.activation_checkpointing=auto: the start-up plan picks the cheapest policy that fits,
every rank logs it, the run's config records it, and a resume on another device keeps it."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from nemofp4.checkpointing import TRAINER_STATE
from tests.integration.test_train import run_train

# The tiny model at seq_len 64, micro-batch 2 (test_train.FAST) plans ~0.060 GiB without
# checkpointing, ~0.059 GiB with attention, every_4 or every_3 blocks recomputed and ~0.055 GiB with
# the Mamba blocks: at 0.056 GiB and no reserve, mamba is the cheapest policy that fits; at 0.07
# GiB, none would be.
AUTO = ["precision=ue5m3", "distributed.activation_checkpointing=auto", "distributed.memory_reserve_gib=0"]


def _recorded(path) -> str:
    return OmegaConf.load(path).distributed.activation_checkpointing


@pytest.mark.slow  # three short runs (~1 min here); tests/unit/test_job_plan.py checks the logic by default
def test_auto_picks_the_cheapest_fitting_policy_and_a_resume_elsewhere_keeps_it(tmp_path):
    run_dir = tmp_path / "run"
    first = run_train(
        run_dir, *AUTO, "distributed.device_memory_gib=0.056", "train.max_steps=2", "checkpoint.interval=2"
    )
    assert "rank 0: distributed.activation_checkpointing=auto -> mamba (+" in first.stderr + first.stdout
    assert _recorded(run_dir / "config.yaml") == "mamba"
    state = torch.load(run_dir / "checkpoints" / "step-2" / TRAINER_STATE, weights_only=True)
    assert OmegaConf.create(state["config"]).distributed.activation_checkpointing == "mamba"

    # a device with more memory (0.07 GiB fits without checkpointing): the resumed run keeps mamba
    second = run_train(
        run_dir, *AUTO, "distributed.device_memory_gib=0.07", "train.max_steps=3", "checkpoint.interval=3"
    )
    log = second.stderr + second.stdout
    assert "auto -> mamba (kept from" in log and "resumed from" in log
    assert _recorded(run_dir / "config.yaml") == "mamba"

    # the user's own policy overrides the recorded one, and is recorded in turn
    third = run_train(
        run_dir, *AUTO[:1], "distributed.activation_checkpointing=full", "train.max_steps=4", "checkpoint.interval=4"
    )
    assert "resumed from" in third.stderr + third.stdout
    assert _recorded(run_dir / "config.yaml") == "full"


@pytest.mark.slow  # plans the tiny model at two micro-batches (~30 s here)
def test_auto_without_a_fitting_policy_names_what_fits(tmp_path):
    proc = run_train(tmp_path / "run", *AUTO, "distributed.device_memory_gib=0.0525", "train.max_steps=1", expect_rc=1)
    err = proc.stderr + proc.stdout
    assert "no policy fits 0.0525 GiB per GPU" in err
    assert "train.micro_batch=1 on 1 GPUs (the largest that fits)" in err
