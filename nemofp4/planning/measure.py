"""Measuring what one block, the LM head and the optimizer step keep alive, on fake tensors.

The plan's activation and temporary figures are measured, not modelled: each distinct block (layer
kind and recipe selection, with and without activation checkpointing), the final norm with the head
loss, and the optimizer step run at the config's real widths under ``FakeTensorMode`` (shapes and
dtypes only), with the quantizer, Mamba scan and Transformer Engine linears a GPU run takes (:func:`gpu_quantizer_path`,
:mod:`nemofp4.planning.standins`, :mod:`nemofp4.planning.te_linear`). :class:`LiveBytes` follows every storage they create until it is
freed and labels it as FSDPMemTracker does: an *activation* when made in forward, a *temporary* when
made in backward (a checkpointed block's recompute included: the tracker sees it as backward work).
"""

from __future__ import annotations

import contextlib
import math
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from nemofp4.models import NemotronHConfig, build_model, get_model_config, lm_loss
from nemofp4.quant import run_inside_for, set_quant_backend, set_quant_stats, set_step
from nemofp4.recipes import Recipe, apply_recipe, is_quantized
from nemofp4.training.parallel import checkpoint_block

from .standins import mamba_kernel_standins
from .te_linear import te_linear_standins

__all__ = [
    "BlockMeasure",
    "HeadMeasure",
    "LiveBytes",
    "LiveTensorBytes",
    "gpu_quantizer_path",
    "measure_blocks",
    "measure_head",
    "measure_optimizer_step",
    "warm_format_tables",
]


# ------------------------------------------------------------------------------------ live bytes
class _TracksOutputs(TorchDispatchMode):
    """A dispatch mode that hands every tensor an op returns to ``self._track``."""

    def _track(self, t: torch.Tensor) -> None:
        raise NotImplementedError

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self._track(t)
        return out


class LiveTensorBytes(_TracksOutputs):
    """Bytes of the tensor storages created inside the mode that are still alive (``live``) and
    the most alive at once (``peak``), on real tensors (keyed by data pointer). Storages of the
    tensors passed in (inputs, parameters) and their views are not counted."""

    def __init__(self, *existing: torch.Tensor) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._seen: set[int] = set()
        self._existing = {t.untyped_storage().data_ptr() for t in existing}

    def _track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in self._seen or key in self._existing or storage.nbytes() == 0:
            return
        self._seen.add(key)
        self.live += storage.nbytes()
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, key, storage.nbytes())

    def _free(self, key: int, nbytes: int) -> None:
        self._seen.discard(key)
        self.live -= nbytes


class LiveBytes(_TracksOutputs):
    """Live bytes of the storages created inside, by label ('act' or 'temp', from :attr:`label` when
    made), and the split at the largest sum since :meth:`reset_peak`. Works on fake tensors (storages
    are followed by weak reference, as torch's MemTracker does)."""

    def __init__(self, *existing: torch.Tensor) -> None:
        super().__init__()
        run_inside_for(type(self))  # the FP4 linears' temporaries too
        self.label = "act"
        self.live = {"act": 0, "temp": 0}
        self.peak = 0
        self.at_peak = dict(self.live)
        self._storages: dict[int, tuple[weakref.ref, str, int]] = {}
        self._existing = [t.untyped_storage() for t in existing]  # held: their ids stay theirs
        self._existing_ids = {id(s) for s in self._existing}

    def reset_peak(self) -> None:
        self.peak = sum(self.live.values())
        self.at_peak = dict(self.live)

    def _track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = id(storage)
        if key in self._storages or key in self._existing_ids or storage.nbytes() == 0:
            return
        label, nbytes = self.label, storage.nbytes()
        self._storages[key] = (weakref.ref(storage, lambda _, key=key: self._free(key)), label, nbytes)
        self.live[label] += nbytes
        if sum(self.live.values()) > self.peak:
            self.reset_peak()

    def _free(self, key: int) -> None:
        _, label, nbytes = self._storages.pop(key)
        self.live[label] -= nbytes


