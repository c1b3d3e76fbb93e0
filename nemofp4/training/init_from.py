"""A run's initial weights from a released model or another run (``train.init_from``).

The source is a transformers NemotronH folder (``config.json``, safetensors in one file or sharded
with ``model.safetensors.index.json``, tokenizer files) or a checkpoint of ours (a run directory or
a step folder). Weights only: the optimizer, the schedule and the quantizers' held references start
fresh, as in any new run.

Memory: the trainer builds the model on the meta device, shards it (FSDP2) and only then
materializes it, so each rank holds its own shard and nothing else. Loading keeps it so: DCP plans
the reads from the sharded model's state dict, and for a transformers folder DCP's
``HuggingFaceStorageReader`` reads each rank's slice of every tensor with safetensors' ``get_slice``
from the memory-mapped file. No rank materializes a full tensor it does not own, so host memory grows
by one slice at a time, not by a copy of the model (figures: docs/benchmarks.md). A checkpoint of
ours is read as a resume reads it (DCP, resharded to the current world size), the model part only.
So no conversion step is needed: the folder is read in place at any world size.

Identity: ``train.init_from`` is a fixed key of the run (a resume with another source is refused),
and the resolved source with a hash of its weights is recorded in ``<run_dir>/init_from.json`` and in
every checkpoint's trainer state. A resume loads its own checkpoint and never reads the source again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import nn

from nemofp4.checkpointing import (
    CheckpointError,
    SafeFileSystemReader,
    SafeLoadPlanner,
    complete_checkpoints,
    read_marker,
    resolve_checkpoint,
)
from nemofp4.data import DataConfig, load_tokenizer
from nemofp4.data.paths import resolve_path
from nemofp4.evaluation.run_config import read_step_config
from nemofp4.models.nemotron_h import (
    INIT_ONLY_FIELDS,
    NemotronHConfig,
    config_mismatches,
    from_hf_config,
    hf_names,
    hf_tensor_headers,
    hf_weight_files,
    read_hf_config,
)
from nemofp4.quant import without_quant_state
from nemofp4.training.checkpoint import CheckpointConfig, CheckpointManager
from nemofp4.training.parallel import engine_kind

__all__ = [
    "INIT_RECORD",
    "InitSource",
    "check_compatible",
    "check_recorded_source",
    "initialize_from",
    "load_initial_weights",
    "resolve_source",
    "source_identity",
    "starts_fresh",
    "write_record",
]

log = logging.getLogger("nemofp4")

INIT_RECORD = "init_from.json"
"""In the run directory: the source the run started from and the hash of its weights."""
_FLOAT_DTYPES = ("F32", "BF16", "F16")


@dataclass(frozen=True)
class InitSource:
    """Where the initial weights come from, resolved."""

    kind: str
    """'hf' (a transformers folder) or 'nemofp4' (a step folder of ours)."""
    path: Path
    """The transformers folder, or the complete step folder."""
    model: NemotronHConfig
    """The architecture the weights were trained with."""
    tokenizer: Path | None
    """The tokenizer the weights were trained with (None: the source names none)."""


def _rank_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def starts_fresh(resume: str, run_dir: Path, *, used: bool) -> bool:
    """Whether this start builds new weights rather than resuming: ``resume=auto`` with no complete
    checkpoint in the run directory, or ``resume=none`` in an unused one (in a used one the start is
    refused after the build, so the source is not read for nothing)."""
    if resume == "auto":
        return not complete_checkpoints(Path(run_dir) / "checkpoints")
    return resume == "none" and not used


def resolve_source(init_from: str) -> InitSource:
    """The source ``train.init_from`` names; FileNotFoundError/ValueError saying what a valid one is."""
    path = resolve_path(init_from)
    if not path.exists():
        raise FileNotFoundError(
            f"train.init_from={init_from!r}: no such folder; pass a transformers NemotronH folder (config.json and "
            "model.safetensors or model.safetensors.index.json) or a run directory / step folder of nemofp4"
        )
    if (path / "config.json").is_file():
        try:
            hf_weight_files(path)  # the folder's weights exist (index and files agree)
            model = from_hf_config(read_hf_config(path))
        except FileNotFoundError as err:
            raise FileNotFoundError(f"train.init_from={init_from!r}: {err}") from err
        except ValueError as err:  # a file that is not valid JSON is named by the reader
            raise ValueError(f"train.init_from={init_from!r}: {err}") from err
        tokenizer = path if (path / "tokenizer.json").is_file() else None
        return InitSource(kind="hf", path=path.resolve(), model=model, tokenizer=tokenizer)
    try:
        step = resolve_checkpoint(path)
    except FileNotFoundError as err:
        raise FileNotFoundError(
            f"train.init_from={init_from!r} is neither a transformers folder (no config.json) nor a nemofp4 run: {err}"
        ) from err
    run, _ = read_step_config(step)
    if engine_kind(run.distributed.backend) == "deepspeed":
        raise ValueError(
            f"train.init_from={init_from!r}: {step} was written by DeepSpeed (distributed.backend="
            f"{run.distributed.backend}), whose weights are not in DCP; export it first (nemofp4-export-hf "
            "checkpoint=... out=DIR) and pass that folder"
        )
    return InitSource(kind="nemofp4", path=step.resolve(), model=run.model, tokenizer=resolve_path(run.data.tokenizer))


def check_compatible(source: InitSource, model: NemotronHConfig, data: DataConfig) -> None:
    """The weights fit ``model`` and were trained on the data's tokenizer; ValueError naming what differs."""
    where = f"train.init_from={source.path}"
    mismatches = config_mismatches(source.model, model)
    if mismatches:
        raise ValueError(
            f"{where}: the model config differs from the run's in {len(mismatches)} field(s) (source -> run): "
            + "; ".join(mismatches)
            + ". Choose the model preset the weights were trained with, or override those fields"
        )
    differing = [
        f"{name}: {getattr(source.model, name)!r} -> {getattr(model, name)!r}"
        for name in INIT_ONLY_FIELDS
        if getattr(source.model, name) != getattr(model, name)
    ]
    if differing:
        log.info(
            "%s: fields that do not change what the weights compute differ, the run's values are used: %s",
            where,
            "; ".join(differing),
        )
    eod = data.eod_token or None
    if source.tokenizer is None or not (source.tokenizer.is_file() or (source.tokenizer / "tokenizer.json").is_file()):
        if source.kind == "hf":
            raise ValueError(
                f"{where} has no tokenizer.json, so the data's tokenizer cannot be checked against the model's; "
                "copy the model's tokenizer files (tokenizer.json, tokenizer_config.json) into the folder"
            )
        log.warning(
            "%s: the source run's tokenizer %s is not found; the data's tokenizer %s is taken to be the "
            "one the weights were trained with",
            where,
            source.tokenizer,
            data.tokenizer,
        )
        return
    try:
        theirs = load_tokenizer(source.tokenizer, eod_token=eod)
    except ValueError as err:  # names the file
        raise ValueError(f"{where}: {err}") from err
    ours = load_tokenizer(resolve_path(data.tokenizer), eod_token=eod)
    if theirs.hash != ours.hash:
        raise ValueError(
            f"{where} was trained with the tokenizer {theirs.path} (hash {theirs.hash[:12]}, EOD {theirs.eod_token!r}), "
            f"but data.tokenizer={data.tokenizer} is another one (hash {ours.hash[:12]}, EOD {ours.eod_token!r}): the "
            f"token ids would mean other tokens. Pass data.tokenizer={source.tokenizer} with data tokenized by it "
            f"(nemofp4-preprocess tokenizer={source.tokenizer} ...)"
        )


