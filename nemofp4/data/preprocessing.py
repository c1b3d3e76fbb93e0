"""Text -> tokens -> Megatron ``.bin``/``.idx`` shards plus a manifest (``nemofp4-preprocess``).

Documents are read in a fixed order (files sorted by name, rows in file order) with Hugging Face
``datasets`` in streaming mode, tokenized by ``workers`` processes, EOD-terminated and appended
to shards of at most ~``max_shard_tokens`` tokens (a shard closes after the document that
reaches the bound). Each finished shard is renamed into place and recorded in
``<output_prefix>.progress.json`` with the number of input documents it consumed; an
interrupted run resumes after the last recorded shard, and a run whose manifest already
matches its inputs and settings does nothing. The manifest is written last, atomically: its
presence is what marks the output complete.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import multiprocessing
import os
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from nemofp4.data.indexed import IndexedDatasetWriter, bin_path, idx_path, token_dtype_for_vocab
from nemofp4.data.manifest import (
    MANIFEST_FORMAT,
    MANIFEST_VERSION,
    manifest_path,
    shard_record,
    verify_shard,
)
from nemofp4.data.tokenizer import LoadedTokenizer, load_tokenizer, train_bpe_tokenizer

log = logging.getLogger(__name__)

# file suffix -> Hugging Face `datasets` builder
BUILDER_BY_SUFFIX = {
    ".jsonl": "json",
    ".json": "json",
    ".jsonl.gz": "json",
    ".json.gz": "json",
    ".parquet": "parquet",
    ".arrow": "arrow",
    ".txt": "text",
    ".txt.gz": "text",
}
HUB_PREFIX = "hf://"
TEXT_UNITS = ("document", "paragraph", "line")


@dataclass(kw_only=True)
class PreprocessConfig:
    """Settings of one preprocessing run (the ``nemofp4-preprocess`` Hydra app)."""

    input: str
    """A file, a folder (searched recursively), a glob, a folder written by ``datasets``'
    ``save_to_disk``, or ``hf://<dataset>[/<config>]`` for the hub.
    Files: .jsonl/.json(.gz), .parquet, .arrow, .txt(.gz)."""
    tokenizer: str
    """A ``tokenizer.json``, a folder holding one, or ``train`` to train a byte-level BPE on the input."""
    output_prefix: str
    """Output files are ``<prefix>_<shard>.bin/.idx`` (``<prefix>.bin/.idx`` with single_file)
    and ``<prefix>.manifest.json``."""
    workers: int = 2
    """Tokenizer processes (1 tokenizes in the main process)."""
    text_key: str = "text"
    """Column holding the document text in jsonl/parquet inputs."""
    text_unit: str = "document"
    """For .txt inputs: one document per file, per blank-line-separated paragraph, or per line."""
    append_eod: bool = True
    """Append the tokenizer's EOD token after every document."""
    max_shard_tokens: int = 1_000_000_000
    """A shard closes after the document that brings it to this many tokens."""
    single_file: bool = False
    """Write one ``<prefix>.bin/.idx`` pair with no size bound (small corpora)."""
    batch_documents: int = 256
    """Documents per tokenization task sent to a worker."""
    eod_token: str = ""
    """Override the EOD token (default: the tokenizer's configured or conventional one)."""
    tokenizer_vocab_size: int = 8192
    """Vocabulary size when ``tokenizer=train``."""
    tokenizer_output: str = ""
    """Where ``tokenizer=train`` saves its tokenizer (default ``<output_prefix>_tokenizer``)."""
    hub_split: str = "train"
    """Split to read from a hub dataset."""
    progress: bool = True
    """Show a progress bar."""

    def __post_init__(self):
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")
        if self.text_unit not in TEXT_UNITS:
            raise ValueError(f"text_unit must be one of {TEXT_UNITS}, got {self.text_unit!r}")
        if self.max_shard_tokens < 1:
            raise ValueError(f"max_shard_tokens must be positive, got {self.max_shard_tokens}")
        if self.batch_documents < 1:
            raise ValueError(f"batch_documents must be positive, got {self.batch_documents}")


# ----------------------------------------------------------------------------------------------
# Reading documents
# ----------------------------------------------------------------------------------------------


def _suffix(path: str) -> str | None:
    name = path.lower()
    for suffix in sorted(BUILDER_BY_SUFFIX, key=len, reverse=True):
        if name.endswith(suffix):
            return suffix
    return None


