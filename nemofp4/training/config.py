"""The typed job configuration: one dataclass per component, composed into `JobConfig`.

Hydra composes YAML under `configs/` into this schema (registered in the ConfigStore by
`nemofp4.cli.train`), so a misspelled key or a wrong type fails at start. Each component receives
its own section, never the whole tree.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from nemofp4.data import DataConfig
from nemofp4.evaluation.run_config import saved_config
from nemofp4.kernels import check_backend
from nemofp4.models.nemotron_h.config import NemotronHConfig
from nemofp4.recipes import Recipe, precision_config, recipe_from_config
from nemofp4.training.checkpoint import CheckpointConfig
from nemofp4.training.metrics import LoggingConfig
from nemofp4.training.nonfinite import NONFINITE_POLICIES
from nemofp4.training.optim import OptimConfig
from nemofp4.training.parallel import DistributedConfig
from nemofp4.training.preemption import PreemptionConfig
from nemofp4.training.schedule import ScheduleConfig

log = logging.getLogger("nemofp4")

COMPUTE_DTYPES = ("float32", "bfloat16")
SYNC_DEBUG_MODES = ("off", "warn", "error")
CHECKPOINT_STALL_S = 300.0


@dataclass(kw_only=True)
class TrainConfig:
    """Budget, batch geometry and step policy."""

    tokens: float = 0.0
    """Token budget (e.g. 188.7e9). Steps = tokens / (global_batch * seq_len). 0: use max_steps."""
    max_steps: int = 0
    """Cap on optimizer steps below the budget (smoke runs); 0: no cap."""
    seq_len: int = 256
    """Tokens per sequence."""
    global_batch: int = 16
    """Sequences per optimizer step, over all data-parallel ranks."""
    micro_batch: int = 16
    """Sequences per forward/backward on one rank; the rest is gradient accumulation."""
    seed: int = 42
    dtype: str = "float32"
    """Compute dtype: float32 (CPU default) or bfloat16 (autocast on GPU). Master weights stay FP32."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value (0: measure only)."""
    nonfinite: str = "stop"
    """On a non-finite loss or gradient norm: 'stop' (name the step and first bad layer) or 'skip'
    (drop the update, count it, go on)."""
    max_skipped_steps: int = 10
    """With nonfinite=skip: stop once this many steps were skipped in total."""
    head_chunk_tokens: int = 0
    """LM head and loss in chunks of this many tokens, so full-vocabulary FP32 logits and their
    gradient never exist at once (the 8B presets: 1024); 0: the full logits at once. Chunks compute
    the head's products in FP32 in every recipe."""
    head_tf32: bool = False
    """The older spelling of ``model.head_precision=tf32`` (TF32 tensor cores for the head's FP32
    matmuls on CUDA): true turns the default ``fp32`` head into ``tf32``; with ``bf16`` it is an error."""
    kernels: str = "auto"
    """FP4 quantization kernels (nemofp4.kernels): 'auto' (fused Triton kernels on CUDA when
    importable; on CPU, when a C++ compiler is present, the native CPU kernel built on first use and
    the torch program compiled by torch.compile for what it does not cover; else the eager torch
    program), or any other of nemofp4.kernels.BACKENDS. Same numerics on every path
    (Triton's stochastic rounding draws its own random bits). 'reference' is a deprecated alias
    of 'eager'."""
    weight_cache: bool = True
    """With gradient accumulation, each FP4 linear quantizes its weight once per optimizer step, on
    the first micro-batch, and reuses the packed operands on the others (:func:`nemofp4.quant.cached_weights`);
    bit for bit the same training as false, which quantizes it in every micro-batch."""
    sync_debug: str = "off"
    """CUDA only: from the second step of each process on, run forward/backward, gradient clipping and
    the optimizer step under ``torch.cuda.set_sync_debug_mode`` ('warn' or 'error'), so a host
    synchronization there warns or raises. The once-per-step read of loss and gradient norm (the
    non-finite policy) and the metrics stay outside. 'off': no check; on CPU any mode is a no-op."""
    init_from: str = ""
    """Start from these weights instead of random ones: a transformers NemotronH folder (config.json,
    safetensors, tokenizer) or a nemofp4 run directory / step folder. Weights only (a new optimizer,
    schedule and quantizer state); the model config must match and data.tokenizer must be the source's.
    Fixed for the run: a resume reads its own checkpoint, never this source. "": random init."""

    def __post_init__(self) -> None:
        for name in ("seq_len", "global_batch", "micro_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"train.{name} must be >= 1, got {getattr(self, name)}")
        if self.dtype not in COMPUTE_DTYPES:
            raise ValueError(f"train.dtype={self.dtype!r}; valid: {COMPUTE_DTYPES}")
        if self.head_chunk_tokens < 0:
            raise ValueError(f"train.head_chunk_tokens={self.head_chunk_tokens}; must be >= 0 (0: unchunked)")
        if self.nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"train.nonfinite={self.nonfinite!r}; valid: {NONFINITE_POLICIES}")
        if self.kernels == "reference":
            warnings.warn(
                "train.kernels=reference is deprecated; it means train.kernels=eager", FutureWarning, stacklevel=2
            )
            self.kernels = "eager"
        check_backend(self.kernels, "train.kernels")  # the one check of the knob
        if self.sync_debug not in SYNC_DEBUG_MODES:
            raise ValueError(f"train.sync_debug={self.sync_debug!r}; valid: {', '.join(SYNC_DEBUG_MODES)}")
        if self.tokens < 0 or self.max_steps < 0:
            raise ValueError(f"train.tokens={self.tokens} and train.max_steps={self.max_steps} must be >= 0")