def _file_sha256(path: Path, chunk: int = 1 << 24) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def source_identity(source: InitSource, init_from: str) -> dict[str, Any]:
    """The record of the source: its path and a hash of its weights (collective; the same on every rank).

    A transformers folder: the sha256 of each safetensors file (what the Hugging Face Hub lists for
    each file), the ranks hashing different files, and a sha256 over those. A checkpoint of ours: the
    sha256 of its marker's file table (sizes and CRC32s of every file, written when it was saved), so
    nothing is read again."""
    record: dict[str, Any] = {"init_from": init_from, "kind": source.kind, "path": str(source.path)}
    if source.kind == "hf":
        rank, world = _rank_world()
        files = hf_weight_files(source.path)
        mine = {name: _file_sha256(source.path / name) for name in files[rank::world]}
        if world > 1:
            parts: list[dict[str, str]] = [{} for _ in range(world)]
            dist.all_gather_object(parts, mine)
            mine = {k: v for part in parts for k, v in part.items()}
        record["files"] = {name: mine[name] for name in files}
        record["hashed"] = "sha256 of each safetensors file; weights_sha256 over 'name sha256' lines"
        lines = "".join(f"{name} {digest}\n" for name, digest in record["files"].items())
        record["weights_sha256"] = hashlib.sha256(lines.encode()).hexdigest()
    else:
        marker = read_marker(source.path)
        record["step"] = int(source.path.name.removeprefix("step-"))
        record["hashed"] = "sha256 of the checkpoint's COMPLETE.json file table (sizes and CRC32s of every file)"
        record["weights_sha256"] = hashlib.sha256(json.dumps(marker["files"], sort_keys=True).encode()).hexdigest()
    return record


