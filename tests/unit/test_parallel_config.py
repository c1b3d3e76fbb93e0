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
