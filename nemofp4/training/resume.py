"""Which checkpoint a start resumes from: the one ``resume`` names, or with ``resume=auto`` the newest
complete one that loads, falling back past damaged ones (set aside once another one loaded, so they are
not tried again); none in a fresh run directory. A resume is a branch point: the run's checkpoints
outside the history of the one that loaded (saved after it, or at a higher step) are set aside with the
metrics rows past its step, before training continues, so ``resume=auto`` after a kill continues the
branch that resumed."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nemofp4.training.checkpoint import CheckpointError, CheckpointManager, step_of
from nemofp4.training.metrics import METRICS_FILE, copy_rows_after, truncate_after
from nemofp4.training.run_dir import describe_used

__all__ = ["load_resume_checkpoint"]

log = logging.getLogger("nemofp4")


def load_resume_checkpoint(
    ckpt: CheckpointManager,
    resume: str,
    *,
    run_dir: Path,
    rank: int,
    dcp_state: Callable[[], dict[str, Any] | None],
    read_collective: Callable[[Path], None] | None,
    check: Callable[[dict[str, Any], Path, dict[str, Any] | None], None],
    apply: Callable[[Path, dict[str, Any] | None, dict[str, Any], dict[str, Any], bool], None],
) -> Path | None:
    """Load the checkpoint to resume from (collective) and hand it to ``apply(folder, dcp_state,
    trainer_state, rank_state, own)``; returns its folder, or None when the run starts fresh.
    ``dcp_state()`` makes the state DCP loads into; ``check(trainer_state, folder, dcp_state)`` refuses a
    checkpoint before any tensor is read (:meth:`CheckpointManager.load`)."""
    used = describe_used(run_dir)
    if resume == "none" and used:
        raise ValueError(
            f"resume=none, but run_dir {run_dir} already holds a run ({used}). Resume it (resume=auto), "
            "choose another run_dir, or pass overwrite=true to move it aside and start over"
        )
    candidates = ckpt.candidates(resume)
    if resume != "auto":
        for folder in candidates:
            _refuse_another_runs_checkpoint(ckpt, resume, folder, run_dir)
    failures = []
    for folder in candidates:
        state = dcp_state()
        try:
            trainer_state, rank_state, own = ckpt.load(
                folder, dcp_state=state, read_collective=read_collective,
                check=lambda saved, folder=folder, state=state: check(saved, folder, state),
            )  # fmt: skip
        except CheckpointError as err:
            if resume != "auto":
                raise
            log.warning("%s; falling back to the previous complete checkpoint", err)
            failures.append(folder)
            continue
        apply(folder, state, trainer_state, rank_state, own)
        for damaged in failures:  # only once another one loaded: if none does, the refusal lists them in place
            aside = ckpt.set_aside(damaged)
            if rank == 0:
                log.warning("moved the damaged checkpoint %s aside to %s: it is not tried again and "
                            "checkpoint.keep_last_k does not count it (nothing was deleted)", damaged, aside)
        _set_aside_other_branches(ckpt, folder, run_dir=run_dir)
        return folder
    if failures:
        raise CheckpointError(
            f"no checkpoint in {ckpt.root} could be loaded (tried {', '.join(f.name for f in failures)}; "
            "reasons above). "
            "Repair or restore one, resume from another with resume=<path>, or pass overwrite=true to move this "
            "run aside and start over"
        )
    return None


def _refuse_another_runs_checkpoint(ckpt: CheckpointManager, resume: str, folder: Path, run_dir: Path) -> None:
    """A checkpoint of another directory starts this run only where it has no checkpoints of its own:
    otherwise a kill before the first save would make ``resume=auto`` continue from those instead."""
    own = [] if ckpt.owns(folder) else ckpt.complete_checkpoints()
    if not own:
        return
    raise ValueError(
        f"resume={resume!r} names a checkpoint outside run_dir {run_dir}, which holds checkpoints of its own "
        f"(newest {own[-1].name}): after a kill before this run's first save, resume=auto would continue from "
        f"{own[-1].name}, not from {folder}. Resume one of this run's checkpoints (resume={ckpt.root}/step-<N>), "
        f"or continue from {folder} in another run_dir"
    )


def _set_aside_other_branches(ckpt: CheckpointManager, folder: Path, *, run_dir: Path) -> None:
    """Set aside the run's checkpoints outside ``folder``'s history, with the metrics rows past its step
    (:meth:`CheckpointManager.abandon`); one log line names them. Collective."""
    step, metrics = step_of(folder), Path(run_dir) / METRICS_FILE
    rows: list[int] = []
    aside, names = ckpt.abandon(folder, keep=lambda into: rows.append(copy_rows_after(metrics, step, into / METRICS_FILE)))
    if not names:
        return
    truncate_after(metrics, step)  # the live file follows the branch that resumed
    log.warning("resumed from %s, older than this run's newest checkpoints: set aside %s and %d metrics rows past "
                "step %d in %s, so resume=auto continues from %s (nothing was deleted)",
                folder.name, ", ".join(names), sum(rows), step, aside, folder.name)  # fmt: skip
