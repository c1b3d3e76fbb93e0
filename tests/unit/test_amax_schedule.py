"""Tensor references: the sample-and-hold schedule, gradient accumulation, eval, exact resume."""

import copy
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from nemofp4.quant import (
    QuantLinear,
    load_reference_state_dict,
    quant_stats,
    reference_state_dict,
    reset_references,
    set_amax_reduce_group,
    set_held_reference_reduce_group,
    set_step,
    without_quant_state,
)
from nemofp4.recipes import get_recipe
from tests.conftest import fresh_standin as _fresh
from tests.conftest import train_standin as _train

pytestmark = pytest.mark.usefixtures("one_thread")


def _layer(recipe="ue5m3", **overrides) -> QuantLinear:
    """A QuantLinear on the eager quantizer: these tests are about the reference schedule, and the
    compiled program (bitwise the eager one, tests/unit/test_kernels_program.py) would compile a graph
    per operand kind in every process, the two-rank workers included."""
    torch.manual_seed(0)
    layer = QuantLinear.from_linear(nn.Linear(32, 16, bias=False), get_recipe(recipe, **overrides).parts["fp4"])
    layer.quant_backend = layer.references.backend = "eager"
    return layer


def _step(layer, step, scale):
    """One training step whose X and dY have amax = scale (and W's grows with the step)."""
    set_step(layer, step)
    with torch.no_grad():
        layer.weight.mul_(1.01)
    x = torch.full((16, 32), 0.5 * scale)
    x[0, 0] = scale
    x.requires_grad_()
    dy = torch.full((16, 16), -0.25 * scale)
    dy[3, 2] = -2 * scale
    layer(x).backward(dy)
    return float(x.detach().abs().max()), float(layer.weight.detach().abs().max()), float(dy.abs().max())


