"""Inference policies: what each one quantizes the activations with, bit for bit."""

from __future__ import annotations

import pytest
import torch

from nemofp4.evaluation import InferencePolicy, PolicyForward, unquantized_copy
from nemofp4.models import build_model, get_model_config
from nemofp4.quant import quant_linears, reference_state_dict, reset_references, set_step
from nemofp4.recipes import apply_recipe, get_recipe

pytestmark = pytest.mark.usefixtures("eager_quantizer")

SEQ = 32


# The tiny model has 6 pattern layers: keep 2 (not the paper's 8) of them in BF16 where a recipe has a BF16 tail.
_KNOBS = {"nvfp4": {"num_bf16_last_layers": 2}, "mxfp4": {"num_bf16_last_layers": 2}}


def _model(recipe: str, seed: int = 0):
    model = build_model(get_model_config("tiny"), device="meta")
    apply_recipe(model, get_recipe(recipe, **_KNOBS.get(recipe, {})), log=False)
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    model.init_weights()
    return model


def _batches(n: int, batch: int = 2, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # Batches of different token statistics, so their activation amaxes differ.
    return [torch.randint(0, 400 * (i + 1), (batch, SEQ), generator=g) for i in range(n)]


@pytest.fixture(scope="module")
def ue5m3_model():
    return _model("ue5m3")


@pytest.mark.parametrize(
    "recipe, step", [("ue5m3", 1), ("nvfp4", 7), ("nvfp4_all_fp4_no_rht", 3), ("fp8", 2), ("mxfp8", 2)]
)
def test_current_equals_the_recipes_training_forward(recipe, step):
    model = _model(recipe)
    x = _batches(1)[0]
    model.train()
    set_step(model, step, seed=0)  # ue5m3 samples fresh references at step 1 (a refresh step)
    trained_logits = model(x).detach()
    with PolicyForward(model, InferencePolicy(name="current")) as forward:
        assert torch.equal(forward(x), trained_logits)


def test_delayed_with_d1_equals_current(ue5m3_model):
    batches = _batches(3)
    with PolicyForward(ue5m3_model, InferencePolicy(name="current")) as forward:
        current = [forward(x) for x in batches]
    with PolicyForward(ue5m3_model, InferencePolicy(name="delayed", delay=1)) as forward:
        for x, expected in zip(batches, current):
            assert torch.equal(forward(x), expected)


def test_delayed_holds_the_refresh_batchs_references(ue5m3_model):
    b1, b2, b3 = _batches(3)
    with PolicyForward(ue5m3_model, InferencePolicy(name="current")) as forward:
        current = [forward(x) for x in (b1, b2, b3)]
    # Calibrating on batch 1 as one forward gives exactly what delayed replay samples on it.
    held = InferencePolicy(name="calibrated", calibration_sequences=len(b1), calibration_batch_size=len(b1))
    with PolicyForward(ue5m3_model, held, calibration_batches=[b1]) as forward:
        b2_with_b1_refs = forward(b2)
    with PolicyForward(ue5m3_model, InferencePolicy(name="delayed", delay=2)) as forward:
        out = [forward(x) for x in (b1, b2, b3)]
    assert torch.equal(out[0], current[0])  # call 1 samples
    assert torch.equal(out[1], b2_with_b1_refs)  # call 2 holds batch 1's references ...
    assert not torch.equal(out[1], current[1])  # ... which is not current scaling
    assert torch.equal(out[2], current[2])  # call 3 = 2D+1... with D=2: call 3 samples again


def test_calibrated_references_are_the_max_over_single_sequence_references(ue5m3_model):
    model = ue5m3_model
    calibration = _batches(2, batch=3, seed=5)
    sequences = [s for b in calibration for s in b][:5]
    # Reference: what the recipe itself samples (training mode, refresh step) on each sequence alone.
    model.train()
    expected: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for seq in sequences:
            reset_references(model)
            set_step(model, 1)
            model(seq[None])
            for fqn, _ in quant_linears(model):
                amax = reference_state_dict(model)[f"{fqn}.x.amax"]
                expected[fqn] = torch.maximum(expected[fqn], amax) if fqn in expected else amax
    model.eval()
    policy = InferencePolicy(name="calibrated", calibration_sequences=5)
    x = _batches(1, batch=3, seed=9)[0]
    with PolicyForward(model, policy, calibration_batches=calibration) as forward:
        assert forward.references.keys() == expected.keys()
        for fqn, amax in expected.items():
            assert torch.equal(forward.references[fqn], amax), fqn
        frozen = forward(x)
        # Frozen references make every sequence independent of its batch (no shared tensor amax).
        alone = torch.cat([forward(x[i : i + 1]) for i in range(len(x))])
    assert torch.equal(frozen, alone)
    with PolicyForward(model, InferencePolicy(name="current")) as forward:
        assert not torch.equal(forward(x), frozen)


def test_calibrated_needs_enough_sequences(ue5m3_model):
    with pytest.raises(ValueError, match="C=8"):
        PolicyForward(
            ue5m3_model,
            InferencePolicy(name="calibrated", calibration_sequences=8),
            calibration_batches=_batches(1, batch=2),
        ).__enter__()


def test_unquantized_is_the_plain_model_with_the_same_weights(ue5m3_model):
    x = _batches(1)[0]
    plain = unquantized_copy(ue5m3_model)
    assert not quant_linears(plain)
    with torch.no_grad():
        expected = plain(x)
    with PolicyForward(ue5m3_model, InferencePolicy(name="bf16")) as forward:
        assert forward.policy.name == "unquantized"
        assert torch.equal(forward(x), expected)
    with PolicyForward(ue5m3_model, InferencePolicy(name="current")) as forward:
        assert not torch.equal(forward(x), expected)


def test_policies_restore_the_models_references_and_mode():
    model = _model("nvfp4")
    model.train()
    set_step(model, 1)
    model(_batches(1)[0]).sum().backward()
    before = {fqn: (dict(m.references.held), dict(m.references.intervals)) for fqn, m in quant_linears(model)}
    for policy in ("current", "delayed", "calibrated", "unquantized"):
        with PolicyForward(
            model, InferencePolicy(name=policy, calibration_sequences=2), calibration_batches=_batches(1)
        ) as forward:
            forward(_batches(1, seed=3)[0])
        assert model.training
        after = {fqn: (dict(m.references.held), dict(m.references.intervals)) for fqn, m in quant_linears(model)}
        assert after == before, policy


def test_fp8_policies_hold_per_tensor_references_and_unquantized_drops_them():
    """fp8's per-tensor scales come from tensor references like NVFP4's: delayed D=1 is current, a
    calibrated reference (a max over sequences) changes the scales, and the BF16 policy is the plain model."""
    model = _model("fp8")
    batches = _batches(2)
    with PolicyForward(model, InferencePolicy(name="current")) as forward:
        current = [forward(x) for x in batches]
    with PolicyForward(model, InferencePolicy(name="delayed", delay=1)) as forward:
        assert all(torch.equal(forward(x), c) for x, c in zip(batches, current))
    with PolicyForward(
        model, InferencePolicy(name="calibrated", calibration_sequences=4), calibration_batches=_batches(2, seed=5)
    ) as forward:
        assert not torch.equal(forward(batches[0]), current[0])
    with PolicyForward(model, InferencePolicy(name="bf16")) as forward:
        assert torch.equal(forward(batches[0]), unquantized_copy(model).eval()(batches[0]))


@pytest.mark.parametrize("recipe", ["mxfp4", "mxfp8"])
def test_mx_recipe_has_no_tensor_reference_so_policies_agree(recipe):
    model = _model(recipe)
    x = _batches(1)[0]
    outs = []
    for name in ("current", "delayed", "calibrated"):
        with PolicyForward(
            model, InferencePolicy(name=name, delay=3, calibration_sequences=2), calibration_batches=_batches(1, seed=4)
        ) as forward:
            forward(_batches(1, seed=7)[0])
            outs.append(forward(x))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"name": "frozen"}, "valid"),
        ({"name": "delayed", "delay": 0}, "D=0"),
        ({"calibration_sequences": 0}, "calibration"),
    ],
)
def test_bad_policy_settings_are_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        InferencePolicy(**kwargs)


def test_forward_outside_the_context_is_an_error(ue5m3_model):
    with pytest.raises(RuntimeError, match="entered"):
        PolicyForward(ue5m3_model, InferencePolicy())(_batches(1)[0])
