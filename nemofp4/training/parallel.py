"""Parallelization applied to a model from outside: activation checkpointing -> compile -> FSDP2.

The model code is single-device; this module wraps each block, then the root, in that order
(after the precision recipe has swapped its linears, before weights are materialized).
"""

from __future__ import annotations

import functools
import logging
import warnings
from dataclasses import dataclass

import torch
from torch import nn

from nemofp4.models.loss import head_keeps_fp32_parameters
from nemofp4.quant import FP32Linear
from nemofp4.training.dist_env import DEFAULT_COLLECTIVE_TIMEOUT_S, DEFAULT_STARTUP_TIMEOUT_S

log = logging.getLogger("nemofp4")

BACKENDS = ("none", "fsdp", "deepspeed_zero1", "deepspeed_zero2", "deepspeed_zero3")
ENGINES = ("torch", "deepspeed")
GRADIENT_SYNC = ("per_step", "per_micro_batch")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def engine_kind(backend: object) -> str:
    """The engine a ``distributed.backend`` value trains with: ``deepspeed`` for ``deepspeed_zero*``,
    else ``torch`` (autograd and a torch optimizer, under FSDP2 or not). The one place the backend's
    name is interpreted; a saved config's raw value may be anything."""
    return "deepspeed" if isinstance(backend, str) and backend.startswith("deepspeed") else "torch"


