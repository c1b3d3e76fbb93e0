"""One evaluation session: a loaded checkpoint, its tokenizer and data, and the policy runs on it.

``evaluate(cfg)`` is what ``nemofp4-eval`` runs: held-out NLL over the fixed validation stream
and the local multiple-choice tasks, under one inference policy, as a results dict that
:func:`write_results` saves as JSON plus a markdown table.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from nemofp4.data import (
    DataConfig,
    LoadedTokenizer,
    build_train_loader,
    build_validation_batches,
    load_tokenizer,
)
from nemofp4.models import NemotronHModel
from nemofp4.quant import set_quant_backend

from .checkpoint import is_hf_folder, load_checkpoint_model, load_hf_model, resolve_checkpoint, resolve_device
from .config import EvaluateConfig
from .multiple_choice import load_task, run_task
from .nll import validation_nll
from .policies import InferencePolicy, PolicyForward
from .run_config import TrainedRunConfig

__all__ = ["EvalSession", "evaluate", "format_markdown", "write_results"]

log = logging.getLogger("nemofp4")

DEFAULT_SEQ_LEN = 256
DEFAULT_VAL_SEQUENCES = 64
DEFAULT_VAL_BATCH = 8


@dataclass(kw_only=True)
class EvalSession:
    """A model ready for evaluation and everything its policies and streams need."""

    model: NemotronHModel
    source: str
    """The resolved checkpoint folder (or transformers folder)."""
    job: TrainedRunConfig | None
    """The run's config (None for a transformers folder)."""
    trainer_state: dict[str, Any]
    device: torch.device
    compute_dtype: torch.dtype
    tokenizer_path: str
    _tokenizer: LoadedTokenizer | None = None

    @classmethod
    def open(
        cls,
        checkpoint: str | Path,
        *,
        device: str = "auto",
        dtype: str = "auto",
        precision: str = "",
        tokenizer: str = "",
        kernels: str = "auto",
    ) -> EvalSession:
        """Load ``checkpoint`` on ``device``; its FP4 linears quantize with the ``kernels`` backend."""
        dev = resolve_device(device)
        if is_hf_folder(checkpoint):
            model = load_hf_model(checkpoint, device=dev, precision=precision or "bf16")
            job, state, source = None, {}, str(checkpoint)
            tokenizer = tokenizer or str(checkpoint)
            run_dtype = "float32"
        else:
            model, job, state = load_checkpoint_model(checkpoint, device=dev, precision=precision or None)
            source = str(resolve_checkpoint(checkpoint))
            tokenizer = tokenizer or job.data.tokenizer
            run_dtype = job.train.dtype
        set_quant_backend(model, kernels)
        if dtype == "auto":
            dtype = run_dtype if dev.type == "cuda" else "float32"
        return cls(
            model=model,
            source=source,
            job=job,
            trainer_state=state,
            device=dev,
            compute_dtype=getattr(torch, dtype),
            tokenizer_path=tokenizer,
        )

    # ------------------------------------------------------------------ pieces
    @property
    def tokenizer(self) -> LoadedTokenizer:
        if self._tokenizer is None:
            eod = self.job.data.eod_token if self.job is not None else ""
            self._tokenizer = load_tokenizer(self.tokenizer_path, eod_token=eod or None)
        return self._tokenizer

    def autocast(self):
        if self.compute_dtype == torch.float32:
            return None
        return lambda: torch.autocast(self.device.type, dtype=self.compute_dtype)

    def data_config(self, val_data: str) -> DataConfig | None:
        if val_data == "none":
            return None
        if val_data == "checkpoint":
            return self.job.data if self.job is not None else None
        path = Path(val_data)
        if not path.is_file():
            raise FileNotFoundError(f"val_data={val_data!r}: not 'checkpoint', 'none' or a data config YAML file")
        node = OmegaConf.load(path)
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(DataConfig), node))

    def calibration_batches(self, data: DataConfig | None, policy: InferencePolicy, seq_len: int) -> list[torch.Tensor]:
        """The first C sequences of the run's training stream (disjoint from validation by construction)."""
        if data is None:
            raise ValueError(
                "policy=calibrated needs calibration data: evaluate a run of ours, or pass val_data=<data config YAML>"
            )
        c = policy.calibration_sequences
        seed = self.job.train.seed if self.job is not None else 0
        loader = build_train_loader(data, seq_len=seq_len, global_batch=c, micro_batch=c, num_samples=c, seed=seed)
        return [next(iter(loader))["input_ids"]]

    def policy_forward(
        self,
        policy: str | InferencePolicy = "current",
        *,
        delay: int = 50,
        calibration_sequences: int = 64,
        calibration_batch_size: int = 1,
        val_data: str = "checkpoint",
        seq_len: int = 0,
    ) -> PolicyForward:
        """A PolicyForward over this model (enter it before use)."""
        if isinstance(policy, str):
            policy = InferencePolicy(
                name=policy,
                delay=delay,
                calibration_sequences=calibration_sequences,
                calibration_batch_size=calibration_batch_size,
            )
        calibration = None
        if policy.name == "calibrated":
            calibration = self.calibration_batches(self.data_config(val_data), policy, seq_len or self._seq_len())
        return PolicyForward(self.model, policy, calibration_batches=calibration, autocast=self.autocast())

    def _seq_len(self) -> int:
        return self.job.train.seq_len if self.job is not None else DEFAULT_SEQ_LEN

    def validation_batches(self, data: DataConfig, *, seq_len: int = 0, num_sequences: int = 0, batch_size: int = 0):
        job = self.job
        return build_validation_batches(
            data,
            seq_len=seq_len or self._seq_len(),
            num_sequences=num_sequences
            or (job.eval.num_sequences if job and job.eval.num_sequences else DEFAULT_VAL_SEQUENCES),
            batch_size=batch_size or (job.eval.batch_size if job else DEFAULT_VAL_BATCH),
        )


