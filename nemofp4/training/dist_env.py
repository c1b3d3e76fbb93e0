"""Process-group setup from torchrun's environment or, when it is absent, from SLURM's.

Two launch styles must both work (torchtitan issue #1749, Megatron's ``_slurm_utils``):

* ``srun torchrun ... -m nemofp4.train``: one SLURM task per node starts a torchrun agent, which sets
  ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ... for its workers. Those variables win, because inside a
  torchrun worker the SLURM variables describe the agent's task, not the worker.
* ``srun python -m nemofp4.train``: one SLURM task per GPU and no torchrun. Ranks come from
  ``SLURM_PROCID`` / ``SLURM_LOCALID`` / ``SLURM_NTASKS``, the rendezvous host is the first host of the
  step's node list, and the port is derived from the job id so every task computes the same one.

With neither, the process is a single-process run. ``init_distributed`` then turns a ``DistEnv`` into an
initialized default process group (NCCL on GPUs, gloo on CPU).

Two timeouts: start-up (the rendezvous, rank 0 building the sample index, the first checkpoint load, the
first step's compilation) may legitimately keep ranks apart for many minutes, so the group starts with a
long one; once training runs, a collective that waits minutes means a rank is stuck or gone, and every
second of waiting is every GPU's, so ``set_collective_timeout`` shortens it for every group (TorchTitan
uses 300 s and then 100 s; Megatron 10 minutes throughout). A gloo collective that times out raises in
the waiting rank (``collective_timeout`` names the operation); NCCL's error handling aborts the process.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import traceback
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

DistSource = Literal["torchrun", "slurm", "single"]

DEFAULT_MASTER_ADDR = "127.0.0.1"
DEFAULT_MASTER_PORT = 29500
# Ports derived from SLURM_JOB_ID fall in [SLURM_PORT_BASE, SLURM_PORT_BASE + SLURM_PORT_SPAN): unprivileged
# and below Linux's default ephemeral range (32768-60999), so an outgoing connection rarely holds one.
SLURM_PORT_BASE = 20000
SLURM_PORT_SPAN = 10000
DEFAULT_STARTUP_TIMEOUT_S = 1800.0
"""Collective timeout from the rendezvous to the end of the first step (``distributed.startup_timeout_s``)."""
DEFAULT_COLLECTIVE_TIMEOUT_S = 300.0
"""Collective timeout once the first step is done (``distributed.collective_timeout_s``)."""


@dataclass(frozen=True, kw_only=True)
class DistEnv:
    """Where this process sits in the job. Ranks are global unless prefixed ``local_`` (within a node)."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    master_addr: str
    master_port: int
    source: DistSource

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, world_size={self.world_size}), got {self.rank}")
        if not 1 <= self.local_world_size <= self.world_size:
            raise ValueError(
                f"local_world_size must be in [1, world_size={self.world_size}], got {self.local_world_size}"
            )
        if not 0 <= self.local_rank < self.local_world_size:
            raise ValueError(
                f"local_rank must be in [0, local_world_size={self.local_world_size}), got {self.local_rank}"
            )
        if self.node_rank < 0:
            raise ValueError(f"node_rank must be >= 0, got {self.node_rank}")
        if not 1 <= self.master_port <= 65535:
            raise ValueError(f"master_port must be in [1, 65535], got {self.master_port}")
        if not self.master_addr:
            raise ValueError("master_addr must not be empty")
        if self.source not in ("torchrun", "slurm", "single"):
            raise ValueError(f"source must be 'torchrun', 'slurm' or 'single', got {self.source!r}")

    @property
    def is_main(self) -> bool:
        """Rank 0: the process that writes shared files and logs."""
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1


# --------------------------------------------------------------------------------------------------
# Slurm's compressed list syntaxes


