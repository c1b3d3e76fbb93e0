"""Which run a directory holds: the resolved config it was trained with, and which changes a resume may make.

A run directory belongs to one resolved config. Resuming compares the checkpoint's config with the
current one key by key (flattened, e.g. ``optim.lr``): keys in :data:`SAFE_KEYS` may change freely;
the budget (``train.max_steps``/``train.tokens``) may grow, and the trainer says what that does to the
schedule; any other change is refused with a diff, unless the user names the key in
``resume_accept``. Keys under :data:`FIXED_KEYS` (recipe, model, data, seed, batch layout) define what
was trained and can never be accepted: resuming would silently continue a different experiment.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, NamedTuple

from omegaconf import OmegaConf

from nemofp4.evaluation.run_config import saved_config
from nemofp4.training.parallel import engine_kind

log = logging.getLogger("nemofp4")

__all__ = [
    "BUDGET_KEYS",
    "FIXED_KEYS",
    "SAFE_KEYS",
    "ConfigChange",
    "ResumeRefusedError",
    "changes_the_run",
    "check_resume_config",
    "config_changes",
    "describe_budget_change",
    "describe_refusal",
    "flatten_config",
    "refused_changes",
    "validate_accept_list",
]

SAFE_KEYS = (
    "name",
    "run_dir",
    "resume",
    "resume_accept",
    "overwrite",
    "logging",
    "eval",
    "checkpoint",
    "debug",
    "train.micro_batch",
    "train.max_skipped_steps",
    "train.head_chunk_tokens",
    "train.kernels",
    "train.weight_cache",
    "train.sync_debug",
    "distributed",
)
"""Keys (or sections) that change how a run is observed, saved or laid out over processes, not what it
trains. Checkpoints reshard between world sizes and between one process and FSDP2, so `distributed`
and `train.micro_batch` (another world size with the same global batch) may change: only the order of
the gradient sums does (likewise for the LM head's chunking, `train.head_chunk_tokens`); `train.kernels` picks among
quantizers with the same numerics. Moving between DeepSpeed and the rest is refused (other checkpoint formats)."""
BUDGET_KEYS = ("train.max_steps", "train.tokens")
"""The budget: may grow on resume (the schedule is recomputed for the new total, which the trainer
states); shrinking it must be accepted by name and may never end before the checkpoint's step."""
FIXED_KEYS = ("precision", "model", "data", "train.seed", "train.seq_len", "train.global_batch", "train.init_from")
"""What was trained: a resume that changes these is refused, and resume_accept cannot override it. The initial
weights' source (`train.init_from`) is among them: a resume continues from its own checkpoint and never
reads the source again, so another source would only mislabel the run."""

_ABSENT = "<absent>"


class ResumeRefusedError(ValueError):
    """A resume that would mix two runs. Its message lists one changed key a line, and the console
    scripts print it so (every other user error is one line)."""


def _matches(key: str, prefixes: tuple[str, ...] | list[str]) -> bool:
    return any(key == p or key.startswith(p + ".") for p in prefixes)


def changes_the_run(key: str, accept: list[str] | tuple[str, ...] = ()) -> bool:
    """Whether a resume refuses a change of this dotted key: neither safe nor the budget, and either fixed
    or not named in `accept` (resume_accept)."""
    if _matches(key, SAFE_KEYS) or _matches(key, BUDGET_KEYS):
        return False
    return _matches(key, FIXED_KEYS) or not _matches(key, list(accept))


def flatten_config(cfg: Any) -> dict[str, Any]:
    """Dotted keys to leaf values of a JobConfig, a YAML string or a plain dict (lists stay leaves)."""
    if isinstance(cfg, str):
        container = saved_config(cfg)
    elif isinstance(cfg, dict):
        container = cfg
    else:
        container = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
    out: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict) and node:
            for k, v in node.items():
                walk(v, f"{prefix}{k}.")
        else:
            out[prefix[:-1]] = node

    walk(container, "")
    return out


class ConfigChange(NamedTuple):
    """One key whose value differs between the checkpoint's config and the current one."""

    key: str
    saved: Any
    current: Any

    def __str__(self) -> str:
        return f"{self.key}: {self.saved!r} -> {self.current!r}"


def _with_schema_defaults(saved: Any, schema: type) -> Any:
    """The saved config over the current schema's defaults, so a field added to the schema after the
    checkpoint was written compares as its default rather than as a change, and normalized as the
    trainer normalizes a config (the dataclasses' ``__post_init__``): an old spelling such as
    ``train.head_tf32=true`` compares as what it means today (``model.head_precision=tf32``), and a value
    the schema now derives (``model.max_position_embeddings`` from ``train.seq_len``) as derived. Falls
    back to the merge without normalizing, then to the raw saved config, when the saved config no
    longer fits."""
    try:
        text = saved if isinstance(saved, str) else OmegaConf.to_yaml(OmegaConf.structured(saved))
        merged = OmegaConf.merge(OmegaConf.structured(schema), saved_config(text))
    except Exception:  # omegaconf raises several types for a config that no longer fits
        return saved
    try:
        return OmegaConf.to_container(OmegaConf.structured(OmegaConf.to_object(merged)), resolve=True)
    except Exception:  # a value today's validation rejects: compare it as saved
        return OmegaConf.to_container(merged, resolve=True)


