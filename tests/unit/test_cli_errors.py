"""Console scripts print a user error as one line (exit 1), keep tracebacks for bugs and on request."""

import importlib.util
import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from nemofp4.cli.errors import run_cli, unknown_key_message, user_error_message
from nemofp4.training.run_identity import ResumeRefusedError

REPO = Path(__file__).resolve().parents[2]


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


def test_a_refused_resume_keeps_one_changed_key_a_line(capsys, monkeypatch):
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    message = "checkpoint x was trained with a different configuration. Changed keys:\n  optim.lr: 0.003 -> 0.01\n  train.seed: 1 -> 2"
    with pytest.raises(SystemExit):
        run_cli(_raise(ResumeRefusedError(message)), name="nemofp4-train")
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0] == "nemofp4-train: error: checkpoint x was trained with a different configuration. Changed keys:"
    assert err[1:] == ["  optim.lr: 0.003 -> 0.01", "  train.seed: 1 -> 2 (HYDRA_FULL_ERROR=1 shows the traceback)"]


def test_bugs_keep_their_traceback_and_hydra_full_error_shows_everything(monkeypatch):
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    with pytest.raises(ZeroDivisionError):
        run_cli(_raise(ZeroDivisionError("a bug")), name="x")
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    with pytest.raises(FileNotFoundError):
        run_cli(_raise(FileNotFoundError("no such file: a.bin")), name="x")


def test_omegaconf_context_lines_are_dropped_and_a_cause_says_why():
    message = "Value 'x' could not be converted to Integer\n    full_key: train.max_steps\n    object_type=TrainConfig"
    assert user_error_message(ValueError(message)) == "Value 'x' could not be converted to Integer"
    wrapped = ValueError("Error merging override train.max_steps=x")
    wrapped.__cause__ = ValueError(message)
    assert user_error_message(wrapped) == (
        "Error merging override train.max_steps=x: Value 'x' could not be converted to Integer"
    )


def test_an_unknown_key_is_named_with_the_nearest_valid_key_and_a_recipe_knob_with_the_knobs():
    keys = ["train", "train.max_steps", "train.seq_len", "optim", "optim.lr", "precision", "precision.gemm"]
    assert unknown_key_message("trian.max_steps", keys).startswith(
        "trian.max_steps is not a key of this config; the nearest valid key is train.max_steps"
    )
    knob = unknown_key_message("precision.gemmm", keys, recipe="nvfp4", value="decoded")
    assert knob.startswith(
        "precision.gemmm='decoded': recipe 'nvfp4' has no such knob (the nearest valid key is "
        "precision.gemm); its knobs are ['disable_rht', 'gemm', 'num_bf16_last_layers', "
        "'reference_interval', 'scale_target']"
    )


_NOTICES = r"""
import logging, tempfile, warnings
import torch, torch.distributed.checkpoint as dcp
from nemofp4.cli.errors import quiet_third_party_noise

seen = []  # the pytree notice reaches its logger (this filter runs before the hiding one) and is dropped there
logging.getLogger("torch.utils._pytree").filters.insert(0, lambda record: seen.append(record.getMessage()) or True)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    dcp.save({"x": torch.zeros(2)}, checkpoint_id=tempfile.mkdtemp())
assert any("torch.distributed is disabled" in str(w.message) for w in caught), caught  # DCP in one process says so
quiet_third_party_noise()
dcp.save({"x": torch.zeros(2)}, checkpoint_id=tempfile.mkdtemp())
import torchao  # noqa: F401  (on a CPU build of torch: "Failed to load ..._C_mxfp8...", and the pytree notice for its enums)
assert any("is an Enum subclass" in m for m in seen), seen
logging.getLogger("torchao").error("an error of torchao's")  # errors still show
"""