def expand_hostlist(hostlist: str, *, environ: Mapping[str, str] = os.environ) -> list[str]:
    """Expand Slurm's compressed host list (``"gpu-[001-003,010],login1"``) in Slurm's order, by asking
    Slurm itself (``scontrol show hostnames``, looked up on ``environ``'s PATH). A list without
    brackets is split at its commas without it."""
    if not hostlist.strip():
        raise ValueError("the SLURM host list is empty")
    if "[" not in hostlist and "]" not in hostlist:
        return [host.strip() for host in hostlist.split(",") if host.strip()]
    scontrol = shutil.which("scontrol", path=environ.get("PATH", os.environ.get("PATH")))
    if scontrol is None:
        raise ValueError(
            f"cannot expand the SLURM host list {hostlist!r}: scontrol is not on PATH; "
            "set MASTER_ADDR to the first host instead"
        )
    try:
        result = subprocess.run(
            [scontrol, "show", "hostnames", hostlist], capture_output=True, text=True, timeout=60, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        raise ValueError(f"scontrol show hostnames {hostlist!r} failed: {error}; set MASTER_ADDR instead") from None
    hosts = result.stdout.split()
    if result.returncode != 0 or not hosts:
        raise ValueError(
            f"scontrol show hostnames {hostlist!r} failed (status {result.returncode}): {result.stderr.strip()}"
        )
    return hosts


_TASKS_RE = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def expand_tasks_per_node(tasks_per_node: str) -> list[int]:
    """Expand ``SLURM_TASKS_PER_NODE``'s syntax, e.g. ``"4(x2),3"`` -> ``[4, 4, 3]`` (one entry per node)."""
    counts: list[int] = []
    for item in tasks_per_node.split(","):
        match = _TASKS_RE.match(item.strip())
        if match is None:
            raise ValueError(
                f"bad tasks-per-node entry {item!r} in {tasks_per_node!r}: expected 'N' or 'N(xM)', e.g. 4(x2),3"
            )
        repeat = int(match.group(2)) if match.group(2) is not None else 1
        counts.extend([int(match.group(1))] * repeat)
    return counts


# --------------------------------------------------------------------------------------------------
# detection


def _int_var(environ: Mapping[str, str], name: str) -> int:
    value = environ[name]
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def _first_int_var(environ: Mapping[str, str], names: tuple[str, ...]) -> int | None:
    for name in names:
        if name in environ:
            return _int_var(environ, name)
    return None


def slurm_master_port(job_id: str) -> int:
    """The rendezvous port every task of job ``job_id`` derives on its own (the sbatch template agrees)."""
    try:
        job_number = int(job_id)
    except ValueError:
        raise ValueError(f"SLURM_JOB_ID={job_id!r} is not an integer") from None
    return SLURM_PORT_BASE + job_number % SLURM_PORT_SPAN


def _detect_torchrun(environ: Mapping[str, str]) -> DistEnv:
    missing = [name for name in ("RANK", "WORLD_SIZE") if name not in environ]
    if missing:
        raise ValueError(
            f"incomplete torchrun environment: {', '.join(missing)} not set (RANK and WORLD_SIZE go together)"
        )
    rank = _int_var(environ, "RANK")
    world_size = _int_var(environ, "WORLD_SIZE")
    # A hand-made environment (RANK/WORLD_SIZE only) is taken as a single node.
    local_world_size = _first_int_var(environ, ("LOCAL_WORLD_SIZE",))
    if local_world_size is None:
        local_world_size = world_size
    local_rank = _first_int_var(environ, ("LOCAL_RANK",))
    if local_rank is None:
        local_rank = rank % local_world_size
    node_rank = _first_int_var(environ, ("GROUP_RANK",))
    if node_rank is None:
        node_rank = rank // local_world_size
    master_port = _first_int_var(environ, ("MASTER_PORT",))
    return DistEnv(
        rank=rank,
        local_rank=local_rank,
        world_size=world_size,
        local_world_size=local_world_size,
        node_rank=node_rank,
        master_addr=environ.get("MASTER_ADDR", DEFAULT_MASTER_ADDR),
        master_port=DEFAULT_MASTER_PORT if master_port is None else master_port,
        source="torchrun",
    )


def _detect_slurm(environ: Mapping[str, str]) -> DistEnv:
    rank = _int_var(environ, "SLURM_PROCID")
    # Inside an srun step the STEP_ variables describe the step, which may use only part of the
    # allocation; the job-level names are the fallback (srun also overwrites them for its tasks).
    world_size = _first_int_var(environ, ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS"))
    if world_size is None:
        raise ValueError("SLURM_PROCID is set but SLURM_NTASKS is not: cannot tell the world size")
    local_rank = _first_int_var(environ, ("SLURM_LOCALID",))
    if local_rank is None:
        raise ValueError("SLURM_PROCID is set but SLURM_LOCALID is not: cannot tell the local rank")
    node_rank = _first_int_var(environ, ("SLURM_NODEID",)) or 0

    local_world_size: int | None = None
    for name in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        if name in environ:
            per_node = expand_tasks_per_node(environ[name])
            if node_rank >= len(per_node):
                raise ValueError(
                    f"SLURM_NODEID={node_rank} but {name}={environ[name]!r} describes only {len(per_node)} node(s)"
                )
            local_world_size = per_node[node_rank]
            break
    if local_world_size is None:
        local_world_size = _first_int_var(environ, ("SLURM_NTASKS_PER_NODE",))
    if local_world_size is None:
        local_world_size = world_size  # nothing says otherwise: one node

    job_id = environ.get("SLURM_JOB_ID")
    master_port = _first_int_var(environ, ("MASTER_PORT",))
    if master_port is None:
        master_port = slurm_master_port(job_id) if job_id is not None else DEFAULT_MASTER_PORT

    master_addr = environ.get("MASTER_ADDR")
    if master_addr is None and world_size > 1:
        # Task 0 runs on the first node of the step (block distribution), which is where it listens.
        for name in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"):
            if environ.get(name):
                master_addr = expand_hostlist(environ[name], environ=environ)[0]
                break
    if master_addr is None:
        if world_size > 1:
            raise ValueError(
                "SLURM gives no node list (SLURM_STEP_NODELIST, SLURM_JOB_NODELIST or SLURM_NODELIST) "
                "and MASTER_ADDR is not set: cannot tell where rank 0 listens"
            )
        master_addr = DEFAULT_MASTER_ADDR

    return DistEnv(
        rank=rank,
        local_rank=local_rank,
        world_size=world_size,
        local_world_size=local_world_size,
        node_rank=node_rank,
        master_addr=master_addr,
        master_port=master_port,
        source="slurm",
    )


def detect_dist_env(environ: Mapping[str, str] = os.environ) -> DistEnv:
    """Read this process's place in the job from torchrun's variables, else SLURM's, else single.

    Raises ValueError naming the variable when values are missing, malformed or inconsistent
    (rank >= world size, a node id beyond the node list, ...).
    """
    if "RANK" in environ or "WORLD_SIZE" in environ:
        return _detect_torchrun(environ)
    if "SLURM_PROCID" in environ:
        return _detect_slurm(environ)
    return DistEnv(
        rank=0,
        local_rank=0,
        world_size=1,
        local_world_size=1,
        node_rank=0,
        master_addr=environ.get("MASTER_ADDR", DEFAULT_MASTER_ADDR),
        master_port=_first_int_var(environ, ("MASTER_PORT",)) or DEFAULT_MASTER_PORT,
        source="single",
    )


# --------------------------------------------------------------------------------------------------
# process group


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def _cuda_device_index(env: DistEnv) -> int:
    """The GPU this rank drives: its local rank, or 0 when SLURM bound one GPU to each task."""
    device_count = torch.cuda.device_count()
    if device_count == 1:
        return 0
    if env.local_rank >= device_count:
        raise ValueError(
            f"local_rank {env.local_rank} has no GPU: this node shows {device_count} CUDA device(s); "
            f"start at most {device_count} processes per node"
        )
    return env.local_rank


def local_device(env: DistEnv) -> torch.device:
    """The device this rank computes on: its GPU (the one it was given: GPU 0 when SLURM bound one GPU
    to each task, else the one of its local rank), or the CPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", _cuda_device_index(env))


def require_process_group(backend: str, env: DistEnv) -> None:
    """FSDP2 needs a process group, which only a launcher (torchrun, srun) provides; without one it
    would fail deep inside ``fully_shard``. (DeepSpeed creates its own group when there is none.)
    Several launched processes need a backend that spreads the model over them."""
    if env.world_size > 1 and backend == "none":
        raise ValueError(
            f"{env.world_size} processes were launched but distributed.backend=none; "
            "use distributed=fsdp (or a deepspeed_zero* backend)"
        )
    if backend == "fsdp" and not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            f"distributed.backend={backend} needs a process group, but this is a single process started "
            f"without a launcher (source: {env.source}); start it with "
            f"`torchrun --nproc_per_node=N -m nemofp4.train distributed={backend} ...` (or srun), "
            "or train one process with distributed=none"
        )


def all_reduce_mean(value: torch.Tensor) -> torch.Tensor:
    """The mean of ``value`` over the ranks (``value`` itself in one process)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
        value /= dist.get_world_size()
    return value


def init_distributed(
    env: DistEnv, *, backend: str | None = None, timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S
) -> DistEnv:
    """Initialize the default process group described by ``env`` (idempotent) and return ``env``.

    Picks NCCL when CUDA is available and gloo otherwise, and binds the CUDA device (from the local
    rank) before NCCL starts. A single process outside torchrun needs no process group and its
    environment is left alone; one launched by torchrun gets a group anyway, so code written for groups
    runs unchanged. When a group is created, MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE/LOCAL_RANK/
    LOCAL_WORLD_SIZE are exported where missing so libraries that read them (DeepSpeed) agree with us;
    the rendezvous itself uses ``env``'s address, so a DistEnv built from another mapping is honoured.
    """
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s}")
    if dist.is_initialized():
        if dist.get_rank() != env.rank or dist.get_world_size() != env.world_size:
            raise ValueError(
                f"a process group is already initialized as rank {dist.get_rank()} of "
                f"{dist.get_world_size()}, which disagrees with rank {env.rank} of {env.world_size}"
            )
        return env

    backend = backend or default_backend()
    device_id: torch.device | None = None
    if torch.cuda.is_available():
        device_id = torch.device("cuda", _cuda_device_index(env))
        torch.cuda.set_device(device_id)
    if "nccl" not in backend:
        device_id = None  # eager (device-bound) init is an NCCL feature

    if env.world_size > 1 or env.source == "torchrun":
        for name, value in (
            ("MASTER_ADDR", env.master_addr),
            ("MASTER_PORT", str(env.master_port)),
            ("RANK", str(env.rank)),
            ("WORLD_SIZE", str(env.world_size)),
            ("LOCAL_RANK", str(env.local_rank)),
            ("LOCAL_WORLD_SIZE", str(env.local_world_size)),
        ):
            os.environ.setdefault(name, value)
        logger.info(
            "init process group: backend=%s rank=%d/%d local_rank=%d node=%d master=%s:%d (from %s)",
            backend,
            env.rank,
            env.world_size,
            env.local_rank,
            env.node_rank,
            env.master_addr,
            env.master_port,
            env.source,
        )
        dist.init_process_group(
            backend=backend,
            init_method=f"tcp://{_format_host(env.master_addr)}:{env.master_port}",
            rank=env.rank,
            world_size=env.world_size,
            timeout=timedelta(seconds=timeout_s),
            device_id=device_id,
        )
    return env


def _format_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def set_collective_timeout(timeout_s: float, *, keep: Iterable[dist.ProcessGroup | None] = ()) -> int:
    """Give every process group of this process (the default group and all groups made after it, such as
    the device mesh's) the timeout ``timeout_s`` for the collectives issued from now on, except the groups
    in ``keep``; returns how many groups changed. Collective in spirit (call it on every rank at the same
    point, e.g. right after a step) but it communicates nothing."""
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s}")
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    from torch.distributed.distributed_c10d import _set_pg_timeout, _world  # what TorchTitan uses, too

    kept = {id(group) for group in keep if group is not None}
    changed = 0
    for group in list(_world.pg_map):
        if id(group) not in kept:
            _set_pg_timeout(timedelta(seconds=timeout_s), group)
            changed += 1
    return changed


