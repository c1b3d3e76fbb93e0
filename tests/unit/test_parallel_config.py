"""DistributedConfig names a bad HSDP / gradient-sync setting and what is valid."""

import pytest

from nemofp4.training.parallel import DistributedConfig


@pytest.mark.parametrize("kwargs, message", [
    ({"backend": "fsdp", "gradient_sync": "never"}, r"gradient_sync='never'; valid: \('per_step', 'per_micro_batch'\)"),
    ({"backend": "fsdp", "replicate_degree": 0}, r"replicate_degree=0; must be >= 1"),
    ({"backend": "deepspeed_zero2", "replicate_degree": 2}, r"replicate_degree=2 needs distributed.backend=fsdp"),
])  # fmt: skip
def test_bad_settings_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DistributedConfig(**kwargs)


def test_hydra_override_reaches_the_typed_config():
    from nemofp4.cli.train import compose_job_config

    cfg = compose_job_config(["distributed=fsdp", "distributed.replicate_degree=4",
                              "distributed.gradient_sync=per_micro_batch"])  # fmt: skip
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
