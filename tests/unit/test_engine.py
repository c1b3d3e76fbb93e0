"""The engine interface and the facts derived once from the config: the torch engine's step is plain
autograd's, bit for bit; every backend has one engine kind, also for a saved config's raw value; a
saved run's backend is read through the one reader of saved configs."""

import contextlib

import pytest
import torch
from omegaconf import OmegaConf

from nemofp4.checkpointing import MARKER, TRAINER_STATE
from nemofp4.cli.train import compose_job_config
from nemofp4.evaluation.run_config import run_config_from_yaml
from nemofp4.training.engine import TorchEngine, TrainEngine
from nemofp4.training.init_from import resolve_source
from nemofp4.training.parallel import BACKENDS, DistributedConfig, engine_kind


def _model_and_batches():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    batches = [(torch.randn(5, 8), torch.randn(5, 4)) for _ in range(2)]
    return model, batches


def _loss(forward, x, y):
    return ((forward(x) - y) ** 2).mean() * 50  # large enough that clipping at 0.5 acts


def test_the_torch_engine_steps_as_plain_autograd_clipping_and_adamw_bit_for_bit():
    reference, batches = _model_and_batches()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for x, y in batches:  # two micro-batches of one rank: each backward sees loss / 2
        (_loss(reference, x, y) / 2).backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
    ref_opt.step()

    model, batches = _model_and_batches()
    engine: TrainEngine = TorchEngine(
        model,
        torch.optim.AdamW(model.parameters(), lr=0.5),
        distributed=DistributedConfig(),
        grad_accum=2,
        world_size=1,
        grad_clip=0.5,
    )
    engine.begin_step(1e-2)
    losses = [
        engine.forward_backward(lambda forward, x=x, y=y: _loss(forward, x, y), micro_batch=micro)
        for micro, (x, y) in enumerate(batches)
    ]
    norm, finite = engine.finish_step(sum(losses) / 2, sync_free=contextlib.nullcontext)

    assert finite and norm.item() > 0.5  # the clipping acted
    assert torch.equal(norm, ref_norm)
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(got, want)
    assert engine.write_collective is None and engine.read_collective is None
    assert set(engine.dcp_state()) == {"model", "optim"}


def test_the_torch_engine_leaves_the_weights_of_a_non_finite_step_and_the_next_step_starts_clean():
    model, batches = _model_and_batches()
    before = [p.detach().clone() for p in model.parameters()]
    engine = TorchEngine(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        distributed=DistributedConfig(),
        grad_accum=1,
        world_size=1,
        grad_clip=1.0,
    )
    engine.begin_step(1e-2)
    x, y = batches[0]
    loss = engine.forward_backward(lambda forward: _loss(forward, x, y) * float("nan"), micro_batch=0)
    norm, finite = engine.finish_step(loss, sync_free=contextlib.nullcontext)
    assert not finite and not torch.isfinite(norm)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    assert all(p.grad is not None for p in model.parameters())  # kept for the non-finite report
    engine.begin_step(1e-2)
    assert all(p.grad is None for p in model.parameters())


def test_every_backend_has_one_engine_kind_and_a_saved_raw_value_reads_the_same():
    kinds = {backend: DistributedConfig(backend=backend).engine for backend in BACKENDS}
    assert kinds == {
        "none": "torch",
        "fsdp": "torch",
        "deepspeed_zero1": "deepspeed",
        "deepspeed_zero2": "deepspeed",
        "deepspeed_zero3": "deepspeed",
    }
    assert all(engine_kind(backend) == kind for backend, kind in kinds.items())
    assert engine_kind(None) == engine_kind(3) == "torch"  # a saved config's value of another type


def test_a_saved_run_names_its_backend_through_the_run_config_view_and_init_from_refuses_deepspeed(tmp_path):
    job = compose_job_config(
        ["model=tiny", "data=tiny", "precision=bf16", "distributed=deepspeed_zero2", "train.micro_batch=2"]
    )
    text = OmegaConf.to_yaml(OmegaConf.structured(job))
    assert run_config_from_yaml(text).distributed.backend == "deepspeed_zero2"
    older = OmegaConf.to_container(OmegaConf.create(text))
    del older["distributed"]  # a config without the section reads as the default backend
    assert run_config_from_yaml(OmegaConf.to_yaml(older)).distributed.backend == "none"

    step = tmp_path / "run" / "checkpoints" / "step-2"
    step.mkdir(parents=True)
    torch.save({"config": text, "step": 2}, step / TRAINER_STATE)
    (step / MARKER).write_text("{}")
    with pytest.raises(ValueError, match=r"was written by DeepSpeed \(distributed.backend=deepspeed_zero2\)"):
        resolve_source(str(step))