def _recorded(run_dir: Path) -> dict[str, Any] | None:
    path = Path(run_dir) / INIT_RECORD
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path} is unreadable ({err}); it records which weights this run started from") from err
    return record if isinstance(record, dict) else None


def check_recorded_source(run_dir: Path, source: InitSource, record: dict[str, Any] | None = None) -> None:
    """A run directory that already started from a source (``init_from.json``, written by a start that
    wrote no checkpoint yet) takes no other: the same folder, and (given ``record``) the same weights."""
    recorded = _recorded(run_dir)
    if recorded is None:
        return
    where = f"run_dir {run_dir} started from {recorded.get('path')}"
    if recorded.get("path") != str(source.path):
        raise ValueError(
            f"{where} (train.init_from={recorded.get('init_from')!r}); this start names {source.path}: a run never "
            "mixes two sources. Restore train.init_from, or start a new run in another run_dir (or pass overwrite=true)"
        )
    if record is not None and recorded.get("weights_sha256") != record["weights_sha256"]:
        raise ValueError(
            f"{where}, whose weights had sha256 {recorded.get('weights_sha256')}; they now have "
            f"{record['weights_sha256']}: the folder changed. Restore it, or start a new run in another run_dir"
        )


def write_record(run_dir: Path, record: dict[str, Any]) -> None:
    """``<run_dir>/init_from.json`` (rank 0, beside the run's config)."""
    path = Path(run_dir) / INIT_RECORD
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    tmp.replace(path)


def load_initial_weights(model: nn.Module, source: InitSource) -> None:
    """Read ``source``'s weights into ``model`` (materialized, sharded or not) in place; each rank reads
    only its own shard of every tensor. Collective under FSDP2."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    state = get_model_state_dict(model)
    with warnings.catch_warnings():  # DCP warns on every load without a process group; one process is supported
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        if source.kind == "hf":
            from torch.distributed.checkpoint import HuggingFaceStorageReader

            headers = hf_tensor_headers(source.path)
            names = hf_names(without_quant_state(state), source.model, headers)
            problems = [
                f"{ours}: {headers[hf][0]} in the folder, {tuple(state[ours].shape)} in the model"
                for ours, hf in names.items()
                if headers[hf][0] != tuple(state[ours].shape)
            ]
            problems += [
                f"{hf}: dtype {headers[hf][1]}"
                for hf in sorted(set(names.values()))
                if headers[hf][1] not in _FLOAT_DTYPES
            ]
            if problems:
                raise ValueError(
                    f"train.init_from={source.path}: tensors that do not fit the model (valid dtypes: "
                    f"{', '.join(_FLOAT_DTYPES)}): " + "; ".join(problems)
                )
            by_hf_name = {}
            for ours, hf in names.items():
                by_hf_name.setdefault(hf, state[ours])  # a tied head shares the embedding's tensor
            dcp.load(by_hf_name, storage_reader=HuggingFaceStorageReader(str(source.path)))
        else:
            reader = SafeFileSystemReader(str(source.path))
            reader.read_metadata()  # a planted metadata pickle fails here, by name
            # the weights alone (they share the state's tensors): held references start fresh
            dcp.load({"model": without_quant_state(state)}, storage_reader=reader, planner=SafeLoadPlanner())
    set_model_state_dict(model, state)


def initialize_from(
    model: nn.Module, init_from: str, *, model_config: NemotronHConfig, data: DataConfig, run_dir: Path
) -> dict[str, Any]:
    """Check, hash and load ``init_from`` into the built model (collective); returns the source's record."""
    started = time.perf_counter()
    source = resolve_source(init_from)
    check_compatible(source, model_config, data)
    check_recorded_source(run_dir, source)
    if source.kind == "nemofp4":
        CheckpointManager(source.path.parent, CheckpointConfig()).verify(
            source.path
        )  # sizes and CRC32s, split over ranks
    record = source_identity(source, init_from)
    check_recorded_source(run_dir, source, record)
    try:
        load_initial_weights(model, source)
    except (ValueError, CheckpointError):
        raise
    except Exception as err:  # DCP raises several types for a damaged file
        raise CheckpointError(f"train.init_from={source.path} could not be read: {str(err).splitlines()[0]}") from err
    if _rank_world()[0] == 0:
        log.info(
            "initial weights from %s (%s, weights sha256 %s) in %.1f s; optimizer, schedule and quantizer "
            "state start fresh",
            source.path,
            source.kind,
            record["weights_sha256"][:12],
            time.perf_counter() - started,
        )
    return record