def test_references_refresh_exactly_at_steps_1_51_101_and_hold_in_between():
    layer = _layer(reference_interval=50)
    sampled = {}
    for step in range(1, 121):
        current = _step(layer, step, scale=float(step))
        held = layer.references.held
        expected_refresh = 1 + 50 * ((step - 1) // 50)
        if step == expected_refresh:
            sampled = dict(zip(("x", "w", "dy"), current))
        for ref in ("x", "w", "dy"):
            assert held[ref].refresh_step == expected_refresh, (step, ref)
            assert float(held[ref].amax) == pytest.approx(sampled[ref], rel=1e-6), (step, ref)
            if step != expected_refresh:  # held, although the tensor has grown since
                assert float(held[ref].amax) < dict(zip(("x", "w", "dy"), current))[ref]
    assert {1, 51, 101} == {1 + 50 * ((s - 1) // 50) for s in range(1, 121)}


def test_current_scaling_keeps_no_state():
    layer = _layer("nvfp4")
    _step(layer, 1, 1.0)
    assert layer.references.held == {}
    assert reference_state_dict(layer) == {}


def test_gradient_accumulation_samples_on_the_first_micro_batch_and_holds():
    layer = _layer(reference_interval=50)
    set_step(layer, 1)
    for micro, scale in enumerate((2.0, 7.0, 3.0)):
        x = torch.full((16, 32), scale, requires_grad=True)
        layer(x).backward(torch.ones(16, 16))
        assert float(layer.references.held["x"].amax) == 2.0, micro
    set_step(layer, 2)
    layer(torch.full((16, 32), 9.0, requires_grad=True)).backward(torch.ones(16, 16))
    assert float(layer.references.held["x"].amax) == 2.0


def test_eval_never_changes_the_references():
    layer = _layer(reference_interval=50)
    layer.eval()
    set_step(layer, 1)
    with torch.no_grad():
        layer(torch.full((4, 32), 5.0))  # empty reference: current amax, not stored
    assert layer.references.held == {}
    layer.train()
    _step(layer, 1, 1.0)
    before = {k: (float(v.amax), v.refresh_step) for k, v in layer.references.held.items()}
    layer.eval()
    set_step(layer, 51)  # a refresh step, but eval does not refresh
    with torch.no_grad():
        layer(torch.full((4, 32), 100.0))
    assert {k: (float(v.amax), v.refresh_step) for k, v in layer.references.held.items()} == before


def test_training_without_set_step_warns_and_uses_current_scaling():
    layer = _layer(reference_interval=50)
    with pytest.warns(UserWarning, match="set_step"):
        layer(torch.ones(4, 32, requires_grad=True)).sum().backward()
    assert layer.references.held == {}
    with pytest.raises(ValueError, match="1-based"):
        set_step(layer, 0)


def test_resume_with_restored_references_continues_bitwise():
    model, optimizer = _fresh()
    _train(model, optimizer, range(1, 71))
    checkpoint = copy.deepcopy(
        {"model": model.state_dict(), "optim": optimizer.state_dict(), "refs": reference_state_dict(model)}
    )
    assert {k.rsplit(".", 2)[-2] for k in checkpoint["refs"]} == {"x", "w", "dy"}
    _train(model, optimizer, range(71, 171))  # uninterrupted: steps 71..170 (refreshes at 101, 151)

    def restored():
        resumed, resumed_optimizer = _fresh()
        resumed.load_state_dict(checkpoint["model"])
        resumed_optimizer.load_state_dict(checkpoint["optim"])
        load_reference_state_dict(resumed, checkpoint["refs"])
        return resumed, resumed_optimizer

    resumed, resumed_optimizer = restored()
    _train(resumed, resumed_optimizer, range(71, 81))
    at_80 = resumed.state_dict()["lm_head.weight"].clone()
    _train(resumed, resumed_optimizer, range(81, 171))
    weights = [without_quant_state(m.state_dict()) for m in (model, resumed)]  # the references: below
    for (name, a), b in zip(weights[0].items(), weights[1].values()):
        assert torch.equal(a, b), name
    assert reference_state_dict(resumed).keys() == reference_state_dict(model).keys()
    for key, value in reference_state_dict(model).items():
        assert torch.equal(value, reference_state_dict(resumed)[key]), key

    # The paper's behaviour: references start empty after the restart, are re-sampled at its
    # first step (71) and the 50-step phase restarts there, so the trajectory differs.
    paper, paper_optimizer = restored()
    reset_references(paper)
    _train(paper, paper_optimizer, range(71, 72))
    assert {int(v) for k, v in reference_state_dict(paper).items() if k.endswith("refresh_step")} == {71}
    _train(paper, paper_optimizer, range(72, 81))
    assert not torch.equal(paper.state_dict()["lm_head.weight"], at_80)


def test_reference_state_dict_rejects_a_checkpoint_of_another_recipe_or_model():
    model, optimizer = _fresh()
    _train(model, optimizer, range(1, 3))
    state = reference_state_dict(model)
    with pytest.raises(ValueError, match="different model or precision recipe"):
        load_reference_state_dict(model, {**state, "layers.9.mixer.in_proj.x.amax": torch.tensor(1.0)})
    nvfp4, _ = _fresh("nvfp4_all_fp4_no_rht")  # current scaling holds nothing
    with pytest.raises(ValueError, match="different model or precision recipe"):
        load_reference_state_dict(nvfp4, state)
    partial = {k: v for k, v in state.items() if not k.startswith("layers.0.")}
    load_reference_state_dict(model, partial)  # missing references start empty
    assert model.layers[0].mixer.in_proj.references.held == {}


def test_quant_stats_reports_every_layer_and_role():
    model, optimizer = _fresh()
    _train(model, optimizer, range(1, 2))
    stats = quant_stats(model)
    assert set(stats) == {n for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    for layer_stats in stats.values():
        # 3 block fractions and rho (1 at the refresh step) per role
        assert len(layer_stats) == 5 * 4 and all(0.0 <= v <= 1.0 for v in layer_stats.values())


def _reduce_worker(rank: int, world: int, init_file: str, results) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        x = torch.full((16, 32), float(rank + 1), requires_grad=True)  # rank r: amax r + 1
        dy = torch.full((16, 16), float(10 * (rank + 1)))
        # every measured amax reduced (tensor parallelism)
        layer = _layer(reference_interval=50)
        set_amax_reduce_group(layer, dist.group.WORLD)
        set_step(layer, 1)
        layer(x).backward(dy)
        reduced = (float(layer.references.held["x"].amax), float(layer.references.held["dy"].amax))
        # only the samples of held references reduced (data parallelism): current scaling stays local
        held, current = _layer(reference_interval=50), _layer(reference_interval=0)
        for module in (held, current):
            set_held_reference_reduce_group(module, dist.group.WORLD)
            set_step(module, 1)
            module._capture = []
            module(x).backward(dy)
        local = float(current._capture[0][1].tensor_amax)  # fprop X's reference, measured per rank
        results[rank] = (reduced, float(held.references.held["x"].amax), local)
    finally:
        dist.destroy_process_group()


def test_amax_is_all_reduced_over_the_group():
    context = mp.get_context("spawn")  # fork would copy the threads of earlier tests (compile workers) and can hang
    with tempfile.TemporaryDirectory() as tmp:
        results = context.Manager().dict()
        ranks = [
            context.Process(target=_reduce_worker, args=(r, 2, os.path.join(tmp, "init"), results)) for r in (0, 1)
        ]
        for process in ranks:
            process.start()
        for process in ranks:
            process.join(timeout=120)
        assert [p.exitcode for p in ranks] == [0, 0]
        assert dict(results) == {0: ((2.0, 20.0), 2.0, 1.0), 1: ((2.0, 20.0), 2.0, 2.0)}
