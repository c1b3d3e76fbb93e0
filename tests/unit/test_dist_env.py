"""Rank derivation from torchrun's and SLURM's environments, Slurm's list syntaxes, and a real gloo init."""

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nemofp4.training.dist_env import (
    DEFAULT_MASTER_ADDR,
    SLURM_PORT_BASE,
    SLURM_PORT_SPAN,
    DistEnv,
    destroy_distributed,
    detect_dist_env,
    expand_hostlist,
    expand_tasks_per_node,
    init_distributed,
    slurm_master_port,
)

# ---------------------------------------------------------------------------------------------- hostlist

# What `scontrol show hostnames` prints for the lists used below (the real one is tested further down).
FAKE_SCONTROL = """#!/bin/bash
echo "$@" >> "$(dirname "$0")/calls.log"
[[ $1 == show && $2 == hostnames ]] || exit 1
case "$3" in
  "gpu-[007-008,010]") printf 'gpu-007\\ngpu-008\\ngpu-010\\n' ;;
  "gpu-[010,007]") printf 'gpu-010\\ngpu-007\\n' ;;
  "gpu-[001-002]") printf 'gpu-001\\ngpu-002\\n' ;;
  *) echo "scontrol: error: Invalid hostlist: $3" >&2; exit 1 ;;
esac
"""


@pytest.fixture(scope="module")
def scontrol_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("bin")
    path = directory / "scontrol"
    path.write_text(FAKE_SCONTROL)
    path.chmod(0o755)
    return directory


def test_expand_hostlist_asks_scontrol(scontrol_dir):
    assert expand_hostlist("gpu-[007-008,010]", environ={"PATH": str(scontrol_dir)}) == [
        "gpu-007",
        "gpu-008",
        "gpu-010",
    ]
    assert (scontrol_dir / "calls.log").read_text().splitlines()[-1] == "show hostnames gpu-[007-008,010]"
    with pytest.raises(ValueError, match="Invalid hostlist"):
        expand_hostlist("n[2-1]", environ={"PATH": str(scontrol_dir)})


def test_expand_hostlist_without_brackets_or_without_scontrol(tmp_path):
    assert expand_hostlist("a, b,c", environ={"PATH": str(tmp_path)}) == ["a", "b", "c"]
    with pytest.raises(ValueError, match="scontrol is not on PATH.*MASTER_ADDR"):
        expand_hostlist("n[1-2]", environ={"PATH": str(tmp_path)})
    with pytest.raises(ValueError, match="empty"):
        expand_hostlist(" ")


REAL_SCONTROL = shutil.which("scontrol")


@pytest.mark.skipif(
    REAL_SCONTROL is None and not os.environ.get("NEMOFP4_REQUIRE_SLURM"), reason="needs Slurm's scontrol"
)
@pytest.mark.parametrize(
    ("hostlist", "expected"),
    [
        ("gpu-[001-004,010],login1", ["gpu-001", "gpu-002", "gpu-003", "gpu-004", "gpu-010", "login1"]),
        ("n[08-11]", ["n08", "n09", "n10", "n11"]),
        ("n[098-101]", ["n098", "n099", "n100", "n101"]),
        ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
    ],
)
def test_expand_hostlist_with_the_real_scontrol(hostlist, expected):
    assert expand_hostlist(hostlist) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [("4", [4]), ("4(x2),3", [4, 4, 3]), ("2(x3)", [2, 2, 2]), ("1,2(x2),8", [1, 2, 2, 8])],
)
def test_expand_tasks_per_node(text, expected):
    assert expand_tasks_per_node(text) == expected


@pytest.mark.parametrize("bad", ["", "4(x)", "x2", "4(2)", "4,,3"])
def test_expand_tasks_per_node_rejects_malformed(bad):
    with pytest.raises(ValueError):
        expand_tasks_per_node(bad)


# ---------------------------------------------------------------------------------------------- detection


def test_no_launcher_is_single_process():
    env = detect_dist_env({})
    assert env == DistEnv(
        rank=0,
        local_rank=0,
        world_size=1,
        local_world_size=1,
        node_rank=0,
        master_addr="127.0.0.1",
        master_port=29500,
        source="single",
    )
    assert env.is_main and not env.is_distributed


