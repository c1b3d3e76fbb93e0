"""train.init_from on a tiny random Nemotron-H that transformers builds and saves here (offline): the
weights arrive bit for bit, the first step's loss is transformers' loss on the same batch, on one process
and on two gloo ranks with FSDP2, and a run keeps to its source across resumes."""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nemofp4.training.metrics import read_metrics
from tests.conftest import load_script

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("init_from_worker.py")
SMALL = [
    "model=tiny",
    "data=tiny",
    "train.seq_len=64",
    "train.global_batch=4",
    "train.max_steps=1",
    "eval.num_sequences=0",
    "logging.wandb=false",
    "logging.console=false",
    "logging.plots=false",
    "train.kernels=eager",
]
FP4_VS_UNQUANTIZED_RTOL = 1e-2
"""The FP4 recipes' first-step loss against transformers' unquantized one: measured 2.3e-3 (ue5m3) and
2.2e-3 (nvfp4) relative on this model; a model that was not loaded is 2.5e-2 away."""


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    """bf16, sharded with an index, as the released folders are."""
    make = load_script("scripts/make_tiny_hf_model.py").make_tiny_hf_model
    return make(tmp_path_factory.mktemp("hf") / "tiny-nemotron-h", max_shard_size="2MB")


def _first_batch(overrides):
    from nemofp4.cli.train import compose_job_config
    from nemofp4.data import build_train_loader

    cfg = compose_job_config(overrides)
    batch = cfg.train.global_batch
    loader = build_train_loader(
        cfg.data,
        seq_len=cfg.train.seq_len,
        global_batch=batch,
        micro_batch=batch,
        num_samples=batch,
        seed=cfg.train.seed,
        dp_rank=0,
        dp_size=1,
    )
    first = next(iter(loader))
    return first["input_ids"], first["labels"]


