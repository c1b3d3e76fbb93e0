"""Held tensor references in checkpoints: independent of wrappers (activation checkpointing, compile)
and of the data-parallel layout (the same global batch split over 1 or 2 gloo ranks)."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import curve, held_references, launch, losses, train_here

UE5M3 = ["precision=ue5m3", "checkpoint.keep_last_k=0"]


def assert_bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], keys=None) -> None:
    assert a.keys() == b.keys()
    for key in keys if keys is not None else a:
        assert torch.equal(a[key], b[key]), (key, a[key], b[key])


@pytest.mark.slow  # three runs, two of them on 2 ranks; the fast check of the DCP entry is in tests/unit
def test_split_batch_holds_the_same_references_and_another_world_size_keeps_them(tmp_path):
    """1 process x micro-batch 8 and 2 FSDP2 ranks x 4 see the same 8 sequences at step 1. Forward
    operands (x, w) are RNE-quantized row by row, so their references agree bitwise; dY is the
    gradient of the global mean loss on every rank, so the last block's dY references (upstream of
    any stochastic rounding) agree bitwise too. Deeper dY references carry the per-rank SR draws.
    The 2-rank checkpoint then resumes on 1 process and holds the very same references."""
    common = [*UE5M3, "train.global_batch=8", "train.max_steps=2", "checkpoint.interval=1"]
    launch(1, tmp_path / "one", *common, "train.micro_batch=8", "train.max_steps=1")
    launch(
        2, tmp_path / "two", *common, "distributed=fsdp", "train.micro_batch=4", "debug.sigkill_at_step=1", expect_rc=1
    )
    one, two = (held_references(tmp_path / run / "checkpoints" / "step-1") for run in ("one", "two"))
    assert losses(tmp_path / "two")[1] == pytest.approx(losses(tmp_path / "one")[1], rel=1e-6)
    assert len(one) == 2 * 3 * 14  # (amax, refresh_step) x (x, w, dy) x the tiny model's 14 FP4 linears
    assert {int(v) for k, v in one.items() if k.endswith("refresh_step")} == {1}
    forward = [k for k in one if ".x." in k or ".w." in k]
    last_block_dy = [k for k in one if k.startswith("layers.5.") and ".dy." in k]
    assert forward and last_block_dy
    assert_bitwise(one, two, forward + last_block_dy)  # dY 2x on 2 ranks if each backpropagated its own mean
    # resume the 2-rank checkpoint on 1 process: step 2 holds (D = 50) what the 2 ranks sampled
    launch(1, tmp_path / "two", *common, "train.micro_batch=4")
    assert_bitwise(two, held_references(tmp_path / "two" / "checkpoints" / "step-2"))


def _resume_with(tmp_path, toggle: str, *extra: str, steps: int = 4) -> tuple[dict[int, float], dict[int, float]]:
    """An uninterrupted run, and one checkpointed at step 2 without the wrapper and resumed with it
    (module names now carry `_checkpoint_wrapped_module` / `_orig_mod`)."""
    common = [*UE5M3, f"train.max_steps={steps}", "checkpoint.interval=2", "train.micro_batch=2", *extra]
    launch(1, tmp_path / "straight", *common)
    launch(1, tmp_path / "moved", *common, "debug.sigkill_at_step=2", expect_rc=-9)
    launch(1, tmp_path / "moved", *common, f"{toggle}=true")
    straight, moved = losses(tmp_path / "straight"), losses(tmp_path / "moved")
    assert sorted(moved) == list(range(1, steps + 1))
    # D = 50: the last step still holds the step-1 references, restored (not re-sampled) bitwise
    assert_bitwise(
        held_references(tmp_path / "straight" / "checkpoints" / f"step-{steps}"),
        held_references(tmp_path / "moved" / "checkpoints" / f"step-{steps}"),
    )
    return straight, moved


def test_resume_with_activation_checkpointing_toggled_continues_bitwise(tmp_path):
    # eager quantizers: the same bits as the compiled ones (tests/integration/test_train.py), no compile time;
    # 2 micro-batches per step: the recomputed forward of each runs between the SR draws of backward
    straight, moved = _resume_with(tmp_path, "distributed.activation_checkpointing", "train.kernels=eager", steps=3)
    assert moved[3] == straight[3]
    # evaluation reads the references through the trainer's path (under the run's own recipe only)
    from nemofp4.evaluation import load_checkpoint_model
    from nemofp4.quant import reference_state_dict

    step_3 = tmp_path / "moved" / "checkpoints" / "step-3"
    model, _, _ = load_checkpoint_model(step_3, log_loaded=False)
    assert_bitwise(reference_state_dict(model), held_references(step_3))
    assert reference_state_dict(load_checkpoint_model(step_3, precision="nvfp4_delayed", log_loaded=False)[0]) == {}


@pytest.mark.slow  # compiling the blocks takes minutes on a loaded CPU
def test_resume_with_compile_toggled_continues_bitwise(tmp_path):
    straight, moved = _resume_with(tmp_path, "distributed.compile")
    # step 3 depends only on the restored weights and references (the compiled forward is bitwise the
    # eager one); Inductor's fused backward sums in another order, and the FP4 roundings of step 4 amplify
    # that fp32 difference (measured 8e-5 relative)
    assert moved[3] == straight[3]
    assert moved[4] == pytest.approx(straight[4], rel=1e-3)


@pytest.mark.slow  # two runs; tests/unit/test_quant_state.py converts each older layout fast
def test_an_older_checkpoint_with_per_rank_wrapper_named_references_resumes_exactly(tmp_path, monkeypatch):
    """Checkpoints written before the references were module state kept them in each rank's file, under
    the module names of the run (here with activation checkpointing's wrapper segment), and their
    trainer state named no 'quant_state'. Such a checkpoint, written here by the current trainer in
    that layout, still resumes, with its references."""
    from nemofp4.quant import reference_state_dict, without_quant_state
    from nemofp4.training.trainer import Trainer

    common = [
        "precision=ue5m3",
        "train.kernels=eager",
        "train.max_steps=3",
        "checkpoint.interval=2",
        "checkpoint.keep_last_k=0",
    ]
    new_dcp_state, new_trainer_state, new_rank_state = Trainer._dcp_state, Trainer._trainer_state, Trainer._rank_state

    def old_dcp_state(self):
        state = new_dcp_state(self)
        return {**state, "model": without_quant_state(state["model"])}

    def old_trainer_state(self):
        return {k: v for k, v in new_trainer_state(self).items() if k != "quant_state"}

    def old_rank_state(self):
        wrapped = {
            k.replace(".mixer.", "._checkpoint_wrapped_module.mixer."): v
            for k, v in reference_state_dict(self.model).items()
        }
        return {**new_rank_state(self), "references": wrapped}

    with monkeypatch.context() as patch:
        patch.setattr(Trainer, "_dcp_state", old_dcp_state)
        patch.setattr(Trainer, "_trainer_state", old_trainer_state)
        patch.setattr(Trainer, "_rank_state", old_rank_state)
        train_here(tmp_path / "old", *common)
    step_2 = tmp_path / "old" / "checkpoints" / "step-2"
    assert not held_references(step_2)
    from nemofp4.checkpointing import load_tensors
    from nemofp4.evaluation import load_checkpoint_model

    saved = load_tensors(step_2 / "rank" / "rank-00000.pt")["references"]
    evaluated = reference_state_dict(load_checkpoint_model(step_2, log_loaded=False)[0])
    assert_bitwise(evaluated, {k.replace("._checkpoint_wrapped_module", ""): v for k, v in saved.items()})
    train_here(tmp_path / "resumed", *common, f"resume={step_2}")
    old, resumed = curve(tmp_path / "old"), curve(tmp_path / "resumed")
    assert sorted(resumed) == [3]
    assert resumed[3] == old[3]  # loss and gradient norm, bitwise
    assert {
        int(v)
        for k, v in held_references(tmp_path / "resumed" / "checkpoints" / "step-3").items()
        if k.endswith("refresh_step")
    } == {1}  # the step-1 references, restored, not re-sampled


@pytest.mark.slow  # three two-rank launches; tests/unit/test_quant_state.py loads each rank's own references fast
def test_ranks_that_hold_their_own_references_resume_each_its_own(tmp_path):
    """distributed.reduce_references=false: each rank samples its own references from its own data; the
    model state keeps one rank's, and each rank's file its own, which a resume holds again."""
    from nemofp4.checkpointing import load_tensors

    common = [
        *UE5M3,
        "distributed=fsdp",
        "distributed.reduce_references=false",
        "train.max_steps=3",
        "checkpoint.interval=2",
        "train.micro_batch=2",
    ]
    launch(2, tmp_path / "straight", *common)
    launch(2, tmp_path / "moved", *common, "debug.sigkill_at_step=2", expect_rc=1)
    ranks = [
        load_tensors(tmp_path / "moved" / "checkpoints" / "step-2" / "rank" / f"rank-0000{r}.pt")["references"]
        for r in (0, 1)
    ]
    assert ranks[0].keys() == ranks[1].keys() and any(not torch.equal(ranks[0][k], ranks[1][k]) for k in ranks[0])
    launch(2, tmp_path / "moved", *common)
    assert losses(tmp_path / "moved")[3] == losses(tmp_path / "straight")[3]


# each bad value is a fast unit test (tests/unit/test_reference_load_checks.py); here the trainer's and
# evaluation's loads name the checkpoint, one in CI
@pytest.mark.parametrize(
    "key, value, message",
    [
        (
            "x.refresh_step",
            10**9,
            r"x\.refresh_step=1000000000 \(valid: 0 \(empty\) or a step from 1 to the checkpoint's "
            r"step 2\)",
        ),
        pytest.param("x.amax", 0.0, r"x\.amax=0 with x\.refresh_step=1 ", marks=pytest.mark.slow),
        pytest.param("x.amax", -1.0, r"x\.amax=-1\.0 ", marks=pytest.mark.slow),
    ],
)
def test_a_checkpoint_with_out_of_range_references_is_refused_naming_it_the_module_and_the_key(
    tmp_path, monkeypatch, key, value, message
):
    """A writer's bug with consistent checksums: a refresh step of 1e9 froze the reference for the rest of the
    run (and was saved again), an amax of 0 trained off with no message, -1 stopped a step later blaming the
    head's gradient. The resume now stops before the first step, naming the checkpoint, the module and the
    key; evaluation's load of it too."""
    from nemofp4.evaluation import load_checkpoint_model
    from nemofp4.training.trainer import Trainer

    common = ["precision=ue5m3", "train.kernels=eager", "checkpoint.interval=2"]
    module = "layers.0.mixer.in_proj"
    real = Trainer._dcp_state

    def written_wrong(self):
        state = real(self)
        extra = state["model"][f"{module}._extra_state"]
        extra[key] = torch.tensor(value, dtype=extra[key].dtype)
        return state

    with monkeypatch.context() as patch:
        patch.setattr(Trainer, "_dcp_state", written_wrong)
        train_here(tmp_path, *common, "train.max_steps=2")
    step_2 = tmp_path / "checkpoints" / "step-2"
    expected = rf"checkpoint {step_2}: the held FP4 reference of module {module} is invalid: {message}"
    with pytest.raises(ValueError, match=expected):
        train_here(tmp_path, *common, "train.max_steps=4")
    assert not (tmp_path / "run.lock").exists()
    with pytest.raises(ValueError, match=expected):
        load_checkpoint_model(step_2, log_loaded=False)
