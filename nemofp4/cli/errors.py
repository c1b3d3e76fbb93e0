"""One error handler for every console script: a user error is one line, not a traceback.

A bad override, a missing file, a locked run directory or a value a config rejects is the user's to
fix: the message says what and how, and a 30-90 line traceback only buries it. Such errors print as
``<command>: error: <message>`` on stderr, on one line, with exit status 1 (what Hydra exits with),
and nothing else does: Hydra's own "Error executing job with overrides: [...]" line before it is
dropped. The one exception is a refused resume, whose message lists one changed key a line.
Anything else is a bug and keeps its traceback. ``HYDRA_FULL_ERROR=1`` shows the full traceback of
everything.

An override of a key the config does not have gets a message of our own instead of Hydra's advice
to add it with ``+`` (the typed schema refuses it either way): the key, the nearest valid key and,
for a recipe knob, the recipe's knobs.

Third-party notices that say nothing to act on (torchao failing to load its CUDA extensions on a CPU
build of torch, torch's pytree deprecation notice for torchao's enums, DCP's "torch.distributed is
disabled" in one process) are filtered here, at the edge, unless the user asks for warnings (``-W``
or ``PYTHONWARNINGS``).

Hydra catches exceptions itself and prints a shortened traceback unless ``HYDRA_FULL_ERROR``
is set, so :func:`run_cli` sets it around the call (Hydra then re-raises) and decides here.
"""

from __future__ import annotations

import difflib
import logging
import os
import re
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import yaml
from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

__all__ = ["USER_ERRORS", "HydraApp", "quiet_third_party_noise", "run_cli", "unknown_key_message", "user_error_message"]

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

_HYDRA_JOB_FAILED = "Error executing job with overrides:"
_UNKNOWN_KEY = (
    re.compile(r"Could not override '(?P<key>[^']+)'"),  # Hydra, for key=value of a key the config lacks
    re.compile(r"Key '[^']+' not in '[^']+'\s+full_key: (?P<key>\S+)"),  # OmegaConf, e.g. after +key=value
)


@dataclass(frozen=True)
class HydraApp:
    """Where a console script's primary config lives, so an error can name the valid keys."""

    config_name: str
    config_dir: str | None = None
    """None: the primary config is stored in Hydra's ConfigStore."""


def _is_user_error(exc: BaseException) -> bool:
    from nemofp4.recipes.apply import RecipeUnavailableError
    from nemofp4.training.checkpoint import CheckpointError
    from nemofp4.training.nonfinite import NonFiniteError
    from nemofp4.training.run_dir import RunLockedError

    return isinstance(exc, (*USER_ERRORS, RecipeUnavailableError, CheckpointError, NonFiniteError, RunLockedError))


def _keeps_its_lines(exc: BaseException) -> bool:
    """A refused resume lists one changed key a line: that list stays a list."""
    from nemofp4.training.run_identity import ResumeRefusedError

    return isinstance(exc, ResumeRefusedError)


def user_error_message(exc: BaseException) -> str:
    """The message on one line, without OmegaConf's trailing ``full_key: ... object_type=...`` context lines.

    A wrapped error (Hydra re-raising a config error, OmegaConf wrapping a dataclass's
    ValueError) keeps the original's message, which names the bad value.
    """
    text = _one_line(exc)
    cause = exc.__cause__
    if isinstance(cause, (ValueError, OmegaConfBaseException)) and _one_line(cause) not in text:
        text = f"{text.rstrip('.')}: {_one_line(cause)}"  # "Error merging override x=y" says what, its cause why
    return text


def _one_line(exc: BaseException) -> str:
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    lines = [line for line in lines if not line.lstrip().startswith(("full_key:", "object_type=", "reference_type="))]
    text = " ".join(line.strip() for line in lines) or type(exc).__name__
    return text.split(" Config search path:", 1)[0]  # Hydra's list of search paths says nothing to fix


def _unknown_key(exc: BaseException) -> str | None:
    """The dotted key of an override the config has no place for, if that is what `exc` (or its cause) says."""
    while exc is not None:
        for pattern in _UNKNOWN_KEY:
            match = pattern.search(str(exc))
            if match:
                return match["key"]
        exc = exc.__cause__ or exc.__context__
    return None


def _command_line_overrides() -> list[str]:
    return [arg for arg in sys.argv[1:] if "=" in arg and not arg.startswith("-")]


def _override_key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def _compose_without(app: HydraApp, key: str) -> Any:
    """The app's config composed from the command line's other (non-sweep) overrides."""
    from hydra import compose, initialize, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides([o for o in _command_line_overrides() if _override_key(o) != key])
    kept = [o.input_line for o in parsed if not o.is_sweep_override() and not o.is_hydra_override()]
    GlobalHydra.instance().clear()
    init = (
        initialize_config_dir(config_dir=app.config_dir, version_base=None)
        if app.config_dir
        else initialize(config_path=None, version_base=None)
    )
    try:
        with init:
            return compose(config_name=app.config_name, overrides=kept)
    finally:
        GlobalHydra.instance().clear()


