"""``train.sync_debug``: where the trainer puts ``torch.cuda.set_sync_debug_mode`` in a step.

On a GPU, scripts/gpu/gpu_check.sh trains with ``train.sync_debug=error``; here, on the CPU, the knob must
be a no-op, and with CUDA's mode switch stood in for, the scope must hold forward, backward, clipping
and the optimizer step of every step but the process's first, and none of the step's host reads.
"""

from __future__ import annotations

import logging

import pytest
import torch

from tests.conftest import FAST_IN_PROCESS


def _trainer(tmp_path, *overrides):
    from nemofp4.cli.train import compose_job_config
    from nemofp4.training.trainer import Trainer

    return Trainer(
        compose_job_config([*FAST_IN_PROCESS, f"run_dir={tmp_path / 'run'}", "train.max_steps=3", *overrides])
    )


def test_an_unknown_mode_is_refused_naming_the_valid_ones():
    from nemofp4.training.config import TrainConfig

    with pytest.raises(ValueError, match=r"train.sync_debug='raise'; valid: off, warn, error"):
        TrainConfig(sync_debug="raise")


def test_the_scope_holds_the_steps_device_work_after_the_first_and_no_host_read(tmp_path, monkeypatch, caplog):
    with caplog.at_level(logging.WARNING, logger="nemofp4"):
        trainer = _trainer(tmp_path, "train.sync_debug=error")
    assert trainer.sync_debug == "off"  # on the CPU the knob does nothing, and says so
    assert "train.sync_debug=error has no effect on cpu" in caplog.text

    mode = {"now": 0}
    events: list[tuple[int, str, object]] = []  # (step, what, the mode in force)

    def set_mode(value):
        events.append((trainer.step, "set", value))
        mode["now"] = value

    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: mode["now"])
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", set_mode)

    def step_counter(tensor) -> bool:
        """AdamW's step count: a CPU tensor on every device (no CUDA sync to read)."""
        return any(tensor is state.get("step") for state in trainer.optimizer.state.values())

    def recorded(what, original):
        def wrapper(*args, **kwargs):
            if what != "read" or not step_counter(args[0]):
                events.append((trainer.step, what, mode["now"]))
            return original(*args, **kwargs)

        return wrapper

    for name in ("item", "tolist", "__bool__"):  # the host reads a step may make
        monkeypatch.setattr(torch.Tensor, name, recorded("read", getattr(torch.Tensor, name)))
    model, optimizer = trainer.model, trainer.optimizer
    original = model.forward  # the validation forwards after the last step are not the step's
    train_forward = recorded("forward", model.forward)
    monkeypatch.setattr(model, "forward", lambda *a, **k: (train_forward if model.training else original)(*a, **k))
    monkeypatch.setattr(optimizer, "step", recorded("optimizer", optimizer.step))
    original_clip = torch.nn.utils.clip_grad_norm_
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", recorded("clip", original_clip))
    trainer.sync_debug = "error"  # what a CUDA device resolves the knob to
    try:
        trainer.run()
    finally:
        trainer.close()

    for step in (1, 2, 3):
        mine = [(what, m) for s, what, m in events if s == step and what != "read"]
        if step == 1:  # the first step compiles and allocates: unchecked
            assert mine == [("forward", 0), ("clip", 0), ("optimizer", 0)], mine
        else:
            # the micro-batches' scope, then the engine's finish_step: clipping, the host read, the update
            assert mine == [
                ("set", "error"),
                ("forward", "error"),
                ("set", 0),
                ("set", "error"),
                ("clip", "error"),
                ("set", 0),
                ("set", "error"),
                ("optimizer", "error"),
                ("set", 0),
            ], mine
    reads = [(s, m) for s, what, m in events if what == "read"]
    assert any(s == 3 for s, _ in reads)  # the loss and the gradient norm are read every step ...
    assert all(m == 0 for _, m in reads), reads  # ... outside the scope
