"""nemofp4-launch: the rendered sbatch script (syntax, options, commands, signal handling) and the app."""

import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nemofp4.cli.launch import (
    CONFIG_DIR,
    PRIMARY_CONFIG_NAME,
    LaunchConfig,
    LaunchMode,
    SlurmConfig,
    launch,
    parse_signal_spec,
    parse_slurm_time,
    register_configs,
    render_sbatch_script,
    validate,
)
from nemofp4.training.dist_env import slurm_master_port
from tests.conftest import process_gone

REPO_ROOT = Path(__file__).resolve().parents[2]


def _config(tmp_path, **slurm) -> LaunchConfig:
    overrides = slurm.pop("overrides", [])
    experiment = slurm.pop("experiment", "tiny_ue5m3")
    return LaunchConfig(
        slurm=SlurmConfig(**slurm),
        experiment=experiment,
        train_overrides=overrides,
        workdir=str(tmp_path),
        check_train_config=False,
    )


def _sbatch_options(script: str) -> list[str]:
    return re.findall(r"^#SBATCH (\S+)$", script, flags=re.MULTILINE)


def _bash_n(script: str, tmp_path) -> None:
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    result = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def _array(script: str, name: str) -> list[str]:
    """The lines of bash array `name=( ... )` as rendered (one element per line)."""
    match = re.search(rf"^{name}=\(\n(.*?)\n\)$", script, flags=re.MULTILINE | re.DOTALL)
    assert match, f"no array {name} in script"
    return [line.strip() for line in match.group(1).splitlines()]


@pytest.mark.parametrize(
    ("nodes", "gpus", "mode", "container"),
    [
        (1, 8, LaunchMode.torchrun, None),
        (4, 8, LaunchMode.torchrun, None),
        (2, 4, LaunchMode.srun, None),
        (2, 8, LaunchMode.torchrun, "nvcr.io/nvidia/pytorch:25.01-py3"),
    ],
)
def test_rendered_script_options_and_commands(tmp_path, nodes, gpus, mode, container):
    config = _config(
        tmp_path,
        nodes=nodes,
        gpus_per_node=gpus,
        mode=mode,
        container_image=container,
        partition="batch",
        account="proj",
        time="1-00:00:00",
        overrides=["optim.lr=3e-4", "train.seed=7"],
    )
    script = render_sbatch_script(config)
    _bash_n(script, tmp_path)
    assert script.startswith("#!/bin/bash\n#SBATCH ")
    assert "set -euo pipefail" in script
    tasks = 1 if mode is LaunchMode.torchrun else gpus
    cpus = 8 * gpus if mode is LaunchMode.torchrun else 8
    options = _sbatch_options(script)
    assert options[:6] == [
        "--job-name=nemofp4-tiny_ue5m3",
        f"--nodes={nodes}",
        f"--ntasks-per-node={tasks}",
        f"--gpus-per-node={gpus}",
        f"--cpus-per-task={cpus}",
        "--time=1-00:00:00",
    ]
    for option in (
        "--partition=batch",
        "--account=proj",
        "--exclusive",
        f"--chdir={tmp_path}",
        "--signal=B:USR1@120",
        "--requeue",
        "--open-mode=append",
    ):
        assert option in options
    assert "--dependency=singleton" not in options
    # every #SBATCH line comes before the first command (sbatch stops reading at the first one)
    first_command = next(i for i, line in enumerate(script.splitlines()[1:], 1) if line and not line.startswith("#"))
    assert max(i for i, line in enumerate(script.splitlines()) if line.startswith("#SBATCH")) < first_command
    assert 'run_dir="runs/nemofp4-tiny_ue5m3"' in script  # no job id: resubmissions resume
    assert "git rev-parse HEAD" in script and 'log "command: ${train_cmd[*]}"' in script
    assert "scontrol show hostnames \"${SLURM_JOB_NODELIST}\" | awk 'NR == 1'" in script

    train_tail = ["experiment=tiny_ue5m3", "optim.lr=3e-4", "train.seed=7", 'run_dir="${run_dir}"']
    srun = _array(script, "srun_cmd")
    assert srun[:4] == [
        'srun --nodes="${SLURM_NNODES}"',
        f"--ntasks-per-node={tasks}",
        f"--cpus-per-task={cpus}",
        "--kill-on-bad-exit=1",
    ]
    assert srun[-1] == '"${train_cmd[@]}"'
    if mode is LaunchMode.torchrun:
        assert _array(script, "train_cmd") == [
            "torchrun",
            '--nnodes="${SLURM_NNODES}"',
            f"--nproc_per_node={gpus}",
            "--rdzv_backend=c10d",
            '--rdzv_endpoint="${head_node}:${rdzv_port}"',
            '--rdzv_id="${SLURM_JOB_ID}"',
            *([] if container else ["--rdzv_conf=is_host=false"]),
            "-m nemofp4.train",
            *train_tail,
        ]
        # the batch shell hosts the rendezvous store (where it has Python), so no agent takes it down
        assert ('python -m nemofp4.cli.rendezvous_store --port "${rdzv_port}"' in script) is (container is None)
        assert srun[-2] == 'bash -c \'trap "" USR1 TERM; exec "$@"\' torchrun-agent'
        assert (
            'export TORCHELASTIC_SIGNALS_TO_HANDLE="SIGINT,SIGHUP,SIGQUIT" '
            'PET_SIGNALS_TO_HANDLE="SIGINT,SIGHUP,SIGQUIT"'
        ) in script
    else:
        assert _array(script, "train_cmd") == ["python -m nemofp4.train", *train_tail]
        assert "torchrun" not in script.split("srun_cmd=(")[1]
    if container:
        assert f"--container-image={container}" in srun
        assert f"--container-mounts={tmp_path}:{tmp_path}" in srun
    else:
        assert not any("--container" in item for item in srun)


