"""`nemofp4-plan format=json` prints one JSON object a tool reads without parsing tables: the headline
throughput, the model body's, MFU, and the memory verdict with each item's bytes, the same numbers the
tables print."""

from __future__ import annotations

import json

import pytest

from nemofp4.cli.plan import plan_report
from nemofp4.cli.train import compose_job_config

OVERRIDES = ["experiment=tiny_fp8", "precision=fp8_te", "train.seq_len=128", "train.micro_batch=4"]


def test_format_json_is_one_object_with_the_plan_keys():
    job = compose_job_config(OVERRIDES)
    out = json.loads(plan_report(job, world_size=2, device="h100", format="json"))
    for key in ("step_s", "tokens_per_s_per_gpu", "body_tokens_per_s_per_gpu", "mfu"):
        assert isinstance(out[key], float) and out[key] > 0, key
    assert out["tokens_per_s_per_gpu"] == pytest.approx(out["tokens_per_step_per_gpu"] / out["step_s"])
    assert out["body_tokens_per_s_per_gpu"] >= out["tokens_per_s_per_gpu"]  # the body is part of the step
    memory = out["memory"]
    assert memory["fits"] is True and memory["total_bytes"] == sum(memory["items"].values())
    assert set(memory["items"]) >= {"parameters", "activations", "optimizer state", "reserve"}
    table = plan_report(job, world_size=2, device="h100")
    assert f"{memory['total_bytes'] / 2**30:.2f} GiB of 80.00 GiB per GPU" in table


def test_format_json_without_a_device_has_no_projection():
    out = json.loads(plan_report(compose_job_config(OVERRIDES), world_size=2, format="json"))
    assert out["step_s"] is None and out["mfu"] is None and out["memory"]["fits"] is True


def test_an_unknown_format_is_refused():
    with pytest.raises(ValueError, match="format='yaml'; valid: table, json"):
        plan_report(compose_job_config(OVERRIDES), world_size=2, format="yaml")
