"""A real install: build the wheel, install it into a fresh venv, train two steps outside the checkout.

The fresh venv sees this interpreter's third-party packages (torch, hydra, ...) through a .pth
line, so nothing is downloaded; nemofp4 itself comes only from the wheel (a plain path line
does not run the editable-install hooks of the old site-packages). So a config, template or
data file missing from the package data fails here, as it would for a user's ``pip install .``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
_IGNORE = shutil.ignore_patterns(
    ".git",
    ".venv",
    "runs",
    "wandb",
    "outputs",
    "multirun",
    "__pycache__",
    "build",
    "dist",
    "*.egg-info",
    ".pytest_cache",
    ".ruff_cache",
    ".hypothesis",
    "cache",
)


def _run(cmd, *, cwd, env, timeout=600):
    result = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{cmd}: exit {result.returncode}\n{(result.stdout + result.stderr)[-4000:]}"
    return result.stdout


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    root = tmp_path_factory.mktemp("wheel")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME") and not k.startswith("HYDRA_")}
    source = root / "source"  # build from a copy: building in place would leave build/ and egg-info in the checkout
    shutil.copytree(REPO, source, ignore=_IGNORE)
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(root / "dist"),
            str(source),
        ],
        cwd=root,
        env=env,
    )
    (wheel,) = (root / "dist").glob("nemofp4-*.whl")
    venv = root / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=root, env=env)
    python = venv / "bin" / "python"
    site = Path(
        _run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=root, env=env
        ).strip()
    )
    (site / "_host_packages.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "-q", str(wheel)],
        cwd=root,
        env=env,
    )
    shutil.rmtree(source)
    work = root / "work"  # outside any checkout: nothing but what the wheel installed
    work.mkdir()
    return venv, work, env, site


def test_the_wheel_carries_configs_template_and_data_and_trains_outside_the_checkout(installed):
    venv, work, env, site = installed
    where = _run(
        [
            str(venv / "bin" / "python"),
            "-c",
            "import nemofp4, nemofp4.data.paths as p; print(nemofp4.__file__); print(p.REPO_ROOT)",
        ],
        cwd=work,
        env=env,
    ).split()
    assert Path(where[0]).is_relative_to(site), where  # nemofp4 from the wheel, not from the checkout
    assert Path(where[1]) == site / "nemofp4" / "share"
    run_dir = work / "runs" / "two-steps"
    env = {**env, "WANDB_MODE": "offline"}
    _run(
        [
            str(venv / "bin" / "nemofp4-train"),
            "experiment=tiny_ue5m3",
            "train.max_steps=2",
            "checkpoint.interval=2",
            "eval.num_sequences=8",
            "logging.wandb=false",
            "train.kernels=eager",
            f"run_dir={run_dir}",
        ],
        cwd=work,
        env=env,
    )
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2]
    assert (run_dir / "checkpoints" / "step-2").is_dir()
    # the native CPU quantizer's source travels in the wheel, and builds from there
    source, is_file, available = _run(
        [
            str(venv / "bin" / "python"),
            "-c",
            "from nemofp4.kernels import native; print(native.SOURCE, native.SOURCE.is_file(), native.available())",
        ],
        cwd=work,
        env={**env, "NEMOFP4_CACHE_DIR": str(work / "kernel-cache")},
    ).split()
    assert Path(source).is_relative_to(site) and is_file == "True", source
    assert available == str(bool(shutil.which("c++") or shutil.which("g++"))), available
    script = _run(
        [str(venv / "bin" / "nemofp4-launch"), "slurm.nodes=2", "experiment=nemotron_h_8b_ue5m3", "dry_run=true"],
        cwd=work,
        env=env,
    )
    assert "#SBATCH" in script and "nemofp4.train" in script