def test_singleton_chain_venv_env_and_extra_options(tmp_path):
    config = _config(
        tmp_path,
        singleton=True,
        num_chained_jobs=3,
        venv=".venv",
        job_name="ue5m3-8b",
        signal="TERM@300",
        requeue=False,
        exclusive=False,
        extra_sbatch=["--constraint=h100", "--mem=0"],
        env={"NCCL_DEBUG": "WARN", "WEIRD": "a b"},
        master_port=29555,
    )
    script = render_sbatch_script(config)
    _bash_n(script, tmp_path)
    options = _sbatch_options(script)
    for option in (
        "--dependency=singleton",
        "--no-requeue",
        "--signal=B:TERM@300",
        "--constraint=h100",
        "--mem=0",
        "--job-name=ue5m3-8b",
    ):
        assert option in options
    assert "--exclusive" not in options and "--requeue" not in options
    # chained jobs have different ids but continue one run
    assert 'run_dir="runs/ue5m3-8b"' in script
    assert 'source ".venv/bin/activate"' in script
    assert "export NCCL_DEBUG=WARN" in script and "export WEIRD='a b'" in script
    assert "rdzv_port=${MASTER_PORT:-29555}" in script
    assert "trap 'forward_signal TERM' TERM" in script


def test_no_signal(tmp_path):
    script = render_sbatch_script(_config(tmp_path, signal=None))
    _bash_n(script, tmp_path)
    assert not any(o.startswith("--signal") for o in _sbatch_options(script))
    assert "forward_signal USR1" not in script


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (dict(time="4 hours"), "slurm.time"),
        (dict(time="00:01:00", signal="USR1@120"), "fires 120s"),
        (dict(signal="KILL@60"), "uncatchable"),
        (dict(signal="USR1@soon"), "whole seconds"),
        (dict(num_chained_jobs=2), "singleton"),
        (dict(container_image="img", venv=".venv"), "not both"),
        (dict(job_name="my job"), "job name"),
        (dict(nodes=0), "slurm.nodes"),
        (dict(extra_sbatch=["-N 2"]), "extra_sbatch"),
        (dict(env={"BAD-NAME": "1"}), "slurm.env"),
        (dict(overrides=["run_dir=/tmp/x"]), "run_dir"),
        (dict(experiment="no_such_experiment"), "no_such_experiment"),
    ],
)
def test_invalid_configs_are_rejected(tmp_path, changes, message):
    with pytest.raises(ValueError, match=message):
        validate(_config(tmp_path, **changes))


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("90", 5400),
        ("30:15", 1815),
        ("04:00:00", 14400),
        ("2-0", 172800),
        ("1-12:30", 131400),
        ("1-00:00:10", 86410),
        ("UNLIMITED", None),
    ],
)
def test_parse_slurm_time(text, seconds):
    assert parse_slurm_time(text) == seconds