@dataclass(kw_only=True)
class DistributedConfig:
    """How the model is spread over processes."""

    backend: str = "none"
    """none (one process, or replicated data parallel when launched on several), fsdp (FSDP2
    fully_shard per block, then the root), deepspeed_zero{1,2,3}."""
    activation_checkpointing: str = "none"
    """Which blocks recompute their activations in backward instead of storing them: ``none``,
    ``full`` (every block), block types joined by ``+`` (``mlp``, ``mamba+mlp``, any of mamba,
    attention, mlp), or ``every_<k>`` (every k-th block: blocks k-1, 2k-1, ...). ``true`` and
    ``false`` are accepted as ``full`` and ``none``. ``auto``: at start-up the memory plan of this job
    on this device picks the policy with the fewest recompute FLOPs that fits (with
    ``memory_reserve_gib`` kept free); the run's config records the policy chosen, and a resume keeps
    it unless the config names another. On the 8B presets by default."""
    device_memory_gib: float = 0.0
    """The memory per device that ``activation_checkpointing=auto`` plans against: 0 reads a CUDA
    device's own (``torch.cuda.mem_get_info``); a CPU run with ``auto`` must set it."""
    memory_reserve_gib: float = 4.0
    """Memory per device that ``activation_checkpointing=auto`` keeps free of the plan's tensors: the
    CUDA context, NCCL's buffers, allocator fragmentation (nemofp4-plan's ``reserve_gib``)."""
    compile: bool = False
    """torch.compile each block."""
    param_dtype: str = "bfloat16"
    """FSDP2 compute dtype of parameters on GPU (CPU runs always compute in float32)."""
    reduce_dtype: str = "float32"
    """Dtype of the gradient reduce-scatter / all-reduce."""
    reshard_after_forward: bool = True
    keep_head_gathered: bool = False
    """FSDP2 only: the LM head's group and the root group, which holds the final norm (and the
    embedding), keep their gathered parameters from forward to backward (``reshard_after_forward=False``
    for them, as TorchTitan keeps its final norm and output layer and FSDP2 its root by default): each
    is all-gathered once per micro-batch instead of twice. At 8B that is 2 GiB (FP32 head) or 1 GiB
    (BF16 head) plus 1 GiB (BF16 embedding) less all-gather per micro-batch and rank, for as much more
    memory held through the micro-batch. On in the 8B presets."""
    replicate_degree: int = 1
    """FSDP2 only: HSDP with a (replicate x shard) mesh. Parameters are sharded over
    world_size / replicate_degree ranks (one node, say) and replicated over replicate_degree groups of
    them; gradients are reduce-scattered within a group and all-reduced across groups. 1: plain FSDP."""
    gradient_sync: str = "per_step"
    """FSDP2 gradient accumulation: per_step reduces gradients once, after the last micro-batch
    (each rank then holds its blocks' unsharded FP32 gradients between micro-batches); per_micro_batch
    reduce-scatters after every micro-batch (sharded gradients only, micro-batches times the traffic)."""
    init_full_model: bool = True
    """Materialize and initialize the whole model on every rank before sharding, so a run's initial
    weights do not depend on the number of ranks. Turn off for models that do not fit one device
    (they are then initialized shard by shard)."""
    reduce_references: bool = True
    """All-reduce (max) the quantizers' sampled tensor references across data-parallel ranks, so
    every rank holds the same reference."""
    startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S
    """Collective timeout from the rendezvous to the end of the first step: covers rank 0 building the
    sample index, the first checkpoint load and the first step's compilation while the others wait."""
    collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S
    """Collective timeout once the first step is done: a rank that waits this long for the others ends
    with a message naming itself and the operation (a hang costs this long of every GPU, not the
    start-up timeout). Checkpoint publication and pruning stay well below it (their slow parts run in
    the background); the background writes of async saves keep the start-up timeout."""

    def __post_init__(self) -> None:
        if str(self.activation_checkpointing).strip().lower() == AC_AUTO:
            self.activation_checkpointing = AC_AUTO  # resolved at start-up (training/job_plan.py)
        else:
            self.activation_checkpointing = ac_policy(self.activation_checkpointing)
        for name in ("device_memory_gib", "memory_reserve_gib"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"distributed.{name}={value!r}; must be a number of GiB >= 0")
        if self.backend not in BACKENDS:
            raise ValueError(f"distributed.backend={self.backend!r}; valid: {BACKENDS}")
        if self.gradient_sync not in GRADIENT_SYNC:
            raise ValueError(f"distributed.gradient_sync={self.gradient_sync!r}; valid: {GRADIENT_SYNC}")
        if self.replicate_degree < 1:
            raise ValueError(f"distributed.replicate_degree={self.replicate_degree}; must be >= 1")
        if self.keep_head_gathered and self.backend != "fsdp":
            warnings.warn(
                f"distributed.keep_head_gathered=true has no effect with distributed.backend={self.backend} "
                "(it keeps FSDP2's head group gathered)",
                stacklevel=2,
            )
        if self.replicate_degree > 1 and self.backend != "fsdp":
            raise ValueError(
                f"distributed.replicate_degree={self.replicate_degree} needs distributed.backend=fsdp "
                f"(HSDP), got backend={self.backend!r}"
            )
        for name in ("startup_timeout_s", "collective_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"distributed.{name}={value!r}; must be a positive number of seconds")
        for name in ("param_dtype", "reduce_dtype"):
            if getattr(self, name) not in _DTYPES:
                raise ValueError(f"distributed.{name}={getattr(self, name)!r}; valid: {tuple(_DTYPES)}")

    @property
    def engine(self) -> str:
        """The engine of this backend (:func:`engine_kind`)."""
        return engine_kind(self.backend)


AC_BLOCK_TYPES = ("mamba", "attention", "mlp")
AC_AUTO = "auto"
"""The config value the start-up plan resolves to a policy; never a policy itself."""
_AC_TRUE, _AC_FALSE = ("true", "True", "1", "on", "yes"), ("false", "False", "0", "off", "no", "")


def ac_policy(value: str | bool) -> str:
    """The canonical activation-checkpointing policy of a config value (see
    ``DistributedConfig.activation_checkpointing``): ``none``, ``full``, block types in pattern order
    joined by ``+``, or ``every_<k>``. Booleans (and their Hydra spellings) mean ``full`` / ``none``."""
    if isinstance(value, bool) or value in _AC_TRUE or value in _AC_FALSE:
        return "full" if value is True or value in _AC_TRUE else "none"
    text = str(value).strip().lower()
    if text in ("none", "full"):
        return text
    if text.startswith("every_"):
        k = text.removeprefix("every_")
        if k.isdigit() and int(k) >= 1:
            return "full" if int(k) == 1 else f"every_{int(k)}"
    else:
        kinds = text.split("+")
        if kinds and set(kinds) <= set(AC_BLOCK_TYPES) and len(set(kinds)) == len(kinds):
            return "+".join(t for t in AC_BLOCK_TYPES if t in kinds)
    unresolved = " (auto is resolved at start-up, before anything is checkpointed)" if text == AC_AUTO else ""
    raise ValueError(
        f"distributed.activation_checkpointing={value!r}{unresolved}; valid: none, full, block types "
        f"joined by '+' ({', '.join(AC_BLOCK_TYPES)}; e.g. mamba+mlp), every_<k> (k >= 1), true/false, "
        "or auto (in a config)"
    )


def checkpointed_blocks(policy: str, block_types: list[str]) -> list[bool]:
    """For each block (by its ``block_type``, in model order): whether ``policy`` recomputes it."""
    policy = ac_policy(policy)
    if policy in ("none", "full"):
        return [policy == "full"] * len(block_types)
    if policy.startswith("every_"):
        k = int(policy.removeprefix("every_"))
        return [(i + 1) % k == 0 for i in range(len(block_types))]
    kinds = set(policy.split("+"))
    return [t in kinds for t in block_types]


def checkpoint_block(block: nn.Module) -> nn.Module:
    """``block`` wrapped so that its activations are recomputed in backward."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    return checkpoint_wrapper(block, preserve_rng_state=True)


def apply_activation_checkpointing(model: nn.Module, policy: str = "full") -> None:
    """Wrap the blocks ``policy`` selects (:func:`checkpointed_blocks`) in a checkpoint wrapper."""
    chosen = checkpointed_blocks(policy, [block.block_type for block in model.layers])
    for i, block in enumerate(model.layers):
        if chosen[i]:
            model.layers[i] = checkpoint_block(block)
    log.info(
        "activation checkpointing (%s): %d of %d blocks recompute in backward",
        ac_policy(policy),
        sum(chosen),
        len(chosen),
    )


def apply_compile(model: nn.Module) -> None:
    for i, block in enumerate(model.layers):
        model.layers[i] = torch.compile(block, fullgraph=False)


def data_parallel_mesh(cfg: DistributedConfig, *, device_type: str):
    """1-D ("dp",) mesh for FSDP, or a 2-D ("replicate", "shard") mesh for HSDP, over all ranks."""
    from torch.distributed.device_mesh import init_device_mesh

    world = torch.distributed.get_world_size()
    replicate = cfg.replicate_degree
    if replicate == 1:
        return init_device_mesh(device_type, (world,), mesh_dim_names=("dp",))
    if world % replicate:
        raise ValueError(
            f"distributed.replicate_degree={replicate} does not divide the world size {world}; "
            f"valid: a divisor of {world} (e.g. the number of nodes)"
        )
    return init_device_mesh(device_type, (replicate, world // replicate), mesh_dim_names=("replicate", "shard"))


def set_gradient_sync(model: nn.Module, cfg: DistributedConfig, *, micro_batch: int, grad_accum: int) -> None:
    """Before micro-batch ``micro_batch`` (0-based) of ``grad_accum``: under FSDP2 with
    ``gradient_sync=per_step``, reduce gradients only in the last micro-batch's backward."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule) and cfg.gradient_sync == "per_step":
        model.set_requires_gradient_sync(micro_batch == grad_accum - 1)


def apply_fsdp(
    model: nn.Module, cfg: DistributedConfig, *, device_type: str, mixed_precision: bool | None = None
) -> None:
    """FSDP2 (HSDP with replicate_degree > 1) per block, then the root. Mixed precision
    (``param_dtype``/``reduce_dtype``) applies on GPU only, CPU runs keep float32; ``mixed_precision=True``
    applies the GPU policy on any device (the planner's simulation of a GPU run on CPU)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = data_parallel_mesh(cfg, device_type=device_type)
    if mixed_precision if mixed_precision is not None else device_type == "cuda":
        mp = MixedPrecisionPolicy(param_dtype=_DTYPES[cfg.param_dtype], reduce_dtype=_DTYPES[cfg.reduce_dtype])
    else:
        mp = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=cfg.reshard_after_forward)
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    if isinstance(getattr(model, "lm_head", None), nn.Module) and not tied:
        # its own group: the chunked loss runs inside the head's FSDP hooks (attach_head_loss), and an
        # FP32 head keeps FP32 parameters instead of being cast to BF16 (a bf16 head takes the body's)
        head_mp = mp
        head_precision = getattr(model.config, "head_precision", "fp32")
        if head_keeps_fp32_parameters(head_precision, fp32_part=isinstance(model.lm_head, FP32Linear)):
            head_mp = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
        reshard = False if cfg.keep_head_gathered else cfg.reshard_after_forward
        fully_shard(model.lm_head, mesh=mesh, mp_policy=head_mp, reshard_after_forward=reshard)
    # the root: the embedding and the final norm (and a tied head); gathered first in forward and
    # needed again at the end of backward
    reshard = False if cfg.keep_head_gathered else cfg.reshard_after_forward
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
    sum_gradients(model)


def sum_gradients(model: nn.Module) -> None:
    """Make every FSDP2 group of ``model`` sum its gradients over the ranks instead of averaging them.

    The trainer then backpropagates each rank's share of the global mean loss (its micro-batch
    loss divided by grad_accum x world size), so every activation gradient dY has the value it has
    in one process taking the whole batch: the sampled dY references, which are held for D steps
    and saved in checkpoints, do not depend on how a batch is split over ranks."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # a plain SUM, no pre-multiplied sum (gloo has none)