def evaluate(cfg: EvaluateConfig, session: EvalSession | None = None) -> dict[str, Any]:
    """Validation NLL and task accuracies of one checkpoint under one policy (see EvalSession)."""
    session = session or EvalSession.open(
        cfg.checkpoint,
        device=cfg.device,
        dtype=cfg.dtype,
        precision=cfg.precision,
        tokenizer=cfg.tokenizer,
        kernels=cfg.kernels,
    )
    policy = cfg.inference_policy()
    data = session.data_config(cfg.val_data)
    results: dict[str, Any] = {
        "checkpoint": session.source,
        "step": session.trainer_state.get("step"),
        "recipe": (cfg.precision or (session.job.precision.name if session.job else "bf16")),
        "policy": policy.name,
        "policy_detail": policy.describe(),
        "dtype": str(session.compute_dtype).removeprefix("torch."),
    }
    if data is not None:
        batches = session.validation_batches(
            data, seq_len=cfg.seq_len, num_sequences=cfg.val_sequences, batch_size=cfg.batch_size
        )
        with session.policy_forward(policy, val_data=cfg.val_data, seq_len=cfg.seq_len) as forward:
            results.update(validation_nll(forward, batches, device=session.device))
        results["val_sequences"] = sum(len(b["input_ids"]) for b in batches)
    tasks = {}
    for task_file in cfg.tasks:
        items = load_task(task_file, cfg.task_limit)
        # Each task gets a fresh policy run: a delayed policy's refresh phase starts at its first batch.
        with session.policy_forward(policy, val_data=cfg.val_data, seq_len=cfg.seq_len) as forward:
            scores = run_task(
                forward,
                session.tokenizer,
                items,
                batch_size=cfg.task_batch_size,
                max_length=cfg.max_length,
                device=session.device,
            )
        tasks[Path(task_file).stem] = {**scores, "file": str(task_file)}
    results["tasks"] = tasks
    return results


def format_markdown(results: dict[str, Any]) -> str:
    """A markdown summary of one results dict."""
    lines = [
        f"# Evaluation of `{results['checkpoint']}`",
        "",
        f"step {results.get('step')}, recipe `{results['recipe']}`, policy `{results['policy_detail']}`, "
        f"compute dtype {results['dtype']}",
        "",
        "| metric | value |",
        "|---|---|",
    ]
    if "val_loss" in results:
        lines += [
            f"| validation NLL ({results['val_tokens']} tokens) | {results['val_loss']:.5f} |",
            f"| validation perplexity | {results['val_ppl']:.3f} |",
        ]
    for name, task in results.get("tasks", {}).items():
        lines += [
            f"| {name} acc ({task['num_items']} items) | {task['acc']:.4f} |",
            f"| {name} acc_norm | {task['acc_norm']:.4f} |",
        ]
    return "\n".join(lines) + "\n"


def write_results(results: dict[str, Any], out: str | Path) -> tuple[Path, Path]:
    """``out`` (JSON) and the markdown table beside it (same name, .md)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    md = out.with_suffix(".md")
    md.write_text(format_markdown(results))
    return out, md
