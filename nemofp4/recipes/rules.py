"""Layer selection as data: ordered (glob, part) rules, first match wins.

A rule names module FQNs with an ``fnmatch`` glob (``layers.*.mixer.in_proj``). A rule may
also select *pattern layers* (positions in the hybrid layer pattern, ``layers.{i}``) with
``{layer}`` in its glob and a :class:`LayerSpan` (first N, last N or explicit indices),
resolved against the model at apply time, so one recipe serves every model depth.
"Last 8 layers" on Nemotron-H 8B is the last 8 *symbols* of the pattern, layers 44-51
(4 Mamba + 4 MLP), as Megatron counts them. A tail span may be capped at a fifth of the
model's layers (``last_layers(8, at_most_fifth=True)``), so the recipes' BF16 tail keeps the
NVFP4 paper's proportions (last 4 of 20, last 8 of 52 or 62 blocks) on any depth.

A rule that claims no linear is an error (a typo must not silently mean "nothing in BF16"),
unless it says ``allow_empty`` (overrides that apply only to models that have the layers).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

__all__ = ["LayerSpan", "Rule", "first_layers", "last_layers", "layer_indices"]


@dataclass(frozen=True, kw_only=True)
class LayerSpan:
    """A set of pattern-layer indices: exactly one of first / last / indices."""

    first: int = 0
    last: int = 0
    indices: tuple[int, ...] = ()
    at_most_fifth: bool = False
    """With ``last``: at most ``max(1, num_layers // 5)`` layers, so a shallow model keeps most in FP4."""

    def __post_init__(self) -> None:
        given = [bool(self.first), bool(self.last), bool(self.indices)]
        if sum(given) != 1:
            raise ValueError(f"LayerSpan needs exactly one of first=N, last=N or indices=(...), got {self}")
        for name in ("first", "last"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"LayerSpan.{name}={value!r} must be a non-negative int")
        if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in self.indices):
            raise ValueError(f"LayerSpan.indices={self.indices!r} must be non-negative ints")
        if self.at_most_fifth and not self.last:
            raise ValueError(f"LayerSpan.at_most_fifth applies to last=N spans only, got {self}")

    def count_last(self, num_layers: int) -> int:
        """How many tail layers a ``last`` span covers on a model of ``num_layers`` layers."""
        if self.at_most_fifth:
            return min(self.last, max(1, num_layers // 5))
        return self.last

    def resolve(self, num_layers: int) -> list[int]:
        """The indices that exist in a model of ``num_layers`` pattern layers."""
        if self.first:
            return list(range(min(self.first, num_layers)))
        if self.last:
            return list(range(max(num_layers - self.count_last(num_layers), 0), num_layers))
        return sorted(i for i in set(self.indices) if i < num_layers)

    def describe(self) -> str:
        if self.first:
            return f"first {self.first} layers"
        if self.last:
            cap = " (at most a fifth of the layers, at least 1)" if self.at_most_fifth else ""
            return f"last {self.last} layers{cap}"
        return "layers " + ",".join(str(i) for i in self.indices)


def first_layers(n: int) -> LayerSpan:
    """The first ``n`` pattern layers."""
    return LayerSpan(first=n)


def last_layers(n: int, *, at_most_fifth: bool = False) -> LayerSpan:
    """The last ``n`` pattern layers (Megatron's ``num_layers_at_end_in_bf16``).

    ``at_most_fifth`` caps them at ``max(1, num_layers // 5)``: the NVFP4 paper keeps about 15%
    of the network in BF16 (last 4 of 20 blocks at 1.2B, last 8 of 52 at 8B), not a fixed 8.
    """
    return LayerSpan(last=n, at_most_fifth=at_most_fifth)


def layer_indices(*indices: int) -> LayerSpan:
    """Explicit zero-based pattern-layer indices; those a model does not have match nothing."""
    return LayerSpan(indices=tuple(indices))


@dataclass(frozen=True, kw_only=True)
class Rule:
    """Linears whose FQN matches ``pattern`` (and, with ``{layer}``, lie in ``layers``) get ``part``."""

    pattern: str
    """fnmatch glob over module FQNs; ``{layer}`` stands for each index of ``layers``."""
    part: str
    """Key into :attr:`Recipe.parts`."""
    layers: LayerSpan | None = None
    allow_empty: bool = False
    """Permit the rule to claim no linear (e.g. a layer-specific override on a shallower model)."""

    def __post_init__(self) -> None:
        has_placeholder = "{layer}" in self.pattern
        if has_placeholder != (self.layers is not None):
            raise ValueError(
                f"rule {self.pattern!r}: a pattern with '{{layer}}' needs layers=LayerSpan(...), and "
                "layers= needs '{layer}' in the pattern"
            )

    def globs(self, num_layers: int) -> list[str]:
        if self.layers is None:
            return [self.pattern]
        return [self.pattern.replace("{layer}", str(i)) for i in self.layers.resolve(num_layers)]

    def matcher(self, num_layers: int):
        """A predicate over FQNs, resolved for a model with ``num_layers`` pattern layers."""
        globs = self.globs(num_layers)
        return lambda fqn: any(fnmatch.fnmatchcase(fqn, g) for g in globs)

    def describe(self) -> str:
        where = f" ({self.layers.describe()})" if self.layers is not None else ""
        return f"{self.pattern}{where} -> {self.part}"
