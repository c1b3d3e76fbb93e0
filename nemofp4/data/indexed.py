"""Megatron-compatible token files: ``<prefix>.bin`` (tokens) and ``<prefix>.idx`` (index).

Layout of ``.idx`` (little-endian), as documented by Megatron-LM:

    9 B   magic  b"MMIDIDX\\x00\\x00"
    8 B   version, uint64 = 1
    1 B   dtype code of the tokens in .bin (1 uint8, 2 int8, 3 int16, 4 int32, 5 int64,
          6 float64, 7 float32, 8 uint16)
    8 B   S = number of sequences, uint64
    8 B   number of entries of document_indices (D + 1 for D documents), uint64
    int32[S]    sequence lengths, in tokens
    int64[S]    sequence pointers, byte offsets into .bin
    int64[D+1]  document_indices: document d is sequences [document_indices[d], document_indices[d+1])

Our writer emits one sequence per document (S == D). The reader accepts any number of
sequences per document and serves a document as its sequences concatenated (Megatron's
writer lays them out contiguously). Both files are read through ``numpy.memmap``: opening
a dataset costs O(1) memory whatever its size.
"""

from __future__ import annotations

import hashlib
import os
import struct
from pathlib import Path

import numpy as np

INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
HEADER_BYTES = len(INDEX_MAGIC) + 8 + 1 + 8 + 8
DTYPE_BY_CODE: dict[int, np.dtype] = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    6: np.dtype(np.float64),
    7: np.dtype(np.float32),
    8: np.dtype(np.uint16),
}
CODE_BY_DTYPE = {dtype: code for code, dtype in DTYPE_BY_CODE.items()}
TOKEN_DTYPES = (np.dtype(np.uint16), np.dtype(np.int32), np.dtype(np.uint8), np.dtype(np.int64))


class CorruptDataError(ValueError):
    """A token file that cannot be what it claims to be (wrong header, sizes, checksum, ids)."""


def token_dtype_for_vocab(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (vocab <= 65,536), else int32 (e.g. Nemotron-H's 131,072)."""
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.int32)


def bin_path(prefix: str | os.PathLike) -> Path:
    return Path(f"{os.fspath(prefix)}.bin")


def idx_path(prefix: str | os.PathLike) -> Path:
    return Path(f"{os.fspath(prefix)}.idx")


def file_sha256(path: str | os.PathLike, chunk_bytes: int = 1 << 24) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


def _fsync_rename(tmp: Path, final: Path) -> None:
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, final)