def test_torchrun_environment():
    environ = {
        "RANK": "13",
        "LOCAL_RANK": "5",
        "WORLD_SIZE": "32",
        "LOCAL_WORLD_SIZE": "8",
        "GROUP_RANK": "1",
        "MASTER_ADDR": "gpu-001",
        "MASTER_PORT": "29400",
    }
    env = detect_dist_env(environ)
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size, env.node_rank) == (13, 5, 32, 8, 1)
    assert (env.master_addr, env.master_port, env.source) == ("gpu-001", 29400, "torchrun")


def test_torchrun_wins_over_slurm():
    """Inside `srun torchrun`, SLURM_PROCID is the agent's task (the node), not the worker's rank."""
    environ = {
        "RANK": "9",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "16",
        "LOCAL_WORLD_SIZE": "8",
        "GROUP_RANK": "1",
        "MASTER_ADDR": "gpu-001",
        "MASTER_PORT": "29500",
        "SLURM_PROCID": "1",
        "SLURM_LOCALID": "0",
        "SLURM_NTASKS": "2",
        "SLURM_NODEID": "1",
        "SLURM_JOB_NODELIST": "gpu-[001-002]",
        "SLURM_JOB_ID": "4242",
        "SLURM_TASKS_PER_NODE": "1(x2)",
    }
    env = detect_dist_env(environ)
    assert (env.source, env.rank, env.local_rank, env.world_size, env.node_rank) == ("torchrun", 9, 1, 16, 1)


def test_hand_made_rank_world_size_is_one_node():
    env = detect_dist_env({"RANK": "3", "WORLD_SIZE": "4"})
    assert (env.local_rank, env.local_world_size, env.node_rank) == (3, 4, 0)


def test_incomplete_torchrun_environment_is_an_error():
    with pytest.raises(ValueError, match="WORLD_SIZE"):
        detect_dist_env({"RANK": "0"})


def _slurm(**overrides):
    environ = {"SLURM_JOB_ID": "123457", "SLURM_JOB_NODELIST": "gpu-[007-008,010]"}
    environ.update({k: str(v) for k, v in overrides.items()})
    return environ


@pytest.mark.parametrize(
    ("layout", "expected"),
    [
        # 3 nodes x 4 tasks, task 6 is on the second node
        (
            dict(SLURM_PROCID=6, SLURM_LOCALID=2, SLURM_NTASKS=12, SLURM_NODEID=1, SLURM_TASKS_PER_NODE="4(x3)"),
            (6, 2, 12, 4, 1),
        ),
        # uneven: 4,4,3 tasks; the last node has 3
        (
            dict(SLURM_PROCID=10, SLURM_LOCALID=2, SLURM_NTASKS=11, SLURM_NODEID=2, SLURM_TASKS_PER_NODE="4(x2),3"),
            (10, 2, 11, 3, 2),
        ),
        # only --ntasks-per-node known
        (
            dict(SLURM_PROCID=3, SLURM_LOCALID=1, SLURM_NTASKS=6, SLURM_NODEID=1, SLURM_NTASKS_PER_NODE=2),
            (3, 1, 6, 2, 1),
        ),
        # the step's layout wins over the job's (srun on part of the allocation)
        (
            dict(
                SLURM_PROCID=1,
                SLURM_LOCALID=1,
                SLURM_NTASKS=2,
                SLURM_NODEID=0,
                SLURM_TASKS_PER_NODE="8(x3)",
                SLURM_STEP_TASKS_PER_NODE="2",
                SLURM_STEP_NUM_TASKS=2,
            ),
            (1, 1, 2, 2, 0),
        ),
        # one task, nothing else known
        (dict(SLURM_PROCID=0, SLURM_LOCALID=0, SLURM_NTASKS=1), (0, 0, 1, 1, 0)),
    ],
)
def test_slurm_layouts(layout, expected, scontrol_dir):
    env = detect_dist_env(_slurm(**layout, PATH=scontrol_dir))
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size, env.node_rank) == expected
    assert env.source == "slurm"
    # the first host of the compressed list; one process needs no rendezvous host
    assert env.master_addr == ("gpu-007" if env.world_size > 1 else DEFAULT_MASTER_ADDR)
    assert env.master_port == SLURM_PORT_BASE + 123457 % SLURM_PORT_SPAN == 23457