def config_changes(saved: Any, current: Any) -> list[ConfigChange]:
    """Every key whose value differs between two configs, sorted by key (a saved config is first
    completed with the current schema's defaults for fields it predates)."""
    if dataclasses.is_dataclass(current):
        saved = _with_schema_defaults(saved, type(current))
    a, b = flatten_config(saved), flatten_config(current)
    return [
        ConfigChange(k, a.get(k, _ABSENT), b.get(k, _ABSENT))
        for k in sorted(set(a) | set(b))
        if a.get(k, _ABSENT) != b.get(k, _ABSENT)
    ]


def validate_accept_list(accept: list[str], current: Any) -> None:
    """Each resume_accept entry must name a key or section of the config and not a fixed one."""
    keys = flatten_config(current)
    for entry in accept:
        if not any(k == entry or k.startswith(entry + ".") for k in keys):
            raise ValueError(
                f"resume_accept names {entry!r}, which is no key of the training config "
                "(use dotted keys such as optim.lr or a section such as schedule)"
            )
        if _matches(entry, FIXED_KEYS) or any(_matches(f, [entry]) for f in FIXED_KEYS):
            raise ValueError(
                f"resume_accept names {entry!r}, which defines what the run trains (fixed: "
                f"{', '.join(FIXED_KEYS)}); a change there is a new run: use another run_dir"
            )


def refused_changes(changes: list[ConfigChange], accept: list[str]) -> tuple[list[ConfigChange], list[ConfigChange]]:
    """(refused, accepted) among `changes`: safe and budget keys are neither (the caller handles the
    budget); fixed keys are always refused; other keys are refused unless named in `accept`."""
    refused, accepted = [], []
    for change in changes:
        if change.key == "distributed.backend" and engine_kind(change.saved) != engine_kind(change.current):
            refused.append(change)
            continue
        if _matches(change.key, SAFE_KEYS) or _matches(change.key, BUDGET_KEYS):
            continue
        if not _matches(change.key, FIXED_KEYS) and _matches(change.key, accept):
            accepted.append(change)
        else:
            refused.append(change)
    return refused, accepted


def describe_refusal(where: str, refused: list[ConfigChange]) -> str:
    """The message for a refused resume: the changed keys, what is fixed, what can be accepted."""
    fixed = [c for c in refused if _matches(c.key, FIXED_KEYS) or c.key == "distributed.backend"]
    other = [c for c in refused if c not in fixed]
    lines = [f"{where} was trained with a different configuration; resuming would mix two runs. Changed keys:"]
    lines += [f"  {c}" for c in refused]
    if fixed:
        lines.append(
            "Recipe, model, data, seed, batch layout, initial weights and checkpoint format cannot change within a run "
            f"({', '.join(c.key for c in fixed)}): restore them, or start a new run in another run_dir "
            "(or pass overwrite=true to move this run aside)."
        )
    init = next((c for c in refused if c.key == "train.init_from"), None)
    if init is not None:
        lines.append(
            f"The run started from train.init_from={init.saved!r}; this start names {init.current!r}. A resume "
            "reads the run's own checkpoint, never the source: restore the original value (the folder need "
            "not exist any more), or start the new source in another run_dir."
        )
    if other:
        names = ",".join(c.key for c in other)
        lines.append(f"To continue with the new values of the other keys, pass resume_accept=[{names}].")
    return "\n".join(lines)


def describe_budget_change(schedule: Any, step: int, old_total: int, new_total: int) -> str:
    """What a changed budget does to the learning-rate schedule from the resumed step on."""
    from nemofp4.training.schedule import lr_multiplier

    at = max(step, 1)
    before, after = lr_multiplier(schedule, at, old_total), lr_multiplier(schedule, at, new_total)
    text = (
        f"the budget changed from {old_total} to {new_total} steps: the {schedule.name} schedule is recomputed "
        f"for {new_total} steps, so the lr multiplier at step {at} goes from {before:.4g} to {after:.4g}"
    )
    if schedule.name == "wsd":
        old_start = old_total - round(schedule.decay_fraction * old_total)
        new_start = new_total - round(schedule.decay_fraction * new_total)
        text += f"; the decay now starts after step {new_start} (was {old_start})"
        if step > old_start and after > before:
            text += " (the lr rises again: the run had already begun decaying)"
    return text


def check_resume_config(
    saved: Any, current: Any, *, step: int, saved_total: int | None, new_total: int, where: str, log_notes: bool = True
) -> list[ConfigChange]:
    """Compare a run's saved config with the current one for a resume at `step`; raise ValueError naming
    every refused key, log what accepted and budget changes do; return the accepted changes."""
    accept = list(current.resume_accept)
    changes = config_changes(saved, current)
    refused, accepted = refused_changes(changes, accept)
    budget = [c for c in changes if _matches(c.key, BUDGET_KEYS)]
    if step and new_total < step:
        raise ValueError(
            f"{where} is at step {step}, but the budget now ends at step {new_total} "
            f"({', '.join(map(str, budget)) or 'train.max_steps/train.tokens'}); raise the budget "
            "or start a new run"
        )
    if saved_total is not None and new_total < saved_total and not any(_matches(c.key, accept) for c in budget):
        refused += budget
    if refused:
        raise ResumeRefusedError(describe_refusal(where, refused))
    if log_notes:
        for change in accepted:
            log.warning("resume_accept: %s changes on resume: %s", change.key, change)
        if step and saved_total is not None and new_total != saved_total:
            log.warning("%s: %s", where, describe_budget_change(current.schedule, step, saved_total, new_total))
    return accepted