def _value(text: str) -> Any:
    """An override's value as Hydra would read it (near enough for a message: YAML)."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def _dotted_keys(node: Any, prefix: str = "") -> list[str]:
    """Every key of a config, sections and leaves, dotted (``train``, ``train.max_steps``)."""
    from omegaconf import DictConfig

    keys = []
    for name in node.keys() if isinstance(node, DictConfig) else ():
        if name == "hydra" and not prefix:
            continue
        key = f"{prefix}{name}"
        keys.append(key)
        child = node._get_node(name)
        if isinstance(child, DictConfig):
            keys += _dotted_keys(child, key + ".")
    return keys


def unknown_key_message(key: str, valid_keys: list[str], *, recipe: str | None = None, value: Any = "?") -> str:
    """The key, the nearest valid key and, for ``precision.<knob>``, the recipe's knobs (the recipe's own
    message, as ``precision_config`` words it when the knob is added with ``+``)."""
    if recipe is not None and key.startswith("precision.") and key.count(".") == 1:
        from nemofp4.recipes import precision_config

        try:
            precision_config({"name": recipe, key.split(".", 1)[1]: value})
        except ValueError as err:
            return str(err)
    same_depth = [k for k in valid_keys if k.count(".") == key.count(".")] or valid_keys
    nearest = difflib.get_close_matches(key, same_depth, n=1, cutoff=0.0)
    where = f"; the nearest valid key is {nearest[0]}" if nearest else ""
    return f"{key} is not a key of this config{where} (a '+' in front would not help: the schema has no such field)"


def _describe_unknown_key(exc: BaseException, app: HydraApp | None) -> str | None:
    key = _unknown_key(exc)
    if key is None or app is None:
        return None
    # OmegaConf names the first missing level ('trian' of +trian.max_steps=3): report the override's key
    key = next((k for k in map(_override_key, _command_line_overrides()) if k == key or k.startswith(key + ".")), key)
    try:
        cfg = _compose_without(app, key)
    except Exception:  # another bad override, or no config to read: fall back to the error's own words
        return None
    recipe = None
    if key.startswith("precision.") and "precision" in cfg and "name" in cfg.precision:
        recipe = str(cfg.precision.name)
    value = next((_value(o.split("=", 1)[1]) for o in _command_line_overrides() if _override_key(o) == key), "?")
    return unknown_key_message(key, _dotted_keys(cfg), recipe=recipe, value=value)


class _DropMessages(logging.Filter):
    def __init__(self, *fragments: str):
        super().__init__()
        self.fragments = fragments

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(fragment in message for fragment in self.fragments)


_PYTREE_ENUM = _DropMessages("is an Enum subclass and is now natively supported by torch.compile")


def quiet_third_party_noise() -> None:
    """Hide messages of libraries that say nothing a user can act on, unless warnings were asked for
    (``python -W ...`` or ``PYTHONWARNINGS=...``)."""
    if sys.warnoptions:
        return
    # torchao (a dev extra, imported by transformers): its CUDA extensions do not load on a CPU build of torch
    logging.getLogger("torchao").setLevel(logging.ERROR)
    # torch's deprecation notice for torchao's pytree registration of its enums
    pytree = logging.getLogger("torch.utils._pytree")
    if _PYTREE_ENUM not in pytree.filters:
        pytree.addFilter(_PYTREE_ENUM)
    # DCP in one process without a process group: the supported single-process layout
    warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled", category=UserWarning)


class _HoldHydraJobLine:
    """sys.stderr, except that Hydra's "Error executing job with overrides" line is held back: it is
    written again before a bug's traceback, and dropped before a user error's one line."""

    def __init__(self, stream: Any):
        self._stream = stream
        self.held: list[str] = []

    def write(self, text: str) -> int:
        if text.startswith(_HYDRA_JOB_FAILED):
            self.held.append(text)
            return len(text)
        return self._stream.write(text)

    def release(self) -> None:
        for text in self.held:
            self._stream.write(text)
        self.held.clear()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def run_cli(entry: Callable[[], object], *, name: str, app: HydraApp | None = None) -> None:
    """Run a console script's Hydra entry point (``name``: the command; ``app``: its primary config, for
    naming valid keys) under the one-line user-error rule."""
    quiet_third_party_noise()
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        entry()
        return
    os.environ["HYDRA_FULL_ERROR"] = "1"  # so Hydra re-raises instead of printing its own traceback
    stderr = sys.stderr
    held = sys.stderr = _HoldHydraJobLine(stderr)
    try:
        entry()
    except Exception as exc:
        sys.stderr = stderr
        if not _is_user_error(exc):
            held.release()
            raise
        message = _describe_unknown_key(exc, app) or user_error_message(exc)
        if _keeps_its_lines(exc):
            message = str(exc).strip()
        print(f"{name}: error: {message} (HYDRA_FULL_ERROR=1 shows the traceback)", file=sys.stderr, flush=True)
        sys.exit(1)
    finally:
        sys.stderr = stderr
        os.environ.pop("HYDRA_FULL_ERROR", None)
