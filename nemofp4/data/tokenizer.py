"""Tokenizers: load any Hugging Face ``tokenizer.json`` (or a folder holding one), or train the
small byte-level BPE that ships with the corpus.

The end-of-document (EOD) token is resolved once, explicitly, and carried with the tokenizer:
an explicit ``eod_token`` argument wins, then the folder's ``tokenizer_config.json``
``eos_token``, then the first of a short list of conventional names present in the vocabulary.
No EOD found is an error, never a silent default.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

CONVENTIONAL_EOD_TOKENS = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|eot_id|>", "<|im_end|>")
SHIPPED_EOD_TOKEN = "<|endoftext|>"


@dataclass(frozen=True)
class LoadedTokenizer:
    """A ``tokenizers.Tokenizer`` with its EOD id, vocabulary size and a content hash."""

    tokenizer: Tokenizer
    eod_id: int
    eod_token: str
    vocab_size: int
    path: str
    hash: str

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tokenizer.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)


def _tokenizer_file(path: Path) -> Path:
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"no tokenizer at {path}: pass a tokenizer.json file or a folder that contains one "
            "(e.g. a Hugging Face model folder)"
        )
    return path


def _configured_eos(folder: Path) -> str | None:
    config_file = folder / "tokenizer_config.json"
    if not config_file.is_file():
        return None
    try:
        config = json.loads(config_file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{config_file} is not valid JSON ({err})") from err
    eos = config.get("eos_token") if isinstance(config, dict) else None
    if isinstance(eos, dict):
        eos = eos.get("content")
    return eos or None


def load_tokenizer(path: str | os.PathLike, *, eod_token: str | None = None) -> LoadedTokenizer:
    """Load a tokenizer from a ``tokenizer.json`` file or a folder; resolve its EOD token."""
    from nemofp4.data.paths import resolve_path

    file = _tokenizer_file(resolve_path(path))
    try:
        tokenizer = Tokenizer.from_file(str(file))
    except Exception as err:  # tokenizers raises a bare Exception that names no file
        raise ValueError(f"{file} is not a tokenizer the tokenizers library reads ({err})") from err
    candidates = [eod_token] if eod_token else [_configured_eos(file.parent), *CONVENTIONAL_EOD_TOKENS]
    for candidate in candidates:
        if candidate is not None and tokenizer.token_to_id(candidate) is not None:
            eod = candidate
            break
    else:
        tried = eod_token or ", ".join(CONVENTIONAL_EOD_TOKENS)
        raise ValueError(f"{file}: no end-of-document token found (tried {tried}); pass eod_token=<token>")
    eod_id = tokenizer.token_to_id(eod)
    digest = hashlib.sha256(tokenizer.to_str().encode())
    digest.update(f"\neod={eod_id}".encode())
    return LoadedTokenizer(
        tokenizer=tokenizer,
        eod_id=eod_id,
        eod_token=eod,
        vocab_size=tokenizer.get_vocab_size(with_added_tokens=True),
        path=str(file),
        hash=digest.hexdigest(),
    )


def iter_jsonl_texts(files: Iterable[str | os.PathLike], text_key: str = "text") -> Iterator[str]:
    """Texts of ``.jsonl`` / ``.jsonl.gz`` files, in order (used to train the shipped tokenizer)."""
    for file in files:
        opener = gzip.open if str(file).endswith(".gz") else open
        with opener(file, "rt", encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    yield json.loads(line)[text_key]


def train_bpe_tokenizer(
    texts: Iterable[str] | Iterable[str | os.PathLike],
    *,
    vocab_size: int = 8192,
    output_dir: str | os.PathLike,
    eod_token: str = SHIPPED_EOD_TOKEN,
    min_frequency: int = 2,
) -> LoadedTokenizer:
    """Train a byte-level BPE (GPT-2 style; any text round-trips exactly) and save it.

    ``texts`` is an iterable of strings, or of ``.jsonl``/``.jsonl.gz`` paths whose ``text``
    fields are used. The EOD token gets id 0. Writes ``tokenizer.json`` and a
    ``tokenizer_config.json`` naming the EOD token, so ``transformers`` can load the folder.
    """
    items = list(texts) if not isinstance(texts, Iterator) else texts
    if isinstance(items, list) and items and isinstance(items[0], (Path, os.PathLike)):
        items = iter_jsonl_texts(items)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[eod_token],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(items, trainer=trainer)
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "tokenizer.json.tmp"
    tokenizer.save(str(tmp))
    (out / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eod_token}, indent=2) + "\n"
    )
    os.replace(tmp, out / "tokenizer.json")
    return load_tokenizer(out, eod_token=eod_token)
