"""distributed.activation_checkpointing=auto at start-up (nemofp4.training.job_plan): rank 0 asks the
planner, or keeps the policy the run recorded; every rank takes its answer, or its error, and logs it.
The planner here is a stand-in; tests/integration/test_activation_checkpointing_auto.py runs the real one."""

from __future__ import annotations

import json
import logging
import socket
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from nemofp4.training.job_plan import JobPlan, recorded_policy, resolve_activation_checkpointing
from nemofp4.training.parallel import DistributedConfig, ac_policy, checkpointed_blocks


@dataclass
class _Job:
    """The parts of a JobConfig the resolution reads."""

    run_dir: str
    resume: str = "auto"
    distributed: DistributedConfig = field(default_factory=lambda: DistributedConfig(activation_checkpointing="auto"))


class _Planner:
    def __init__(self, policy: str | None):
        self.policy, self.calls = policy, 0

    def choose(self, cfg, *, world_size, device):
        self.calls += 1
        if self.policy is None:
            raise ValueError("no policy fits; it fits on 4 GPUs")
        return JobPlan(
            activation_checkpointing=self.policy, reason=f"stand-in on {world_size} ranks", summary="| table |"
        )

    def log_plan(self, cfg, *, world_size, device, log):
        raise AssertionError("not called for auto")


def test_auto_is_a_config_value_never_a_policy():
    assert DistributedConfig(activation_checkpointing="AUTO").activation_checkpointing == "auto"
    with pytest.raises(ValueError, match="auto is resolved at start-up"):
        ac_policy("auto")
    with pytest.raises(ValueError, match="auto is resolved at start-up"):
        checkpointed_blocks("auto", ["mamba", "mlp"])
    with pytest.raises(ValueError, match="device_memory_gib=-1"):
        DistributedConfig(device_memory_gib=-1)


def test_a_configured_policy_is_left_alone(tmp_path):
    job = _Job(str(tmp_path), distributed=DistributedConfig(activation_checkpointing="mlp"))
    assert resolve_activation_checkpointing(job, None, rank=0, world_size=1, device=torch.device("cpu")) is job


def test_rank_0_chooses_or_keeps_what_the_run_recorded(tmp_path, caplog):
    planner = _Planner("mamba")
    with caplog.at_level(logging.INFO, logger="nemofp4"):
        job = resolve_activation_checkpointing(
            _Job(str(tmp_path)), planner, rank=0, world_size=1, device=torch.device("cpu")
        )
    assert (job.distributed.activation_checkpointing, planner.calls) == ("mamba", 1)
    assert "rank 0: distributed.activation_checkpointing=auto -> mamba (stand-in on 1 ranks)" in caplog.text
    # the run recorded full: a resume keeps it whatever this device's plan would say; resume=none plans anew
    (tmp_path / "config.yaml").write_text("distributed:\n  activation_checkpointing: full\n")
    assert recorded_policy(tmp_path) == "full"
    job = resolve_activation_checkpointing(
        _Job(str(tmp_path)), planner, rank=0, world_size=1, device=torch.device("cpu")
    )
    assert (job.distributed.activation_checkpointing, planner.calls) == ("full", 1)
    job = resolve_activation_checkpointing(
        _Job(str(tmp_path), resume="none"), planner, rank=0, world_size=1, device=torch.device("cpu")
    )
    assert (job.distributed.activation_checkpointing, planner.calls) == ("mamba", 2)
    with pytest.raises(ValueError, match="needs the job's planner"):
        resolve_activation_checkpointing(
            _Job(str(tmp_path / "new")), None, rank=0, world_size=1, device=torch.device("cpu")
        )


def _two_ranks(rank: int, port: int, run_dir: str, results: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("nemofp4").addHandler(handler)
    logging.getLogger("nemofp4").setLevel(logging.INFO)
    out = {}
    planner = _Planner("mamba" if rank == 0 else "full")  # only rank 0's may decide
    job = resolve_activation_checkpointing(_Job(run_dir), planner, rank=rank, world_size=2, device=torch.device("cpu"))
    out["policy"], out["calls"], out["logged"] = job.distributed.activation_checkpointing, planner.calls, records[:]
    try:
        resolve_activation_checkpointing(
            _Job(run_dir), _Planner(None if rank == 0 else "none"), rank=rank, world_size=2, device=torch.device("cpu")
        )
    except ValueError as err:
        out["error"] = str(err)
    Path(results, f"rank-{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


def test_every_rank_takes_rank_0s_choice_or_error_and_logs_it_once(tmp_path):
    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(_two_ranks, args=(port, str(tmp_path / "run"), str(tmp_path)), nprocs=2)
    for rank in (0, 1):
        out = json.loads((tmp_path / f"rank-{rank}.json").read_text())
        assert (out["policy"], out["calls"]) == ("mamba", 1 if rank == 0 else 0)
        choice = [m for m in out["logged"] if "auto ->" in m]
        assert choice == [f"rank {rank}: distributed.activation_checkpointing=auto -> mamba (stand-in on 2 ranks)"]
        assert any("| table |" in m for m in out["logged"]) == (rank == 0)
        assert out["error"] == "no policy fits; it fits on 4 GPUs"
