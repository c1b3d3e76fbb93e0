"""nemofp4-preprocess reads what `datasets` writes (save_to_disk folders, .arrow, parquet) and
names the file for empty or unreadable inputs."""

import datasets
import pytest

from nemofp4.data import PreprocessConfig, load_tokenizer, preprocess
from nemofp4.data.preprocessing import resolve_input_files
from tests.conftest import TOKENIZER, read_all, shipped_chapters


def _run(tmp_path, input_path, name="out"):
    cfg = PreprocessConfig(
        input=str(input_path),
        tokenizer=TOKENIZER,
        output_prefix=str(tmp_path / name / "tokens"),
        workers=1,
        progress=False,
        single_file=True,
    )
    preprocess(cfg)
    return read_all(tmp_path / name / "tokens")


@pytest.fixture(scope="module")
def texts():
    return shipped_chapters(5)


def test_save_to_disk_folders_arrow_and_parquet_give_the_tokens_of_the_texts(tmp_path, texts):
    tok = load_tokenizer(TOKENIZER)
    expected = [tok.encode(t) + [tok.eod_id] for t in texts]
    ds = datasets.Dataset.from_dict({"text": texts, "id": list(range(len(texts)))})
    ds.save_to_disk(str(tmp_path / "saved"), num_shards=2)
    assert len(resolve_input_files(str(tmp_path / "saved"))) == 2  # the .arrow shards, not state.json
    assert _run(tmp_path, tmp_path / "saved", "a") == expected
    arrow = resolve_input_files(str(tmp_path / "saved"))[0]
    assert _run(tmp_path, arrow, "b") == expected[: len(read_all(tmp_path / "b" / "tokens"))]
    ds.to_parquet(str(tmp_path / "docs.parquet"))
    assert _run(tmp_path, tmp_path / "docs.parquet", "c") == expected


def test_a_dataset_dict_folder_asks_for_one_split(tmp_path, texts):
    ds = datasets.Dataset.from_dict({"text": texts[:2]})
    datasets.DatasetDict({"train": ds, "validation": ds}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(ValueError, match=r"DatasetDict .*splits \['train', 'validation'\].*input=.*dd/train"):
        resolve_input_files(str(tmp_path / "dd"))
    assert len(resolve_input_files(str(tmp_path / "dd" / "train"))) == 1


def test_empty_and_unreadable_files_are_named(tmp_path):
    (tmp_path / "empty.jsonl").write_bytes(b"")
    with pytest.raises(ValueError, match=r"empty.jsonl: the file is empty \(0 bytes\)"):
        _run(tmp_path, tmp_path / "empty.jsonl")
    (tmp_path / "bad.parquet").write_bytes(b"not a parquet file at all")
    with pytest.raises(ValueError, match=r"bad.parquet: cannot be read as parquet"):
        _run(tmp_path, tmp_path / "bad.parquet", "bad")
