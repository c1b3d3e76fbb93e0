#!/usr/bin/env python
"""Rebuild the shipped corpus, tokenizer and token files under ``data/`` from a Debian package.

The corpus is Jane Austen's six completed novels (1811-1818, public domain), as shipped by the
Debian package ``r-cran-janeaustenr`` (the CRAN package ``janeaustenr``, whose texts come from
Project Gutenberg). The package stores the novels as R character vectors in an R lazy-load
database; this script reads that format directly (no R needed), splits every novel into chapters
(one chapter = one document), holds out a fixed set of chapters for validation, and writes:

    data/corpus/austen_{train,validation}.jsonl.gz     the raw text, one chapter per line
    data/tokenizer/tokenizer.json                      byte-level BPE (8,192 tokens), trained on train
    data/tokens/austen_{train,validation}.{bin,idx}    Megatron-layout uint16 token files
    data/tokens/austen_{train,validation}.manifest.json

Run from the repository root (needs ``apt-get`` and network access to Debian's archive, or a
local copy of the .deb passed with ``--deb``):

    python scripts/fetch_corpus.py                 # download, extract, tokenize
    python scripts/fetch_corpus.py --deb FILE.deb  # use a .deb you already have
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import re
import struct
import subprocess
import sys
import tarfile
import tempfile
import zlib
from pathlib import Path

PACKAGE = "r-cran-janeaustenr"
VERSION = "1.0.0-1"
DEB_SHA256 = "df6bddf211906d1ff404f8ff662c21b34e6660e7f54a311084e749050c019c95"
RDATA_DIR = "usr/lib/R/site-library/janeaustenr/data/"

# R object name -> (title, year of first publication)
NOVELS = {
    "sensesensibility": ("Sense and Sensibility", 1811),
    "prideprejudice": ("Pride and Prejudice", 1813),
    "mansfieldpark": ("Mansfield Park", 1814),
    "emma": ("Emma", 1815),
    "northangerabbey": ("Northanger Abbey", 1817),
    "persuasion": ("Persuasion", 1817),
}
VALIDATION_FRACTION = 0.08
CHAPTER_RE = re.compile(r"^\s*chapter\s+([0-9]+|[ivxlc]+)\.?\s*$", re.IGNORECASE)
# Book structure, not prose: volume headings and end marks that fall inside a chapter's lines.
HEADING_RE = re.compile(r"^\s*(volume\s+[ivx0-9]+|the end|finis)\.?\s*$", re.IGNORECASE)


# --------------------------------------------------------------------------------------------
# Debian package (.deb = ar archive holding data.tar.*)
# --------------------------------------------------------------------------------------------


def download_deb(dest: Path) -> Path:
    subprocess.run(["apt-get", "download", f"{PACKAGE}={VERSION}"], cwd=dest, check=True)
    (deb,) = dest.glob(f"{PACKAGE}_*.deb")
    return deb


def read_ar_members(blob: bytes) -> dict[str, bytes]:
    if not blob.startswith(b"!<arch>\n"):
        raise ValueError("not a Debian package (missing ar magic)")
    members, pos = {}, 8
    while pos + 60 <= len(blob):
        header = blob[pos : pos + 60]
        name = header[:16].decode().strip().rstrip("/")
        size = int(header[48:58].decode().strip())
        members[name] = blob[pos + 60 : pos + 60 + size]
        pos += 60 + size + (size % 2)
    return members


def extract_rdata(deb_bytes: bytes) -> tuple[bytes, bytes, bytes]:
    """Return (Rdata.rdx, Rdata.rdb, copyright) from the package's data tarball."""
    members = read_ar_members(deb_bytes)
    (data_name,) = [n for n in members if n.startswith("data.tar")]
    with tarfile.open(fileobj=io.BytesIO(members[data_name])) as tar:

        def member(path: str) -> bytes:
            return tar.extractfile(tar.getmember("./" + path)).read()

        return (
            member(RDATA_DIR + "Rdata.rdx"),
            member(RDATA_DIR + "Rdata.rdb"),
            member(f"usr/share/doc/{PACKAGE}/copyright"),
        )


# --------------------------------------------------------------------------------------------
# R serialization (XDR, versions 2 and 3): just the object types a data package uses
# --------------------------------------------------------------------------------------------