_TIMEOUT_RE = re.compile(r"timed out|timeout", re.IGNORECASE)


def collective_timeout(error: BaseException) -> str | None:
    """If ``error`` is a collective's timeout (gloo raises one in the waiting thread), the operation and
    where it was issued, e.g. ``all_reduce (nemofp4/training/preemption.py:should_stop)``; else None."""
    if not isinstance(error, RuntimeError) or not _TIMEOUT_RE.search(str(error)):
        return None
    frames = traceback.extract_tb(error.__traceback__)
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # .../nemofp4
    c10d = [f for f in frames if f.filename.endswith(os.path.join("distributed", "distributed_c10d.py"))]
    ours = [f for f in frames if os.path.abspath(f.filename).startswith(package + os.sep)]
    operation = c10d[-1].name if c10d else "a collective"
    if ours:
        where = ours[-1]
        path = os.path.relpath(os.path.abspath(where.filename), os.path.dirname(package)).replace(os.sep, "/")
        operation += f" ({path}:{where.name})"
    return operation


# --------------------------------------------------------------------------------------------------
# the launcher's workers

PR_SET_PDEATHSIG = 1
"""prctl(2)'s option that asks the kernel for a signal when this process's parent dies."""
TORCHRUN_ENV = "TORCHELASTIC_RUN_ID"
"""Set by torchrun's agent in every worker it starts (and by nothing else we run under)."""


