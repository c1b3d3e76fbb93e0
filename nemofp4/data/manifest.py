"""Token sources: one ``.bin``/``.idx`` pair, or a set of shards listed in a manifest.

``<prefix>.manifest.json`` is written by ``nemofp4-preprocess`` when a run completes. It lists
each shard with its document and token counts, largest token id and the sizes and sha256
checksums of both files, plus the tokenizer hash, so a loader can check the data against the
tokenizer without reading the tokens. A source presents its shards as one list of documents
(global document id = position in shard order).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from nemofp4.data.cache import check_same_as_rank_zero, is_rank_zero
from nemofp4.data.indexed import CorruptDataError, IndexedDataset, bin_path, file_sha256, idx_path
from nemofp4.data.paths import resolve_prefix

MANIFEST_FORMAT = "nemofp4-token-manifest"
MANIFEST_VERSION = 1
VERIFY_LEVELS = ("sizes", "index", "full")


def manifest_path(prefix: str | os.PathLike) -> Path:
    return Path(f"{os.fspath(prefix)}.manifest.json")


def shard_record(prefix: str, relative_to: Path) -> dict:
    """Describe a finished shard (counts, largest id, sizes, checksums) for the manifest."""
    dataset = IndexedDataset(prefix)
    largest = int(dataset.tokens.max()) if dataset.num_tokens else -1
    return {
        "prefix": os.path.relpath(prefix, relative_to),
        "documents": len(dataset),
        "tokens": dataset.num_tokens,
        "max_token_id": largest,
        "bin_bytes": bin_path(prefix).stat().st_size,
        "idx_bytes": idx_path(prefix).stat().st_size,
        "bin_sha256": file_sha256(bin_path(prefix)),
        "idx_sha256": file_sha256(idx_path(prefix)),
    }


def verify_shard(prefix: str, record: dict, level: str) -> None:
    """Check a shard against its manifest record; raise CorruptDataError naming the file."""
    if level not in VERIFY_LEVELS:
        raise ValueError(f"verify level {level!r} is not one of {VERIFY_LEVELS}")
    for path, key in ((bin_path(prefix), "bin"), (idx_path(prefix), "idx")):
        if not path.is_file():
            raise FileNotFoundError(f"shard file {path} listed in the manifest does not exist")
        size = path.stat().st_size
        if size != record[f"{key}_bytes"]:
            raise CorruptDataError(f"{path}: size {size} bytes, the manifest says {record[f'{key}_bytes']}")
        if level == "full" or (level == "index" and key == "idx"):
            digest = file_sha256(path)
            if digest != record[f"{key}_sha256"]:
                raise CorruptDataError(
                    f"{path}: sha256 checksum mismatch with the manifest (the file changed or is corrupt)"
                )


@dataclass
class TokenSource:
    """The documents of one or more shards, addressed by a global document id."""

    name: str
    shards: list[IndexedDataset]
    max_token_id: int | None  # known from a manifest; None for a bare .bin/.idx pair
    tokenizer_hash: str | None
    identity: dict  # content identity used in cache keys and resume fingerprints

    def __post_init__(self):
        counts = np.array([len(s) for s in self.shards], dtype=np.int64)
        self.shard_starts = np.concatenate([[0], np.cumsum(counts)])
        self.num_documents = int(self.shard_starts[-1])
        self.num_tokens = sum(s.num_tokens for s in self.shards)

    def locate(self, doc: int) -> tuple[IndexedDataset, int]:
        shard = int(np.searchsorted(self.shard_starts, doc, side="right")) - 1
        return self.shards[shard], doc - int(self.shard_starts[shard])

    def lengths_of(self, docs: np.ndarray) -> np.ndarray:
        """Document lengths (int64) for an array of global document ids, gathered shard by shard."""
        if len(self.shards) == 1:
            return self.shards[0].document_lengths[docs].astype(np.int64)
        out = np.empty(len(docs), dtype=np.int64)
        shard_of = np.searchsorted(self.shard_starts, docs, side="right") - 1
        for shard in np.unique(shard_of):
            mask = shard_of == shard
            local = docs[mask] - self.shard_starts[shard]
            out[mask] = self.shards[shard].document_lengths[local]
        return out

    def all_document_lengths(self) -> np.ndarray:
        """Every document's length, in global id order: the shard's memory map for one shard,
        else one int32 (or int64) array of 4 (8) bytes per document, for index builds."""
        if len(self.shards) == 1:
            return self.shards[0].document_lengths
        longest = max((int(s.document_lengths.max()) for s in self.shards if len(s)), default=0)
        out = np.empty(self.num_documents, dtype=np.int32 if longest < 2**31 else np.int64)
        for shard, start in zip(self.shards, self.shard_starts[:-1]):
            out[start : start + len(shard)] = shard.document_lengths
        return out

    def get(self, doc: int, offset: int, length: int) -> np.ndarray:
        shard, local = self.locate(doc)
        return shard.get(local, offset, length)

    def check_vocab(self, vocab_size: int) -> None:
        if self.max_token_id is not None and self.max_token_id >= vocab_size:
            raise CorruptDataError(
                f"{self.name}: the manifest records token id {self.max_token_id}, outside the tokenizer's "
                f"vocabulary [0, {vocab_size}); the data was tokenized with a different tokenizer"
            )


def _sampled_digest(path: Path, sample_bytes: int = 1 << 20) -> str:
    """sha256 of a file's size, first and last MiB: a cheap content identity for large .idx files."""
    size = path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        digest.update(f.read(sample_bytes))
        if size > sample_bytes:
            f.seek(max(size - sample_bytes, sample_bytes))
            digest.update(f.read())
    return digest.hexdigest()