# ------------------------------------------------------------------------------------ set-up
_WARMED: set[str] = set()


def warm_format_tables(recipe: Recipe) -> None:
    """Run one tiny real step of ``recipe`` on CPU first (once per process and recipe): the formats'
    lookup tables and constants are built once per device and cached, from host data; built inside
    FakeTensorMode they would be fake tensors (a host read of one raises there) and the cache would
    hand them to later real runs."""
    key = repr(recipe)
    if key in _WARMED:
        return
    _WARMED.add(key)
    tiny = build_model(get_model_config("tiny", vocab_size=256), device="cpu")
    with te_linear_standins(recipe.needs_transformer_engine):
        apply_recipe(tiny, recipe, log=False)
    set_quant_backend(tiny, "eager")
    set_step(tiny, 1)
    ids = torch.zeros(1, 32, dtype=torch.long)
    lm_loss(tiny, ids, ids).backward()


@contextlib.contextmanager
def gpu_quantizer_path(path: str):
    """Inside: FP4 operands on (fake) CPU tensors take ``path``, the quantizer path of a CUDA run:
    ``triton`` runs the Triton kernels' Python glue, the kernels themselves by their registered fake
    implementations (the buffers they allocate, as ``torch.compile`` traces them); ``eager`` the torch
    program op by op. Neither a Triton kernel nor a compiled graph can run on fake CPU tensors."""
    from nemofp4.kernels import planned_path

    with planned_path(path):
        yield


@contextlib.contextmanager
def fake_run(*, quantizer: str, mamba_ssm: bool):
    """FakeTensorMode with the GPU run's quantizer and Mamba scan."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True), gpu_quantizer_path(quantizer), mamba_kernel_standins(mamba_ssm):
        yield


def _autocast(dtype: torch.dtype):
    return torch.autocast("cpu", dtype=torch.bfloat16) if dtype == torch.bfloat16 else contextlib.nullcontext()


# ------------------------------------------------------------------------------------ blocks
@dataclass(frozen=True, kw_only=True)
class BlockMeasure:
    """One block's bytes for one micro-batch, with activation checkpointing off (``saved``) and on."""

    kind: str
    quantized_linears: int
    """Its linears on quantized operands (emulated or in Transformer Engine)."""
    quantized_parts: str
    """Recipe parts of those linears ('' when none)."""
    layers: tuple[int, ...]
    """The blocks this measurement stands for."""
    parameters: int
    """Parameters of the block (gathered at the compute dtype under FSDP)."""
    saved_bytes: int
    """Kept for backward after its forward, without checkpointing (its input included when saved)."""
    input_bytes: int
    """What checkpointing keeps instead: the block's input."""
    forward_peak: dict[bool, int]
    """checkpointed -> most bytes it has alive at once in forward (saves and transients)."""
    backward_peak: dict[bool, tuple[int, int]]
    """checkpointed -> (activations, temporaries) at its backward peak: its saves (or recomputed saves)
    still alive, and what backward made (its input, output and parameter gradients included)."""

    @property
    def count(self) -> int:
        return len(self.layers)

    def kept(self, checkpointed: bool) -> int:
        return self.input_bytes if checkpointed else self.saved_bytes


def _selection(specs, layer: int) -> tuple[tuple[str, str], ...]:
    return tuple(
        sorted((s.fqn.split(".", 2)[2], s.part_name) for s in specs if s.layer == layer and is_quantized(s.part))
    )


def _run_block(block: nn.Module, *, batch: int, seq_len: int, width: int, dtype: torch.dtype, checkpointed: bool):
    """(saved, forward peak, (activations, temporaries) at the backward peak) of one block on fake tensors."""
    run = checkpoint_block(block) if checkpointed else block
    weight = torch.empty(batch, seq_len, width, dtype=dtype)  # d loss / d output: made in backward
    # the input is the previous block's output, not a leaf (autograd would hold a leaf alive)
    leaf = torch.empty(batch, seq_len, width, dtype=dtype, requires_grad=True)
    tracker = LiveBytes(weight, leaf, *block.parameters(), *block.buffers())
    with tracker:
        x = leaf.clone()
        with _autocast(dtype):
            out = run(x)
        loss = (out * weight).sum()
        del x, out
        saved, forward_peak = tracker.live["act"], tracker.peak
        tracker.label = "temp"
        tracker.reset_peak()
        loss.backward()
        del loss
    return saved, forward_peak, (tracker.at_peak["act"], tracker.at_peak["temp"])