def _saved_dataset_files(folder: Path) -> list[str] | None:
    """The .arrow files of a ``Dataset.save_to_disk`` folder in their order, or None for another folder.

    Such a folder also holds ``state.json`` and ``dataset_info.json``, which are metadata, not
    documents. A ``DatasetDict`` folder holds one such folder per split: the user picks one.
    """
    if (folder / "dataset_dict.json").is_file():
        splits = json.loads((folder / "dataset_dict.json").read_text()).get("splits", [])
        raise ValueError(
            f"input {str(folder)!r} is a DatasetDict saved with save_to_disk (splits {splits}); "
            f"point input at one split's folder, e.g. input={folder / (splits[0] if splits else 'train')}"
        )
    state = folder / "state.json"
    if not (state.is_file() and (folder / "dataset_info.json").is_file()):
        return None
    try:
        names = [entry["filename"] for entry in json.loads(state.read_text())["_data_files"]]
    except (json.JSONDecodeError, KeyError, TypeError) as error:
        raise ValueError(f"{state}: not a readable datasets state file ({error})") from error
    missing = [name for name in names if not (folder / name).is_file()]
    if missing or not names:
        raise FileNotFoundError(f"{folder}: save_to_disk folder lists data files {missing or names} that do not exist")
    return [str(folder / name) for name in names]


def resolve_input_files(spec: str) -> list[str]:
    """The input files of ``spec`` (file, folder, save_to_disk folder or glob); errors name what was searched."""
    if os.path.isdir(spec) and (saved := _saved_dataset_files(Path(spec))) is not None:
        return saved
    if os.path.isdir(spec):
        candidates = [str(p) for p in Path(spec).rglob("*") if p.is_file()]
    elif any(ch in spec for ch in "*?["):
        candidates = [p for p in glob.glob(spec, recursive=True) if os.path.isfile(p)]
    elif os.path.isfile(spec):
        if _suffix(spec) is None:
            raise ValueError(f"input file {spec}: unsupported type; supported: {sorted(BUILDER_BY_SUFFIX)}")
        return [spec]
    else:
        raise FileNotFoundError(f"input {spec!r} is not a file, folder or matching glob")
    files = sorted(p for p in candidates if _suffix(p) is not None)
    if not files:
        raise FileNotFoundError(f"input {spec!r} contains no {sorted(BUILDER_BY_SUFFIX)} files")
    return files


def _iter_file_texts(file: str, cfg: PreprocessConfig) -> Iterator[str]:
    import datasets

    builder = BUILDER_BY_SUFFIX[_suffix(file)]
    if os.path.getsize(file) == 0:
        raise ValueError(f"{file}: the file is empty (0 bytes); remove it or give input= without it")
    kwargs = {"sample_by": cfg.text_unit} if builder == "text" else {}
    key = "text" if builder == "text" else cfg.text_key
    try:
        stream = datasets.load_dataset(builder, data_files=[file], split="train", streaming=True, **kwargs)
        for row_number, row in enumerate(stream):
            if key not in row:
                raise ValueError(f"{file}: row {row_number} has no {key!r} field (fields: {sorted(row)}); set text_key")
            text = row[key]
            yield "" if text is None else str(text)
    except ValueError as error:
        if str(error).startswith(file):
            raise
        raise ValueError(f"{file}: cannot be read as {builder}: {error}") from error
    except Exception as error:  # datasets/pyarrow raise many types for a corrupt file
        raise ValueError(f"{file}: cannot be read as {builder}: {type(error).__name__}: {error}") from error


def iter_input_texts(cfg: PreprocessConfig) -> Iterator[str]:
    if cfg.input.startswith(HUB_PREFIX):
        import datasets

        name, _, config = cfg.input[len(HUB_PREFIX) :].partition("/")
        stream = datasets.load_dataset(name, config or None, split=cfg.hub_split, streaming=True)
        for row in stream:
            yield str(row[cfg.text_key] or "")
        return
    for file in resolve_input_files(cfg.input):
        yield from _iter_file_texts(file, cfg)


def input_identity(cfg: PreprocessConfig) -> list:
    if cfg.input.startswith(HUB_PREFIX):
        return [cfg.input, cfg.hub_split]
    # Names relative to the input's folder and sizes: stable when a checkout moves or is cloned.
    files = resolve_input_files(cfg.input)
    root = cfg.input if os.path.isdir(cfg.input) else os.path.dirname(files[0])
    return [[os.path.relpath(f, root), os.path.getsize(f)] for f in files]


# ----------------------------------------------------------------------------------------------
# Tokenization workers
# ----------------------------------------------------------------------------------------------

