"""Rebuild ``austen_cloze.jsonl``: a sentence-ending multiple-choice task from the held-out chapters.

Each item takes one sentence of a validation chapter (chapters the tiny models never train on),
gives the previous sentence and all but the last ``ENDING_WORDS`` words as the context, and asks
which of four endings is the real one; the three distractors are endings of other sentences of
the same chapter, so style and vocabulary give no cue. Deterministic: the same corpus file and
seed always give the same bytes.

    python data/tasks/build_austen_cloze.py            # writes data/tasks/austen_cloze.jsonl
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import random
import re
from pathlib import Path

HERE = Path(__file__).resolve().parent
CORPUS = HERE.parent / "corpus" / "austen_validation.jsonl.gz"
ENDING_WORDS = 4
NUM_CHOICES = 4
NUM_ITEMS = 120
SEED = 1817
# Sentences end with . ! or ? (optionally followed by a closing quote) and a space.
_SENTENCE_END = re.compile(r"(?<=[.!?])[\"']?\s+")


def sentences(text: str) -> list[str]:
    out = []
    for paragraph in text.split("\n\n"):
        out += [s.strip() for s in _SENTENCE_END.split(" ".join(paragraph.split())) if s.strip()]
    return out


def usable(sentence: str) -> bool:
    words = sentence.split()
    # Long enough to carry context, plain prose (no dialogue quotes or italics markers, which would cue the ending).
    return 12 <= len(words) <= 40 and not any(c in sentence for c in '"_') and sentence[-1] in ".!?"


def build(seed: int = SEED, num_items: int = NUM_ITEMS) -> list[dict]:
    rng = random.Random(seed)
    chapters = [json.loads(line) for line in gzip.open(CORPUS, "rt", encoding="utf-8")]
    candidates = []  # (chapter index, sentence index)
    per_chapter = []
    for c, chapter in enumerate(chapters):
        sents = sentences(chapter["text"])
        per_chapter.append(sents)
        candidates += [(c, i) for i in range(1, len(sents)) if usable(sents[i])]
    rng.shuffle(candidates)
    items = []
    for c, i in candidates:
        sents = per_chapter[c]
        words = sents[i].split()
        ending = " ".join(words[-ENDING_WORDS:])
        pool = sorted(
            {" ".join(s.split()[-ENDING_WORDS:]) for j, s in enumerate(sents) if j != i and usable(s)} - {ending}
        )
        if len(pool) < NUM_CHOICES - 1:
            continue
        choices = rng.sample(pool, NUM_CHOICES - 1) + [ending]
        rng.shuffle(choices)
        context = sents[i - 1] + " " + " ".join(words[:-ENDING_WORDS])
        items.append(
            {
                "context": context,
                "choices": choices,
                "label": choices.index(ending),
                "source": f"{chapters[c]['title']}, chapter {chapters[c]['chapter']}",
            }
        )
        if len(items) == num_items:
            break
    return items


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=HERE / "austen_cloze.jsonl")
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--num-items", type=int, default=NUM_ITEMS)
    args = parser.parse_args()
    items = build(args.seed, args.num_items)
    text = "".join(json.dumps(item, ensure_ascii=False) + "\n" for item in items)
    args.out.write_text(text, encoding="utf-8")
    print(f"{args.out}: {len(items)} items, sha256 {hashlib.sha256(text.encode()).hexdigest()}")


if __name__ == "__main__":
    main()
