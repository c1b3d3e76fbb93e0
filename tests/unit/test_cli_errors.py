"""Console scripts print a user error as one line (exit 1), keep tracebacks for bugs and on request."""

import sys

import pytest

from nemofp4.cli import evaluate, export, preprocess, train
from nemofp4.cli.errors import run_cli, user_error_message


def _raise(exc):
    def entry():
        raise exc

    return entry


def test_a_user_error_is_one_line_on_stderr_with_exit_status_1(capsys, monkeypatch):
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        run_cli(_raise(ValueError("train.max_steps=-1 must be >= 0")), name="nemofp4-train")
    assert exit_info.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["nemofp4-train: error: train.max_steps=-1 must be >= 0 (HYDRA_FULL_ERROR=1 shows the traceback)"]


def test_bugs_keep_their_traceback_and_hydra_full_error_shows_everything(monkeypatch):
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    with pytest.raises(ZeroDivisionError):
        run_cli(_raise(ZeroDivisionError("a bug")), name="x")
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    with pytest.raises(FileNotFoundError):
        run_cli(_raise(FileNotFoundError("no such file: a.bin")), name="x")


def test_omegaconf_context_lines_are_dropped():
    message = "Value 'x' could not be converted to Integer\n    full_key: train.max_steps\n    object_type=TrainConfig"
    assert user_error_message(ValueError(message)) == "Value 'x' could not be converted to Integer"


@pytest.mark.parametrize(
    ("module", "argv", "expected"),
    [
        (train, ["trian.max_steps=3"], "Could not override 'trian.max_steps'"),
        (train, ["precision=nvfp5"], "Could not find 'precision/nvfp5' Available options in 'precision': bf16"),
        (train, ["logging.log_interval=0"], "logging.log_interval must be >= 1, got 0"),
        (preprocess, ["input=/nonexistent/*.jsonl", "tokenizer=data/tokenizer", "output_prefix=out/x"], "/nonexistent/*.jsonl"),
        (evaluate, ["checkpoint=/nonexistent/run"], "/nonexistent/run"),
        (export, ["checkpoint=/nonexistent/run", "out=out"], "/nonexistent/run"),
    ],
)
def test_every_console_script_reports_bad_input_in_one_line(module, argv, expected, capsys, monkeypatch, tmp_path):
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["cmd", *argv])
    with pytest.raises(SystemExit) as exit_info:
        module.main()
    assert exit_info.value.code == 1
    err = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(err) == 1 and expected in err[0], err
    assert "Traceback" not in capsys.readouterr().err
