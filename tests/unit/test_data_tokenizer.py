"""Tokenizers: the shipped one, EOD resolution, and the byte-exact text -> .bin/.idx -> text trip."""

import json

import numpy as np
import pytest

from nemofp4.data import IndexedDataset, load_tokenizer, train_bpe_tokenizer, write_indexed_dataset

TEXTS = [
    "It is a truth universally acknowledged, that a single man in possession of a good fortune...",
    "  Leading spaces,\ttabs,\r\nCRLF line ends and trailing spaces   \n\n",
    "Ünïcödé — “quotes”, emoji 🎻, CJK 漢字, and a NUL-free control \x07 char.",
    "",
]


def test_shipped_tokenizer():
    tok = load_tokenizer("data/tokenizer")
    assert tok.vocab_size == 8192
    assert tok.eod_token == "<|endoftext|>" and tok.eod_id == 0
    assert len(tok.hash) == 64


def test_byte_exact_round_trip_through_token_files(tmp_path):
    tok = load_tokenizer("data/tokenizer")
    ids = [tok.encode(t) for t in TEXTS]
    assert all(max(i, default=0) < tok.vocab_size for i in ids)
    write_indexed_dataset(tmp_path / "rt", [np.append(i, tok.eod_id) for i in ids], np.uint16)
    ds = IndexedDataset(tmp_path / "rt")
    for text, expected, stored in zip(TEXTS, ids, (ds[i] for i in range(len(ds)))):
        assert stored[-1] == tok.eod_id
        assert stored[:-1].tolist() == expected
        assert tok.decode(stored[:-1]) == text


def test_eod_comes_from_tokenizer_config_or_argument(tmp_path):
    tok = train_bpe_tokenizer(iter(TEXTS * 20), vocab_size=300, output_dir=tmp_path / "t", eod_token="<eod>")
    assert tok.eod_token == "<eod>" and tok.eod_id == 0
    (tmp_path / "t" / "tokenizer_config.json").unlink()
    with pytest.raises(ValueError, match="no end-of-document token"):
        load_tokenizer(tmp_path / "t")
    assert load_tokenizer(tmp_path / "t" / "tokenizer.json", eod_token="<eod>").eod_id == 0
    (tmp_path / "t" / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<eod>"}}))
    assert load_tokenizer(tmp_path / "t").eod_token == "<eod>"


def test_trained_bpe_round_trips_and_is_deterministic(tmp_path):
    a = train_bpe_tokenizer(iter(TEXTS * 20), vocab_size=300, output_dir=tmp_path / "a")
    b = train_bpe_tokenizer(iter(TEXTS * 20), vocab_size=300, output_dir=tmp_path / "b")
    assert a.hash == b.hash
    for text in TEXTS:
        assert a.decode(a.encode(text)) == text


def test_missing_tokenizer_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="no tokenizer at"):
        load_tokenizer(tmp_path / "absent")
