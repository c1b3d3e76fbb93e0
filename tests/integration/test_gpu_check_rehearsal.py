"""``scripts/gpu/gpu_check.sh --rehearse``: the whole GPU check on the CPU, so the one GPU call works first time.

The wheelhouse is the checkout's ``.wheelhouse`` when built (scripts/gpu/gpu_wheelhouse.sh), else built here
(skipped without access to the package index).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT


@pytest.mark.slow  # the check's every stage: 45 s to 3 min on the shared 2 cores
def test_the_rehearsal_runs_every_stage_and_prints_one_table(tmp_path):
    wheels = ROOT / ".wheelhouse"
    if not list(wheels.glob("*.whl")):
        wheels = tmp_path / "wheelhouse"
        built = subprocess.run(
            ["bash", "scripts/gpu/gpu_wheelhouse.sh", str(wheels)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHON": sys.executable},
            timeout=300,
        )
        if built.returncode:
            pytest.skip(f"no wheelhouse (scripts/gpu/gpu_wheelhouse.sh needs the package index): {built.stderr[-300:]}")
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "PYTHON": sys.executable, "WHEELHOUSE": str(wheels), "OUT": str(out)}
    env.pop("PYTHONPATH", None)  # the check puts the checkout and the wheelhouse there itself
    proc = subprocess.run(
        ["bash", "scripts/gpu/gpu_check.sh", "--rehearse"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    table = proc.stdout[proc.stdout.index("| check ") :]
    for check in (
        "machine",
        "wheelhouse",
        "GPU tests",
        "benchmark",
        "train 30 steps, sync_debug=error",
        "killed after step 20",
        "resumed 20 -> 30",
        "resume exact",
        "nemofp4-eval",
    ):
        assert f"| {check}" in table, table
    assert "30/30 steps bitwise equal" in table
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["train"]["resume"]["bitwise_equal_steps"] == 30
    assert report["train"]["eval"]["results"]
    assert len(list(out.iterdir())) <= 8  # what the device tool brings back