_WORKER_TOKENIZER: LoadedTokenizer | None = None


def _init_worker(tokenizer_path: str, eod_token: str) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker: workers are the parallelism
    global _WORKER_TOKENIZER
    _WORKER_TOKENIZER = load_tokenizer(tokenizer_path, eod_token=eod_token or None)


def _tokenize_batch(texts: list[str]) -> list[np.ndarray]:
    assert _WORKER_TOKENIZER is not None
    return [np.asarray(ids, dtype=np.int64) for ids in _WORKER_TOKENIZER.encode_batch(texts)]


def _ordered_map(pool: ProcessPoolExecutor, fn, items: Iterator, window: int) -> Iterator:
    """``map`` in input order with at most ``window`` tasks in flight (bounded memory)."""
    pending: deque = deque()
    for item in items:
        pending.append(pool.submit(fn, item))
        if len(pending) >= window:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()


def _batched(texts: Iterator[str], size: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for text in texts:
        batch.append(text)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


# ----------------------------------------------------------------------------------------------
# The run
# ----------------------------------------------------------------------------------------------


def _atomic_write_json(path: Path, payload: dict) -> None:
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(payload, indent=2) + "\n")
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _shard_prefix(cfg: PreprocessConfig, shard: int) -> str:
    return cfg.output_prefix if cfg.single_file else f"{cfg.output_prefix}_{shard:05d}"


def _resolve_tokenizer(cfg: PreprocessConfig) -> LoadedTokenizer:
    if cfg.tokenizer != "train":
        return load_tokenizer(cfg.tokenizer, eod_token=cfg.eod_token or None)
    out = Path(cfg.tokenizer_output or f"{cfg.output_prefix}_tokenizer")
    if (out / "tokenizer.json").is_file():  # trained by an earlier (possibly interrupted) run
        log.info("reusing the tokenizer trained earlier at %s", out)
        return load_tokenizer(out, eod_token=cfg.eod_token or None)
    log.info("training a byte-level BPE tokenizer (vocab %d) on %s", cfg.tokenizer_vocab_size, cfg.input)
    kwargs = {"eod_token": cfg.eod_token} if cfg.eod_token else {}
    return train_bpe_tokenizer(
        (t for t in iter_input_texts(cfg) if t), vocab_size=cfg.tokenizer_vocab_size, output_dir=out, **kwargs
    )


def _settings_fingerprint(cfg: PreprocessConfig, tokenizer: LoadedTokenizer) -> str:
    settings = {
        "inputs": input_identity(cfg),
        "text_key": cfg.text_key,
        "text_unit": cfg.text_unit,
        "append_eod": cfg.append_eod,
        "max_shard_tokens": None if cfg.single_file else cfg.max_shard_tokens,
        "tokenizer": tokenizer.hash,
    }
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()


def _manifest_is_current(cfg: PreprocessConfig, fingerprint: str) -> bool:
    path = manifest_path(cfg.output_prefix)
    if not path.is_file():
        return False
    manifest = json.loads(path.read_text())
    if manifest.get("settings_fingerprint") != fingerprint:
        raise ValueError(
            f"{path} was written from other inputs or settings; remove the old output or choose another output_prefix"
        )
    for record in manifest["shards"]:
        verify_shard(str(path.parent / record["prefix"]), record, "index")
    return True


