"""Held references as module state: wrappers change no key, the model state holds them once (FSDP2
too), and checkpoints of the older layouts convert through one path."""

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from nemofp4.quant import (
    HeldReference,
    QuantTraining,
    QuantTrainingConfig,
    canonical_fqn,
    load_reference_state_dict,
    quant_linears,
    reference_state_dict,
    without_quant_state,
)
from nemofp4.quant.state import set_held_reference_reduce_group, set_quant_backend
from nemofp4.training.parallel import apply_activation_checkpointing, apply_compile
from tests.conftest import fresh_standin as _fresh_auto
from tests.conftest import train_standin as _train

pytestmark = pytest.mark.usefixtures("one_thread")


def _fresh():
    """The stand-in model under ue5m3 with the eager quantizers: the same bits, nothing to compile."""
    model, optimizer = _fresh_auto()
    set_quant_backend(model, "eager")
    return model, optimizer


@pytest.mark.parametrize(
    "wrapped, canonical",
    [
        ("layers.0._checkpoint_wrapped_module._orig_mod.mixer.in_proj", "layers.0.mixer.in_proj"),
        ("_fsdp_wrapped_module.layers.3._fsdp_wrapped_module.mixer.out_proj", "layers.3.mixer.out_proj"),
        ("module.layers.1.mixer.up_proj", "layers.1.mixer.up_proj"),  # a DeepSpeed engine's root
        ("layers.2.module.fc", "layers.2.module.fc"),  # only the root's `module.` is the engine's
        ("lm_head", "lm_head"),
    ],
)
def test_canonical_fqn_drops_wrapper_segments(wrapped, canonical):
    assert canonical_fqn(wrapped) == canonical


def _wrapped(kind: str):
    model, optimizer = _fresh()
    if kind in ("ac", "ac+compile"):
        apply_activation_checkpointing(model)
    if kind in ("compile", "ac+compile"):
        apply_compile(model)  # wraps only: nothing is compiled before a call
    return model, optimizer


def _references(state: dict) -> dict[str, dict[str, torch.Tensor]]:
    """The FP4 linears' extra state in a model state dict."""
    return {k: v for k, v in state.items() if k.endswith("._extra_state")}


def test_held_references_are_module_state_under_the_same_keys_with_any_wrappers():
    model, optimizer = _fresh()
    _train(model, optimizer, range(1, 3))
    saved = _references(get_model_state_dict(model))
    assert len(saved) == len(quant_linears(model)) and all(v for v in saved.values())
    assert without_quant_state(get_model_state_dict(model)).keys() == dict(model.named_parameters()).keys()
    for kind in ("ac", "compile", "ac+compile"):
        other, _ = _wrapped(kind)
        assert any("_checkpoint_wrapped_module" in n or "_orig_mod" in n for n, _ in other.named_modules())
        state = get_model_state_dict(other)
        assert _references(state).keys() == saved.keys(), kind
        state.update(saved)
        set_model_state_dict(other, state)
        assert_equal(reference_state_dict(other), reference_state_dict(model))


def test_an_older_checkpoint_with_wrapper_names_restores_by_canonical_name():
    model, optimizer = _fresh()
    _train(model, optimizer, range(1, 2))
    legacy = {
        k.replace("layers.0.", "layers.0._checkpoint_wrapped_module."): v
        for k, v in reference_state_dict(model).items()
    }
    assert legacy.keys() != reference_state_dict(model).keys()
    fresh, _ = _fresh()
    load_reference_state_dict(fresh, legacy)
    assert_equal(reference_state_dict(fresh), reference_state_dict(model))


def test_an_empty_reference_is_saved_as_step_zero_and_restored_empty():
    model, _ = _fresh()
    state = {f"{fqn}.{k}": v for fqn, m in quant_linears(model) for k, v in m.get_extra_state().items()}
    assert state and {int(v) for k, v in state.items() if k.endswith("refresh_step")} == {0}
    assert {float(v) for k, v in state.items() if k.endswith("amax")} == {0.0}
    set_model_state_dict(model, get_model_state_dict(model))
    assert reference_state_dict(model) == {}


def assert_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a and a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]