@dataclass(kw_only=True)
class EvalConfig:
    """Validation loss during training."""

    interval: int = 0
    """Evaluate every this many steps (0: only at the end)."""
    num_sequences: int = 64
    """Size of the fixed held-out stream, in sequences of train.seq_len tokens."""
    batch_size: int = 8
    at_start: bool = True
    """Also evaluate before the first step of a fresh run (the starting loss)."""

    def __post_init__(self) -> None:
        if self.interval < 0 or self.num_sequences < 0 or self.batch_size < 1:
            raise ValueError(
                f"eval: interval={self.interval} and num_sequences={self.num_sequences} must be >= 0, "
                f"batch_size={self.batch_size} >= 1"
            )


@dataclass(kw_only=True)
class DebugConfig:
    """Fault injection for tests of resume and of the non-finite policy. All 0/empty = off."""

    sigkill_at_step: int = 0
    """SIGKILL this process right after finishing this step (and its checkpoint, if one is due)."""
    sigkill_during_checkpoint_step: int = 0
    """SIGKILL this process in the middle of writing the checkpoint of this step."""
    stall_during_checkpoint_step: int = 0
    """Stall rank 0 for `CHECKPOINT_STALL_S` in the middle of writing the checkpoint of this step (a
    slow file system; the other ranks wait in the save's collectives), so a test can signal the job
    during a save. Only in a run that did not resume, so a resubmitted job gets past it."""
    hold_async_save_step: int = 0
    """Hold the background write of this step's async checkpoint for `hold_async_save_s` on every rank
    while training goes on, so a test can kill the job with a save in flight or check that the saved
    state is the step's. Only in a run that did not resume, so a resumed job gets past it."""
    hold_async_save_s: float = CHECKPOINT_STALL_S
    stall_after_step: int = 0
    """Stall rank `stall_rank` for `stall_s` right after this step (a hung rank: the others wait in their
    next collective until distributed.collective_timeout_s ends them). Only in a run that did not resume."""
    stall_rank: int = 1
    stall_s: float = CHECKPOINT_STALL_S
    nan_at_step: int = 0
    """Before this step, fill `nan_param` with NaN."""
    nan_param: str = ""
    nan_loss_at_step: int = 0
    """Make the loss of this step NaN (a transient fault: weights stay finite, gradients are NaN)."""


@dataclass(kw_only=True)
class Budget:
    """Steps and accumulation derived from the token budget and the batch geometry."""

    total_steps: int
    grad_accum: int
    tokens_per_step: int
    budget_remainder_tokens: int
    """Tokens of train.tokens that do not fill a whole step (reported, then dropped)."""


