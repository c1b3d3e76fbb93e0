"""Whether the first step can be allocated, checked before anything large is: a sequence length or
micro-batch that cannot fit stops the start with one line (what the step needs, what the host or the
device has) and releases the run lock, instead of an out-of-memory kill that names nothing and leaves
``run.lock`` behind, or a traceback from wherever the first large allocation happens to be.

The estimate comes from the model config alone (the trainer never imports :mod:`nemofp4.planning`,
whose plan of a GPU job is exact and which ``nemofp4-plan`` prints): what autograd keeps per token in
each block, the LM head's logits, the FP32 weights, gradients and AdamW moments of this rank, and on
the host the validation batches. It is meant to be close to, and below, what the step takes: on CPU
with the tiny model it is 90-98% of the measured peak's growth with the step's size (unchunked head,
chunked head, full activation checkpointing; ``tests/unit/test_memory_check.py``), so a run it
refuses does not fit, and one close to the limit may still fail at its first allocation.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from nemofp4.models.nemotron_h.config import LayerType, NemotronHConfig
from nemofp4.training.config import JobConfig
from nemofp4.training.parallel import AC_AUTO, checkpointed_blocks

__all__ = ["FirstStepMemory", "available_memory", "check_first_step_fits", "first_step_memory"]

GIB = 2**30
_FP32 = 4
_TOKEN_ID = 8  # int64 token ids


@dataclass(frozen=True, kw_only=True)
class FirstStepMemory:
    """Bytes of one rank's first step, by where they live: ``device`` (the host too on CPU) and ``host``
    (the validation batches, on the host whatever the device). ``parts`` names the large terms."""

    device: int
    host: int
    parts: dict[str, int]
    what: str
    """The knobs that set the size, as the command line spells them."""


def _block_bytes_per_token(model: NemotronHConfig, layer: LayerType, *, act: int, torch_scan: bool) -> int:
    """What autograd keeps per token for one block's backward (its input and norm output included)."""
    d = model.hidden_size
    kept = 2 * d * act  # the residual input and the norm's output
    if layer is LayerType.MAMBA:
        inner, heads = model.mamba_intermediate_size, model.mamba_num_heads
        # in_proj's output (z and the conv's input), the conv's output (the scan's x, B, C), out_proj's input
        kept += (model.mamba_in_proj_size + model.mamba_conv_dim + inner) * act
        kept += (4 * inner + heads) * _FP32  # the scan's output with D, the gated norm's FP32 gate, input, output; dt
        if torch_scan:  # the chunked torch scan (mamba_ssm's kernel keeps none of it): x dt and its decayed
            # copy, the entering states' output, each chunk's scores and decay weights, the chunk states
            q, states = model.chunk_size, heads * model.mamba_head_dim * model.ssm_state_size
            kept += (3 * inner + 2 * heads * q + model.mamba_num_groups * q + 3 * states // q) * _FP32
    elif layer is LayerType.ATTENTION:
        q_width = model.num_attention_heads * model.attention_head_dim
        kv_width = model.num_key_value_heads * model.attention_head_dim
        kept += (2 * q_width + 2 * kv_width) * act + model.num_attention_heads * _FP32  # q, k, v, out; the lse
    else:
        kept += 2 * model.ffn_hidden_size * act  # relu's output and its square (down_proj's input)
    return kept


def _state_bytes(cfg: JobConfig, world_size: int) -> int:
    """FP32 weights, gradients and AdamW's two moments of this rank (its shards under FSDP2 or ZeRO)."""
    params = cfg.model.num_parameters()
    backend, shards = cfg.distributed.backend, world_size
    if backend == "fsdp":
        shards = max(1, world_size // cfg.distributed.replicate_degree)
        return 16 * params // shards
    stage = int(backend.removeprefix("deepspeed_zero")) if backend.startswith("deepspeed_zero") else 0
    weights = 4 * params // (shards if stage >= 3 else 1)
    grads = 4 * params // (shards if stage >= 2 else 1)
    moments = 8 * params // (shards if stage >= 1 else 1)
    return weights + grads + moments


def first_step_memory(cfg: JobConfig, *, world_size: int, device: torch.device) -> FirstStepMemory:
    """The estimate (see the module docstring) for ``cfg`` on one of ``world_size`` ranks on ``device``:
    the larger of a training micro-batch (forward kept for backward, and the head's gradients) and the
    evaluation at start (one batch of ``eval.batch_size`` sequences, forward only)."""
    model, train = cfg.model, cfg.train
    act = 2 if train.dtype == "bfloat16" else 4
    torch_scan = device.type != "cuda" or not _mamba_ssm_available()
    policy = cfg.distributed.activation_checkpointing
    # `auto` is resolved later, by the plan: count it as checkpointing every block (the least it can keep)
    recomputed = checkpointed_blocks("full" if policy == AC_AUTO else policy, [t.block_type for t in model.layer_types])
    per_block = [_block_bytes_per_token(model, t, act=act, torch_scan=torch_scan) for t in model.layer_types]
    kept = sum(model.hidden_size * act if r else b for r, b in zip(recomputed, per_block))
    kept += 3 * model.hidden_size * _FP32  # the embedding's output, the final norm's input and output
    # after the head's backward, one block's at a time: its gradients (as large as what it keeps), and what it
    # keeps again when it is recomputed
    block_backward = max(per_block) + max((b for r, b in zip(recomputed, per_block) if r), default=0)
    vocab = model.vocab_size * _FP32

    def head(tokens: int, *, backward: bool) -> int:
        chunk = train.head_chunk_tokens
        if chunk <= 0 and model.head_precision == "fp32":  # the full logits: log-softmax, and its two gradients
            return (3 if backward else 2) * tokens * vocab
        chunk = min(chunk if chunk > 0 else tokens, tokens)
        return 2 * chunk * vocab + tokens * _FP32 + (tokens * model.hidden_size * _FP32 if backward else 0)

    tokens = train.seq_len * train.micro_batch
    # the head's backward runs before any block's, and frees its logits first
    logits = head(tokens, backward=True)
    if tokens * block_backward > logits:
        step = {"activations": tokens * (kept + block_backward)}
    else:
        step = {"activations": tokens * kept, "logits": logits}
    what = f"train.seq_len={train.seq_len} x train.micro_batch={train.micro_batch}"
    eval_sequences = min(cfg.eval.batch_size, cfg.eval.num_sequences) if cfg.eval.at_start else 0
    eval_tokens = train.seq_len * eval_sequences
    if eval_tokens and eval_tokens * kept + head(eval_tokens, backward=False) > sum(step.values()):
        step = {"activations": eval_tokens * kept, "logits": head(eval_tokens, backward=False)}
        what = f"train.seq_len={train.seq_len} x eval.batch_size={eval_sequences} (the evaluation at start)"
    parts = {**step, "weights, gradients and optimizer state": _state_bytes(cfg, world_size)}
    # the validation set, held on the host: each sample read, then its inputs and labels
    host = 3 * cfg.eval.num_sequences * (train.seq_len + 1) * _TOKEN_ID
    if host:
        parts["validation batches"] = host
    return FirstStepMemory(
        device=sum(v for k, v in parts.items() if k != "validation batches"), host=host, parts=parts, what=what
    )


def _mamba_ssm_available() -> bool:
    from nemofp4.models.nemotron_h.ssd import mamba_ssm_available

    return mamba_ssm_available()


def _read_int(path: Path) -> int | None:
    with contextlib.suppress(OSError, ValueError):
        return int(path.read_text().split()[0])
    return None


def _stat_value(path: Path, key: str) -> int:
    """The number after ``key`` in a ``key value`` file (memory.stat, /proc/meminfo); 0 if absent."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in path.read_text().splitlines():
            fields = line.split()
            if fields and fields[0] == key:
                return int(fields[1])
    return 0


def _cgroup_available(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """What this process's memory cgroup still admits (a SLURM job's or a container's limit), or None
    without a limit. Reclaimable page cache counts as free, as in MemAvailable."""
    dirs: list[tuple[Path, str]] = []
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if controllers == "":
                dirs.append((root / path.lstrip("/"), "v2"))
            elif "memory" in controllers.split(","):
                dirs.append((root / "memory" / path.lstrip("/"), "v1"))
    dirs += [(root, "v2"), (root / "memory", "v1")]  # a namespaced cgroup shows its own at the mount
    for folder, version in dirs:
        if version == "v2" and (folder / "memory.max").is_file():
            limit, used = _read_int(folder / "memory.max"), _read_int(folder / "memory.current")
            cache = _stat_value(folder / "memory.stat", "inactive_file")
        elif version == "v1" and (folder / "memory.limit_in_bytes").is_file():
            limit, used = _read_int(folder / "memory.limit_in_bytes"), _read_int(folder / "memory.usage_in_bytes")
            cache = _stat_value(folder / "memory.stat", "total_inactive_file")
        else:
            continue
        if limit is None or used is None or limit >= 2**60:  # "max", or v1's page-rounded 2^63
            return None
        return max(0, limit - used + cache)
    return None


def _host_available() -> int | None:
    """The host's available memory (MemAvailable), within this process's cgroup limit; None if unknown."""
    available = None
    try:
        import psutil

        available = int(psutil.virtual_memory().available)
    except ImportError:
        kib = _stat_value(Path("/proc/meminfo"), "MemAvailable:")
        available = kib * 1024 if kib else None
    limited = _cgroup_available()
    if available is None:
        return limited
    return available if limited is None else min(available, limited)


def available_memory(device: torch.device) -> tuple[int | None, int | None]:
    """(bytes free on ``device``, bytes available on the host); the device's is None on CPU (the host's
    holds everything) and either is None when it cannot be told."""
    free = None
    if device.type == "cuda":
        free = int(torch.cuda.mem_get_info(device)[0])
    return free, _host_available()


def _gib(n: int) -> str:
    return f"{n / GIB:.1f} GiB"


def check_first_step_fits(
    cfg: JobConfig, *, world_size: int, local_world_size: int, device: torch.device, rank: int = 0
) -> None:
    """ValueError, on every rank, when the first step of ``cfg`` cannot be allocated on some rank's host
    or device (collective with more than one rank: the ranks agree, so none waits for another that
    stopped). The ranks of one host share its memory."""
    need = first_step_memory(cfg, world_size=world_size, device=device)
    free, host = available_memory(device)
    on_host = need.host + (need.device if device.type != "cuda" else 0)
    ranks_here = f" on each of the {local_world_size} ranks of this host" if local_world_size > 1 else ""
    parts = ", ".join(f"{name} {_gib(n)}" for name, n in need.parts.items() if n >= GIB // 10)
    parts = f" ({parts})" if parts else ""
    problem = None
    if device.type == "cuda" and free is not None and need.device > free:
        problem = f"needs about {_gib(need.device)} for the first step{parts}; {device} has {_gib(free)} free"
    elif host is not None and on_host * local_world_size > host:
        problem = (
            f"needs about {_gib(on_host)} for the first step{ranks_here}{parts}; this host has {_gib(host)} available"
        )
    if problem is not None:
        problem = (
            f"{need.what} {problem}. Lower train.seq_len or train.micro_batch; train.head_chunk_tokens=1024 "
            "and distributed.activation_checkpointing=full also need less"
        )
        if world_size > 1:
            problem = f"rank {rank}: {problem}"
    if world_size > 1 and dist.is_initialized():
        problems: list[str | None] = [None] * world_size
        dist.all_gather_object(problems, problem)
        problem = next((p for p in problems if p is not None), None)
    if problem is not None:
        raise ValueError(problem)
