"""Megatron .bin/.idx files: our writer/reader, an independent writer, and every kind of damage."""

import json
import struct

import numpy as np
import pytest

from nemofp4.data import CorruptDataError, IndexedDataset, open_token_source, write_indexed_dataset
from nemofp4.data.indexed import token_dtype_for_vocab
from nemofp4.data.manifest import shard_record


def megatron_layout_writer(prefix, sequences, document_indices, dtype_code=8, dtype=np.uint16):
    """Independent writer that follows Megatron's documented layout byte by byte."""
    payload = b"".join(np.asarray(s, dtype=dtype).tobytes() for s in sequences)
    with open(f"{prefix}.bin", "wb") as f:
        f.write(payload)
    lengths = [len(s) for s in sequences]
    pointers, position = [], 0
    for n in lengths:
        pointers.append(position)
        position += n * np.dtype(dtype).itemsize
    with open(f"{prefix}.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", dtype_code))
        f.write(struct.pack("<Q", len(sequences)))
        f.write(struct.pack("<Q", len(document_indices)))
        f.write(struct.pack(f"<{len(lengths)}i", *lengths))
        f.write(struct.pack(f"<{len(pointers)}q", *pointers))
        f.write(struct.pack(f"<{len(document_indices)}q", *document_indices))


def random_docs(rng, count, vocab=8192, max_len=50):
    return [rng.integers(0, vocab, size=int(rng.integers(1, max_len))) for _ in range(count)]


def test_round_trip_through_our_writer(tmp_path):
    rng = np.random.default_rng(0)
    docs = random_docs(rng, 40)
    write_indexed_dataset(tmp_path / "d", docs, np.uint16)
    ds = IndexedDataset(tmp_path / "d")
    assert len(ds) == 40 and ds.dtype == np.uint16
    assert ds.num_tokens == sum(len(d) for d in docs)
    for i, doc in enumerate(docs):
        np.testing.assert_array_equal(ds[i], doc)
    np.testing.assert_array_equal(ds[-1], docs[-1])
    np.testing.assert_array_equal(ds.get(3, 1, 2), docs[3][1:3])


def test_our_files_match_the_independent_writer_byte_for_byte(tmp_path):
    docs = random_docs(np.random.default_rng(1), 10)
    write_indexed_dataset(tmp_path / "ours", docs, np.uint16)
    megatron_layout_writer(tmp_path / "theirs", docs, list(range(11)))
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"ours{suffix}").read_bytes() == (tmp_path / f"theirs{suffix}").read_bytes()


def test_reads_independent_writer_with_several_sequences_per_document(tmp_path):
    seqs = [np.arange(5) + 10 * i for i in range(6)]
    # documents: [s0, s1], [s2], [] (empty), [s3, s4, s5]
    megatron_layout_writer(tmp_path / "m", seqs, [0, 2, 3, 3, 6], dtype_code=4, dtype=np.int32)
    ds = IndexedDataset(tmp_path / "m")
    assert len(ds) == 4 and ds.dtype == np.int32
    np.testing.assert_array_equal(ds[0], np.concatenate(seqs[0:2]))
    np.testing.assert_array_equal(ds[1], seqs[2])
    assert ds[2].size == 0
    np.testing.assert_array_equal(ds[3], np.concatenate(seqs[3:6]))
    np.testing.assert_array_equal(ds.document_lengths, [10, 5, 0, 15])


def test_token_dtype_follows_vocabulary():
    assert token_dtype_for_vocab(8192) == np.uint16
    assert token_dtype_for_vocab(65536) == np.uint16
    assert token_dtype_for_vocab(131072) == np.int32


@pytest.fixture
def good(tmp_path):
    write_indexed_dataset(tmp_path / "g", random_docs(np.random.default_rng(2), 20), np.uint16)
    return tmp_path / "g"


def test_truncated_bin_is_named(good):
    data = good.with_suffix(".bin").read_bytes()
    good.with_suffix(".bin").write_bytes(data[:-2])
    with pytest.raises(CorruptDataError, match=r"g\.bin.*does not match its index"):
        IndexedDataset(good)


def test_truncated_idx_is_named(good):
    data = good.with_suffix(".idx").read_bytes()
    good.with_suffix(".idx").write_bytes(data[:-8])
    with pytest.raises(CorruptDataError, match=r"g\.idx.*truncated or corrupt"):
        IndexedDataset(good)


@pytest.mark.parametrize(
    "offset, value, message",
    [(0, b"XXIDIDX\x00\x00", "wrong header"), (9, struct.pack("<Q", 2), "version 2"), (17, b"\x63", "dtype code 99")],
)
def test_wrong_header_fields_are_named(good, offset, value, message):
    data = bytearray(good.with_suffix(".idx").read_bytes())
    data[offset : offset + len(value)] = value
    good.with_suffix(".idx").write_bytes(bytes(data))
    with pytest.raises(CorruptDataError, match=message):
        IndexedDataset(good)


def test_missing_files_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothere"):
        IndexedDataset(tmp_path / "nothere")
    with pytest.raises(FileNotFoundError, match="nothere"):
        open_token_source(tmp_path / "nothere")


def test_token_ids_beyond_the_vocabulary_are_named(good):
    ds = IndexedDataset(good)
    assert ds.check_token_ids(8192) < 8192
    with pytest.raises(CorruptDataError, match=r"g\.bin: token id \d+ .* outside the vocabulary \[0, 100\)"):
        ds.check_token_ids(100)


def _manifest(prefix, tmp_path, records):
    manifest = {
        "format": "nemofp4-token-manifest",
        "version": 1,
        "dtype": "uint16",
        "documents": 20,
        "tokens": 0,
        "tokenizer": {"hash": "x"},
        "shards": records,
    }
    (tmp_path / "m.manifest.json").write_text(json.dumps(manifest))
    return tmp_path / "m"


def test_checksum_mismatch_is_named(good, tmp_path):
    record = shard_record(str(good), tmp_path)
    prefix = _manifest(good, tmp_path, [record])
    assert open_token_source(prefix, verify="full").num_documents == 20
    data = bytearray(good.with_suffix(".bin").read_bytes())
    data[0] ^= 1  # same size, different content
    good.with_suffix(".bin").write_bytes(bytes(data))
    open_token_source(prefix, verify="index")  # the .idx is intact
    with pytest.raises(CorruptDataError, match=r"g\.bin: sha256 checksum mismatch"):
        open_token_source(prefix, verify="full")


def test_manifest_max_token_beyond_vocabulary_is_an_error(good, tmp_path):
    source = open_token_source(_manifest(good, tmp_path, [shard_record(str(good), tmp_path)]))
    with pytest.raises(CorruptDataError, match="outside the tokenizer's vocabulary"):
        source.check_vocab(10)


def test_writer_leaves_nothing_that_opens_as_complete_on_failure(tmp_path):
    def docs():
        yield np.arange(5)
        raise RuntimeError("source died")

    with pytest.raises(RuntimeError):
        write_indexed_dataset(tmp_path / "p", docs(), np.uint16)
    assert not (tmp_path / "p.idx").exists() and not (tmp_path / "p.bin").exists()
