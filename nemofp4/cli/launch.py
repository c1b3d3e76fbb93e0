"""`nemofp4-launch`: render the SLURM batch script for a training run, print it or submit it.

    nemofp4-launch slurm.nodes=4 slurm.gpus_per_node=8 experiment=nemotron_h_8b_ue5m3 dry_run=true

The script comes from ``slurm/nemofp4.sbatch.tmpl`` (``{{ name }}`` placeholders, filled here) and
runs the trainer in one of two ways (torchtitan issue #1749 asks which; both work):

* ``mode=torchrun``: one task per node, ``srun torchrun --nnodes ... --rdzv_endpoint=<head>:<port>``;
  torchrun starts ``procs_per_node`` workers and sets RANK/LOCAL_RANK/WORLD_SIZE for them.
* ``mode=srun``: one task per process, ``srun --ntasks-per-node=<procs> python -m nemofp4.train``; each
  task derives its rank from SLURM_PROCID/SLURM_LOCALID/SLURM_NTASKS (``nemofp4.training.dist_env``).

Nodes may be GPU nodes (one process per GPU by default) or CPU nodes (``slurm.gpus_per_node=0``, gloo).
Either way the run directory is named, not numbered (``<runs_root>/<job_name>``): a requeued job, a
chained job and a resubmission all resume the same run. Before rendering, the trainer's config is
composed and checked against the job's shape (batch split, backend, data paths), so such mistakes fail
on the submit host rather than after the queue wait. The git commit and the resolved command go to the job log, and
``--signal=B:<sig>@<seconds>`` warns the job before its time limit so the trainer can checkpoint and
requeue (``nemofp4.training.preemption``). Standard output carries only the script (``dry_run=true``)
or the submitted job ids; messages go to standard error.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import shlex
import shutil
import signal as signal_module
import string
import subprocess
import sys
from dataclasses import dataclass, field
from datetime import datetime
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from nemofp4.cli.errors import HydraApp, run_cli
from nemofp4.data.paths import CONFIG_DIR, REPO_ROOT  # the checkout, or the installed wheel's share/
from nemofp4.training.dist_env import SLURM_PORT_BASE, SLURM_PORT_SPAN
from nemofp4.training.preemption import DEFAULT_SIGNALS

if TYPE_CHECKING:
    from nemofp4.training.config import JobConfig

logger = logging.getLogger("nemofp4.launch")

LAUNCH_CONFIG = CONFIG_DIR / "launch.yaml"
# configs/launch.yaml is registered under this name (not "launch", which would collide with the file
# wherever configs/ is on a search path).
PRIMARY_CONFIG_NAME = "nemofp4_launch"
DEFAULT_TEMPLATE = REPO_ROOT / "slurm" / "nemofp4.sbatch.tmpl"
TRAIN_MODULE = "nemofp4.train"
REPLICATE_DEGREE_KEY = "distributed.replicate_degree"

# Every job also exports OMP_NUM_THREADS: the CPUs of one task divided among its processes (PyTorch
# would otherwise start one thread per core of the node in every process).
# Exported on GPU nodes: the caching allocator grows segments instead of fragmenting (long runs with
# varying shapes), NCCL reports warnings only, and a failed or timed-out collective aborts the
# process (then Slurm's --kill-on-bad-exit ends the step) instead of hanging it.
GPU_DEFAULT_ENV: dict[str, str] = {
    "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
    "NCCL_DEBUG": "WARN",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
}


class LaunchMode(Enum):
    """How the training processes are started inside the allocation."""

    torchrun = "torchrun"  # one task per node running torchrun, which starts one worker per GPU
    srun = "srun"  # one task per GPU, ranks from SLURM's variables


@dataclass(kw_only=True)
class SlurmConfig:
    """The allocation and how the job uses it. Optional sbatch settings are omitted when None."""

    nodes: int = 1
    """Number of nodes (``--nodes``)."""
    gpus_per_node: int = 8
    """GPUs per node (``--gpus-per-node``); 0: CPU nodes (no GPU request, gloo), which needs ``procs_per_node``."""
    procs_per_node: int | None = None
    """Training processes per node (torchrun's ``--nproc_per_node``, or srun tasks per node); None: one per GPU."""
    cpus_per_task: int | None = None
    """CPUs per task; None: 8 per GPU the task drives, or 1 per process on CPU nodes."""
    time: str = "04:00:00"
    """Time limit in Slurm's syntax: ``MM``, ``HH:MM:SS``, ``D-HH:MM:SS``, ..."""
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    job_name: str | None = None
    """None: ``nemofp4-<experiment>`` (or ``nemofp4``). Also names the run directory."""
    mode: LaunchMode = LaunchMode.torchrun
    container_image: str | None = None
    """Run the tasks in this container through pyxis/enroot (``srun --container-image``)."""
    container_mounts: list[str] = field(default_factory=list)
    """Extra ``src:dst`` mounts; the working directory is always mounted at the same path."""
    venv: str | None = None
    """Activate this virtual environment in the batch shell (exclusive with ``container_image``)."""
    signal: str | None = "USR1@120"
    """``<SIG>@<seconds>``: send SIG this long before the time limit to the batch shell, which forwards
    it to the tasks (``--signal=B:...``); the trainer then checkpoints and requeues. None: no warning."""
    requeue: bool = True
    """``--requeue`` (else ``--no-requeue``): Slurm may requeue the job and the trainer may requeue it."""
    singleton: bool = False
    """``--dependency=singleton``: jobs with this name run one after another, sharing one run directory."""
    num_chained_jobs: int = 1
    """How many copies to submit; more than one needs ``singleton`` (each resumes the previous one)."""
    exclusive: bool = True
    """``--exclusive``: whole nodes, as multi-GPU training wants."""
    master_port: int | None = None
    """Rendezvous port; None: derived from SLURM_JOB_ID exactly as ``dist_env`` derives it."""
    extra_sbatch: list[str] = field(default_factory=list)
    """More sbatch options, each written as ``--option=value``, e.g. ``--constraint=h100``."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment variables exported before the step, e.g. ``{NCCL_DEBUG: INFO}``. They are added to
    the defaults (``OMP_NUM_THREADS``, plus ``GPU_DEFAULT_ENV`` on GPU nodes) and replace a default of
    the same name; an empty value drops that default."""


@dataclass(kw_only=True)
class LaunchConfig:
    """Primary config of ``nemofp4-launch`` (``configs/launch.yaml``)."""

    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    experiment: str | None = None
    """Experiment preset passed to the trainer as ``experiment=<name>`` (``configs/experiment/``)."""
    train_overrides: list[str] = field(default_factory=list)
    """More Hydra overrides for ``nemofp4-train``; on the command line quote each one, since Hydra
    reads `=` inside a list as syntax: ``'train_overrides=["precision=nvfp4","optim.lr=3e-4"]'``."""
    dry_run: bool = False
    """Print the rendered script to standard output and submit nothing."""
    check_train_config: bool = True
    """Compose the trainer's config with these overrides before rendering, so a typo fails now
    rather than after the queue wait."""
    workdir: str | None = None
    """Directory the job runs in (``--chdir``); None: the current directory."""
    runs_root: str = "runs"
    """Run directories, rendered scripts (``<runs_root>/slurm/``) and job logs go under it."""
    run_dir: str | None = None
    """None: ``<runs_root>/<job_name>``. The job id is no part of it, so a requeued job, a chained job
    and a resubmission of the same script all continue the same run from its latest checkpoint."""
    template: str | None = None
    """sbatch template to render; None: the shipped ``slurm/nemofp4.sbatch.tmpl``."""


def register_configs() -> None:
    """Register the schema and ``configs/launch.yaml`` itself as the primary config.

    The launcher keeps ``configs/`` off its search path on purpose: there ``experiment/`` is a config
    group, so Hydra would read ``experiment=<name>`` as a group override (loading the trainer's preset
    into the launcher's config) instead of the plain string the launcher passes on to the trainer.
    """
    store = ConfigStore.instance()
    store.store(name="launch_schema", node=LaunchConfig)
    store.store(name=PRIMARY_CONFIG_NAME, node=OmegaConf.load(LAUNCH_CONFIG))


# --------------------------------------------------------------------------------------------------
# parsing and validation

_TIME_RE = re.compile(r"^(?:(?P<days>\d+)-)?(?P<rest>\d+(?::\d+){0,2})$")


def parse_slurm_time(text: str) -> int | None:
    """Seconds in a Slurm time limit; None for ``UNLIMITED``/``INFINITE``.

    Slurm's forms: ``M``, ``M:S``, ``H:M:S``, ``D-H``, ``D-H:M``, ``D-H:M:S``.
    """
    if text.strip().upper() in ("UNLIMITED", "INFINITE"):
        return None
    match = _TIME_RE.match(text.strip())
    if match is None:
        raise ValueError(
            f"slurm.time={text!r} is not a Slurm time limit; use e.g. '04:00:00', '1-12:00:00' or '90' (minutes)"
        )
    parts = [int(p) for p in match.group("rest").split(":")]
    if match.group("days") is not None:
        hours, minutes, seconds = (parts + [0, 0])[:3]
        return ((int(match.group("days")) * 24 + hours) * 60 + minutes) * 60 + seconds
    if len(parts) == 1:
        return parts[0] * 60
    if len(parts) == 2:
        return parts[0] * 60 + parts[1]
    return (parts[0] * 60 + parts[1]) * 60 + parts[2]


def parse_signal_spec(text: str) -> tuple[str, int]:
    """``"USR1@120"`` -> ``("USR1", 120)``. A ``B:`` prefix is accepted (the script always uses it);
    without ``@`` Slurm's default of 60 s applies."""
    spec = text.strip()
    spec = spec[2:] if spec.upper().startswith("B:") else spec
    name, _, seconds_text = spec.partition("@")
    name = name.upper().removeprefix("SIG")
    if f"SIG{name}" not in signal_module.Signals.__members__ or name in ("KILL", "STOP"):
        raise ValueError(f"slurm.signal={text!r}: unknown or uncatchable signal {name!r}; use e.g. 'USR1@120'")
    try:
        seconds = int(seconds_text) if seconds_text else 60
    except ValueError:
        raise ValueError(f"slurm.signal={text!r}: the time after '@' must be whole seconds") from None
    if not 0 <= seconds <= 65535:
        raise ValueError(f"slurm.signal={text!r}: seconds must be in [0, 65535] (Slurm's limit)")
    return name, seconds


_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def default_job_name(config: LaunchConfig) -> str:
    if config.slurm.job_name:
        return config.slurm.job_name
    return f"nemofp4-{config.experiment}" if config.experiment else "nemofp4"


def available_experiments() -> list[str]:
    return sorted(path.stem for path in (CONFIG_DIR / "experiment").glob("*.yaml"))


def validate(config: LaunchConfig) -> None:
    """Reject settings that would fail (or silently misbehave) only after the queue wait."""
    slurm = config.slurm
    if slurm.nodes < 1:
        raise ValueError(f"slurm.nodes must be >= 1, got {slurm.nodes}")
    if slurm.gpus_per_node < 0:
        raise ValueError(f"slurm.gpus_per_node must be >= 0 (0: CPU nodes), got {slurm.gpus_per_node}")
    if slurm.procs_per_node is None and slurm.gpus_per_node == 0:
        raise ValueError(
            "slurm.gpus_per_node=0 (CPU nodes) needs slurm.procs_per_node=N, the training processes per node"
        )
    if slurm.procs_per_node is not None and slurm.procs_per_node < 1:
        raise ValueError(f"slurm.procs_per_node must be >= 1 or null (one per GPU), got {slurm.procs_per_node}")
    if slurm.gpus_per_node and procs_per_node(slurm) > slurm.gpus_per_node:
        raise ValueError(
            f"slurm.procs_per_node={slurm.procs_per_node} is more than slurm.gpus_per_node={slurm.gpus_per_node}: "
            "each training process drives one GPU"
        )
    if slurm.cpus_per_task is not None and slurm.cpus_per_task < 1:
        raise ValueError(f"slurm.cpus_per_task must be >= 1 or null, got {slurm.cpus_per_task}")
    time_limit_s = parse_slurm_time(slurm.time)
    if slurm.signal is not None:
        name, seconds = parse_signal_spec(slurm.signal)
        if time_limit_s is not None and seconds >= time_limit_s:
            raise ValueError(
                f"slurm.signal={slurm.signal!r} fires {seconds}s before the end but slurm.time={slurm.time!r} "
                f"is only {time_limit_s}s long"
            )
        if signal_module.Signals[f"SIG{name}"] not in DEFAULT_SIGNALS:
            handled = ", ".join(s.name for s in DEFAULT_SIGNALS)
            logger.warning("slurm.signal uses SIG%s, which the trainer's preemption handler ignores (%s)", name, handled)
    job_name = default_job_name(config)
    if not _NAME_RE.match(job_name):
        raise ValueError(f"job name {job_name!r} must be letters, digits, '.', '_' or '-' (it names a directory)")
    if slurm.container_image and slurm.venv:
        raise ValueError("set slurm.container_image or slurm.venv, not both (the container brings its own Python)")
    if slurm.num_chained_jobs < 1:
        raise ValueError(f"slurm.num_chained_jobs must be >= 1, got {slurm.num_chained_jobs}")
    if slurm.num_chained_jobs > 1 and not slurm.singleton:
        raise ValueError(
            "slurm.num_chained_jobs > 1 needs slurm.singleton=true, otherwise the copies run at the same time"
        )
    if slurm.master_port is not None and not 1024 <= slurm.master_port <= 65535:
        raise ValueError(f"slurm.master_port must be in [1024, 65535], got {slurm.master_port}")
    for option in slurm.extra_sbatch:
        if not option.startswith("--") or "\n" in option:
            raise ValueError(f"slurm.extra_sbatch entry {option!r} must be one '--option[=value]'")
    for name in slurm.env:
        if not _ENV_NAME_RE.match(name):
            raise ValueError(f"slurm.env key {name!r} is not a valid environment variable name")
    for label, path in (("workdir", config.workdir), ("runs_root", config.runs_root), ("run_dir", config.run_dir)):
        if path is not None and (re.search(r'[\s"`\\]', path) or not path):
            raise ValueError(f"{label}={path!r} must be a non-empty path without spaces, quotes or backslashes")
    for override in config.train_overrides:
        if override.split("=", 1)[0].lstrip("+~") == "run_dir":
            raise ValueError(
                f"train_overrides sets run_dir ({override!r}); set the launcher's run_dir instead, "
                "which the script passes to the trainer"
            )
    if config.experiment is not None and CONFIG_DIR.joinpath("experiment").is_dir():
        if config.experiment not in available_experiments():
            raise ValueError(
                f"experiment={config.experiment!r} not found in configs/experiment/; "
                f"available: {', '.join(available_experiments())}"
            )


def procs_per_node(slurm: SlurmConfig) -> int:
    """Training processes per node: ``slurm.procs_per_node``, else one per GPU."""
    return slurm.procs_per_node if slurm.procs_per_node is not None else slurm.gpus_per_node


def world_size(slurm: SlurmConfig) -> int:
    """Training processes of the whole job (data-parallel ranks)."""
    return slurm.nodes * procs_per_node(slurm)


def _tasks_per_node(slurm: SlurmConfig) -> int:
    return 1 if slurm.mode is LaunchMode.torchrun else procs_per_node(slurm)


def job_environment(slurm: SlurmConfig) -> dict[str, str]:
    """What the script exports: the defaults, then ``slurm.env`` (an empty value drops a default)."""
    threads = max(1, _cpus_per_task(slurm) // (procs_per_node(slurm) if slurm.mode is LaunchMode.torchrun else 1))
    environment = {"OMP_NUM_THREADS": str(threads)}
    if slurm.gpus_per_node:
        environment.update(GPU_DEFAULT_ENV)
    environment.update({name: str(value) for name, value in slurm.env.items()})
    return {name: value for name, value in environment.items() if value != ""}


def train_arguments(config: LaunchConfig, run_dir_expression: str) -> list[str]:
    """The trainer's Hydra overrides, shell-quoted, with the run directory last (it may expand $vars)."""
    overrides = [f"experiment={config.experiment}"] if config.experiment else []
    overrides += config.train_overrides
    return [shlex.quote(o) for o in overrides] + [f'run_dir="{run_dir_expression}"']


def check_train_config(config: LaunchConfig, run_dir: str) -> JobConfig:
    """Compose the trainer's config with the same overrides (run_dir made concrete), validate it
    through the trainer's own schema and conversion (``nemofp4.cli.train``), then run every check
    that depends on the job's shape (``check_job_shape``). Returns the trainer's config."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    from nemofp4.cli.train import register_configs as register_train_configs  # heavy: only when asked
    from nemofp4.cli.train import to_job_config

    overrides = [f"experiment={config.experiment}"] if config.experiment else []
    overrides += [*config.train_overrides, f"run_dir={run_dir.replace('${SLURM_JOB_ID}', '0')}"]
    # The launcher's own Hydra context is finished with (its config is already a LaunchConfig);
    # composing the trainer's config needs a fresh one.
    GlobalHydra.instance().clear()
    register_train_configs()
    try:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
            cfg = compose(config_name="train", overrides=overrides, return_hydra_config=True)
            HydraConfig.instance().set_config(cfg)  # serves ${hydra:...} interpolations such as the run name
            with open_dict(cfg):
                del cfg["hydra"]  # its sweep fields only resolve inside a real multirun
            job = to_job_config(cfg)
    except Exception as error:  # Hydra and the schema raise several types; all mean "bad overrides"
        raise ValueError(f"the trainer rejects overrides {overrides}: {error}") from error
    finally:
        GlobalHydra.instance().clear()
    check_job_shape(config, job)
    return job


def _visible(path: str, workdir: Path, *suffixes: str) -> bool:
    """Whether ``path`` (or ``path + suffix`` for one of ``suffixes``) exists as the job will resolve it:
    relative to its working directory, else to the repository root (``nemofp4.data.paths``)."""
    candidates = [Path(path)] if Path(path).is_absolute() else [workdir / path, REPO_ROOT / path]
    return any(Path(f"{c}{suffix}").exists() for c in candidates for suffix in (suffixes or ("",)))


def check_job_shape(config: LaunchConfig, job: JobConfig) -> None:
    """The checks that depend on nodes x processes and on the job's file system, which composing the
    config alone cannot see: the batch split over the ranks, a backend for more than one process, and
    the data and tokenizer paths (seen from the submit host, which shares the job's file system)."""
    from nemofp4.training.config import batch_layouts, compute_budget

    world = world_size(config.slurm)
    shape = f"{config.slurm.nodes} node(s) x {procs_per_node(config.slurm)} process(es) = {world} rank(s)"
    try:
        compute_budget(job.train, world)
    except ValueError as error:
        if job.train.global_batch % (job.train.micro_batch * world):  # name the node counts that divide it
            layouts = batch_layouts(job.train, world, ranks_per_node=procs_per_node(config.slurm))
            error = f"{str(error).split('; ')[0]}; {layouts}"
        raise ValueError(f"{shape}: {error}") from None
    if world > 1 and job.distributed.backend == "none":
        raise ValueError(
            f"{shape} but distributed.backend=none; add 'distributed=fsdp' to train_overrides "
            "(or set slurm.procs_per_node / slurm.nodes to 1)"
        )
    replicate = job.distributed.replicate_degree
    if replicate > 1 and world % replicate:
        raise ValueError(f"{shape}: distributed.replicate_degree={replicate} does not divide the {world} ranks; "
                         f"use a divisor such as the node count {config.slurm.nodes}")
    if config.slurm.gpus_per_node == 0 and job.distributed.engine == "deepspeed":
        raise ValueError(f"distributed.backend={job.distributed.backend} needs GPUs; CPU nodes train with fsdp or none")
    workdir = _workdir(config)
    missing = [
        f"data source {source.name or source.prefix!r}: {label}={prefix!r} (no .manifest.json or .idx)"
        for source in job.data.sources
        for label, prefix in (("prefix", source.prefix), ("validation_prefix", source.validation_prefix))
        if prefix and not _visible(prefix, workdir, ".manifest.json", ".idx")
    ]
    if not _visible(job.data.tokenizer, workdir):
        missing.append(f"data.tokenizer={job.data.tokenizer!r}")
    if missing:
        roots = [workdir] if workdir.resolve() == REPO_ROOT.resolve() else [workdir, REPO_ROOT]
        where = f"(relative paths are looked up under {' and '.join(map(str, roots))}, as the job will)"
        if config.dry_run:  # the script may be meant for another cluster's file system
            logger.warning("not found from this host, the job would fail: %s %s", "; ".join(missing), where)
        else:
            raise FileNotFoundError(
                f"not found from this host: {'; '.join(missing)} {where}; preprocess the data with "
                "nemofp4-preprocess or fix the paths (dry_run=true only warns)"
            )


def _layout(job: JobConfig, world: int) -> str:
    backend, replicate = job.distributed.backend, job.distributed.replicate_degree
    if backend == "fsdp" and replicate > 1:
        return f"fsdp (HSDP: {replicate} replicas x {world // replicate} shard(s))"
    return backend


def describe_job(config: LaunchConfig, job: JobConfig | None) -> list[str]:
    """What the job will run, in a few lines for the submitting user (standard error)."""
    slurm = config.slurm
    world = world_size(slurm)
    hardware = f"{slurm.gpus_per_node} GPU(s)/node, nccl" if slurm.gpus_per_node else "CPU only, gloo"
    lines = [
        f"job {default_job_name(config)}: {slurm.nodes} node(s) x {procs_per_node(slurm)} process(es) = "
        f"{world} rank(s) ({hardware}), {slurm.mode.value} mode, time limit {slurm.time}",
        f"run dir {run_dir_expression(config)} (a requeue or resubmission resumes from its latest checkpoint)",
    ]
    if job is not None:
        from nemofp4.training.config import compute_budget

        budget = compute_budget(job.train, world)
        lines.append(
            f"trains {job.precision.name} with {_layout(job, world)}: {budget.total_steps} steps of "
            f"{job.train.global_batch} x {job.train.seq_len} tokens (micro batch {job.train.micro_batch} x "
            f"{world} rank(s) x {budget.grad_accum} accumulation)"
        )
    return lines


# --------------------------------------------------------------------------------------------------
# rendering


class _SbatchTemplate(string.Template):
    """``{{ name }}`` placeholders: bash's own ``$`` and ``${...}`` stay untouched."""

    pattern = r"""
    \{\{\s*(?P<braced>[a-z_]+)\s*\}\}
    | (?P<escaped>(?!))
    | (?P<named>(?!))
    | (?P<invalid>(?!))
    """


def _cpus_per_task(slurm: SlurmConfig) -> int:
    if slurm.cpus_per_task is not None:
        return slurm.cpus_per_task
    procs_per_task = procs_per_node(slurm) if slurm.mode is LaunchMode.torchrun else 1
    return (8 if slurm.gpus_per_node else 1) * procs_per_task


def _workdir(config: LaunchConfig) -> Path:
    return Path(config.workdir or os.getcwd()).resolve()


def log_folder(config: LaunchConfig) -> Path:
    """Where the job logs go (``--output``). Slurm opens the log before the script runs and does not
    create its folder, so the launcher creates it whenever it renders a script."""
    return _workdir(config) / config.runs_root / "slurm" / "logs"


def run_dir_expression(config: LaunchConfig) -> str:
    """The run directory as the script writes it (may contain ``${SLURM_JOB_ID}``)."""
    if config.run_dir:
        return config.run_dir
    return f"{config.runs_root}/{default_job_name(config)}"


def _sbatch_directives(config: LaunchConfig, workdir: Path) -> list[str]:
    slurm = config.slurm
    options = [
        f"--job-name={default_job_name(config)}",
        f"--nodes={slurm.nodes}",
        f"--ntasks-per-node={_tasks_per_node(slurm)}",
        *([f"--gpus-per-node={slurm.gpus_per_node}"] if slurm.gpus_per_node else []),
        f"--cpus-per-task={_cpus_per_task(slurm)}",
        f"--time={slurm.time}",
    ]
    options += [f"--{name}={value}" for name, value in
                (("partition", slurm.partition), ("account", slurm.account), ("qos", slurm.qos)) if value]  # fmt: skip
    if slurm.exclusive:
        options.append("--exclusive")
    options += [
        f"--chdir={workdir}",
        f"--output={log_folder(config)}/%x-%j.out",
        "--open-mode=append",  # a requeued job keeps its id: append to its log instead of truncating it
    ]
    if slurm.signal is not None:
        name, seconds = parse_signal_spec(slurm.signal)
        options.append(f"--signal=B:{name}@{seconds}")
    options.append("--requeue" if slurm.requeue else "--no-requeue")
    if slurm.singleton:
        options.append("--dependency=singleton")
    options += slurm.extra_sbatch
    return [f"#SBATCH {option}" for option in options]


def _environment_setup(config: LaunchConfig) -> list[str]:
    slurm = config.slurm
    lines: list[str] = []
    if slurm.venv:
        lines.append(f'source "{slurm.venv}/bin/activate"')
    elif slurm.container_image:
        lines.append(f"# tasks run in the container {slurm.container_image} (pyxis); see srun_cmd below")
    else:
        lines.append("# the submission environment (exported by sbatch) provides python and nemofp4")
    lines += [f"export {name}={shlex.quote(value)}" for name, value in job_environment(slurm).items()]
    return lines


def _bash_array(name: str, items: list[str]) -> str:
    body = "\n".join(f"  {item}" for item in items)
    return f"{name}=(\n{body}\n)"


RENDEZVOUS_STORE_BLOCK = """\
# The rendezvous store lives in this shell's job step, not in a torchrun agent: the agent hosting it
# would leave the exit barrier first and take the store down under the others, which then log a
# traceback at the end of a successful run (pytorch/pytorch#69520). It ignores Slurm's signals and
# is killed when this shell exits, after srun has returned. (In a container the batch host may lack
# Python, so there the agents host the store as torchrun does by default.)
rendezvous_ready="$(mktemp -u "${TMPDIR:-/tmp}/nemofp4-rendezvous.XXXXXX")"
python -m nemofp4.cli.rendezvous_store --port "${rdzv_port}" --ready-file "${rendezvous_ready}" &
rendezvous_store_pid=$!
trap 'kill -KILL "${rendezvous_store_pid}" 2>/dev/null || true; rm -f "${rendezvous_ready}"' EXIT
until [[ -f "${rendezvous_ready}" ]]; do
  if ! kill -0 "${rendezvous_store_pid}" 2>/dev/null; then
    log "the rendezvous store did not start on port ${rdzv_port} (is the port taken? set MASTER_PORT)"
    exit 1
  fi
  sleep 0.2
done
log "rendezvous store: pid ${rendezvous_store_pid} on ${head_node}:${rdzv_port}"
"""


def _launch_block(config: LaunchConfig, workdir: Path) -> str:
    slurm = config.slurm
    train_args = train_arguments(config, "${run_dir}")
    srun = [
        'srun --nodes="${SLURM_NNODES}"',
        f"--ntasks-per-node={_tasks_per_node(slurm)}",
        # Slurm >= 22.05 no longer passes sbatch's --cpus-per-task on to srun
        f"--cpus-per-task={_cpus_per_task(slurm)}",
        "--kill-on-bad-exit=1",
    ]
    if slurm.container_image:
        mounts = ",".join([f"{workdir}:{workdir}", *slurm.container_mounts])
        srun += [
            f"--container-image={shlex.quote(slurm.container_image)}",
            f"--container-mounts={shlex.quote(mounts)}",
            f"--container-workdir={workdir}",
        ]
    if slurm.mode is LaunchMode.srun:
        train_cmd = [f"python -m {TRAIN_MODULE}", *train_args]
        return "\n".join([_bash_array("train_cmd", train_cmd), _bash_array("srun_cmd", [*srun, '"${train_cmd[@]}"'])])

    train_cmd = [
        "torchrun",
        '--nnodes="${SLURM_NNODES}"',
        f"--nproc_per_node={procs_per_node(slurm)}",
        "--rdzv_backend=c10d",
        '--rdzv_endpoint="${head_node}:${rdzv_port}"',
        '--rdzv_id="${SLURM_JOB_ID}"',
        *([] if slurm.container_image else ["--rdzv_conf=is_host=false"]),
        f"-m {TRAIN_MODULE}",
        *train_args,
    ]
    ignored = " ".join(dict.fromkeys([*_forwarded_signals(slurm), "TERM"]))
    agent_wrapper = f"bash -c 'trap \"\" {ignored}; exec \"$@\"' torchrun-agent"
    return "\n".join(
        [
            *([] if slurm.container_image else [RENDEZVOUS_STORE_BLOCK.rstrip()]),
            _bash_array("train_cmd", train_cmd),
            "# The signals are meant for the workers (their preemption handler checkpoints). torchrun's agent",
            "# would die of SIGUSR1 and answer SIGTERM by killing the workers 30 s later, so the agent ignores",
            "# them (the wrapper's `trap ''` survives exec) and SIGTERM is taken off torchrun's handled list.",
            "# Slurm signals every process of the step (proctrack/cgroup), so the workers still receive them.",
            "# (Recent torchrun takes the list from --signals-to-handle, i.e. PET_SIGNALS_TO_HANDLE, and",
            "# overwrites TORCHELASTIC_SIGNALS_TO_HANDLE with it; older versions read only the latter.)",
            'export TORCHELASTIC_SIGNALS_TO_HANDLE="SIGINT,SIGHUP,SIGQUIT" PET_SIGNALS_TO_HANDLE="SIGINT,SIGHUP,SIGQUIT"',
            _bash_array("srun_cmd", [*srun, agent_wrapper, '"${train_cmd[@]}"']),
        ]
    )


def _forwarded_signals(slurm: SlurmConfig) -> list[str]:
    return [parse_signal_spec(slurm.signal)[0]] if slurm.signal is not None else []


def _signal_lines(slurm: SlurmConfig) -> tuple[str, str]:
    forwarded = _forwarded_signals(slurm)
    if not forwarded:
        return "# No early-warning signal is configured (slurm.signal=null).", "# (no signal to forward)"
    name, seconds = parse_signal_spec(slurm.signal)
    comment = (
        f"# Slurm sends SIG{name} to this shell {seconds} s before the time limit (--signal=B:{name}@{seconds});\n"
        "# the trap forwards it to srun, which passes it to every task."
    )
    return comment, f"trap 'forward_signal {name}' {name}"


def render_sbatch_script(config: LaunchConfig) -> str:
    """The complete batch script for ``config`` (validated first)."""
    validate(config)
    workdir = _workdir(config)
    template_path = Path(config.template) if config.template else DEFAULT_TEMPLATE
    if not template_path.is_file():
        raise FileNotFoundError(f"sbatch template {template_path} not found (set template=<path> or leave it null)")
    config_yaml = OmegaConf.to_yaml(OmegaConf.structured(config)).rstrip("\n")
    signal_comment, signal_traps = _signal_lines(config.slurm)
    master_port = config.slurm.master_port
    values = {
        "sbatch_directives": "\n".join(_sbatch_directives(config, workdir)),
        "launch_config_comment": "\n".join(f"#   {line}" for line in config_yaml.splitlines()),
        "environment_setup": "\n".join(_environment_setup(config)),
        "run_dir": run_dir_expression(config),
        "master_port_expression": (
            str(master_port) if master_port is not None
            else f"$(({SLURM_PORT_BASE} + SLURM_JOB_ID % {SLURM_PORT_SPAN}))"
        ),  # fmt: skip
        "launch_block": _launch_block(config, workdir),
        "signal_comment": signal_comment,
        "signal_traps": signal_traps,
    }
    try:
        return _SbatchTemplate(template_path.read_text()).substitute(values)
    except KeyError as error:
        raise ValueError(f"template {template_path} uses unknown placeholder {error}; known: {sorted(values)}") from None


# --------------------------------------------------------------------------------------------------
# submission


def submit(config: LaunchConfig, script: str) -> list[str]:
    """Write ``script`` under ``<runs_root>/slurm/`` and ``sbatch`` it ``num_chained_jobs`` times; return the ids."""
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        raise FileNotFoundError(
            "sbatch not found on PATH: submit from a SLURM login node, or use dry_run=true to print the script"
        )
    if config.slurm.venv:
        workdir = _workdir(config)
        activate = (workdir / config.slurm.venv / "bin" / "activate").resolve()
        if not activate.is_file():
            raise FileNotFoundError(f"slurm.venv={config.slurm.venv!r}: {activate} does not exist")
    slurm_dir = log_folder(config).parent
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    script_path = slurm_dir / f"{default_job_name(config)}-{stamp}.sbatch"
    script_path.write_text(script)
    job_ids: list[str] = []
    for _ in range(config.slurm.num_chained_jobs):
        result = subprocess.run([sbatch, "--parsable", str(script_path)], capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise RuntimeError(
                f"sbatch {script_path} failed (status {result.returncode}): {result.stderr.strip()}"
                + (f"; already submitted: {', '.join(job_ids)}" if job_ids else "")
            )
        job_ids.append(result.stdout.strip().split(";")[0])  # --parsable prints "<id>[;<cluster>]"
    logger.info("script: %s", script_path)
    logger.info("logs:   %s", slurm_dir / "logs" / f"{default_job_name(config)}-<job id>.out")
    return job_ids


def _sets_replicate_degree(overrides: list[str]) -> bool:
    return any(o.lstrip("+~").split("=", 1)[0].strip() == REPLICATE_DEGREE_KEY for o in overrides)


def with_hsdp_default(config: LaunchConfig, job: JobConfig) -> tuple[LaunchConfig, JobConfig]:
    """On more than one node under FSDP2, shard within a node and replicate across nodes (HSDP,
    ``distributed.replicate_degree=<nodes>``) unless the overrides set a replicate degree (1 included)
    or the experiment sets one above 1: each block's all-gathers and reduce-scatters then stay on the node's own links
    and only one all-reduce of each rank's gradient shard per step crosses the network. Returns the
    config with the override added and the trainer's config as the job will compose it."""
    nodes = config.slurm.nodes
    if (nodes == 1 or job.distributed.backend != "fsdp" or job.distributed.replicate_degree != 1
            or _sets_replicate_degree(config.train_overrides)):
        return config, job
    override = f"{REPLICATE_DEGREE_KEY}={nodes}"
    logger.info("HSDP across nodes: %s (parameters sharded over each node's %d process(es), gradients all-reduced "
                "across the %d nodes); set %s in train_overrides to choose another layout", override,
                procs_per_node(config.slurm), nodes, REPLICATE_DEGREE_KEY)  # fmt: skip
    config = dataclasses.replace(config, train_overrides=[*config.train_overrides, override])
    job = dataclasses.replace(job, distributed=dataclasses.replace(job.distributed, replicate_degree=nodes))
    return config, job


def launch(config: LaunchConfig) -> list[str]:
    """Render; print (dry run) or submit. Returns the submitted job ids (none for a dry run)."""
    validate(config)
    job = None
    if config.check_train_config:
        job = check_train_config(config, run_dir_expression(config))
        config, job = with_hsdp_default(config, job)
    elif config.slurm.nodes > 1 and not _sets_replicate_degree(config.train_overrides):
        logger.warning("check_train_config=false: the launcher cannot tell the backend, so it leaves %s as the "
                       "config has it (1: FSDP over all %d ranks); add %s=%d to train_overrides for HSDP across "
                       "nodes", REPLICATE_DEGREE_KEY, world_size(config.slurm), REPLICATE_DEGREE_KEY,
                       config.slurm.nodes)  # fmt: skip
    script = render_sbatch_script(config)
    log_folder(config).mkdir(parents=True, exist_ok=True)  # also for a dry run: `sbatch job.sbatch` needs it
    for line in describe_job(config, job):
        logger.info("%s", line)
    logger.info("job log: %s/%s-<job id>.out", log_folder(config), default_job_name(config))
    if config.dry_run:
        sys.stdout.write(script)
        sys.stdout.flush()
        return []
    job_ids = submit(config, script)
    for job_id in job_ids:
        print(f"submitted job {job_id}", flush=True)
    return job_ids


@hydra.main(version_base=None, config_path=None, config_name=PRIMARY_CONFIG_NAME)
def _hydra_main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if HydraConfig.get().mode is RunMode.MULTIRUN:
        raise ValueError(
            "nemofp4-launch renders one job; sweep with the trainer's SLURM launcher instead: "
            "nemofp4-train -m precision=bf16,ue5m3 hydra/launcher=slurm ... (docs/slurm.md)"
        )
    launch(OmegaConf.to_object(cfg))


def main() -> None:
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="[nemofp4-launch] %(message)s")
    register_configs()
    run_cli(_hydra_main, name="nemofp4-launch", app=HydraApp(PRIMARY_CONFIG_NAME))


if __name__ == "__main__":
    main()