@pytest.fixture(scope="module")
def reference(hf_folder):
    """transformers' loss (its own loss function) on the run's first global batch, in FP32 on CPU, and the
    loss of a randomly initialized model of ours on it (the value a load that did nothing would give)."""
    from nemofp4.models import build_model, get_model_config, lm_loss

    input_ids, labels = _first_batch(SMALL)
    hf = transformers.NemotronHForCausalLM.from_pretrained(hf_folder, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(input_ids).logits
        loss = hf.loss_function(logits=logits, labels=None, shift_labels=labels, vocab_size=hf.config.vocab_size)
        torch.manual_seed(42)
        random_init = lm_loss(build_model(get_model_config("tiny")), input_ids, labels)
    return {"loss": loss.item(), "random_init": random_init.item(), "batch": (input_ids, labels)}


def _hf_tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


def assert_export_equals_the_source(weights: dict[str, torch.Tensor], hf_folder: Path, out: Path) -> None:
    """Our FP32 weights exported in the source's dtype are the source's tensors, bit for bit."""
    from nemofp4.models import NemotronHModel
    from nemofp4.models.nemotron_h import export_hf, from_hf_config, read_hf_config

    model = NemotronHModel(from_hf_config(read_hf_config(hf_folder)))
    model.load_state_dict(weights, strict=True)
    source = _hf_tensors(hf_folder)
    exported = _hf_tensors(export_hf(model, out, dtype=torch.bfloat16))
    assert exported.keys() == source.keys()
    for name, tensor in source.items():
        assert tensor.dtype == torch.bfloat16 and exported[name].dtype == torch.bfloat16, name
        assert torch.equal(exported[name], tensor), name


def first_loss(run_dir: Path) -> float:
    return next(r["loss"] for r in read_metrics(run_dir, "train") if r["step"] == 1)


def test_one_process_bf16_weights_round_trip_and_first_loss_is_transformers(hf_folder, reference, tmp_path):
    from nemofp4.cli.train import compose_job_config
    from nemofp4.training.trainer import Trainer

    run = tmp_path / "run"
    trainer = Trainer(
        compose_job_config([*SMALL, "train.micro_batch=4", f"train.init_from={hf_folder}", f"run_dir={run}"])
    )
    try:
        assert_export_equals_the_source(trainer.full_model_state_dict(), hf_folder, tmp_path / "export")
        trainer.run()
    finally:
        trainer.close()
    loss, theirs = first_loss(run), reference["loss"]
    assert abs(reference["random_init"] - theirs) / theirs > 1e-2  # the comparison below can fail
    assert abs(loss - theirs) / theirs <= 1e-5, (loss, theirs)
    record = json.loads((run / "init_from.json").read_text())
    assert record["kind"] == "hf" and record["path"] == str(hf_folder.resolve())
    assert sorted(record["files"]) == sorted(p.name for p in hf_folder.glob("*.safetensors"))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_worker(nproc: int, weights: Path, *overrides: str) -> None:
    cmd = (
        [sys.executable, str(WORKER)]
        if nproc == 1
        else [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={nproc}",
            f"--master_port={_free_port()}",
            str(WORKER),
        ]
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [*cmd, str(weights), *overrides], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"


@pytest.mark.parametrize(
    "precision, backend",
    [
        ("bf16", "fsdp"),
        pytest.param("ue5m3", "fsdp", marks=pytest.mark.slow),
        pytest.param("bf16", "deepspeed_zero3", marks=pytest.mark.slow),  # loaded before the engine partitions it
    ],
)
def test_two_ranks_read_the_same_weights_and_first_loss(hf_folder, reference, tmp_path, precision, backend):
    """FSDP2 materializes shards only and each rank reads its own slices; the gathered weights are the
    folder's and the first loss is transformers'."""
    run = tmp_path / "run"
    run_worker(
        2,
        tmp_path / "weights.safetensors",
        *SMALL,
        f"distributed={backend}",
        "train.micro_batch=2",
        f"precision={precision}",
        f"train.init_from={hf_folder}",
        f"run_dir={run}",
    )
    from safetensors.torch import load_file

    assert_export_equals_the_source(load_file(str(tmp_path / "weights.safetensors")), hf_folder, tmp_path / "export")
    loss, theirs = first_loss(run), reference["loss"]
    # the mean of the two ranks' means over 2 sequences each: the global mean up to FP32 rounding
    assert abs(loss - theirs) / theirs <= (1e-5 if precision == "bf16" else FP4_VS_UNQUANTIZED_RTOL), (loss, theirs)


@pytest.mark.parametrize("precision", ["ue5m3", pytest.param("nvfp4", marks=pytest.mark.slow)])
def test_fp4_first_loss_is_the_recipes_forward_of_the_loaded_weights(hf_folder, reference, tmp_path, precision):
    """Bit for bit our own FP4 forward of the folder's weights at step 1, and within the stated tolerance
    of transformers' unquantized loss."""
    from nemofp4.cli.train import compose_job_config
    from nemofp4.evaluation import load_hf_model
    from nemofp4.models import lm_loss
    from nemofp4.quant import set_quant_backend, set_step
    from nemofp4.training.trainer import train

    cfg = compose_job_config(
        [
            *SMALL,
            "train.micro_batch=4",
            f"precision={precision}",
            f"train.init_from={hf_folder}",
            f"run_dir={tmp_path / 'run'}",
        ]
    )
    train(cfg)
    model = load_hf_model(hf_folder, precision=cfg.precision).train()
    set_quant_backend(model, "eager")
    set_step(model, 1, seed=cfg.train.seed, rank=0)
    with torch.no_grad():
        ours = lm_loss(model, *reference["batch"]).item()
    loss, theirs = first_loss(tmp_path / "run"), reference["loss"]
    assert loss == ours
    assert 0 < abs(loss - theirs) / theirs <= FP4_VS_UNQUANTIZED_RTOL, (loss, theirs)
    assert abs(reference["random_init"] - theirs) / theirs > FP4_VS_UNQUANTIZED_RTOL


def test_a_resume_never_reads_the_source_and_refuses_another(hf_folder, tmp_path):
    from nemofp4.checkpointing import load_tensors
    from nemofp4.cli.train import compose_job_config
    from nemofp4.training.trainer import train

    copy = tmp_path / "copy"
    shutil.copytree(hf_folder, copy)
    run = tmp_path / "run"
    common = [*SMALL, "train.micro_batch=4", f"run_dir={run}", "checkpoint.interval=1"]
    train(compose_job_config([*common, f"train.init_from={copy}"]))
    record = json.loads((run / "init_from.json").read_text())
    shutil.rmtree(copy)  # the source is gone: a resume must not need it
    train(compose_job_config([*common, f"train.init_from={copy}", "train.max_steps=2"]))
    assert sorted(r["step"] for r in read_metrics(run, "train")) == [1, 2]
    state = load_tensors(run / "checkpoints" / "step-2" / "trainer_state.pt")
    assert state["init_from"] == record  # carried from the first start, not recomputed
    with pytest.raises(ValueError, match=rf"train.init_from: '{copy}' -> '{hf_folder}'") as err:
        train(compose_job_config([*common, f"train.init_from={hf_folder}", "train.max_steps=3"]))
    assert "never the source" in str(err.value)
    with pytest.raises(ValueError, match=r"train.init_from: '.*' -> ''"):
        train(compose_job_config([*common, "train.max_steps=3"]))  # nor random weights


def test_init_from_a_run_of_ours_reads_its_weights_bitwise(tmp_path):
    from nemofp4.cli.train import compose_job_config
    from nemofp4.evaluation import load_checkpoint_model
    from nemofp4.training.trainer import Trainer, train

    source = tmp_path / "source"
    train(compose_job_config([*SMALL, "train.micro_batch=4", "train.max_steps=2", f"run_dir={source}"]))
    saved, _, _ = load_checkpoint_model(source, precision="bf16")
    trainer = Trainer(
        compose_job_config(
            [
                *SMALL,
                "train.micro_batch=4",
                "precision=ue5m3",
                f"train.init_from={source}",
                f"run_dir={tmp_path / 'run'}",
            ]
        )
    )
    try:
        weights = trainer.full_model_state_dict()
        assert trainer.init_record["kind"] == "nemofp4" and trainer.init_record["step"] == 2
    finally:
        trainer.close()
    expected = saved.state_dict()
    assert weights.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(weights[name], tensor), name
    assert not math.isclose(weights["embeddings.weight"].std().item(), 0.0)
