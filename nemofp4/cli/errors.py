"""One error handler for every console script: a user error is one line, not a traceback.

A bad override, a missing file or a value a config rejects is the user's to fix: the message
says what and how, and a 30-90 line traceback only buries it. Such errors print as
``<command>: error: <message>`` on stderr with exit status 1 (what Hydra exits with). Anything else is a bug and keeps
its traceback. ``HYDRA_FULL_ERROR=1`` shows the full traceback of everything.

Hydra catches exceptions itself and prints a shortened traceback unless ``HYDRA_FULL_ERROR``
is set, so :func:`run_cli` sets it around the call (Hydra then re-raises) and decides here.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

__all__ = ["USER_ERRORS", "run_cli", "user_error_message"]

USER_ERRORS: tuple[type[BaseException], ...] = (
    ValueError,  # bad values: our configs' validation, CorruptDataError, OmegaConf's ValidationError
    FileNotFoundError,
    FileExistsError,
    NotADirectoryError,
    IsADirectoryError,
    PermissionError,
    HydraException,  # composition: unknown group option, malformed override, missing config
    OmegaConfBaseException,  # unknown key, wrong type
)


def _is_user_error(exc: BaseException) -> bool:
    from nemofp4.recipes.apply import RecipeUnavailableError
    from nemofp4.training.checkpoint import CheckpointError
    from nemofp4.training.nonfinite import NonFiniteError

    return isinstance(exc, (*USER_ERRORS, RecipeUnavailableError, CheckpointError, NonFiniteError))


def user_error_message(exc: BaseException) -> str:
    """The message without OmegaConf's trailing ``full_key: ... object_type=...`` context lines.

    A wrapped error (Hydra re-raising a config error, OmegaConf wrapping a dataclass's
    ValueError) keeps the original's message, which names the bad value.
    """
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    lines = [line for line in lines if not line.lstrip().startswith(("full_key:", "object_type=", "reference_type="))]
    text = " ".join(line.strip() for line in lines) or type(exc).__name__
    return text.split(" Config search path:", 1)[0]  # Hydra's list of search paths says nothing to fix


def run_cli(entry: Callable[[], object], *, name: str) -> None:
    """Run a console script's Hydra entry point (``name``: the command) under the one-line user-error rule."""
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        entry()
        return
    os.environ["HYDRA_FULL_ERROR"] = "1"  # so Hydra re-raises instead of printing its own traceback
    try:
        entry()
    except Exception as exc:
        if not _is_user_error(exc):
            raise
        print(f"{name}: error: {user_error_message(exc)} (HYDRA_FULL_ERROR=1 shows the traceback)",
              file=sys.stderr, flush=True)
        sys.exit(1)
    finally:
        os.environ.pop("HYDRA_FULL_ERROR", None)
