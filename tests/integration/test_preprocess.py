"""nemofp4-preprocess end to end: formats, workers, shards, manifest, resume, reruns, bad input."""

import json
import subprocess
import sys

import pytest

from nemofp4.data import IndexedDataset, PreprocessConfig, load_tokenizer, preprocess
from tests.conftest import TOKENIZER, read_all, shipped_chapters


def write_jsonl(path, texts):
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))


@pytest.fixture
def corpus(tmp_path):
    texts = shipped_chapters(12)
    folder = tmp_path / "in"
    folder.mkdir()
    write_jsonl(folder / "a.jsonl", texts[:6] + [""])  # one empty document
    write_jsonl(folder / "b.jsonl", texts[6:])
    return folder, texts


def test_cli_with_workers_matches_direct_tokenization(corpus, tmp_path):
    folder, texts = corpus
    out = tmp_path / "out" / "corpus"
    cmd = [
        sys.executable,
        "-m",
        "nemofp4.cli.preprocess",
        f"input={folder}",
        f"tokenizer={TOKENIZER}",
        f"output_prefix={out}",
        "workers=2",
        "max_shard_tokens=2000",
        "batch_documents=3",
        "progress=false",
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    manifest = json.loads((tmp_path / "out" / "corpus.manifest.json").read_text())
    tok = load_tokenizer(TOKENIZER)
    expected = [tok.encode(t) + [tok.eod_id] for t in texts]
    assert read_all(out) == expected  # order kept across workers and shards
    assert manifest["documents"] == 12 and manifest["empty_documents_skipped"] == 1
    assert manifest["tokens"] == sum(map(len, expected)) and manifest["dtype"] == "uint16"
    assert len(manifest["shards"]) > 1 and manifest["tokenizer"]["hash"] == tok.hash
    assert all(r["tokens"] < 2000 + max(map(len, expected)) for r in manifest["shards"])
    # rerun on finished output: nothing is rewritten
    mtimes = {p: p.stat().st_mtime_ns for p in (tmp_path / "out").iterdir()}
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "nothing to do" in result.stdout + result.stderr
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "out").iterdir()} == mtimes


def test_interrupted_run_resumes_to_identical_output(corpus, tmp_path, monkeypatch):
    folder, _ = corpus
    config = dict(tokenizer=TOKENIZER, workers=1, max_shard_tokens=1500, batch_documents=2, progress=False)
    preprocess(PreprocessConfig(input=str(folder), output_prefix=str(tmp_path / "ref" / "c"), **config))

    import nemofp4.data.preprocessing as module

    real, calls = module._tokenize_batch, []

    def interrupted(texts):
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt  # the job is killed mid-run
        return real(texts)

    monkeypatch.setattr(module, "_tokenize_batch", interrupted)
    target = tmp_path / "run" / "c"
    with pytest.raises(KeyboardInterrupt):
        preprocess(PreprocessConfig(input=str(folder), output_prefix=str(target), **config))
    monkeypatch.setattr(module, "_tokenize_batch", real)
    progress = json.loads((tmp_path / "run" / "c.progress.json").read_text())
    assert progress["shards"] and not (tmp_path / "run" / "c.manifest.json").exists()
    assert not list((tmp_path / "run").glob("*.tmp"))  # the half-written shard was discarded
    finished = {r["prefix"]: (tmp_path / "run" / f"{r['prefix']}.bin").stat().st_mtime_ns for r in progress["shards"]}

    preprocess(PreprocessConfig(input=str(folder), output_prefix=str(target), **config))
    for name, mtime in finished.items():  # finished shards were kept, not redone
        assert (tmp_path / "run" / f"{name}.bin").stat().st_mtime_ns == mtime
    assert read_all(target) == read_all(tmp_path / "ref" / "c")
    for suffix in (".bin", ".idx"):
        names = sorted(p.name for p in (tmp_path / "ref").glob(f"*{suffix}"))
        assert names == sorted(p.name for p in (tmp_path / "run").glob(f"*{suffix}"))
        for name in names:
            assert (tmp_path / "ref" / name).read_bytes() == (tmp_path / "run" / name).read_bytes()


def test_text_and_parquet_inputs_and_trained_tokenizer(tmp_path):
    texts = shipped_chapters(4)
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "one.txt").write_text(texts[0])
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": texts[1:]}), tmp_path / "in" / "two.parquet")
    manifest = preprocess(
        PreprocessConfig(
            input=str(tmp_path / "in"),
            tokenizer="train",
            tokenizer_vocab_size=400,
            text_key="body",
            output_prefix=str(tmp_path / "o" / "mix"),
            workers=1,
            single_file=True,
            progress=False,
        )
    )
    tok = load_tokenizer(tmp_path / "o" / "mix_tokenizer")
    assert tok.vocab_size == 400 and manifest["documents"] == 4
    ds = IndexedDataset(tmp_path / "o" / "mix")
    # sorted file order: one.txt (whole file = one document), then the parquet rows
    assert [tok.decode(ds[i][:-1]) for i in range(4)] == texts


def test_unreadable_and_missing_inputs_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothing-here"):
        preprocess(
            PreprocessConfig(
                input=str(tmp_path / "nothing-here"), tokenizer=TOKENIZER, output_prefix=str(tmp_path / "x")
            )
        )
    (tmp_path / "bad.parquet").write_bytes(b"this is not parquet")
    with pytest.raises(ValueError, match=r"bad\.parquet: cannot be read as parquet"):
        preprocess(
            PreprocessConfig(
                input=str(tmp_path / "bad.parquet"),
                tokenizer=TOKENIZER,
                output_prefix=str(tmp_path / "x"),
                workers=1,
                progress=False,
            )
        )
    write_jsonl(tmp_path / "nokey.jsonl", ["a"])
    with pytest.raises(ValueError, match=r"nokey\.jsonl.*has no 'content' field"):
        preprocess(
            PreprocessConfig(
                input=str(tmp_path / "nokey.jsonl"),
                tokenizer=TOKENIZER,
                text_key="content",
                output_prefix=str(tmp_path / "x"),
                workers=1,
                progress=False,
            )
        )
    write_jsonl(tmp_path / "empty.jsonl", ["", ""])
    with pytest.raises(ValueError, match="all 2 documents are empty"):
        preprocess(
            PreprocessConfig(
                input=str(tmp_path / "empty.jsonl"),
                tokenizer=TOKENIZER,
                output_prefix=str(tmp_path / "e"),
                workers=1,
                progress=False,
            )
        )
    assert not (tmp_path / "e.manifest.json").exists()


def test_output_from_other_inputs_is_not_overwritten(corpus, tmp_path):
    folder, _ = corpus
    config = dict(tokenizer=TOKENIZER, workers=1, progress=False, output_prefix=str(tmp_path / "o" / "c"))
    preprocess(PreprocessConfig(input=str(folder / "a.jsonl"), **config))
    with pytest.raises(ValueError, match="other inputs or settings"):
        preprocess(PreprocessConfig(input=str(folder / "b.jsonl"), **config))