def test_slurm_master_from_step_nodelist_and_env_overrides(scontrol_dir):
    base = dict(SLURM_PROCID=0, SLURM_LOCALID=0, SLURM_NTASKS=2, SLURM_TASKS_PER_NODE="1(x2)", PATH=scontrol_dir)
    assert detect_dist_env(_slurm(**base, SLURM_STEP_NODELIST="gpu-[010,007]")).master_addr == "gpu-010"
    env = detect_dist_env(_slurm(**base, MASTER_ADDR="10.1.2.3", MASTER_PORT=31000))
    assert (env.master_addr, env.master_port) == ("10.1.2.3", 31000)


def test_slurm_port_is_deterministic_and_unprivileged():
    ports = {slurm_master_port(str(job)) for job in range(0, 10**6, 977)}
    assert min(ports) >= SLURM_PORT_BASE and max(ports) < SLURM_PORT_BASE + SLURM_PORT_SPAN
    assert slurm_master_port("31337") == slurm_master_port("31337")
    assert slurm_master_port("1") != slurm_master_port("2")


@pytest.mark.parametrize(
    ("layout", "message"),
    [
        (dict(SLURM_PROCID=4, SLURM_LOCALID=0, SLURM_NTASKS=4), "rank"),
        (dict(SLURM_PROCID=0, SLURM_LOCALID=4, SLURM_NTASKS=8, SLURM_TASKS_PER_NODE="4(x2)"), "local_rank"),
        (
            dict(SLURM_PROCID=0, SLURM_LOCALID=0, SLURM_NTASKS=8, SLURM_NODEID=2, SLURM_TASKS_PER_NODE="4(x2)"),
            "SLURM_NODEID",
        ),
        (dict(SLURM_PROCID=0, SLURM_LOCALID=0), "SLURM_NTASKS"),
        (dict(SLURM_PROCID=0, SLURM_NTASKS=2), "SLURM_LOCALID"),
        (dict(SLURM_PROCID="zero", SLURM_LOCALID=0, SLURM_NTASKS=2), "SLURM_PROCID"),
    ],
)
def test_inconsistent_slurm_values_are_errors(layout, message, scontrol_dir):
    with pytest.raises(ValueError, match=message):
        detect_dist_env(_slurm(**layout, PATH=scontrol_dir))


def test_slurm_without_nodelist_needs_master_addr():
    with pytest.raises(ValueError, match="MASTER_ADDR"):
        detect_dist_env({"SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NTASKS": "2"})


def test_inconsistent_torchrun_values_are_errors():
    with pytest.raises(ValueError, match="rank"):
        detect_dist_env({"RANK": "2", "WORLD_SIZE": "2"})
    with pytest.raises(ValueError, match="local_world_size"):
        detect_dist_env({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "4", "LOCAL_RANK": "0"})


# ---------------------------------------------------------------------------------------------- init


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _slurm_worker(rank: int, world_size: int, port: int, results) -> None:
    # What `srun --ntasks=2 python -m nemofp4.train` gives each task, minus torchrun's variables.
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(name, None)
    environ = {
        "SLURM_PROCID": str(rank),
        "SLURM_LOCALID": str(rank),
        "SLURM_NTASKS": str(world_size),
        "SLURM_NODEID": "0",
        "SLURM_TASKS_PER_NODE": str(world_size),
        "SLURM_JOB_NODELIST": "localhost",
        "SLURM_JOB_ID": "77",
        "MASTER_PORT": str(port),
    }
    env = init_distributed(detect_dist_env(environ), timeout_s=60)
    assert init_distributed(env) is env  # idempotent
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    results.put((rank, dist.get_backend(), dist.get_world_size(), value.item(), os.environ["RANK"]))
    destroy_distributed()
    destroy_distributed()  # safe twice
    assert not dist.is_initialized()


