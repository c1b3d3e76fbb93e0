"""The launcher's typed config (``configs/launch.yaml``: the SLURM job and what it trains), its
parsing and the checks that need no trainer config; ``nemofp4.cli.launch`` renders and submits it."""

from __future__ import annotations

import logging
import re
import signal as signal_module
from dataclasses import dataclass, field
from enum import Enum

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from nemofp4.data.paths import CONFIG_DIR, REPO_ROOT  # the checkout, or the installed wheel's share/
from nemofp4.training.preemption import DEFAULT_SIGNALS

logger = logging.getLogger("nemofp4.launch")

LAUNCH_CONFIG = CONFIG_DIR / "launch.yaml"
# configs/launch.yaml is registered under this name (not "launch", which would collide with the file
# wherever configs/ is on a search path).
PRIMARY_CONFIG_NAME = "nemofp4_launch"
DEFAULT_TEMPLATE = REPO_ROOT / "slurm" / "nemofp4.sbatch.tmpl"
TRAIN_MODULE = "nemofp4.train"
REPLICATE_DEGREE_KEY = "distributed.replicate_degree"


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
            logger.warning(
                "slurm.signal uses SIG%s, which the trainer's preemption handler ignores (%s)", name, handled
            )
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
