"""Typed configuration of ``nemofp4-eval`` and ``nemofp4-export-hf`` (configs/evaluate.yaml, configs/export.yaml)."""

from __future__ import annotations

from dataclasses import dataclass, field

from nemofp4.kernels import check_backend

from .policies import InferencePolicy

__all__ = ["COMPUTE_DTYPES", "EvaluateConfig", "ExportConfig"]

COMPUTE_DTYPES = ("auto", "float32", "bfloat16")
EXPORT_DTYPES = ("float32", "bfloat16")


@dataclass(kw_only=True)
class EvaluateConfig:
    """One evaluation of one checkpoint under one inference policy."""

    checkpoint: str = ""
    """A run directory, checkpoints folder or step folder of ours, or a transformers NemotronH folder."""
    policy: str = "current"
    """unquantized (alias bf16) | current | delayed | calibrated (see nemofp4.evaluation.policies)."""
    delay: int = 50
    """delayed: D, forward batches a sampled activation reference is held for."""
    calibration_sequences: int = 64
    """calibrated: C, training-stream sequences whose activation amaxes are max-reduced."""
    calibration_batch_size: int = 1
    """calibrated: sequences per calibration forward (1 = the paper's per-sequence max)."""
    tasks: list[str] = field(default_factory=list)
    """Local multiple-choice task files (jsonl: context, choices, label)."""
    task_limit: int = 0
    """Score only the first N items of each task (0: all)."""
    task_batch_size: int = 1
    """Requests per forward in the task runner (1: each request alone, independent of batching)."""
    max_length: int = 2048
    """Longest task input in tokens; longer ones keep their last max_length tokens."""
    val_data: str = "checkpoint"
    """Validation stream: 'checkpoint' (the run's data config), 'none', or a data config YAML file
    (configs/data/*.yaml), e.g. for a transformers folder."""
    val_sequences: int = 0
    """Sequences of the validation stream (0: the run's eval.num_sequences, or 64)."""
    seq_len: int = 0
    """Validation sequence length (0: the run's train.seq_len, or 256)."""
    batch_size: int = 0
    """Validation batch size (0: the run's eval.batch_size, or 8)."""
    precision: str = ""
    """Recipe to evaluate the weights with ('': the run's own; a transformers folder: bf16)."""
    tokenizer: str = ""
    """Tokenizer for tasks ('': the run's data.tokenizer, or the transformers folder's)."""
    device: str = "auto"
    """auto (CUDA when available) | cpu | cuda | cuda:N."""
    dtype: str = "auto"
    """Compute dtype: auto (the run's train.dtype on CUDA, float32 on CPU) | float32 | bfloat16."""
    kernels: str = "auto"
    """FP4 quantization kernels, as the trainer's train.kernels: one of nemofp4.kernels.BACKENDS
    (the same numerics on every path; eager skips the compile of the first forward)."""
    out: str = ""
    """Results JSON path ('' prints only); a markdown table is written next to it (.md)."""

    def __post_init__(self) -> None:
        if not self.checkpoint:
            raise ValueError("checkpoint= is required: a run directory, step folder or transformers folder")
        if self.dtype not in COMPUTE_DTYPES:
            raise ValueError(f"dtype={self.dtype!r}; valid: {COMPUTE_DTYPES}")
        check_backend(self.kernels, "kernels")
        for name in ("task_limit", "val_sequences", "seq_len", "batch_size"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0")
        if self.task_batch_size < 1 or self.max_length < 2:
            raise ValueError(
                f"task_batch_size={self.task_batch_size} must be >= 1 and max_length={self.max_length} >= 2"
            )
        self.inference_policy()  # validates the policy fields

    def inference_policy(self) -> InferencePolicy:
        return InferencePolicy(
            name=self.policy,
            delay=self.delay,
            calibration_sequences=self.calibration_sequences,
            calibration_batch_size=self.calibration_batch_size,
        )


@dataclass(kw_only=True)
class ExportConfig:
    """Checkpoint -> transformers NemotronH folder."""

    checkpoint: str = ""
    """A run directory, checkpoints folder or step folder."""
    out: str = ""
    """Output folder (config.json, model.safetensors, tokenizer files when the run has them)."""
    dtype: str = "float32"
    """Weight dtype in the folder: float32 (the master weights, exact) or bfloat16."""
    tokenizer: str = ""
    """Tokenizer to copy ('': the run's data.tokenizer; 'none': copy none)."""

    def __post_init__(self) -> None:
        if not self.checkpoint or not self.out:
            raise ValueError("checkpoint= and out= are required: nemofp4-export-hf checkpoint=<run dir> out=<folder>")
        if self.dtype not in EXPORT_DTYPES:
            raise ValueError(f"dtype={self.dtype!r}; valid: {EXPORT_DTYPES}")