def preprocess(cfg: PreprocessConfig) -> dict:
    """Run (or resume, or skip) a preprocessing job; return the manifest."""
    tokenizer = _resolve_tokenizer(cfg)
    dtype = token_dtype_for_vocab(tokenizer.vocab_size)
    fingerprint = _settings_fingerprint(cfg, tokenizer)
    out_manifest = manifest_path(cfg.output_prefix)
    if _manifest_is_current(cfg, fingerprint):
        log.info("%s is complete and matches the inputs: nothing to do", out_manifest)
        return json.loads(out_manifest.read_text())

    out_dir = out_manifest.parent
    out_dir.mkdir(parents=True, exist_ok=True)
    progress_file = Path(f"{cfg.output_prefix}.progress.json")
    progress = {"settings_fingerprint": fingerprint, "shards": [], "input_documents": 0, "empty_documents": 0}
    if progress_file.is_file():
        previous = json.loads(progress_file.read_text())
        if previous["settings_fingerprint"] != fingerprint:
            raise ValueError(
                f"{progress_file} belongs to a run with other inputs or settings; remove it and its shards to restart"
            )
        progress = previous
        for record in progress["shards"]:
            verify_shard(str(out_dir / record["prefix"]), record, "index")
        log.info(
            "resuming after %d finished shard(s), %d input documents",
            len(progress["shards"]),
            progress["input_documents"],
        )

    skip = progress["input_documents"]
    texts = iter_input_texts(cfg)
    for _ in range(skip):
        next(texts, None)

    if cfg.workers > 1:
        # spawn: forking after tokenizers' threads have started can deadlock. An executor (not a
        # Pool) so that a worker that dies raises BrokenProcessPool instead of hanging.
        pool = ProcessPoolExecutor(
            cfg.workers,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_init_worker,
            initargs=(tokenizer.path, cfg.eod_token),
        )
        tokenized = _ordered_map(pool, _tokenize_batch, _batched(texts, cfg.batch_documents), 2 * cfg.workers)
    else:
        pool = None
        _init_worker(tokenizer.path, cfg.eod_token)
        tokenized = map(_tokenize_batch, _batched(texts, cfg.batch_documents))

    from tqdm import tqdm

    bar = tqdm(desc=f"tokenizing {cfg.input}", unit=" doc", disable=not cfg.progress, initial=skip)
    shard = len(progress["shards"])
    writer: IndexedDatasetWriter | None = None
    consumed = skip
    empty = progress["empty_documents"]
    tokens_written = 0
    start = time.perf_counter()

    def close_shard() -> None:
        nonlocal writer
        assert writer is not None
        writer.finalize()
        record = shard_record(writer.prefix, out_dir)
        record["input_documents_end"] = consumed
        progress["shards"].append(record)
        progress["input_documents"] = consumed
        progress["empty_documents"] = empty
        _atomic_write_json(progress_file, progress)
        writer = None

    try:
        for batch in tokenized:
            for ids in batch:
                consumed += 1
                if ids.size == 0:
                    empty += 1
                    continue
                if int(ids.max()) >= tokenizer.vocab_size:
                    raise ValueError(
                        f"tokenizer {tokenizer.path} produced id {int(ids.max())} >= vocab {tokenizer.vocab_size}"
                    )
                if writer is None:
                    writer = IndexedDatasetWriter(_shard_prefix(cfg, shard), dtype)
                    shard += 1
                if cfg.append_eod:
                    ids = np.append(ids, tokenizer.eod_id)
                writer.add_document(ids)
                tokens_written += ids.size
                if not cfg.single_file and writer.num_tokens >= cfg.max_shard_tokens:
                    close_shard()
            bar.update(len(batch))
            bar.set_postfix(tokens=tokens_written, refresh=False)
        if writer is not None:
            close_shard()
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    finally:
        bar.close()
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
    progress["input_documents"] = consumed
    progress["empty_documents"] = empty
    seconds = time.perf_counter() - start

    records = progress["shards"]
    manifest = {
        "format": MANIFEST_FORMAT,
        "version": MANIFEST_VERSION,
        "settings_fingerprint": fingerprint,
        "config": asdict(cfg),
        "tokenizer": {
            "path": cfg.tokenizer
            if cfg.tokenizer != "train"
            else (cfg.tokenizer_output or f"{cfg.output_prefix}_tokenizer"),
            "hash": tokenizer.hash,
            "vocab_size": tokenizer.vocab_size,
            "eod_id": tokenizer.eod_id,
            "eod_token": tokenizer.eod_token,
        },
        "dtype": str(dtype),
        "append_eod": cfg.append_eod,
        "input_documents": consumed,
        "empty_documents_skipped": empty,
        "documents": sum(r["documents"] for r in records),
        "tokens": sum(r["tokens"] for r in records),
        "shards": records,
    }
    if not records:
        raise ValueError(f"input {cfg.input!r}: all {consumed} documents are empty; nothing to write")
    _atomic_write_json(out_manifest, manifest)
    progress_file.unlink(missing_ok=True)
    rate = tokens_written / seconds if seconds > 0 else float("nan")
    log.info(
        "%s: %d documents (%d empty skipped), %d tokens in %d shard(s); this run %.0f tokens/s (%.0f per worker)",
        out_manifest,
        manifest["documents"],
        empty,
        manifest["tokens"],
        len(records),
        rate,
        rate / cfg.workers,
    )
    manifest["throughput_tokens_per_s"] = rate
    return manifest


def shard_files(manifest: dict, manifest_dir: Path) -> list[Path]:
    files = []
    for record in manifest["shards"]:
        prefix = manifest_dir / record["prefix"]
        files += [bin_path(prefix), idx_path(prefix)]
    return files