def _save_on_two_ranks(rank: int, world: int, folder: str) -> None:
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{folder}/init", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        model, _ = _fresh()
        set_held_reference_reduce_group(model, dist.group.WORLD)
        with torch.no_grad():  # rank-local data: the reduced references are the max over both ranks
            model.embeddings.weight.mul_(1.0 + rank)
        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
        _train(model, torch.optim.AdamW(model.parameters(), lr=1e-2), range(1, 2))
        dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=f"{folder}/ckpt")
        torch.save(reference_state_dict(model), f"{folder}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_references_saved_by_two_fsdp2_ranks_load_in_one_process_bitwise():
    """The model state of two FSDP2 ranks keeps one copy of the replicated references; a run at another
    world size reads them whole, with the weights."""
    with tempfile.TemporaryDirectory() as folder:
        mp.start_processes(_save_on_two_ranks, args=(2, folder), nprocs=2, join=True, start_method="spawn")
        per_rank = [torch.load(os.path.join(folder, f"rank{r}.pt"), weights_only=True) for r in (0, 1)]
        assert_equal(per_rank[0], per_rank[1])  # one set of references
        model, _ = _fresh()
        state = get_model_state_dict(model)
        with pytest.warns(UserWarning, match="single process"):
            dcp.load({"model": state}, checkpoint_id=os.path.join(folder, "ckpt"), no_dist=True)
        set_model_state_dict(model, state)
        assert_equal(reference_state_dict(model), per_rank[0])


def _write_old_layout(model, folder: str, layout: str) -> dict:
    """A checkpoint as the trainer wrote them before references were module state: the model state
    without them, and the references in a "quant" DCP entry ('dcp': canonical names, every reference
    with refresh step 0 where empty) or in each rank's file ('per_rank': the run's module names, here
    activation checkpointing's); returns (trainer state, rank state)."""
    saved = {f"{fqn}.{k}": v for fqn, m in quant_linears(model) for k, v in m.get_extra_state().items()}
    state = {"model": without_quant_state(get_model_state_dict(model))}
    rank_state = {}
    if layout == "dcp":
        state["quant"] = saved
    else:
        rank_state["references"] = {
            k.replace(".mixer.", "._checkpoint_wrapped_module.mixer."): v
            for k, v in reference_state_dict(model).items()
        }
    with pytest.warns(UserWarning, match="single process"):
        dcp.save(state, checkpoint_id=folder, no_dist=True)
    return {"quant_state": layout} if layout else {}, rank_state


def _resume(folder: str, trainer_state: dict, rank_state: dict, *, restore: bool = True):
    """The trainer's resume of a checkpoint into a model wrapped as another run wraps it (activation
    checkpointing and compile: its strict model-state load names every module's extra state)."""
    model, _ = _wrapped("ac+compile")
    quant = QuantTraining(model, QuantTrainingConfig(kernels="eager", restore_references=restore))
    state = {"model": get_model_state_dict(model)}

    def read(state):
        with pytest.warns(UserWarning, match="single process"):
            dcp.load(state, checkpoint_id=folder, no_dist=True)

    quant.read_checkpoint(state, read, trainer_state=trainer_state, rank_state=rank_state)
    set_model_state_dict(model, state["model"])
    return model


@pytest.mark.parametrize("layout", ["dcp", "per_rank", None])  # None: before the layout was recorded
def test_older_checkpoint_layouts_resume_with_their_references_through_one_conversion(layout, tmp_path):
    model, optimizer = _fresh()
    _train(model, optimizer, range(1, 3))
    trainer_state, rank_state = _write_old_layout(model, str(tmp_path), layout)
    resumed = _resume(str(tmp_path), trainer_state, rank_state)
    assert_equal(reference_state_dict(resumed), reference_state_dict(model))
    weights = [without_quant_state(get_model_state_dict(m)) for m in (resumed, model)]
    assert_equal(*weights)
    assert reference_state_dict(_resume(str(tmp_path), trainer_state, rank_state, restore=False)) == {}


def test_the_current_layout_resumes_the_module_state_and_each_ranks_own_references(tmp_path):
    model, optimizer = _fresh()
    _train(model, optimizer, range(1, 3))
    quant = QuantTraining(model, QuantTrainingConfig(kernels="eager"))
    with pytest.warns(UserWarning, match="single process"):
        dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=str(tmp_path), no_dist=True)
    trainer_state = quant.trainer_entries()
    assert_equal(
        reference_state_dict(_resume(str(tmp_path), trainer_state, quant.rank_entries())), reference_state_dict(model)
    )
    assert reference_state_dict(_resume(str(tmp_path), trainer_state, {}, restore=False)) == {}
    # ranks that hold their own references (distributed.reduce_references=false) keep them in their files
    own = {k: v * 2 if k.endswith("amax") else v for k, v in reference_state_dict(model).items()}
    assert_equal(reference_state_dict(_resume(str(tmp_path), trainer_state, {"references": own})), own)


def test_the_fp4_op_gets_values_and_the_state_not_the_module(monkeypatch):
    import dataclasses

    from nemofp4.quant import linear, linear_op

    model, optimizer = _fresh()
    _train(model, optimizer, range(1, 2))
    seen, real = [], linear_op._fp4_linear

    def spy(*args):
        seen.append(args)
        return real(*args)

    monkeypatch.setattr(linear_op, "_fp4_linear", spy)  # the forward program, op or not
    _train(model, optimizer, range(2, 3))
    assert len(seen) == len(quant_linears(model)) > 0  # one call per FP4 linear
    for args in seen:
        assert not any(isinstance(a, torch.nn.Module) for a in args)
        state = args[3]
        assert isinstance(state, linear.QuantLinearState)
        call = state.call(args[0].device, training=args[4], compute_dtype=args[5])
        hash(call)
        with pytest.raises(dataclasses.FrozenInstanceError):
            call.training = False


def test_nonfinite_reports_name_the_unwrapped_module():
    from nemofp4.training.nonfinite import (
        first_nonfinite_gradient,
        first_nonfinite_parameter,
        first_nonfinite_reference,
    )

    model, optimizer = _wrapped("ac+compile")
    fqn, layer = quant_linears(model)[0]
    assert fqn == "layers.0.mixer.in_proj"
    with torch.no_grad():
        layer.weight.fill_(float("nan"))
    layer.weight.grad = torch.full_like(layer.weight, float("inf"))
    layer.references.held["x"] = HeldReference(amax=torch.tensor(float("nan")), refresh_step=1)
    assert first_nonfinite_parameter(model) == first_nonfinite_gradient(model) == f"{fqn}.weight"
    assert first_nonfinite_reference(model) == f"{fqn}.x amax"
