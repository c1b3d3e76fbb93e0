"""DistributedConfig names a bad HSDP / gradient-sync setting and what is valid; checkpointing policies."""

import re

import pytest

from nemofp4.training.parallel import DistributedConfig


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"backend": "fsdp", "gradient_sync": "never"},
            r"gradient_sync='never'; valid: \('per_step', 'per_micro_batch'\)",
        ),
        ({"backend": "fsdp", "replicate_degree": 0}, r"replicate_degree=0; must be >= 1"),
        ({"backend": "deepspeed_zero2", "replicate_degree": 2}, r"replicate_degree=2 needs distributed.backend=fsdp"),
    ],
)
def test_bad_settings_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DistributedConfig(**kwargs)


def test_hydra_override_reaches_the_typed_config():
    from nemofp4.cli.train import compose_job_config

    cfg = compose_job_config(
        ["distributed=fsdp", "distributed.replicate_degree=4", "distributed.gradient_sync=per_micro_batch"]
    )
    assert cfg.distributed.replicate_degree == 4 and cfg.distributed.gradient_sync == "per_micro_batch"


@pytest.mark.parametrize("name", ["startup_timeout_s", "collective_timeout_s"])
@pytest.mark.parametrize("value", [0, -5.0, True])
def test_timeouts_must_be_positive_seconds(name, value):
    with pytest.raises(ValueError, match=rf"distributed.{name}={value!r}; must be a positive number of seconds"):
        DistributedConfig(**{name: value})


def test_keep_head_gathered_without_fsdp_warns_that_it_does_nothing():
    with pytest.warns(UserWarning, match="keep_head_gathered=true has no effect with distributed.backend=none"):
        DistributedConfig(keep_head_gathered=True)


def test_collective_timeout_recognizes_only_timeouts_and_names_the_operation():
    from nemofp4.training.dist_env import collective_timeout

    assert collective_timeout(ValueError("timed out")) is None  # not a collective's error type
    assert collective_timeout(RuntimeError("Connection closed by peer")) is None
    try:
        raise RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 3000ms for recv operation")
    except RuntimeError as err:
        assert collective_timeout(err) == "a collective"  # raised outside torch.distributed and nemofp4


@pytest.mark.parametrize(
    "value, policy",
    [
        (True, "full"),
        (False, "none"),
        ("true", "full"),
        ("False", "none"),
        ("full", "full"),
        ("none", "none"),
        ("mlp", "mlp"),
        ("MLP+mamba", "mamba+mlp"),
        ("attention+mamba+mlp", "mamba+attention+mlp"),
        ("every_2", "every_2"),
        ("every_1", "full"),
    ],
)
def test_activation_checkpointing_accepts_policies_and_the_old_booleans(value, policy):
    assert DistributedConfig(activation_checkpointing=value).activation_checkpointing == policy


@pytest.mark.parametrize("value", ["moe", "mlp+mlp", "every_0", "every_x", "mlp,mamba"])
def test_a_bad_checkpointing_policy_is_named_with_what_is_valid(value):
    with pytest.raises(
        ValueError, match=re.escape(f"activation_checkpointing={value!r}; valid: none, full, block types")
    ):
        DistributedConfig(activation_checkpointing=value)


def test_policies_choose_blocks_by_type_or_position():
    from nemofp4.training.parallel import checkpointed_blocks

    kinds = ["mamba", "mlp", "attention", "mlp", "mamba", "mlp"]
    assert checkpointed_blocks("mlp", kinds) == [False, True, False, True, False, True]
    assert checkpointed_blocks("mamba+attention", kinds) == [True, False, True, False, True, False]
    assert checkpointed_blocks("every_3", kinds) == [False, False, True, False, False, True]
    assert checkpointed_blocks("none", kinds) == [False] * 6 and checkpointed_blocks("full", kinds) == [True] * 6


@pytest.mark.parametrize("override, wrapped", [("true", 6), ("false", 0), ("mamba", 2), ("every_2", 3)])
def test_the_policy_wraps_exactly_its_blocks(override, wrapped):
    """Through Hydra (true/false as before), only the blocks the policy chooses are wrapped."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    from nemofp4.cli.train import compose_job_config
    from nemofp4.models import build_model
    from nemofp4.training.parallel import parallelize

    cfg = compose_job_config([f"distributed.activation_checkpointing={override}"])
    model = parallelize(build_model(cfg.model, device="meta"), cfg.distributed, device_type="cpu")
    assert sum(isinstance(b, CheckpointWrapper) for b in model.layers) == wrapped


def test_a_selective_policy_keeps_the_numerics_bitwise():
    """A step's gradients under ``mamba+attention`` are bitwise those without checkpointing (ue5m3, eager)."""
    import torch

    from nemofp4.models import build_model, get_model_config, lm_loss
    from nemofp4.quant import set_quant_backend, set_step
    from nemofp4.recipes import apply_recipe, get_recipe
    from nemofp4.training.parallel import parallelize

    def grads(policy):
        torch.manual_seed(0)
        model = build_model(get_model_config("tiny", vocab_size=512), device="meta")
        apply_recipe(model, get_recipe("ue5m3"), log=False)
        set_quant_backend(model, "eager")
        parallelize(model, DistributedConfig(activation_checkpointing=policy), device_type="cpu")
        model.to_empty(device="cpu")
        model.init_weights()
        set_step(model, 1, seed=0, rank=0)
        ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(1))
        lm_loss(model, ids, ids).backward()
        return [p.grad for p in model.parameters()]

    assert all(torch.equal(a, b) for a, b in zip(grads("mamba+attention"), grads("none")))
