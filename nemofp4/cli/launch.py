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
import shlex
import shutil
import string
import subprocess
import sys
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

import hydra
from omegaconf import DictConfig, OmegaConf

from nemofp4.cli.errors import HydraApp, run_cli
from nemofp4.cli.launch_config import (
    CONFIG_DIR,
    DEFAULT_TEMPLATE,
    PRIMARY_CONFIG_NAME,
    REPLICATE_DEGREE_KEY,
    TRAIN_MODULE,
    LaunchConfig,
    LaunchMode,
    SlurmConfig,
    default_job_name,
    parse_signal_spec,
    parse_slurm_time,
    procs_per_node,
    register_configs,
    validate,
    world_size,
)
from nemofp4.data.paths import REPO_ROOT  # the checkout, or the installed wheel's share/
from nemofp4.training.dist_env import SLURM_PORT_BASE, SLURM_PORT_SPAN

if TYPE_CHECKING:
    from nemofp4.training.config import JobConfig

# the launcher's config and its parsing are re-exported: nemofp4.cli.launch is the command's one module to import
__all__ = [
    "CONFIG_DIR",
    "PRIMARY_CONFIG_NAME",
    "LaunchConfig",
    "LaunchMode",
    "SlurmConfig",
    "check_train_config",
    "launch",
    "main",
    "parse_signal_spec",
    "parse_slurm_time",
    "register_configs",
    "render_sbatch_script",
    "submit",
    "validate",
    "with_hsdp_default",
]

logger = logging.getLogger("nemofp4.launch")

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
        raise ValueError(
            f"{shape}: distributed.replicate_degree={replicate} does not divide the {world} ranks; "
            f"use a divisor such as the node count {config.slurm.nodes}"
        )
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
    options += [
        f"--{name}={value}"
        for name, value in (("partition", slurm.partition), ("account", slurm.account), ("qos", slurm.qos))
        if value
    ]
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
    agent_wrapper = f'bash -c \'trap "" {ignored}; exec "$@"\' torchrun-agent'
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
            str(master_port)
            if master_port is not None
            else f"$(({SLURM_PORT_BASE} + SLURM_JOB_ID % {SLURM_PORT_SPAN}))"
        ),
        "launch_block": _launch_block(config, workdir),
        "signal_comment": signal_comment,
        "signal_traps": signal_traps,
    }
    try:
        return _SbatchTemplate(template_path.read_text()).substitute(values)
    except KeyError as error:
        raise ValueError(
            f"template {template_path} uses unknown placeholder {error}; known: {sorted(values)}"
        ) from None


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
    if (
        nodes == 1
        or job.distributed.backend != "fsdp"
        or job.distributed.replicate_degree != 1
        or _sets_replicate_degree(config.train_overrides)
    ):
        return config, job
    override = f"{REPLICATE_DEGREE_KEY}={nodes}"
    logger.info(
        "HSDP across nodes: %s (parameters sharded over each node's %d process(es), gradients all-reduced "
        "across the %d nodes); set %s in train_overrides to choose another layout",
        override,
        procs_per_node(config.slurm),
        nodes,
        REPLICATE_DEGREE_KEY,
    )
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
        logger.warning(
            "check_train_config=false: the launcher cannot tell the backend, so it leaves %s as the "
            "config has it (1: FSDP over all %d ranks); add %s=%d to train_overrides for HSDP across "
            "nodes",
            REPLICATE_DEGREE_KEY,
            world_size(config.slurm),
            REPLICATE_DEGREE_KEY,
            config.slurm.nodes,
        )
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
