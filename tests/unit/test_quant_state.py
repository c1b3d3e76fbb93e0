"""Quantization state under canonical names: wrappers change no key, DCP holds the references once."""

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

from nemofp4.quant import (
    HeldReference,
    QuantState,
    canonical_fqn,
    load_reference_state_dict,
    quant_linears,
    reference_state_dict,
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


def test_quant_state_keys_are_the_same_with_any_wrappers_and_restore_across_them():
    model, optimizer = _fresh()
    _train(model, optimizer, range(1, 3))
    saved = {k: v.clone() for k, v in QuantState(model).state_dict().items()}
    assert saved and all(k.startswith(("layers.", "lm_head")) for k in saved)
    for kind in ("ac", "compile", "ac+compile"):
        other, _ = _wrapped(kind)
        assert any("_checkpoint_wrapped_module" in n or "_orig_mod" in n for n, _ in other.named_modules())
        target = QuantState(other)
        assert target.state_dict().keys() == saved.keys(), kind
        target.load_state_dict(saved)
        restored = target.state_dict()
        assert all(torch.equal(restored[k], v) for k, v in saved.items()), kind


def test_an_older_checkpoint_with_wrapper_names_restores_by_canonical_name():
    model, optimizer = _fresh()
    _train(model, optimizer, range(1, 2))
    legacy = {k.replace("layers.0.", "layers.0._checkpoint_wrapped_module."): v for k, v in reference_state_dict(model).items()}
    assert legacy.keys() != reference_state_dict(model).keys()
    fresh, _ = _fresh()
    load_reference_state_dict(fresh, legacy)
    assert all(torch.equal(a, b) for a, b in zip(reference_state_dict(fresh).values(), reference_state_dict(model).values()))


def test_an_empty_reference_is_saved_as_step_zero_and_restored_empty():
    model, _ = _fresh()
    state = QuantState(model).state_dict()
    assert state and {int(v) for k, v in state.items() if k.endswith("refresh_step")} == {0}
    assert {float(v) for k, v in state.items() if k.endswith("amax")} == {0.0}
    QuantState(model).load_state_dict(state)
    assert reference_state_dict(model) == {}


def _save_on_two_ranks(rank: int, world: int, folder: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{folder}/init", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        model, optimizer = _fresh()
        set_held_reference_reduce_group(model, dist.group.WORLD)
        with torch.no_grad():  # rank-local data: the reduced references are the max over both ranks
            model.embeddings.weight.mul_(1.0 + rank)
        _train(model, optimizer, range(1, 2))
        dcp.save({"quant": QuantState(model)}, checkpoint_id=f"{folder}/ckpt")
        torch.save(reference_state_dict(model), f"{folder}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_references_saved_by_two_ranks_load_in_one_process_bitwise():
    """DCP keeps one copy of the replicated QuantState; a run at another world size reads it whole."""
    with tempfile.TemporaryDirectory() as folder:
        mp.start_processes(_save_on_two_ranks, args=(2, folder), nprocs=2, join=True, start_method="spawn")
        per_rank = [torch.load(os.path.join(folder, f"rank{r}.pt"), weights_only=True) for r in (0, 1)]
        assert per_rank[0] and per_rank[0].keys() == per_rank[1].keys()
        assert all(torch.equal(per_rank[0][k], per_rank[1][k]) for k in per_rank[0])  # one set of references
        model, _ = _fresh()
        with pytest.warns(UserWarning, match="single process"):
            dcp.load({"quant": QuantState(model)}, checkpoint_id=os.path.join(folder, "ckpt"), no_dist=True)
        restored = reference_state_dict(model)
        assert restored.keys() == per_rank[0].keys()
        assert all(torch.equal(restored[k], per_rank[0][k]) for k in restored)


def test_the_autograd_function_gets_a_frozen_call_and_the_state_not_the_module(monkeypatch):
    import dataclasses

    from nemofp4.quant import linear

    model, optimizer = _fresh()
    _train(model, optimizer, range(1, 2))  # builds the opaque entry with the real Function
    seen = []
    real_apply = linear._QuantLinearFunction.apply

    def spy(*args):
        seen.append(args)
        return real_apply(*args)

    monkeypatch.setattr(linear._QuantLinearFunction, "apply", spy)
    _train(model, optimizer, range(2, 3))
    assert len(seen) == len(quant_linears(model)) > 0  # one call per FP4 linear
    for args in seen:
        assert not any(isinstance(a, torch.nn.Module) for a in args)
        call, state = args[-2:]
        assert isinstance(call, linear.QuantCall) and isinstance(state, linear.QuantLinearState)
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