def open_token_source(prefix: str | os.PathLike, *, verify: str = "index") -> TokenSource:
    """Open ``<prefix>.manifest.json`` (sharded output) or else ``<prefix>.bin``/``.idx``.

    Under torch.distributed only rank 0 verifies checksums (``verify``); the other ranks check file
    sizes against the manifest and that their source's identity equals rank 0's, instead of each
    re-hashing gigabytes of ``.idx`` files.
    """
    prefix = resolve_prefix(prefix)
    if not is_rank_zero() and verify in VERIFY_LEVELS:
        verify = "sizes"
    source = _open_token_source(prefix, verify)
    check_same_as_rank_zero(source.identity, what=f"token source {prefix}")
    return source


def _open_token_source(prefix: str, verify: str) -> TokenSource:
    manifest_file = manifest_path(prefix)
    if manifest_file.is_file():
        manifest = json.loads(manifest_file.read_text())
        if manifest.get("format") != MANIFEST_FORMAT:
            raise CorruptDataError(f"{manifest_file}: not a {MANIFEST_FORMAT} file")
        shards = []
        for record in manifest["shards"]:
            shard_prefix = str(manifest_file.parent / record["prefix"])
            verify_shard(shard_prefix, record, verify)
            shards.append(IndexedDataset(shard_prefix))
        identity = {
            "documents": manifest["documents"],
            "tokens": manifest["tokens"],
            "dtype": manifest["dtype"],
            "shards_idx_sha256": [r["idx_sha256"] for r in manifest["shards"]],
        }
        max_id = max((r["max_token_id"] for r in manifest["shards"]), default=-1)
        return TokenSource(prefix, shards, max_id, manifest["tokenizer"]["hash"], identity)
    if not idx_path(prefix).is_file():
        raise FileNotFoundError(
            f"no token data at prefix {prefix!r}: expected {prefix}.manifest.json or {prefix}.bin/.idx"
        )
    dataset = IndexedDataset(prefix)
    identity = {
        "documents": len(dataset),
        "tokens": dataset.num_tokens,
        "dtype": str(dataset.dtype),
        "idx_digest": _sampled_digest(idx_path(prefix)),
    }
    return TokenSource(prefix, [dataset], None, None, identity)