def measure_blocks(
    model: NemotronHConfig,
    recipe: Recipe,
    *,
    seq_len: int,
    micro_batch: int,
    dtype: torch.dtype,
    quantizer: str = "triton",
    mamba_ssm: bool = False,
) -> list[BlockMeasure]:
    """One :class:`BlockMeasure` per distinct (block kind, quantized linears) of ``model`` under ``recipe``."""
    from .layers import linear_specs

    warm_format_tables(recipe)
    specs = linear_specs(model, recipe)
    groups: dict[tuple, list[int]] = {}
    for i, layer_type in enumerate(model.layer_types):
        groups.setdefault((layer_type.block_type, _selection(specs, i)), []).append(i)
    meta = build_model(model, device="meta")
    with te_linear_standins(recipe.needs_transformer_engine):  # TE's linears as allocated on a GPU
        apply_recipe(meta, recipe, log=False)
    set_quant_backend(meta, quantizer)
    out = []
    for (kind, selection), layers in groups.items():
        block = meta.layers[layers[0]].to(dtype)  # gathered at the compute dtype, as FSDP2 gathers it
        with fake_run(quantizer=quantizer, mamba_ssm=mamba_ssm):
            block.to_empty(device="cpu")
            set_step(block, 1)
            set_quant_stats(block, False)
            runs = {
                ac: _run_block(
                    block, batch=micro_batch, seq_len=seq_len, width=model.hidden_size, dtype=dtype, checkpointed=ac
                )
                for ac in (False, True)
            }
        out.append(
            BlockMeasure(
                kind=kind,
                quantized_linears=len(selection),
                quantized_parts=",".join(sorted({p for _, p in selection})),
                layers=tuple(layers),
                parameters=sum(p.numel() for p in block.parameters()),
                saved_bytes=runs[False][0],
                input_bytes=micro_batch * seq_len * model.hidden_size * dtype.itemsize,
                forward_peak={ac: r[1] for ac, r in runs.items()},
                backward_peak={ac: r[2] for ac, r in runs.items()},
            )
        )
    return out


# ------------------------------------------------------------------------------------ the head
@dataclass(frozen=True, kw_only=True)
class HeadMeasure:
    """The final norm, the LM head and the loss for one micro-batch."""

    saved_bytes: int
    """Kept for backward after the loss's forward."""
    forward_peak: int
    """Most bytes alive at once in forward (the full logits' cross-entropy included)."""
    head_forward_peak: int
    """The same while the head module runs (the chunked loss runs inside it)."""
    loss_backward_peak: tuple[int, int]
    """(activations, temporaries) at the peak of the loss's backward before the head's own: the full
    logits' cross-entropy, which runs outside the head module (zeros for the chunked loss, which runs
    inside it)."""
    backward_peak: tuple[int, int]
    """(activations, temporaries) at the peak of the head's backward (its weight's gradient included)."""


