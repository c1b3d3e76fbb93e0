"""Rank derivation from torchrun's and SLURM's environments, Slurm's list syntaxes, and a real gloo init."""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hypothesis import given, settings
from hypothesis import strategies as st

from nemofp4.training.dist_env import (
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


@pytest.mark.parametrize(
    ("hostlist", "expected"),
    [
        ("node1", ["node1"]),
        ("a,b,c", ["a", "b", "c"]),
        ("gpu-[001-004,010],login1", ["gpu-001", "gpu-002", "gpu-003", "gpu-004", "gpu-010", "login1"]),
        ("n[8-11]", ["n8", "n9", "n10", "n11"]),
        ("n[08-11]", ["n08", "n09", "n10", "n11"]),
        ("n[098-101]", ["n098", "n099", "n100", "n101"]),
        ("n[3]", ["n3"]),
        ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
        ("x[1,3],y[2-3]z", ["x1", "x3", "y2z", "y3z"]),
        ("10.0.0.[1-2]", ["10.0.0.1", "10.0.0.2"]),
    ],
)
def test_expand_hostlist(hostlist, expected):
    assert expand_hostlist(hostlist) == expected


@pytest.mark.parametrize("bad", ["", "a,,b", "n[1-2", "n1-2]", "n[2-1]", "n[a-b]", "n[[1]]", "n[]", "n[1-]"])
def test_expand_hostlist_rejects_malformed(bad):
    with pytest.raises(ValueError):
        expand_hostlist(bad)


def _compress(prefix: str, numbers: list[int], width: int) -> str:
    """Reference compressor: consecutive runs become lo-hi ranges, zero-padded to ``width``."""
    runs: list[tuple[int, int]] = []
    for n in numbers:
        if runs and n == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], n)
        else:
            runs.append((n, n))
    parts = [f"{lo:0{width}d}" if lo == hi else f"{lo:0{width}d}-{hi:0{width}d}" for lo, hi in runs]
    return f"{prefix}[{','.join(parts)}]"


@settings(max_examples=60, deadline=None)
@given(
    groups=st.lists(
        st.tuples(
            st.sampled_from(["gpu-", "node", "r1n", "x"]),
            st.lists(st.integers(0, 999), min_size=1, max_size=12, unique=True).map(sorted),
            st.integers(1, 4),
        ),
        min_size=1,
        max_size=3,
    )
)
def test_expand_hostlist_inverts_a_reference_compressor(groups):
    expected = [f"{prefix}{n:0{width}d}" for prefix, numbers, width in groups for n in numbers]
    compressed = ",".join(_compress(prefix, numbers, width) for prefix, numbers, width in groups)
    assert expand_hostlist(compressed) == expected


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
        rank=0, local_rank=0, world_size=1, local_world_size=1, node_rank=0,
        master_addr="127.0.0.1", master_port=29500, source="single",
    )  # fmt: skip
    assert env.is_main and not env.is_distributed


def test_torchrun_environment():
    environ = {
        "RANK": "13", "LOCAL_RANK": "5", "WORLD_SIZE": "32", "LOCAL_WORLD_SIZE": "8", "GROUP_RANK": "1",
        "MASTER_ADDR": "gpu-001", "MASTER_PORT": "29400",
    }  # fmt: skip
    env = detect_dist_env(environ)
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size, env.node_rank) == (13, 5, 32, 8, 1)
    assert (env.master_addr, env.master_port, env.source) == ("gpu-001", 29400, "torchrun")


def test_torchrun_wins_over_slurm():
    """Inside `srun torchrun`, SLURM_PROCID is the agent's task (the node), not the worker's rank."""
    environ = {
        "RANK": "9", "LOCAL_RANK": "1", "WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8", "GROUP_RANK": "1",
        "MASTER_ADDR": "gpu-001", "MASTER_PORT": "29500",
        "SLURM_PROCID": "1", "SLURM_LOCALID": "0", "SLURM_NTASKS": "2", "SLURM_NODEID": "1",
        "SLURM_JOB_NODELIST": "gpu-[001-002]", "SLURM_JOB_ID": "4242", "SLURM_TASKS_PER_NODE": "1(x2)",
    }  # fmt: skip
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
        (dict(SLURM_PROCID=6, SLURM_LOCALID=2, SLURM_NTASKS=12, SLURM_NODEID=1, SLURM_TASKS_PER_NODE="4(x3)"),
         (6, 2, 12, 4, 1)),
        # uneven: 4,4,3 tasks; the last node has 3
        (dict(SLURM_PROCID=10, SLURM_LOCALID=2, SLURM_NTASKS=11, SLURM_NODEID=2, SLURM_TASKS_PER_NODE="4(x2),3"),
         (10, 2, 11, 3, 2)),
        # only --ntasks-per-node known
        (dict(SLURM_PROCID=3, SLURM_LOCALID=1, SLURM_NTASKS=6, SLURM_NODEID=1, SLURM_NTASKS_PER_NODE=2),
         (3, 1, 6, 2, 1)),
        # the step's layout wins over the job's (srun on part of the allocation)
        (dict(SLURM_PROCID=1, SLURM_LOCALID=1, SLURM_NTASKS=2, SLURM_NODEID=0, SLURM_TASKS_PER_NODE="8(x3)",
              SLURM_STEP_TASKS_PER_NODE="2", SLURM_STEP_NUM_TASKS=2),
         (1, 1, 2, 2, 0)),
        # one task, nothing else known
        (dict(SLURM_PROCID=0, SLURM_LOCALID=0, SLURM_NTASKS=1), (0, 0, 1, 1, 0)),
    ],
)
def test_slurm_layouts(layout, expected):
    env = detect_dist_env(_slurm(**layout))
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size, env.node_rank) == expected
    assert env.source == "slurm"
    assert env.master_addr == "gpu-007"  # first host of the compressed list
    assert env.master_port == SLURM_PORT_BASE + 123457 % SLURM_PORT_SPAN == 23457


def test_slurm_master_from_step_nodelist_and_env_overrides():
    base = dict(SLURM_PROCID=0, SLURM_LOCALID=0, SLURM_NTASKS=2, SLURM_TASKS_PER_NODE="1(x2)")
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
        (dict(SLURM_PROCID=0, SLURM_LOCALID=0, SLURM_NTASKS=8, SLURM_NODEID=2, SLURM_TASKS_PER_NODE="4(x2)"),
         "SLURM_NODEID"),
        (dict(SLURM_PROCID=0, SLURM_LOCALID=0), "SLURM_NTASKS"),
        (dict(SLURM_PROCID=0, SLURM_NTASKS=2), "SLURM_LOCALID"),
        (dict(SLURM_PROCID="zero", SLURM_LOCALID=0, SLURM_NTASKS=2), "SLURM_PROCID"),
    ],
)
def test_inconsistent_slurm_values_are_errors(layout, message):
    with pytest.raises(ValueError, match=message):
        detect_dist_env(_slurm(**layout))


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
        "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank), "SLURM_NTASKS": str(world_size),
        "SLURM_NODEID": "0", "SLURM_TASKS_PER_NODE": str(world_size), "SLURM_JOB_NODELIST": "localhost",
        "SLURM_JOB_ID": "77", "MASTER_PORT": str(port),
    }  # fmt: skip
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