def test_parse_signal_spec():
    assert parse_signal_spec("USR1@120") == ("USR1", 120)
    assert parse_signal_spec("B:SIGUSR2@90") == ("USR2", 90)
    assert parse_signal_spec("TERM") == ("TERM", 60)


# ---------------------------------------------------------------------------------------------- running it

FAKE_SRUN = """#!/bin/bash
# Records srun's arguments, strips its options, runs the task command, and on the forwarded signal
# records it and ends the step as a checkpointing trainer would (with status $FAKE_EXIT).
printf '%s\\n' "$@" > "$FAKE_DIR/srun.args"
trap 'echo "$sig" >> "$FAKE_DIR/srun.signals"; kill -KILL "$child" 2>/dev/null; exit "$FAKE_EXIT"' USR1
while [[ $# -gt 0 && $1 == --* ]]; do shift; done
"$@" &
child=$!
while true; do wait "$child" && exit 0 || status=$?; (( status > 128 )) || exit "$status"; done
"""
FAKE_SRUN = FAKE_SRUN.replace('echo "$sig"', "echo USR1")

FAKE_TASK = """#!{python}
# Stands in for torchrun / python: records argv, ignored signals and the environment, then waits.
# The batch shell's own rendezvous store is the real one.
import json, os, sys, time
if sys.argv[1:3] == ["-m", "nemofp4.cli.rendezvous_store"]:
    os.execv(sys.executable, [sys.executable, *sys.argv[1:]])
ignored = int(next(l for l in open("/proc/self/status") if l.startswith("SigIgn:")).split()[1], 16)
record = dict(argv=sys.argv[1:], ignored=[s for s in (10, 15) if ignored >> (s - 1) & 1],
              torchelastic_signals=[os.environ.get(n) for n in ("TORCHELASTIC_SIGNALS_TO_HANDLE", "PET_SIGNALS_TO_HANDLE")],
              master=(os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")))
with open(os.path.join(os.environ["FAKE_DIR"], "task.json"), "w") as f:
    json.dump(record, f)
time.sleep(60)
"""