def test_init_distributed_from_simulated_slurm_environment_two_processes():
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    mp.start_processes(_slurm_worker, args=(2, _free_port(), results), nprocs=2, start_method="spawn")
    rows = sorted(results.get() for _ in range(2))
    assert rows == [(0, "gloo", 2, 3.0, "0"), (1, "gloo", 2, 3.0, "1")]


def test_single_process_needs_no_process_group():
    assert not dist.is_initialized()
    env = init_distributed(detect_dist_env({}))
    assert env.world_size == 1 and not dist.is_initialized()


def test_init_distributed_rejects_bad_timeout():
    with pytest.raises(ValueError, match="timeout_s"):
        init_distributed(detect_dist_env({}), timeout_s=0)


def test_sharded_backend_outside_a_launcher_is_a_clear_error():
    from nemofp4.training.dist_env import local_device, require_process_group

    env = detect_dist_env({})
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match=r"distributed.backend=fsdp needs a process group.*torchrun --nproc_per_node"):
        require_process_group("fsdp", env)
    require_process_group("none", env)  # one process, no group: fine
    if not torch.cuda.is_available():
        assert local_device(env) == torch.device("cpu")


@pytest.mark.parametrize(("visible", "local_rank", "expected"), [(1, 3, 0), (8, 3, 3), (8, 0, 0)])
def test_each_rank_computes_on_the_gpu_it_was_given(monkeypatch, visible, local_rank, expected):
    """srun with one GPU bound per task shows each task a single device 0; otherwise the local rank picks."""
    from nemofp4.training.dist_env import local_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    env = DistEnv(
        rank=8 + local_rank,
        local_rank=local_rank,
        world_size=16,
        local_world_size=8,
        node_rank=1,
        master_addr="n1",
        master_port=29500,
        source="slurm",
    )
    assert local_device(env) == torch.device("cuda", expected)


def test_more_ranks_than_gpus_on_a_node_is_a_clear_error(monkeypatch):
    from nemofp4.training.dist_env import local_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    env = DistEnv(
        rank=5,
        local_rank=5,
        world_size=8,
        local_world_size=8,
        node_rank=0,
        master_addr="n1",
        master_port=29500,
        source="slurm",
    )
    with pytest.raises(ValueError, match="local_rank 5 has no GPU"):
        local_device(env)


# ---------------------------------------------------------------------------------------------- the launcher
def test_only_a_torchrun_worker_asks_to_stop_with_its_launcher(monkeypatch):
    from nemofp4.training import dist_env

    asked = []
    monkeypatch.setattr(dist_env, "_request_parent_death_signal", asked.append)
    assert not dist_env.stop_with_launcher({})  # one process, srun: left alone
    assert asked == []
    assert dist_env.stop_with_launcher({"TORCHELASTIC_RUN_ID": "none"}) == sys.platform.startswith("linux")
    assert asked == ([9] if sys.platform.startswith("linux") else [])  # SIGKILL: no checkpoint, no requeue


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux's")
def test_a_worker_whose_launcher_is_already_gone_exits(monkeypatch):
    from nemofp4.training import dist_env

    monkeypatch.setattr(dist_env, "_request_parent_death_signal", lambda sig: None)
    parents = iter([4321, 1])  # the launcher dies between the look and the request: init adopts the worker
    monkeypatch.setattr(os, "getppid", lambda: next(parents))
    with pytest.raises(SystemExit, match=r"the launcher that started this worker \(torchrun, pid 4321\) is gone"):
        dist_env.stop_with_launcher({"TORCHELASTIC_RUN_ID": "none"})
    monkeypatch.setattr(os, "getppid", lambda: 1)  # adopted before it looked
    with pytest.raises(SystemExit):
        dist_env.stop_with_launcher({"TORCHELASTIC_RUN_ID": "none"})


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux's")
def test_the_kernel_holds_the_request():
    """In a fresh process (the request outlives the call): PR_GET_PDEATHSIG reads SIGKILL back."""
    script = (
        "import ctypes, os\nfrom nemofp4.training.dist_env import stop_with_launcher\n"
        "assert stop_with_launcher({'TORCHELASTIC_RUN_ID': 'none'})\n"
        "sig = ctypes.c_int()\nassert ctypes.CDLL(None).prctl(2, ctypes.byref(sig)) == 0\nprint(sig.value)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["9"]
