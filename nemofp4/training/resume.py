"""What a checkpoint restores, and which checkpoint a start resumes from.

:class:`ResumableState` is the set of stateful objects a checkpoint saves and a resume loads into, one
per piece of state, as TorchTitan's checkpointer takes a dict of ``Stateful``s. :func:`load_resume_checkpoint`
picks the checkpoint: the one ``resume`` names, or with ``resume=auto`` the newest complete one that
loads, falling back past damaged ones (set aside once another one loaded, so they are not tried again);
none in a fresh run directory. A checkpoint is refused from its saved metadata before any tensor is
read. A resume is a branch point: the run's checkpoints outside the history of the one that loaded
(saved after it, or at a higher step) are set aside with the metrics rows past its step, before
training continues, so ``resume=auto`` after a kill continues the branch that resumed."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from nemofp4.training.checkpoint import CheckpointError, CheckpointManager, step_of
from nemofp4.training.metrics import METRICS_FILE, copy_rows_after, truncate_after
from nemofp4.training.rng import rng_state, set_rng_state
from nemofp4.training.run_dir import describe_used

if TYPE_CHECKING:
    from nemofp4.quant import QuantTraining
    from nemofp4.training.engine import TrainEngine

__all__ = ["ResumableState", "Saved", "Stateful", "load_resume_checkpoint"]

log = logging.getLogger("nemofp4")


class Stateful(Protocol):
    """A piece of resumable state: what a checkpoint keeps of it, and how it takes that back."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class RNGState:
    """This rank's generators (Python, NumPy, torch's CPU and device ones)."""

    def state_dict(self) -> dict[str, Any]:
        return rng_state()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_rng_state(state)


@dataclass(frozen=True)
class Saved:
    """A checkpoint's small files, read before any of its DCP tensors."""

    trainer_state: dict[str, Any]
    """Rank 0's trainer state: progress, the loader's position, the run's metadata."""
    rank_state: dict[str, Any]
    """This rank's file, or rank 0's when the checkpoint was written by fewer ranks."""
    own: bool
    """Whether ``rank_state`` is this rank's own."""


class Resumable(Protocol):
    """What :func:`load_resume_checkpoint` loads a checkpoint into (:class:`ResumableState`)."""

    def load(self, ckpt: CheckpointManager, folder: Path, saved: Saved) -> None: ...


@dataclass(kw_only=True)
class ResumableState:
    """Everything a checkpoint saves and a resume restores, one stateful object per piece, and where the
    checkpoint keeps it:

    - model and optimizer: ``engine`` (:meth:`~nemofp4.training.engine.TrainEngine.dcp_state`,
      ``load_dcp_state``), through DCP, read in place and resharded; DeepSpeed's format forces its own
      files instead, which only its engine reads (``read_collective``);
    - the held quantizer references: the model state (each FP4 linear's extra state), and each rank's own
      in its file; ``quant`` reads a checkpoint of any layout into the current one
      (:meth:`~nemofp4.quant.QuantTraining.read_checkpoint`, the one converter of older layouts);
    - ``progress`` (step, tokens seen, skipped steps, wandb run, initial weights' source): entries of
      rank 0's trainer state; ``loader`` (the data position): its ``"loader"`` entry;
    - ``rng``: each rank's file, restored on the ranks that wrote one.

    The learning-rate schedule has no state of its own: it is a function of the step (the trainer state's
    ``"schedule"`` is the config, which the resume check compares, never loads)."""

    engine: TrainEngine
    quant: QuantTraining
    progress: Stateful
    loader: Stateful
    rng: Stateful = field(default_factory=RNGState)
    rank: int = 0

    def dcp_state(self) -> dict[str, Any] | None:
        """What DCP saves, and loads in place (None: the engine writes its own)."""
        return self.engine.dcp_state() or None  # the model's state holds the held FP4 references

    def trainer_state(self) -> dict[str, Any]:
        """Rank 0's entries of the trainer state (the run's metadata is the trainer's to add)."""
        return {**self.progress.state_dict(), "loader": self.loader.state_dict(), **self.quant.trainer_entries()}

    def rank_state(self) -> dict[str, Any]:
        """This rank's file."""
        return {"rng": self.rng.state_dict(), **self.quant.rank_entries()}

    def load(self, ckpt: CheckpointManager, folder: Path, saved: Saved) -> None:
        """Load checkpoint ``folder`` (collective), whose small files are ``saved``, into every piece; a
        damaged tensor file is a CheckpointError, bad held references one ValueError naming the folder."""
        state = self.dcp_state()
        problem = self.quant.load_problem(saved.trainer_state, reads_model_state=state is not None)
        if problem is not None:  # from the saved metadata alone, before any tensor is read
            raise ValueError(problem)
        try:
            self.quant.read_checkpoint(
                state,
                lambda state: ckpt.read_tensors(folder, state, read_collective=self.engine.read_collective),
                trainer_state=saved.trainer_state,
                rank_state=saved.rank_state,
            )
        except ValueError as err:
            raise ValueError(
                f"checkpoint {folder}: {err}; resume from another checkpoint (resume=<path>) or without "
                "its references (precision.restore_references=false)"
            ) from None
        if state is not None:
            self.engine.load_dcp_state(state)
        self.progress.load_state_dict(saved.trainer_state)
        self.loader.load_state_dict(saved.trainer_state["loader"])
        if saved.own:
            self.rng.load_state_dict(saved.rank_state["rng"])
        else:
            log.warning(
                "rank %d is new to this run (checkpoint written by %d ranks): its generators keep the seed's state",
                self.rank,
                saved.trainer_state["world_size"],
            )


def load_resume_checkpoint(
    ckpt: CheckpointManager,
    resume: str,
    *,
    run_dir: Path,
    rank: int,
    state: Resumable,
    refuse: Callable[[Mapping[str, Any], Path], None],
) -> Path | None:
    """Load the checkpoint to resume from into ``state`` (collective); returns its folder, or None when
    the run starts fresh. ``refuse(trainer_state, folder)`` reads a candidate's saved metadata and raises
    to refuse it, changing nothing, before any of its tensors is read."""
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
        try:
            saved = Saved(*ckpt.read_saved(folder))
            refuse(saved.trainer_state, folder)
            state.load(ckpt, folder, saved)
        except CheckpointError as err:
            if resume != "auto":
                raise
            log.warning("%s; falling back to the previous complete checkpoint", err)
            failures.append(folder)
            continue
        for damaged in failures:  # only once another one loaded: if none does, the refusal lists them in place
            aside = ckpt.set_aside(damaged)
            if rank == 0:
                log.warning(
                    "moved the damaged checkpoint %s aside to %s: it is not tried again and "
                    "checkpoint.keep_last_k does not count it (nothing was deleted)",
                    damaged,
                    aside,
                )
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
    aside, names = ckpt.abandon(
        folder, keep=lambda into: rows.append(copy_rows_after(metrics, step, into / METRICS_FILE))
    )
    if not names:
        return
    truncate_after(metrics, step)  # the live file follows the branch that resumed
    log.warning(
        "resumed from %s, older than this run's newest checkpoints: set aside %s and %d metrics rows past "
        "step %d in %s, so resume=auto continues from %s (nothing was deleted)",
        folder.name,
        ", ".join(names),
        sum(rows),
        step,
        aside,
        folder.name,
    )