def _executable(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def _fake_cluster(tmp_path) -> tuple[Path, dict]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _executable(bin_dir / "srun", FAKE_SRUN)
    _executable(bin_dir / "torchrun", FAKE_TASK.format(python=sys.executable))
    _executable(bin_dir / "python", FAKE_TASK.format(python=sys.executable))
    _executable(bin_dir / "scontrol", '#!/bin/bash\nprintf "gpu-007\\ngpu-008\\n"\n')
    _executable(bin_dir / "git", "#!/bin/bash\n[[ $1 == rev-parse ]] && echo 0123456789abcdef\nexit 0\n")
    environ = {
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "FAKE_DIR": str(tmp_path),
        "SLURM_JOB_ID": "12345",
        "SLURM_JOB_NAME": "nemofp4-tiny_ue5m3",
        "SLURM_JOB_NODELIST": "gpu-[007-008]",
        "SLURM_NNODES": "2",
        "SLURM_JOB_NUM_NODES": "2",
        "HOME": os.environ.get("HOME", str(tmp_path)),
    }
    return bin_dir, environ


def _wait_for(path: Path, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists() or not path.read_text():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def _wait_for_exit(pid: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not process_gone(pid):
        assert time.monotonic() < deadline, f"process {pid} still runs"
        time.sleep(0.05)


@pytest.mark.parametrize("mode", [LaunchMode.torchrun, LaunchMode.srun])
def test_script_runs_survives_sigterm_and_forwards_the_warning_signal(tmp_path, mode):
    """Run the rendered script under bash with fake srun/torchrun/scontrol: the commands are expanded as
    intended, torchrun's agent ignores USR1/TERM, and the batch shell outlives SIGTERM and forwards SIGUSR1."""
    _, environ = _fake_cluster(tmp_path)
    step_status = 0 if mode is LaunchMode.torchrun else 3  # the script must exit with the step's status
    environ["FAKE_EXIT"] = str(step_status)
    config = _config(tmp_path, nodes=2, gpus_per_node=4, mode=mode, cpus_per_task=16)
    script_path = tmp_path / "job.sbatch"
    script_path.write_text(render_sbatch_script(config))
    job = subprocess.Popen(
        ["bash", str(script_path)],
        cwd=tmp_path,
        env=environ,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        _wait_for(tmp_path / "task.json")
        job.send_signal(signal.SIGTERM)  # e.g. scancel: the shell must keep waiting for the step
        time.sleep(0.3)
        assert job.poll() is None, "the batch shell died of SIGTERM"
        job.send_signal(signal.SIGUSR1)
        output, _ = job.communicate(timeout=20)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == step_status, output
    assert (tmp_path / "srun.signals").read_text() == "USR1\n"
    port = str(slurm_master_port("12345"))
    task = json.loads((tmp_path / "task.json").read_text())
    run_dir = "runs/nemofp4-tiny_ue5m3"
    assert (tmp_path / run_dir).is_dir()
    assert task["master"] == ["gpu-007", port]
    srun_args = (tmp_path / "srun.args").read_text().splitlines()
    if mode is LaunchMode.torchrun:
        assert srun_args[:4] == ["--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=16", "--kill-on-bad-exit=1"]
        assert task["argv"] == [
            "--nnodes=2",
            "--nproc_per_node=4",
            "--rdzv_backend=c10d",
            f"--rdzv_endpoint=gpu-007:{port}",
            "--rdzv_id=12345",
            "--rdzv_conf=is_host=false",
            "-m",
            "nemofp4.train",
            "experiment=tiny_ue5m3",
            f"run_dir={run_dir}",
        ]
        assert task["ignored"] == [10, 15]  # SIGUSR1 and SIGTERM are ignored by the agent
        assert task["torchelastic_signals"] == ["SIGINT,SIGHUP,SIGQUIT"] * 2
    else:
        assert srun_args[:4] == ["--nodes=2", "--ntasks-per-node=4", "--cpus-per-task=16", "--kill-on-bad-exit=1"]
        assert task["argv"] == ["-m", "nemofp4.train", "experiment=tiny_ue5m3", f"run_dir={run_dir}"]
        assert task["ignored"] == []  # python tasks receive the signals directly
    assert "git commit: 0123456789abcdef" in output
    assert f"rendezvous: gpu-007:{port}" in output
    store = re.search(rf"rendezvous store: pid (\d+) on gpu-007:{port}", output)
    if mode is LaunchMode.torchrun:  # started before srun, gone with the batch shell
        assert store, output
        _wait_for_exit(int(store.group(1)))
    else:
        assert store is None, output
    assert "received SIGTERM" in output and "received SIGUSR1" in output
    assert f"training step exited with status {step_status}" in output


REQUEUE_SRUN = """#!/bin/bash
while [[ $# -gt 0 && $1 == --* ]]; do shift; done
"$@"
status=$?
echo srun-returned >> "$FAKE_DIR/order"
exit $status
"""
REQUEUE_TASK = """#!/bin/bash
# a preempted trainer: checkpointed, leaves the request (unless told not to), exits 0
if [[ -n "$WRITE_REQUEST" ]]; then echo "job $SLURM_JOB_ID; it resumes from /ckpt/step-7" > "$NEMOFP4_REQUEUE_REQUEST"; fi
exit 0
"""
REQUEUE_SCONTROL = """#!/bin/bash
if [[ $1 == requeue ]]; then echo "requeue $2" >> "$FAKE_DIR/order"; exit "$REQUEUE_RC"; fi
printf "gpu-007\\ngpu-008\\n"
"""


@pytest.mark.parametrize(
    ("write_request", "requeue_rc", "status"),
    [(True, 0, 0), (True, 1, 143), (False, 0, 0)],
    ids=["requeued", "requeue-fails", "stale-request-ignored"],
)
def test_script_requeues_after_the_step_returns_when_the_trainer_asks(tmp_path, write_request, requeue_rc, status):
    """The trainer only leaves a request file; the batch script calls `scontrol requeue` after srun has
    returned (so no process of the step is signalled by it), once, and never for a stale request."""
    bin_dir, environ = _fake_cluster(tmp_path)
    _executable(bin_dir / "srun", REQUEUE_SRUN)
    _executable(bin_dir / "torchrun", REQUEUE_TASK)
    _executable(bin_dir / "scontrol", REQUEUE_SCONTROL)
    environ.update(REQUEUE_RC=str(requeue_rc), WRITE_REQUEST="1" if write_request else "")
    config = _config(tmp_path, nodes=2, gpus_per_node=4)
    script_path = tmp_path / "job.sbatch"
    script_path.write_text(render_sbatch_script(config))
    run_dir = tmp_path / "runs" / "nemofp4-tiny_ue5m3"
    run_dir.mkdir(parents=True)
    (run_dir / ".requeue-request").write_text("job 1; an earlier run's\n")  # stale: removed before the step
    result = subprocess.run(
        ["bash", str(script_path)], cwd=tmp_path, env=environ, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == status, result.stdout + result.stderr
    order = (tmp_path / "order").read_text().splitlines()
    assert order == (["srun-returned", "requeue 12345"] if write_request else ["srun-returned"])
    assert not (run_dir / ".requeue-request").exists()
    if write_request and requeue_rc == 0:
        assert "requeued SLURM job 12345; it resumes from /ckpt/step-7" in result.stdout
    elif write_request:
        assert "scontrol requeue 12345 failed" in result.stdout


# ---------------------------------------------------------------------------------------------- submit / app


def test_submit_writes_the_script_and_chains_jobs(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _executable(
        bin_dir / "sbatch",
        f'#!/bin/bash\necho "$@" >> "{tmp_path}/sbatch.calls"\necho "$((700 + $(wc -l < "{tmp_path}/sbatch.calls")));cluster"\n',
    )
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    config = _config(tmp_path, singleton=True, num_chained_jobs=3)
    config.dry_run = False
    assert launch(config) == ["701", "702", "703"]
    calls = (tmp_path / "sbatch.calls").read_text().splitlines()
    assert len(set(calls)) == 1 and calls[0].startswith("--parsable ")
    script_path = Path(calls[0].split()[1])
    assert script_path.parent == tmp_path / "runs" / "slurm"
    assert script_path.read_text() == render_sbatch_script(config)
    assert (tmp_path / "runs" / "slurm" / "logs").is_dir()


def test_submit_without_sbatch_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    config = _config(tmp_path)
    config.dry_run = False
    with pytest.raises(FileNotFoundError, match="dry_run=true"):
        launch(config)


def test_dry_run_prints_only_the_script(tmp_path, capsys):
    config = _config(tmp_path)
    config.dry_run = True
    assert launch(config) == []
    assert capsys.readouterr().out == render_sbatch_script(config)
    # `sbatch` of the printed script needs the log folder, since Slurm opens the log before the script runs
    assert [p.relative_to(tmp_path).as_posix() for p in sorted(tmp_path.rglob("*"))] == [
        "runs",
        "runs/slurm",
        "runs/slurm/logs",
    ]


def test_misspelled_trainer_override_fails_before_submission(tmp_path, capsys):
    config = _config(tmp_path, overrides=["optim.lrr=1e-3"])
    config.check_train_config, config.dry_run = True, True
    with pytest.raises(ValueError, match="optim.lrr"):
        launch(config)
    assert capsys.readouterr().out == ""


def _run_app(command: list[str], cwd) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=180)


def test_interface_command_prints_the_script(tmp_path):
    """The documented interface, exactly, including the check of the trainer's config."""
    executable = shutil.which("nemofp4-launch", path=str(Path(sys.executable).parent))
    command = [executable] if executable else [sys.executable, "-m", "nemofp4.cli.launch"]
    result = _run_app(
        [*command, "slurm.nodes=4", "slurm.gpus_per_node=8", "experiment=nemotron_h_8b_ue5m3", "dry_run=true"],
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    script = result.stdout
    _bash_n(script, tmp_path)
    assert '--nnodes="${SLURM_NNODES}"' in script and "--nproc_per_node=8" in script
    assert "#SBATCH --nodes=4" in script and "experiment=nemotron_h_8b_ue5m3" in script
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.sbatch", "runs"]  # and the log folder only
    assert [p.name for p in (tmp_path / "runs").rglob("*")] == ["slurm", "logs"]


def test_python_module_form(tmp_path):
    base = [sys.executable, "-m", "nemofp4.cli.launch", "check_train_config=false", "dry_run=true"]
    result = _run_app(
        [*base, "slurm.mode=srun", "slurm.gpus_per_node=4", 'train_overrides=["optim.lr=1e-3"]'], tmp_path
    )
    assert result.returncode == 0, result.stderr
    assert "--ntasks-per-node=4" in result.stdout and "  optim.lr=1e-3" in result.stdout


def test_misspelled_launch_key_fails():
    from hydra import compose, initialize
    from hydra.errors import ConfigCompositionException

    register_configs()
    with initialize(version_base=None, config_path=None):
        cfg = compose(config_name=PRIMARY_CONFIG_NAME, overrides=["slurm.nodes=2", "slurm.mode=srun"])
        assert cfg.slurm.nodes == 2 and cfg.slurm.mode is LaunchMode.srun
        with pytest.raises(ConfigCompositionException, match="gpu_per_node"):
            compose(config_name=PRIMARY_CONFIG_NAME, overrides=["slurm.gpu_per_node=4"])
        with pytest.raises(ConfigCompositionException, match="mode"):
            compose(config_name=PRIMARY_CONFIG_NAME, overrides=["slurm.mode=mpirun"])


def test_hydra_submitit_launcher_config_composes():
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    from hydra import compose, initialize_config_dir
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    ConfigStore.instance().store(name="launch_schema", node=LaunchConfig)
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        cfg = compose(
            config_name="launch",
            overrides=["hydra/launcher=slurm", "hydra.launcher.partition=batch"],
            return_hydra_config=True,
        )
    launcher = cfg.hydra.launcher
    assert launcher._target_ == "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
    assert type(OmegaConf.to_object(launcher)).__name__ == "SlurmQueueConf"  # typed: typos fail
    assert (launcher.partition, launcher.tasks_per_node, launcher.gpus_per_node) == ("batch", 8, 8)
    assert launcher.signal_delay_s == 120


# ---------------------------------------------------------------------------------------------- CPU nodes, shape checks


def _shape_config(tmp_path, overrides, **slurm) -> LaunchConfig:
    slurm = {"nodes": 2, "gpus_per_node": 0, "procs_per_node": 1, "cpus_per_task": 1, **slurm}
    config = _config(tmp_path, overrides=overrides, **slurm)
    config.workdir = str(REPO_ROOT)  # the shipped data resolves from the repository, as in a real job
    config.check_train_config = True
    return config


def test_cpu_nodes_render_gloo_ranks_without_gpus(tmp_path):
    config = _config(tmp_path, nodes=2, gpus_per_node=0, procs_per_node=3, cpus_per_task=6)
    config.run_dir = "/scratch/runs/tiny"
    script = render_sbatch_script(config)
    _bash_n(script, tmp_path)
    options = _sbatch_options(script)
    assert not any(o.startswith("--gpus") for o in options)
    assert "--ntasks-per-node=1" in options and "--cpus-per-task=6" in options
    assert "--nproc_per_node=3" in _array(script, "train_cmd")
    assert 'run_dir="/scratch/runs/tiny"' in script
    assert "export OMP_NUM_THREADS=2" in script  # 6 CPUs of the task over its 3 processes
    assert "NCCL" not in script.split("set -euo pipefail")[1] and "PYTORCH_CUDA_ALLOC_CONF" not in script

    config.slurm.mode = LaunchMode.srun
    script = render_sbatch_script(config)
    assert "--ntasks-per-node=3" in _sbatch_options(script) and "--ntasks-per-node=3" in _array(script, "srun_cmd")
    assert "export OMP_NUM_THREADS=6" in script


def test_procs_per_node_on_gpu_nodes_and_environment_defaults(tmp_path):
    config = _config(
        tmp_path,
        nodes=2,
        gpus_per_node=8,
        procs_per_node=4,
        mode=LaunchMode.srun,
        env={"NCCL_DEBUG": "INFO", "PYTORCH_CUDA_ALLOC_CONF": "", "NCCL_IB_HCA": "mlx5"},
    )
    script = render_sbatch_script(config)
    options = _sbatch_options(script)
    assert "--gpus-per-node=8" in options and "--ntasks-per-node=4" in options and "--cpus-per-task=8" in options
    exports = re.findall(r"^export (\w+)=(.*)$", script, flags=re.MULTILINE)
    assert ("NCCL_DEBUG", "INFO") in exports and ("NCCL_IB_HCA", "mlx5") in exports  # overridden, added
    assert ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3") in exports and ("OMP_NUM_THREADS", "8") in exports
    assert not any(name == "PYTORCH_CUDA_ALLOC_CONF" for name, _ in exports)  # an empty value drops it
    config = _config(tmp_path, gpus_per_node=8)
    assert "export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in render_sbatch_script(config)
    assert "--nproc_per_node=8" in _array(render_sbatch_script(config), "train_cmd")  # default: one per GPU


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (dict(gpus_per_node=0), "procs_per_node=N"),
        (dict(gpus_per_node=-1), "slurm.gpus_per_node"),
        (dict(gpus_per_node=4, procs_per_node=8), "one GPU"),
        (dict(gpus_per_node=0, procs_per_node=0), "slurm.procs_per_node"),
    ],
)
def test_invalid_process_layouts_are_rejected(tmp_path, changes, message):
    with pytest.raises(ValueError, match=message):
        validate(_config(tmp_path, **changes))


@pytest.mark.parametrize(
    ("overrides", "slurm", "error", "message"),
    [
        # 8 sequences of 8 per rank cannot be split over 2 ranks
        (
            ["distributed=fsdp", "train.global_batch=8", "train.micro_batch=8"],
            {},
            ValueError,
            r"2 node\(s\) x 1 process\(es\) = 2 rank\(s\): train.global_batch=8 is not a multiple",
        ),
        (["distributed=none", "train.micro_batch=2"], {}, ValueError, "distributed.backend=none"),
        (
            ["distributed=fsdp", "train.micro_batch=2", "data.sources=[{prefix: data/tokens/nowhere}]"],
            {},
            FileNotFoundError,
            "data/tokens/nowhere",
        ),
        (
            ["distributed=fsdp", "train.micro_batch=2", "data.tokenizer=data/no_tokenizer"],
            {},
            FileNotFoundError,
            "data.tokenizer='data/no_tokenizer'",
        ),
        (["distributed=deepspeed_zero1", "train.micro_batch=2"], {}, ValueError, "needs GPUs"),
        # 3 x 2 ranks: 8 is not a multiple of 2 x 6
        (["distributed=fsdp", "train.micro_batch=2"], {"nodes": 3, "procs_per_node": 2}, ValueError, "= 6 rank"),
        # ... and the node counts that divide it are named
        (
            ["distributed=fsdp", "train.micro_batch=2"],
            {"nodes": 3, "procs_per_node": 2},
            ValueError,
            r"nearest world sizes that divide it: 2 nodes \(4 ranks, 1 micro-batch\(es\) per rank\)",
        ),
    ],
)
def test_presubmit_checks_what_depends_on_the_job_shape(tmp_path, capsys, caplog, overrides, slurm, error, message):
    config = _shape_config(tmp_path, overrides, **slurm)
    config.dry_run = error is not FileNotFoundError  # a real submission: missing data is an error there
    with pytest.raises(error, match=message):
        launch(config)
    assert capsys.readouterr().out == ""  # no script: nothing to submit by mistake
    if error is FileNotFoundError:  # a dry run (a script for another cluster, maybe) warns instead
        config.dry_run = True
        with caplog.at_level("WARNING", logger="nemofp4.launch"):
            launch(config)
        assert "not found from this host" in caplog.text and re.search(message, caplog.text)
        warning = next(line for line in caplog.text.splitlines() if "not found from this host" in line)
        assert f"(relative paths are looked up under {REPO_ROOT}, as the job will)" in warning  # once: workdir is it
        assert capsys.readouterr().out.startswith("#!/bin/bash\n")


def test_presubmit_check_passes_and_says_what_the_job_runs(tmp_path, capsys, caplog):
    config = _shape_config(tmp_path, ["distributed=fsdp", "train.micro_batch=2", "train.max_steps=60"])
    config.dry_run, config.run_dir, config.runs_root = True, str(tmp_path / "run"), str(tmp_path / "runs")
    with caplog.at_level("INFO", logger="nemofp4.launch"):
        assert launch(config) == []
    summary = caplog.text
    assert "2 node(s) x 1 process(es) = 2 rank(s) (CPU only, gloo)" in summary
    assert (
        "trains ue5m3 with fsdp (HSDP: 2 replicas x 1 shard(s)): 60 steps of 8 x 256 tokens (micro batch 2 x "
        "2 rank(s) x 2 accumulation)"
    ) in summary
    assert f"run dir {tmp_path / 'run'}" in summary
    assert capsys.readouterr().out.startswith("#!/bin/bash\n")
    assert (tmp_path / "runs" / "slurm" / "logs").is_dir()


@pytest.mark.parametrize(
    ("slurm", "overrides", "expected"),
    [
        ({"nodes": 2, "procs_per_node": 2}, [], 2),  # 2 nodes: shard within a node, replicate across
        ({"nodes": 1, "procs_per_node": 4}, [], 1),  # one node: plain FSDP
        ({"nodes": 2, "procs_per_node": 2}, ["distributed.replicate_degree=1"], 1),  # the user's choice stands
        ({"nodes": 2, "procs_per_node": 2}, ["++distributed.replicate_degree=4"], 4),
    ],
)
def test_multi_node_fsdp_defaults_to_hsdp_in_the_script_and_the_composed_config(
    tmp_path, capsys, slurm, overrides, expected
):
    """The rendered script carries distributed.replicate_degree=<nodes> unless the user set one, and the
    trainer's config composed from the script's own arguments has it."""
    from nemofp4.cli.train import compose_job_config

    config = _shape_config(
        tmp_path, ["distributed=fsdp", "train.global_batch=8", "train.micro_batch=2", *overrides], **slurm
    )
    config.dry_run = True
    launch(config)
    script = capsys.readouterr().out
    arguments = [a for a in _array(script, "train_cmd") if "=" in a and not a.startswith(("--", "run_dir="))]
    carried = [a for a in arguments if "replicate_degree" in a]
    assert carried == (
        []
        if expected == 1 and not overrides
        else [*overrides]
        if overrides
        else [f"distributed.replicate_degree={expected}"]
    )
    job = compose_job_config([a.strip("'") for a in arguments])
    assert job.distributed.replicate_degree == expected


def test_hsdp_default_needs_fsdp_and_a_divisor(tmp_path, capsys):
    config = _shape_config(
        tmp_path,
        ["distributed=fsdp", "train.micro_batch=1", "distributed.replicate_degree=3"],
        nodes=2,
        procs_per_node=2,
    )
    with pytest.raises(ValueError, match="replicate_degree=3 does not divide the 4 ranks"):
        launch(config)
    from nemofp4.cli.launch import with_hsdp_default
    from nemofp4.cli.train import compose_job_config

    job = compose_job_config(["distributed=none"])
    unchanged = _shape_config(tmp_path, ["distributed=none"])
    assert with_hsdp_default(unchanged, job) == (unchanged, job)  # no FSDP, no replicas


def test_multirun_is_refused_with_the_sweep_command(tmp_path):
    command = [
        sys.executable,
        "-m",
        "nemofp4.cli.launch",
        "-m",
        "check_train_config=false",
        "dry_run=true",
        "slurm.nodes=1,2",
    ]
    result = _run_app(command, tmp_path)
    assert result.returncode != 0 and result.stdout == ""
    assert "hydra/launcher=slurm" in result.stderr