def _request_parent_death_signal(sig: int) -> None:
    """prctl(PR_SET_PDEATHSIG, sig) for this process; OSError when the kernel refuses."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno))


def stop_with_launcher(environ: Mapping[str, str] = os.environ) -> bool:
    """In a worker torchrun started (Linux): have the kernel SIGKILL this process when its launcher dies;
    returns whether it was asked. Anything else (one process, srun, another OS) is left alone.

    torchrun starts each worker in a session of its own, so a SIGKILL to the launcher's process group
    (``kill -9 -<pgid>``, a job step's teardown that only reaches the launcher) does not reach them, and
    without this they train on, orphaned, and keep writing checkpoints. SIGKILL, not SIGTERM: SIGTERM is
    the scheduler's preemption notice, after which the ranks checkpoint and rank 0 requeues the job
    (:mod:`nemofp4.training.preemption`); orphans of a dead launcher doing that would save into a run
    directory that the requeued or restarted job may already be resuming in, and requeue it again. A
    kill at any point leaves the previous complete checkpoint, which ``resume=auto`` continues from,
    and a stale ``run.lock`` that the next start takes over. A launcher that died before the request
    took (this process's parent is then init, or another process than a moment before) ends the worker
    at once. The kernel sends the signal when the launcher's thread that started the worker ends;
    torchrun starts its workers from its main thread."""
    if TORCHRUN_ENV not in environ or not sys.platform.startswith("linux"):
        return False
    launcher = os.getppid()
    try:
        _request_parent_death_signal(int(signal.SIGKILL))
    except (OSError, AttributeError) as err:  # AttributeError: a C library without prctl
        logger.warning(
            "could not ask to be stopped with the launcher (prctl: %s); if torchrun is killed, this "
            "worker keeps running",
            err,
        )
        return False
    if launcher == 1 or os.getppid() != launcher:
        sys.exit(f"the launcher that started this worker (torchrun, pid {launcher}) is gone; this worker exits")
    return True


def destroy_distributed() -> None:
    """Tear down the default process group if one exists (safe to call more than once)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