def attach_head_loss(model: nn.Module) -> None:
    """Give ``model.lm_head`` a ``chunked_cross_entropy(hidden, labels, **kwargs)`` method
    (:func:`nemofp4.models.loss.head_cross_entropy` with that head). Under FSDP2 it is registered
    as a forward method of the head, so the head's weight is all-gathered around it and its gradient
    reduce-scattered after backward, as for a call of the head itself; without FSDP it is the plain
    function. Use it with ``model(input_ids, return_hidden=True)``."""
    from torch.distributed.fsdp import register_fsdp_forward_method

    from nemofp4.models.loss import HEAD_LOSS_METHOD, head_cross_entropy

    head = model.lm_head
    setattr(head, HEAD_LOSS_METHOD, functools.partial(head_cross_entropy, head))
    register_fsdp_forward_method(head, HEAD_LOSS_METHOD)  # no-op unless head is an FSDP module


def parallelize_and_materialize(
    model: nn.Module, cfg: DistributedConfig, *, device: torch.device, seed: int, full_init: bool
) -> nn.Module:
    """:func:`parallelize` a meta-device model and give it weights on ``device`` (initialized from
    ``seed``). With ``full_init`` and FSDP2 (``init_full_model``) the whole model is initialized before
    sharding, so the initial weights do not depend on the number of ranks; otherwise (and always when
    the weights will come from ``train.init_from``: ``full_init=False``) shards only are materialized."""
    if cfg.backend == "fsdp" and cfg.init_full_model and full_init:
        model.to_empty(device=device)
        torch.manual_seed(seed)
        model.init_weights()
        return parallelize(model, cfg, device_type=device.type)
    model = parallelize(model, cfg, device_type=device.type)
    model.to_empty(device=device)
    torch.manual_seed(seed)
    model.init_weights()
    return model


def parallelize(
    model: nn.Module, cfg: DistributedConfig, *, device_type: str, mixed_precision: bool | None = None
) -> nn.Module:
    """Apply AC, compile and FSDP2 as configured; returns the model (wrapped in place).
    ``mixed_precision``: see :func:`apply_fsdp`."""
    if cfg.activation_checkpointing != "none":
        apply_activation_checkpointing(model, cfg.activation_checkpointing)
    if cfg.compile:
        apply_compile(model)
    if cfg.backend == "fsdp":
        apply_fsdp(model, cfg, device_type=device_type, mixed_precision=mixed_precision)
    if hasattr(model, "lm_head"):
        attach_head_loss(model)
    return model
