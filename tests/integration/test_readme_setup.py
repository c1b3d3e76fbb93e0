"""The README's set-up as a new user meets it (slow: minutes each, and the package registries): a fresh
clone installs the lock into a new virtual environment, `make train` trains the tiny model to the
validation losses the README states (within the spread across CPUs it states), `make test` runs in
that environment, `make lock` regenerates locks that still agree with pyproject.toml, and
`make drift` passes on the newest allowed releases."""

import os
import subprocess
from pathlib import Path

import pytest

from tests.integration.test_main_job_losses import CPU_SPREAD, eval_losses, readme_losses

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def run(cmd: list[str], cwd: Path, timeout: int) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHONPATH"))}
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("fresh") / "nemofp4"
    run(["git", "clone", "-q", str(REPO), str(root)], cwd=REPO, timeout=120)
    return root


def test_make_train_then_make_test_in_a_fresh_clone(clone):
    run(["make", "train"], cwd=clone, timeout=3600)
    measured, stated = eval_losses(clone / "runs/tiny-ue5m3"), readme_losses()
    assert sorted(measured) == sorted(stated) == [0, 100, 200, 300]
    assert all(abs(measured[step] - stated[step]) <= CPU_SPREAD for step in stated), (measured, stated)
    run(["make", "test", "PYTEST_ARGS=tests/unit/test_lock.py"], cwd=clone, timeout=1800)


def test_make_lock_regenerates_consistent_locks(clone):
    run(["make", "lock"], cwd=clone, timeout=1800)
    run(
        [
            ".venv/bin/python",
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "tests/unit/test_lock.py",
            "-k",
            "not environment",
        ],
        cwd=clone,
        timeout=600,
    )


def test_make_drift_passes(clone):
    out = run(["make", "drift"], cwd=clone, timeout=3600).stdout
    assert "drift check" in out and " passed" in out.splitlines()[-1]