class _RReader:
    NILVALUE, REF, GLOBALENV, EMPTYENV, BASEENV = 254, 255, 253, 242, 241
    SYM, LIST, CHAR, LGL, INT, REAL, STR, VEC = 1, 2, 9, 10, 13, 14, 16, 19

    def __init__(self, buf: bytes):
        self.buf, self.pos, self.refs = buf, 0, []
        if buf[:2] != b"X\n":
            raise ValueError("only XDR-format R serialization is supported")
        self.pos = 2
        version = self._int()
        self._int(), self._int()  # writer's R version, minimal reader version
        if version == 3:
            name_length = self._int()  # then the native encoding's name
            self.pos += name_length

    def _int(self) -> int:
        (value,) = struct.unpack_from(">i", self.buf, self.pos)
        self.pos += 4
        return value

    def read(self):
        flags = self._int()
        kind, has_attr, has_tag = flags & 0xFF, bool(flags & (1 << 9)), bool(flags & (1 << 10))
        if kind in (self.NILVALUE, self.GLOBALENV, self.EMPTYENV, self.BASEENV):
            return None
        if kind == self.REF:
            index = flags >> 8 or self._int()
            return self.refs[index - 1]
        if kind == self.SYM:
            name = self.read()
            self.refs.append(("symbol", name))
            return ("symbol", name)
        if kind == self.LIST:  # pairlist: attributes, tag, value, rest
            attrs = self.read() if has_attr else None
            tag = self.read() if has_tag else None
            head = [(tag[1] if tag else None, self.read())]
            rest = self.read()
            del attrs
            return head + (rest or [])
        if kind == self.CHAR:
            length = self._int()
            if length == -1:
                return None  # NA_character_
            text = self.buf[self.pos : self.pos + length].decode("utf-8")
            self.pos += length
            return text
        if kind in (self.LGL, self.INT, self.REAL, self.STR, self.VEC):
            length = self._int()
            if kind in (self.LGL, self.INT):
                value = list(struct.unpack_from(f">{length}i", self.buf, self.pos))
                self.pos += 4 * length
            elif kind == self.REAL:
                value = list(struct.unpack_from(f">{length}d", self.buf, self.pos))
                self.pos += 8 * length
            else:
                value = [self.read() for _ in range(length)]
            attrs = dict(self.read()) if has_attr else {}
            names = attrs.get("names")
            return dict(zip(names, value)) if names and kind == self.VEC else value
        raise ValueError(f"R object type {kind} is not supported by this reader")


def _unpack_lazyload_blob(blob: bytes) -> bytes:
    (length,) = struct.unpack(">I", blob[:4])
    data = zlib.decompress(blob[4:])
    assert len(data) == length, "corrupt lazy-load record"
    return data


def read_lazyload_db(rdx: bytes, rdb: bytes) -> dict[str, list[str]]:
    index = _RReader(zlib.decompress(rdx, 16 + zlib.MAX_WBITS) if rdx[:2] == b"\x1f\x8b" else rdx).read()
    objects = {}
    for name, (offset, length) in index["variables"].items():
        objects[name] = _RReader(_unpack_lazyload_blob(rdb[offset : offset + length])).read()
    return objects


# --------------------------------------------------------------------------------------------
# Chapters as documents
# --------------------------------------------------------------------------------------------


def split_chapters(lines: list[str]) -> list[str]:
    """Chapters of one novel as prose: hard-wrapped lines joined, paragraphs separated by a blank line."""
    chapters: list[list[str]] = []
    for line in lines:
        line = line or ""
        if CHAPTER_RE.match(line):
            chapters.append([])
        elif chapters and not HEADING_RE.match(line):
            chapters[-1].append(line)
    texts = []
    for body in chapters:
        paragraphs, current = [], []
        for line in body:
            if line.strip():
                current.append(line.strip())
            elif current:
                paragraphs.append(" ".join(current))
                current = []
        if current:
            paragraphs.append(" ".join(current))
        if paragraphs:
            texts.append("\n\n".join(paragraphs))
    return texts


def is_validation(title: str, chapter: int) -> bool:
    digest = hashlib.sha256(f"{title}/{chapter}".encode()).digest()
    return int.from_bytes(digest[:8], "little") / 2**64 < VALIDATION_FRACTION


def write_jsonl_gz(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode()
    with open(path, "wb") as f, gzip.GzipFile(filename="", mode="wb", fileobj=f, mtime=0, compresslevel=9) as gz:
        gz.write(payload)  # mtime=0 and no name: the same input gives the same bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--deb", type=Path, help="a local copy of the package (skips the download)")
    parser.add_argument("--out", type=Path, default=Path("data"), help="output folder (default: data)")
    parser.add_argument("--no-tokenize", action="store_true", help="write the text only")
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        deb_path = args.deb or download_deb(Path(tmp))
        deb_bytes = deb_path.read_bytes()
    digest = hashlib.sha256(deb_bytes).hexdigest()
    if digest != DEB_SHA256:
        sys.exit(f"{deb_path}: sha256 {digest} differs from the pinned {PACKAGE} {VERSION} ({DEB_SHA256})")
    rdx, rdb, copyright_text = extract_rdata(deb_bytes)
    novels = read_lazyload_db(rdx, rdb)

    splits: dict[str, list[dict]] = {"train": [], "validation": []}
    for name, (title, year) in NOVELS.items():
        for chapter, text in enumerate(split_chapters(novels[name]), start=1):
            split = "validation" if is_validation(title, chapter) else "train"
            splits[split].append({"text": text, "title": title, "year": year, "chapter": chapter})
    for split, records in splits.items():
        path = args.out / "corpus" / f"austen_{split}.jsonl.gz"
        write_jsonl_gz(path, records)
        chars = sum(len(r["text"]) for r in records)
        print(f"{path}: {len(records)} chapters, {chars:,} characters")
    (args.out / "corpus" / "debian-copyright.txt").write_bytes(copyright_text)

    if args.no_tokenize:
        return
    from nemofp4.data.preprocessing import PreprocessConfig, preprocess
    from nemofp4.data.tokenizer import train_bpe_tokenizer

    tokenizer_dir = args.out / "tokenizer"
    train_bpe_tokenizer([args.out / "corpus" / "austen_train.jsonl.gz"], vocab_size=8192, output_dir=tokenizer_dir)
    for split in splits:
        preprocess(
            PreprocessConfig(
                input=str(args.out / "corpus" / f"austen_{split}.jsonl.gz"),
                tokenizer=str(tokenizer_dir),
                output_prefix=str(args.out / "tokens" / f"austen_{split}"),
                workers=args.workers,
                single_file=True,
            )
        )


if __name__ == "__main__":
    main()