# Library notices with nothing to act on, then every console script with a bad input, in one interpreter (one
# start-up for all); stderr is captured at the file descriptor, so whatever a library prints there counts too.
# Without quiet_third_party_noise (or under -W default) the notices script prints four notices (two torchao lines).
_DRIVER = r"""
import json, os, sys, tempfile
from importlib import import_module
from hydra.core.global_hydra import GlobalHydra

def stderr_of(run):
    with tempfile.TemporaryFile("w+") as err:
        saved = os.dup(2)
        os.dup2(err.fileno(), 2)
        try:
            run()
            code = 0
        except SystemExit as exit:
            code = exit.code
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
        err.seek(0)
        return code, err.read()

results = {"notices": stderr_of(lambda: exec(sys.argv[2], {}))}
for case, (module, argv) in json.loads(sys.argv[1]).items():
    main = import_module(module).main
    sys.argv = [case, *argv]
    results[case] = stderr_of(main)
    GlobalHydra.instance().clear()
print(json.dumps(results))
"""


def test_every_console_script_reports_bad_input_in_exactly_one_line_of_stderr_and_no_library_notices(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    (locked / "run.lock").write_text(json.dumps({"host": socket.gethostname(), "pid": 1, "started": "today"}))
    (tmp_path / "a-file").write_text("")
    cases = {
        "nemofp4-train": ("nemofp4.cli.train", [f"run_dir={locked}", "train.max_steps=1", "logging.wandb=false"]),
        "nemofp4-train ": ("nemofp4.cli.train", ["trian.max_steps=3"]),
        "nemofp4-train  ": ("nemofp4.cli.train", ["precision=nvfp4", "precision.gemmm=decoded"]),
        "nemofp4-eval": ("nemofp4.cli.evaluate", ["checkpoint=/nonexistent/run"]),
        "nemofp4-export-hf": ("nemofp4.cli.export", ["checkpoint=/nonexistent/run", f"out={tmp_path / 'a-file'}"]),
        "nemofp4-preprocess": (
            "nemofp4.cli.preprocess",
            ["input=/nonexistent/*.jsonl", "tokenizer=data/tokenizer", f"output_prefix={tmp_path / 'x'}"],
        ),
        "nemofp4-launch": ("nemofp4.cli.launch", ["slurm.nods=2", "dry_run=true"]),
        "nemofp4-plan": ("nemofp4.cli.plan", ["world_size=x"]),
    }
    expected = {
        "nemofp4-train": f"run_dir {locked} is in use by pid 1 on host {socket.gethostname()}",
        "nemofp4-train ": "trian.max_steps is not a key of this config; the nearest valid key is train.max_steps",
        "nemofp4-train  ": "recipe 'nvfp4' has no such knob (the nearest valid key is precision.gemm); its knobs are",
        "nemofp4-eval": "checkpoint='/nonexistent/run': no such step folder or run directory",
        "nemofp4-export-hf": "is an existing file; the export writes a folder",
        "nemofp4-preprocess": "/nonexistent/*.jsonl",
        "nemofp4-launch": "slurm.nods is not a key of this config; the nearest valid key is slurm.nodes",
        "nemofp4-plan": "Error merging override world_size=x: Value 'x' of type 'str' could not be converted to Integer",
    }
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    notices = _NOTICES if importlib.util.find_spec("torchao") else ""  # torchao: a dev extra
    proc = subprocess.run(
        [sys.executable, "-c", _DRIVER, json.dumps(cases), notices],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert results.pop("notices") == [0, "an error of torchao's\n" if notices else ""]  # nothing else of theirs
    for case, (code, err) in results.items():
        name = case.strip()
        assert code == 1 and len(err.splitlines()) == 1 and err.endswith("\n"), (case, code, err)
        assert err.startswith(f"{name}: error: ") and expected[case] in err, (case, err)
        assert err.rstrip().endswith("(HYDRA_FULL_ERROR=1 shows the traceback)"), err


def test_asked_for_warnings_are_not_hidden(monkeypatch):
    import logging
    import warnings

    from nemofp4.cli.errors import quiet_third_party_noise

    torchao, pytree = logging.getLogger("torchao"), logging.getLogger("torch.utils._pytree")
    monkeypatch.setattr(torchao, "level", logging.NOTSET)  # as before any console script ran in this process
    monkeypatch.setattr(pytree, "filters", [])
    monkeypatch.setattr(warnings, "filters", list(warnings.filters))
    monkeypatch.setattr(sys, "warnoptions", ["default"])  # python -W default, or PYTHONWARNINGS
    before = list(warnings.filters)
    quiet_third_party_noise()
    assert torchao.level == logging.NOTSET and not pytree.filters and warnings.filters == before
