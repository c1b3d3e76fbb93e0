"""`nemofp4-train`: the Hydra app over configs/ that builds a JobConfig and trains.

Hydra stays here, at the edge: the rest of the code sees only typed dataclasses.
"""

from __future__ import annotations

import hashlib
import logging
import re
import sys
from dataclasses import replace
from pathlib import Path

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf, open_dict

from nemofp4.cli.errors import HydraApp, run_cli
from nemofp4.data.paths import CONFIG_DIR as _CONFIG_DIR
from nemofp4.training.config import JobConfig

CONFIG_DIR = str(_CONFIG_DIR)


def register_configs() -> None:
    """Register the typed schema that every composed training config is validated against."""
    ConfigStore.instance().store(name="job_schema", node=JobConfig)


def to_job_config(cfg: DictConfig) -> JobConfig:
    """Resolve interpolations and convert to the typed config (runs each dataclass's validation)."""
    cfg = cfg.copy()
    with open_dict(cfg):
        cfg.pop("hydra", None)  # Hydra's own node has interpolations that only resolve inside a job
    container = OmegaConf.to_container(cfg, resolve=True)
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(JobConfig), container))


MAX_JOB_DIRNAME = 96
"""Longest sweep-job directory name; longer ones keep a prefix and gain a hash of the whole."""


def job_dirname(override_dirname: str) -> str:
    """A sweep job's directory name from its overrides (Hydra's `hydra.job.override_dirname`, keys such
    as run_dir and resume excluded): unsafe characters become '_', and a long name is cut with a hash
    of the full one, so distinct jobs never share a directory."""
    name = re.sub(r"[^A-Za-z0-9._,=+-]", "_", override_dirname).strip(".") or "defaults"
    if len(name) > MAX_JOB_DIRNAME:
        digest = hashlib.sha256(override_dirname.encode()).hexdigest()[:12]
        name = f"{name[: MAX_JOB_DIRNAME - 13]}-{digest}"
    return name


NAMED_GROUPS = ("model", "precision", "experiment")
"""Overrides the default run name already stands for (`<model>-<precision>`), or a preset of them."""


def run_dir_suffix(overrides: list[str] | tuple[str, ...], accept: list[str] | tuple[str, ...] = ()) -> str:
    """What the default run directory adds to `runs/<model>-<precision>` for these command-line overrides:
    `-<key=value,...>` of the overrides that make another run (any key a resume would refuse to change:
    not the safe keys such as logging, eval, checkpoint, distributed or train.kernels, not the budget, not
    the model/precision/experiment choices the name shows, not the keys `accept` (resume_accept) lets
    change), sorted, made safe as a sweep job's directory name is; "" when there are none. So two
    differently configured runs on the command line get two directories, and the same command (a
    requeue, a longer budget, a change the user accepts into the run) finds its own again."""
    from nemofp4.training.run_identity import changes_the_run

    kept = []
    for override in overrides:
        key = override.split("=", 1)[0].lstrip("+~")
        if key.startswith("hydra") or key in NAMED_GROUPS or not changes_the_run(key, accept):
            continue
        kept.append(override)
    return f"-{job_dirname(','.join(sorted(kept)))}" if kept else ""


def _default_run_dir_suffix(*, _root_: DictConfig) -> str:
    """The `nemofp4.run_dir_suffix` resolver of configs/train.yaml: :func:`run_dir_suffix` of this job's
    command line and resume_accept; "" in a sweep, whose jobs each train in `<run_dir>/<their overrides>`
    already."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized() or HydraConfig.get().mode == RunMode.MULTIRUN:
        return ""
    return run_dir_suffix(list(HydraConfig.get().overrides.task), list(_root_.get("resume_accept") or ()))


OmegaConf.register_new_resolver("nemofp4.run_dir_suffix", _default_run_dir_suffix, replace=True)


def sweep_job_run_dir(job: JobConfig) -> JobConfig:
    """In a multirun (`nemofp4-train -m`), each job trains in `<run_dir>/<job_dirname(overrides)>`;
    a single run keeps its run_dir as given."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return job
    return replace(job, run_dir=str(Path(job.run_dir) / job_dirname(HydraConfig.get().job.override_dirname)))


def compose_job_config(overrides: list[str] | tuple[str, ...] = ()) -> JobConfig:
    """Compose configs/ with command-line style overrides, as `nemofp4-train` would (for scripts, tests)."""
    from hydra import compose, initialize_config_dir

    register_configs()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        cfg = compose(config_name="train", overrides=list(overrides), return_hydra_config=True)
        from hydra.core.hydra_config import HydraConfig

        HydraConfig.instance().set_config(cfg)
        return to_job_config(cfg)


@hydra.main(version_base=None, config_path=CONFIG_DIR, config_name="train")
def _hydra_main(cfg: DictConfig) -> None:
    from nemofp4.planning import StartupPlanner
    from nemofp4.training.trainer import train

    logging.getLogger("nemofp4").setLevel(logging.INFO)
    summary = train(sweep_job_run_dir(to_job_config(cfg)), planner=StartupPlanner())
    if summary.get("exit_code"):
        sys.exit(summary["exit_code"])


def main() -> None:
    from nemofp4.training.dist_env import stop_with_launcher

    stop_with_launcher()  # a torchrun worker ends with its launcher, even one killed with SIGKILL
    register_configs()
    run_cli(_hydra_main, name="nemofp4-train", app=HydraApp("train", CONFIG_DIR))


if __name__ == "__main__":
    main()