def batch_layouts(train: TrainConfig, dp_size: int, *, ranks_per_node: int = 1) -> str:
    """What would divide a batch that does not: the nearest data-parallel world sizes (whole nodes of
    ``ranks_per_node``) over which ``train.global_batch`` splits into micro-batches of
    ``train.micro_batch``, and at ``dp_size`` ranks the nearest ``global_batch`` and ``micro_batch``."""
    micro, batch = train.micro_batch, train.global_batch

    def fits(world: int) -> bool:
        return batch % (micro * world) == 0

    worlds = range(ranks_per_node, batch // micro + 1, ranks_per_node)
    below = max((w for w in worlds if w < dp_size and fits(w)), default=None)
    above = min((w for w in worlds if w > dp_size and fits(w)), default=None)

    def named(world: int) -> str:
        accum = f"{batch // (micro * world)} micro-batch(es) per rank"
        return (
            f"{world // ranks_per_node} nodes ({world} ranks, {accum})" if ranks_per_node > 1 else f"{world} ({accum})"
        )

    hints = []
    if below or above:
        hints.append("nearest world sizes that divide it: " + " or ".join(named(w) for w in (below, above) if w))
    step = micro * dp_size
    batches = sorted({b for b in (batch // step * step, -(-batch // step) * step) if b > 0})
    at = f"{dp_size // ranks_per_node} nodes" if ranks_per_node > 1 else f"{dp_size} ranks"
    setting = f"train.global_batch={' or '.join(map(str, batches))}"
    if batch % dp_size == 0:
        micros = [m for m in range(1, batch // dp_size + 1) if (batch // dp_size) % m == 0 and m != micro]
        if micros:
            setting += f", or train.micro_batch={min(micros, key=lambda m: (abs(m - micro), -m))}"
    hints.append(f"at {at}: {setting}")
    return "; ".join(hints)


def compute_budget(train: TrainConfig, dp_size: int) -> Budget:
    """Steps and gradient accumulation; raises if the batch geometry does not divide, naming the
    nearest layouts that do (:func:`batch_layouts`)."""
    if train.tokens == 0 and train.max_steps == 0:
        raise ValueError("no budget: set train.tokens > 0 or train.max_steps > 0")
    per_step = train.micro_batch * dp_size
    if train.global_batch % per_step:
        raise ValueError(
            f"train.global_batch={train.global_batch} is not a multiple of train.micro_batch x "
            f"data-parallel ranks = {train.micro_batch} x {dp_size} = {per_step}; {batch_layouts(train, dp_size)}"
        )
    tokens_per_step = train.global_batch * train.seq_len
    if train.tokens > 0:
        steps = math.floor(train.tokens / tokens_per_step)
        remainder = int(round(train.tokens - steps * tokens_per_step))
        if steps < 1:
            raise ValueError(
                f"train.tokens={train.tokens:g} is less than one step of {tokens_per_step} tokens "
                f"(global_batch {train.global_batch} x seq_len {train.seq_len})"
            )
        if train.max_steps:
            steps = min(steps, train.max_steps)
    else:
        steps, remainder = train.max_steps, 0
    return Budget(
        total_steps=steps,
        grad_accum=train.global_batch // per_step,
        tokens_per_step=tokens_per_step,
        budget_remainder_tokens=remainder,
    )


@dataclass(kw_only=True)
class JobConfig:
    """Everything one training run needs."""

    name: str = "run"
    """Run name (wandb, logs); the default run_dir derives from it."""
    run_dir: str = "runs/run"
    """Where metrics, checkpoints and the resolved config go."""
    resume: str = "auto"
    """'auto': continue from the newest complete checkpoint in run_dir if any; 'none': start fresh
    (refused in a directory that already holds a run, unless overwrite=true); or a path to a step
    folder / run directory."""
    resume_accept: list[str] = field(default_factory=list)
    """Config keys (or sections, e.g. optim) whose change a resume accepts, beyond the safe set
    (logging, eval, checkpoint, a longer budget). Recipe, model, data, seed and batch layout never."""
    overwrite: bool = False
    """Start over in a run_dir that holds a run: move its contents aside to
    `<run_dir>.replaced-<UTC time>` first (nothing is deleted)."""
    model: NemotronHConfig
    precision: Any
    """The recipe's own typed config (a :class:`~nemofp4.recipes.PrecisionConfig` subclass whose
    fields are its knobs). Typed ``Any`` here so each recipe's dataclass can be the node; a Hydra
    mapping becomes that dataclass in ``__post_init__``, where an unknown knob is an error."""
    data: DataConfig
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)
    preemption: PreemptionConfig = field(default_factory=PreemptionConfig)

    def __post_init__(self) -> None:
        self.precision = precision_config(self.precision)
        if self.train.head_tf32:  # the older spelling of model.head_precision=tf32
            if self.model.head_precision == "bf16":
                raise ValueError(
                    "train.head_tf32=true asks for a TF32 head but model.head_precision=bf16; set one of "
                    "them (train.head_tf32 is the older spelling of model.head_precision=tf32)"
                )
            self.model = self.model.replace(head_precision="tf32")
        trained = self.model.trained_on(self.train.seq_len)
        if trained is not self.model:  # NoPE: no limit to enforce; the config says what was trained
            log.info(
                "train.seq_len=%d is longer than model.max_position_embeddings=%d: the model has no "
                "positional embedding, so it trains as given and records max_position_embeddings=%d "
                "(the run's config and an HF export carry it)",
                self.train.seq_len,
                self.model.max_position_embeddings,
                self.train.seq_len,
            )
            self.model = trained

    @property
    def recipe(self) -> Recipe:
        """The recipe ``precision`` names, with its knobs (:func:`~nemofp4.recipes.recipe_from_config`):
        what the trainer applies and the planner plans."""
        return recipe_from_config(self.precision)


def job_config_from_yaml(saved: str | Mapping[str, Any]) -> JobConfig:
    """The typed JobConfig of a run from its resolved YAML (``trainer_state['config']``) or the mapping
    :func:`~nemofp4.evaluation.run_config.read_saved_config` read from ``<run_dir>/config.yaml`` (both
    parsed by :func:`~nemofp4.evaluation.run_config.saved_config`); validation runs as at training time."""
    from omegaconf import OmegaConf

    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(JobConfig), saved_config(saved)))