class IndexedDataset:
    """Random access to the documents of one ``.bin``/``.idx`` pair.

    ``len(ds)`` is the number of documents and ``ds[i]`` document ``i`` as a read-only numpy
    array (a view into the memory-mapped ``.bin``). Every structural inconsistency found at
    open time raises :class:`CorruptDataError` naming the file.
    """

    def __init__(self, prefix: str | os.PathLike):
        self.prefix = os.fspath(prefix)
        self._open()

    # -- opening and validation ---------------------------------------------------------------

    def _open(self) -> None:
        idx_file, bin_file = idx_path(self.prefix), bin_path(self.prefix)
        for path in (idx_file, bin_file):
            if not path.is_file():
                raise FileNotFoundError(f"token file {path} does not exist (expected {self.prefix}.bin/.idx)")
        idx_bytes = idx_file.stat().st_size
        if idx_bytes < HEADER_BYTES:
            raise CorruptDataError(f"{idx_file}: {idx_bytes} bytes is shorter than the {HEADER_BYTES}-byte header")
        with open(idx_file, "rb") as f:
            header = f.read(HEADER_BYTES)
        if header[: len(INDEX_MAGIC)] != INDEX_MAGIC:
            raise CorruptDataError(
                f"{idx_file}: wrong header {header[:9]!r}, expected {INDEX_MAGIC!r} (not a Megatron .idx file)"
            )
        version, dtype_code, num_sequences, num_doc_entries = struct.unpack("<QBQQ", header[9:])
        if version != INDEX_VERSION:
            raise CorruptDataError(f"{idx_file}: index version {version}, only version {INDEX_VERSION} is supported")
        if dtype_code not in DTYPE_BY_CODE:
            raise CorruptDataError(f"{idx_file}: unknown dtype code {dtype_code}, valid codes {sorted(DTYPE_BY_CODE)}")
        if num_doc_entries < 1:
            raise CorruptDataError(f"{idx_file}: document_indices must have at least one entry (the leading 0)")
        expected = HEADER_BYTES + num_sequences * (4 + 8) + num_doc_entries * 8
        if idx_bytes != expected:
            raise CorruptDataError(
                f"{idx_file}: size {idx_bytes} bytes does not match its header ({num_sequences} sequences, "
                f"{num_doc_entries - 1} documents need {expected} bytes); the file is truncated or corrupt"
            )
        self.dtype = DTYPE_BY_CODE[dtype_code]
        if self.dtype not in TOKEN_DTYPES:
            raise CorruptDataError(f"{idx_file}: dtype {self.dtype} is not an integer token dtype")
        index = np.memmap(idx_file, dtype=np.uint8, mode="r")
        offset = HEADER_BYTES
        self.sequence_lengths = index[offset : offset + 4 * num_sequences].view(np.int32)
        offset += 4 * num_sequences
        self.sequence_pointers = index[offset : offset + 8 * num_sequences].view(np.int64)
        offset += 8 * num_sequences
        self.document_indices = index[offset : offset + 8 * num_doc_entries].view(np.int64)
        self.num_sequences = num_sequences
        self.num_documents = num_doc_entries - 1

        bin_bytes = bin_file.stat().st_size
        if num_sequences:
            end = int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * self.dtype.itemsize
        else:
            end = 0
        if bin_bytes != end:
            raise CorruptDataError(
                f"{bin_file}: size {bin_bytes} bytes does not match its index {idx_file} "
                f"(the last sequence ends at byte {end}); the file is truncated or corrupt"
            )
        if self.document_indices[0] != 0 or self.document_indices[-1] != num_sequences:
            raise CorruptDataError(
                f"{idx_file}: document_indices must run from 0 to {num_sequences}, found "
                f"{int(self.document_indices[0])}..{int(self.document_indices[-1])}"
            )
        self.one_sequence_per_document = num_sequences == self.num_documents
        self.tokens = np.memmap(bin_file, dtype=self.dtype, mode="r") if bin_bytes else np.empty(0, dtype=self.dtype)
        if self.one_sequence_per_document:
            self._doc_starts = self.sequence_pointers  # bytes
            self.document_lengths = self.sequence_lengths
        else:
            first = self.document_indices[:-1]
            seq_ends = np.concatenate([[0], np.cumsum(self.sequence_lengths, dtype=np.int64)])
            self.document_lengths = seq_ends[self.document_indices[1:]] - seq_ends[first]
            if num_sequences:
                clipped = np.minimum(first, num_sequences - 1)
                self._doc_starts = np.where(first < num_sequences, self.sequence_pointers[clipped], end)
            else:
                self._doc_starts = np.zeros(self.num_documents, dtype=np.int64)

    # -- pickling: workers reopen the memory maps instead of copying them ----------------------

    def __getstate__(self):
        return {"prefix": self.prefix}

    def __setstate__(self, state):
        self.prefix = state["prefix"]
        self._open()

    # -- access -------------------------------------------------------------------------------

    def __len__(self) -> int:
        return self.num_documents

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])

    def get(self, doc: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of document ``doc`` (to its end when length is None)."""
        doc_length = int(self.document_lengths[doc])
        if length is None:
            length = doc_length - offset
        if not (0 <= offset and offset + length <= doc_length and length >= 0):
            raise IndexError(
                f"{self.prefix}: tokens [{offset}, {offset + length}) outside document {doc} of {doc_length}"
            )
        start = int(self._doc_starts[doc]) // self.dtype.itemsize + offset
        return self.tokens[start : start + length]

    def __getitem__(self, doc: int) -> np.ndarray:
        if not -self.num_documents <= doc < self.num_documents:
            raise IndexError(f"{self.prefix}: document {doc} out of range for {self.num_documents} documents")
        return self.get(doc % self.num_documents)

    def check_token_ids(self, vocab_size: int, chunk_tokens: int = 1 << 24) -> int:
        """Scan every token (chunk by chunk) and return the largest id; raise if one is >= vocab_size."""
        largest = -1
        for start in range(0, self.num_tokens, chunk_tokens):
            chunk = self.tokens[start : start + chunk_tokens]
            chunk_max = int(chunk.max())
            if chunk_max >= vocab_size or int(chunk.min()) < 0:
                position = start + int(np.argmax((chunk >= vocab_size) | (chunk < 0)))
                raise CorruptDataError(
                    f"{bin_path(self.prefix)}: token id {int(self.tokens[position])} at token {position} "
                    f"is outside the vocabulary [0, {vocab_size})"
                )
            largest = max(largest, chunk_max)
        return largest


class IndexedDatasetWriter:
    """Writes one ``.bin``/``.idx`` pair, one sequence per document.

    Output goes to ``*.tmp`` files that are renamed into place only by :meth:`finalize`, .bin
    first and .idx last, so a crash never leaves a pair that opens as complete.
    """

    def __init__(self, prefix: str | os.PathLike, dtype: np.dtype | type):
        self.prefix = os.fspath(prefix)
        self.dtype = np.dtype(dtype)
        if self.dtype not in TOKEN_DTYPES:
            raise ValueError(f"token dtype must be one of {[str(d) for d in TOKEN_DTYPES]}, got {self.dtype}")
        Path(self.prefix).parent.mkdir(parents=True, exist_ok=True)
        self._bin_tmp = Path(f"{bin_path(self.prefix)}.tmp")
        self._bin = open(self._bin_tmp, "wb")
        self._lengths: list[int] = []
        self.num_tokens = 0

    def add_document(self, tokens: np.ndarray | list[int]) -> None:
        array = np.asarray(tokens)
        if array.ndim != 1:
            raise ValueError(f"a document must be a 1-D token array, got shape {array.shape}")
        if array.size and array.dtype != self.dtype:
            info = np.iinfo(self.dtype)
            if int(array.min()) < info.min or int(array.max()) > info.max:
                raise ValueError(f"token ids {int(array.min())}..{int(array.max())} do not fit in {self.dtype}")
        self._bin.write(array.astype(self.dtype, copy=False).tobytes())
        self._lengths.append(int(array.size))
        self.num_tokens += int(array.size)

    @property
    def num_documents(self) -> int:
        return len(self._lengths)

    def finalize(self) -> None:
        self._bin.close()
        lengths = np.asarray(self._lengths, dtype=np.int64)
        if lengths.size and lengths.max() >= 2**31:
            raise ValueError(f"{self.prefix}: a document of {int(lengths.max())} tokens exceeds the int32 length field")
        pointers = np.zeros(lengths.size, dtype=np.int64)
        if lengths.size:
            np.cumsum(lengths[:-1] * self.dtype.itemsize, out=pointers[1:])
        idx_tmp = Path(f"{idx_path(self.prefix)}.tmp")
        with open(idx_tmp, "wb") as f:
            f.write(INDEX_MAGIC)
            f.write(struct.pack("<QBQQ", INDEX_VERSION, CODE_BY_DTYPE[self.dtype], lengths.size, lengths.size + 1))
            f.write(lengths.astype("<i4").tobytes())
            f.write(pointers.astype("<i8").tobytes())
            f.write(np.arange(lengths.size + 1, dtype="<i8").tobytes())
        _fsync_rename(self._bin_tmp, bin_path(self.prefix))
        _fsync_rename(idx_tmp, idx_path(self.prefix))

    def abort(self) -> None:
        self._bin.close()
        self._bin_tmp.unlink(missing_ok=True)


def write_indexed_dataset(prefix: str | os.PathLike, documents, dtype: np.dtype | type) -> None:
    """Write ``documents`` (an iterable of 1-D token arrays) as ``<prefix>.bin``/``.idx``."""
    writer = IndexedDatasetWriter(prefix, dtype)
    try:
        for document in documents:
            writer.add_document(document)
    except BaseException:
        writer.abort()
        raise
    writer.finalize()
