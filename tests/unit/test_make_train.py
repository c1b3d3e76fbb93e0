"""`make train` reports the trainer's status: a clean stop after SIGINT (130) is an interrupt, not make's error 2."""

import shutil
import signal
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
@pytest.mark.parametrize(("trainer_status", "make_status"), [(0, 0), (130, -signal.SIGINT), (3, 2)])
def test_make_train_exits_as_the_trainer_stopped(tmp_path, trainer_status, make_status):
    venv = tmp_path / "venv"
    venv.mkdir()
    (venv / ".installed").touch()  # set-up done: `train` runs the trainer only
    trainer = tmp_path / "python"
    trainer.write_text(f'#!/bin/sh\necho "trainer $*"\nexit {trainer_status}\n')
    trainer.chmod(0o755)
    # make as a terminal starts it, with SIGINT's default action: a make started in the background by a
    # non-interactive shell (nohup, `&` in a script) inherits SIGINT ignored and can only exit 2.
    proc = subprocess.run(
        ["make", "-s", "-C", str(REPO), "train", f"VENV={venv}", f"PY={trainer}", "TRAIN_ARGS=a=1"],
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    assert proc.returncode == make_status, proc.stderr  # killed by SIGINT: a shell reports 130, as after Ctrl-C
    assert "trainer -m nemofp4.train experiment=tiny_ue5m3 a=1" in proc.stdout