def measure_head(
    model: NemotronHConfig,
    *,
    seq_len: int,
    micro_batch: int,
    dtype: torch.dtype,
    head_weight_dtype: torch.dtype,
    chunk_tokens: int,
    fp32_head: bool = True,
    fsdp: bool = False,
) -> HeadMeasure:
    """``norm_f`` and the loss as the trainer computes them: the chunked head loss when
    ``chunk_tokens`` > 0, else the head's full logits in FP32 and ``F.cross_entropy``; the head an
    ``FP32Linear`` (the FP4 recipes') when ``fp32_head``, else an ``nn.Linear`` under autocast.
    Under FSDP2 (``fsdp``) the head's inputs arrive cast to its parameters' dtype, as its
    mixed-precision policy casts them (an FP32 head saves FP32 hidden states)."""
    from nemofp4.models.loss import head_cross_entropy
    from nemofp4.models.nemotron_h.model import RMSNorm
    from nemofp4.quant import FP32Linear

    with fake_run(quantizer="eager", mamba_ssm=False):
        norm = RMSNorm(model.hidden_size, model.norm_eps, device="cpu", dtype=dtype)
        head = nn.Linear(model.hidden_size, model.vocab_size, bias=False, device="cpu", dtype=head_weight_dtype)
        if fp32_head:
            FP32Linear.from_linear(head)
        labels = torch.zeros(micro_batch, seq_len, dtype=torch.long)
        leaf = torch.empty(micro_batch, seq_len, model.hidden_size, dtype=dtype, requires_grad=True)
        tracker = LiveBytes(norm.weight, head.weight, labels, leaf)
        loss_phase: list[tuple[int, int]] = []

        def head_backward_starts(*_):  # the loss's backward outside the head is done
            loss_phase.append((tracker.at_peak["act"], tracker.at_peak["temp"]))
            tracker.reset_peak()

        peaks: dict[str, int] = {}

        def head_forward_starts(*_):
            peaks["before"] = tracker.peak
            tracker.reset_peak()

        def head_forward_ends(*_):
            peaks["head"] = tracker.peak
            tracker.peak = max(tracker.peak, peaks["before"])

        hooks = [
            head.register_full_backward_pre_hook(head_backward_starts),
            head.register_forward_pre_hook(head_forward_starts),
            head.register_forward_hook(head_forward_ends),
        ]
        if chunk_tokens > 0:  # the chunked loss reads the head's weight inside: the whole loss is the head's
            hooks[1].remove(), hooks[2].remove()
            head_forward_starts()
        with tracker:
            h = leaf.clone()  # the last block's output, not a leaf
            with _autocast(dtype):
                hidden = norm(h)
                if fsdp and hidden.dtype != head_weight_dtype:  # FSDP2's cast_forward_inputs at the head
                    hidden = hidden.to(head_weight_dtype)
                if chunk_tokens > 0:
                    loss = head_cross_entropy(head, hidden, labels, chunk_tokens=chunk_tokens)
                else:
                    logits = head(hidden).float()
                    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
                    del logits
            del h, hidden
            if chunk_tokens > 0:
                head_forward_ends()
            saved, forward_peak = tracker.live["act"], tracker.peak
            tracker.label = "temp"
            tracker.reset_peak()
            loss.backward()
            del loss
        for hook in hooks:
            hook.remove()
    return HeadMeasure(
        saved_bytes=saved,
        forward_peak=forward_peak,
        head_forward_peak=peaks["head"],
        loss_backward_peak=(loss_phase or [(0, 0)])[0],
        backward_peak=(tracker.at_peak["act"], tracker.at_peak["temp"]),
    )


# ------------------------------------------------------------------------------------ the optimizer
def measure_optimizer_step(shapes: list[tuple[int, ...]], *, foreach: bool = True) -> int:
    """Peak bytes AdamW's step allocates beyond its state, over FP32 parameters of ``shapes``."""
    with fake_run(quantizer="eager", mamba_ssm=False):
        params = [nn.Parameter(torch.empty(s)) for s in shapes]
        for p in params:
            p.grad = torch.empty_like(p)
        optimizer = torch.optim.AdamW(params, foreach=foreach)
        optimizer.step()  # creates the state (not measured: it is counted as optimizer state)
        state = [t for st in optimizer.state.values() for t in st.values() if isinstance(t, torch.Tensor)]
        tracker = LiveBytes(*params, *(p.grad for p in params), *state)
        with tracker:
            optimizer.step()
    return tracker.peak


def sharded_numel(shape: tuple[int, ...], shards: int) -> int:
    """Elements of one rank's FSDP2 shard of a parameter: dim 0 padded to a multiple of ``shards``."""
    return math.ceil(shape[0] / shards) * math.prod(shape[1:]) if shape else 1
