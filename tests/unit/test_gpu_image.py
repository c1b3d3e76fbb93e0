"""scripts/gpu/gpu_image.py: the wheelhouse the GPU check carries covers what the trainer and evaluation CLIs
import that the GPU image lacks (checked by importing them as the image would, the rest hidden)."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import ROOT, load_script

IMPORTS = (
    "import nemofp4.cli.train, nemofp4.cli.evaluate, nemofp4.training.trainer, nemofp4.evaluation.runner, "
    "nemofp4.planning\n"
    "from nemofp4.cli.train import compose_job_config\n"
    "print(compose_job_config(['experiment=tiny_ue5m3', 'train.sync_debug=error']).train.sync_debug)\n"
)


def _import_as_the_image(tmp_path, keep) -> subprocess.CompletedProcess:
    image = load_script("scripts/gpu/gpu_image.py")
    image.write_sitecustomize(tmp_path / "image", [], keep)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "image"), str(ROOT)])}
    return subprocess.run(
        [sys.executable, "-c", IMPORTS], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )


def test_the_wheelhouse_covers_the_cli_imports_the_image_lacks(tmp_path):
    image = load_script("scripts/gpu/gpu_image.py")
    assert [spec.split("==")[0] for spec in image.pinned()] == list(image.WHEELHOUSE)  # each pinned by the lock
    proc = _import_as_the_image(tmp_path, image.WHEELHOUSE)
    assert proc.returncode == 0 and proc.stdout.strip() == "error", proc.stderr[-3000:]


def test_without_the_wheelhouse_the_image_cannot_import_the_cli(tmp_path):
    proc = _import_as_the_image(tmp_path, keep=())
    assert proc.returncode != 0
    assert "No module named 'hydra' (not in the GPU image)" in proc.stderr
