"""The state of one FP4 linear, and the frozen value each of its calls is made with.

:class:`QuantLinearState` is the one mutable object the FP4 linear's ops update: the held tensor
references, the stochastic-rounding generator, reseeded from (seed, rank, step, module index) at
every step (:func:`_mix_seed`, so a resumed run reproduces the same random bits), the statistics,
the kernels setting and what it resolved to per device, the weight cache and the layouts of the
operands saved for backward. To ``torch.compile`` it is an opaque reference object (an input of the
graph, never traced). Each call builds a frozen, hashable :class:`QuantCall` from it, so the ops
depend on values, not on a module they could mutate.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch._opaque_base import OpaqueBase

from nemofp4 import kernels
from nemofp4.formats import QuantizedBlocks

from .config import LinearQuantConfig, Role
from .reference import ReferenceState
from .stats import OperandStats, operand_stats

__all__ = ["QuantCall", "QuantLinearState"]


def _mix_seed(*values: int) -> int:
    """A well-mixed 63-bit seed from a tuple of ints (splitmix64 chained over the values)."""
    mask = (1 << 64) - 1
    state = 0x9E3779B97F4A7C15
    for v in values:
        state = (state ^ (int(v) & mask)) & mask
        state = (state + 0x9E3779B97F4A7C15) & mask
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        state = z ^ (z >> 31)
    return state >> 1


@dataclass(frozen=True)
class QuantCall:
    """What one call of an FP4 linear computes: a frozen, hashable value built per call from the
    module's settings, so the ops depend on values, not on a module they could mutate."""

    config: LinearQuantConfig
    backend: kernels.Backend
    """the kernels backend the module's setting resolved to for the input's device"""
    training: bool
    """training mode: held references are sampled when due (eval only reads them)"""
    collect_stats: bool
    compute_dtype: torch.dtype

    @property
    def forward_uses_sr(self) -> bool:
        return any(self.config.operand(r).rounding != "rne" for r in (Role.X, Role.W, Role.X_WGRAD))


class QuantLinearState(OpaqueBase):
    """The mutable quantization state of one QuantLinear, the only thing its FP4 linear op updates:
    the tensor references (:class:`ReferenceState`), the stochastic-rounding generator (reseeded from
    (seed, rank, step, module index) at every step), the statistics (the switch and the last ones),
    the kernel backend (the setting, and what it resolved to per device), the layouts of the operands
    saved for backward, and the test seam (``capture``: a list collects every GEMM's operands and
    product). To ``torch.compile`` it is an opaque reference object: an input of the graph, read and
    changed only when the op runs, so the steps, refreshes, seeds and statistics compile nothing new."""

    def __init__(self, references: ReferenceState, index: int, config: LinearQuantConfig) -> None:
        self.references = references
        self.index = index
        self.config = config
        self.collect_stats = True
        """Keep the statistics of each quantization (:func:`nemofp4.quant.set_quant_stats`)."""
        self.backend = "auto"
        """The kernels setting (one of :data:`nemofp4.kernels.BACKENDS`), stored here only."""
        self._resolved: dict[torch.device, kernels.Backend] = {}
        self.seed = 0
        self.rank = 0
        self.generator: torch.Generator | None = None
        self.generator_seed: int | None = None
        self.stats: dict[str, OperandStats] = {}
        self.capture: list | None = None
        self.weight_cache: dict[str, QuantizedBlocks] | None = None
        """The weight's quantized operands of the current optimizer step ('w' for fprop, 'wt' for the
        dgrad of a 1-D weight), reused by every micro-batch after the first; None: not cached
        (:func:`nemofp4.quant.cached_weights` turns it on for the micro-batches of one step)."""
        self.layouts: dict[tuple, dict] = {}
        """The layout (:meth:`QuantizedBlocks.meta`) of each operand saved for backward, by operand and
        shape: a pure function of the recipe and the shape, so backward rebuilds the operand from it."""

    def call(self, device: torch.device, *, training: bool, compute_dtype: torch.dtype) -> QuantCall:
        """The frozen :class:`QuantCall` of one call on ``device``."""
        return QuantCall(
            config=self.config,
            backend=self.kernels_for(device),
            training=training,
            collect_stats=self.collect_stats,
            compute_dtype=compute_dtype,
        )

    def set_backend(self, backend: str) -> None:
        self.backend = kernels.check_backend(backend)
        self._resolved = {}

    def kernels_for(self, device: torch.device) -> kernels.Backend:
        """The backend the setting resolves to on ``device``, resolved at the first call there."""
        backend = self._resolved.get(device)
        if backend is None:
            backend = self._resolved[device] = kernels.backend_for(self.backend, device)
        return backend

    def set_step(self, step: int, *, seed: int = 0, rank: int = 0) -> None:
        if self.weight_cache:  # a new step, new weights
            self.weight_cache = {}
        self.references.step = step
        self.seed, self.rank = seed, rank
        self.generator_seed = _mix_seed(seed, rank, step, self.index)
        self.generator = None

    def sr_generator(self, device: torch.device) -> torch.Generator:
        if self.generator is None or self.generator.device != device:
            if self.generator_seed is None:
                self.generator_seed = _mix_seed(self.seed, self.rank, 0, self.index)
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(self.generator_seed)
        return self.generator

    def record(
        self, role: Role, q: QuantizedBlocks, held_source: torch.Tensor | None, *, backend: kernels.Backend
    ) -> None:
        # Keep only the block counts and rho (device scalars, read lazily), not the data.
        self.stats[role.value] = operand_stats(q, held_source, backend=backend)

    def capture_gemm(self, name, qa, qb, b_transposed, out) -> None:
        """The test seam at each GEMM (tests set ``QuantLinear._capture = []``)."""
        if self.capture is not None:
            self.capture.append((name, qa, qb, b_transposed, out.detach().clone()))
