"""Every shell command in README.md and docs/*.md runs as written.

Each ```bash block is one test: its lines run under ``bash -euo pipefail`` in a scratch copy of
the repository (one copy per page, blocks in page order, so a page's later blocks see what the
earlier ones wrote). The HTML comment on the line just before a block controls it:

* ``<!-- docs-test: skip: REASON -->``: not run (needs a GPU, a cluster, a long run); the
  reason shows in the doc and in pytest's skip report.
* ``<!-- docs-test: append: OVERRIDES -->``: OVERRIDES are appended to every ``nemofp4-*``,
  ``python -m nemofp4.*`` and ``torchrun ... -m nemofp4.*`` command of the block, so a
  300-step example runs two steps here.

Commands and examples that are not to be run belong in ```text blocks; a fence without a
language is an error, so no command escapes the check. ``nemofp4-*``, ``python`` and
``torchrun`` resolve to this interpreter and the scratch copy's code. Training commands also get
``train.kernels=eager`` (:data:`TRAIN_APPEND`): the eager CPU quantizer has the compiled one's
numerics bit for bit and saves each command its compile time. Pages run side by side
(``NEMOFP4_DOCS_TEST_JOBS``, default 2), the blocks of one page one after another.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
BLOCK_TIMEOUT_S = 600
_DIRECTIVE = re.compile(r"^<!--\s*docs-test:\s*(?P<kind>[a-z]+)\s*:\s*(?P<arg>.*?)\s*-->\s*$")
_FENCE = re.compile(r"^(?P<fence>```+|~~~+)(?P<lang>[^\s`]*)")
_NEMOFP4 = re.compile(r"^nemofp4-[a-z-]+$")
TRAIN_APPEND = "train.kernels=eager"
"""Appended to every training command (bitwise the same run as the default compiled quantizer)."""


@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    """1-based line of the opening fence."""
    lang: str
    text: str
    skip: str | None
    append: str

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


def parse_blocks(page: Path) -> list[Block]:
    """Fenced blocks of a Markdown page, with the docs-test directive on the line before each."""
    lines = page.read_text().splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        match = _FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        fence, lang, start = match["fence"], match["lang"], i
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith(fence)), None)
        if end is None:
            raise ValueError(f"{page}:{start + 1}: unterminated code fence")
        skip, append = None, ""
        directive = _DIRECTIVE.match(lines[start - 1].strip()) if start else None
        if start and lines[start - 1].lstrip().startswith("<!-- docs-test") and not directive:
            raise ValueError(f"{page}:{start}: malformed docs-test comment {lines[start - 1]!r}")
        if directive:
            kind, arg = directive["kind"], directive["arg"]
            if kind not in ("skip", "append") or not arg:
                raise ValueError(
                    f"{page}:{start}: docs-test {kind!r} needs a non-empty argument and must be "
                    "'skip: REASON' or 'append: OVERRIDES'"
                )
            skip, append = (arg, "") if kind == "skip" else (None, arg)
        blocks.append(Block(page, start + 1, lang, "\n".join(lines[start + 1 : end]), skip, append))
        i = end + 1
    return blocks


def split_comment(line: str) -> tuple[str, str]:
    """(code, comment) of a shell line: a '#' that starts a word outside quotes starts a comment."""
    quote = ""
    for k, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = ""
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (k == 0 or line[k - 1].isspace()):
            return line[:k].rstrip(), line[k:]
    return line.rstrip(), ""


def is_nemofp4_command(code: str) -> bool:
    """nemofp4-*, python -m nemofp4.*, or torchrun ... -m nemofp4.* (after VAR=value prefixes)."""
    words = code.split()
    while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):
        words = words[1:]
    if not words:
        return False
    if _NEMOFP4.match(words[0]):
        return True
    if words[0] in ("python", "python3", "torchrun"):
        return any(a == "-m" and b.startswith("nemofp4") for a, b in zip(words, words[1:]))
    return False


def logical_lines(text: str) -> list[str]:
    """Shell lines with backslash continuations joined."""
    out, pending = [], ""
    for raw in text.splitlines():
        if raw.endswith("\\"):
            pending += raw[:-1] + " "
            continue
        out.append(pending + raw)
        pending = ""
    if pending:
        out.append(pending)
    return out


def is_train_command(code: str) -> bool:
    """A nemofp4 command that trains: nemofp4-train, or -m nemofp4.train / nemofp4.cli.train."""
    words = code.split()
    return is_nemofp4_command(code) and any(
        w == "nemofp4-train" or (a == "-m" and w in ("nemofp4.train", "nemofp4.cli.train"))
        for a, w in zip(["", *words], words)
    )


def render(block: Block) -> str:
    """The script the test runs: the block, with its overrides appended to the nemofp4 commands
    (and :data:`TRAIN_APPEND` to the training commands)."""
    lines = []
    for line in logical_lines(block.text):
        code, _comment = split_comment(line)
        if block.append and is_nemofp4_command(code):
            code = f"{code} {block.append}"
        if is_train_command(code):
            code = f"{code} {TRAIN_APPEND}"
        lines.append(code)
    return "\n".join(lines) + "\n"


ALL_BLOCKS = [block for page in PAGES for block in parse_blocks(page)]
BASH_BLOCKS = [block for block in ALL_BLOCKS if block.lang == "bash"]


def test_every_code_block_declares_its_language():
    # A command in an unlabeled fence would escape this check: commands go in ```bash, the rest in ```text.
    unlabeled = [block.id for block in ALL_BLOCKS if not block.lang]
    assert not unlabeled, f"code fences without a language (use ```bash or ```text): {unlabeled}"
    for block in ALL_BLOCKS:
        if block.lang != "bash":
            assert block.skip is None and not block.append, f"{block.id}: a docs-test comment on a ```{block.lang} block"


def test_the_parser_and_the_override_rewriting():
    block = Block(REPO / "README.md", 1, "bash", "", None, "train.max_steps=2")
    text = (
        "nemofp4-train experiment=tiny_ue5m3   # the main job\n"
        "DATA_ROOT=/d python -m nemofp4.train a='#not a comment' \\\n    b=1\n"
        "torchrun --nproc_per_node=2 -m nemofp4.train x=1\n"
        "# nemofp4-train in a comment\n"
        "ls runs/#x\n"
    )
    rendered = render(Block(block.page, 1, "bash", text, None, block.append)).splitlines()
    assert rendered == [
        f"nemofp4-train experiment=tiny_ue5m3 train.max_steps=2 {TRAIN_APPEND}",
        f"DATA_ROOT=/d python -m nemofp4.train a='#not a comment'      b=1 train.max_steps=2 {TRAIN_APPEND}",
        f"torchrun --nproc_per_node=2 -m nemofp4.train x=1 train.max_steps=2 {TRAIN_APPEND}",
        "",
        "ls runs/#x",
    ]
    assert not is_nemofp4_command("python scripts/compare_recipes.py --steps 2")
    assert is_nemofp4_command("nemofp4-eval checkpoint=runs/demo") and not is_train_command("nemofp4-eval checkpoint=x")


def _console_scripts() -> dict[str, str]:
    """[project.scripts] of pyproject.toml: name -> "module:function"."""
    text = (REPO / "pyproject.toml").read_text()
    section = text.split("[project.scripts]", 1)[1].split("\n[", 1)[0]
    return dict(re.findall(r'^([\w-]+)\s*=\s*"([\w.]+:\w+)"', section, flags=re.M))


def _write_shims(bin_dir: Path) -> None:
    """nemofp4-*, python, torchrun: this interpreter, importing the scratch copy's code."""
    bin_dir.mkdir(parents=True)
    py = sys.executable
    shims = {
        "python": f'exec "{py}" "$@"',
        "python3": f'exec "{py}" "$@"',
        "torchrun": f'exec "{py}" -m torch.distributed.run "$@"',
    }
    for name, target in _console_scripts().items():
        module, func = target.split(":")
        shims[name] = f'exec "{py}" -c "import sys; sys.argv[0] = \'{name}\'; from {module} import {func}; sys.exit({func}())" "$@"'
    for name, body in shims.items():
        path = bin_dir / name
        path.write_text(f"#!/usr/bin/env bash\n{body}\n")
        path.chmod(0o755)


def _copy_repo(dest: Path) -> None:
    ignore = shutil.ignore_patterns(".git", ".venv", "runs", "wandb", "outputs", "multirun", "__pycache__",
                                    ".pytest_cache", ".ruff_cache", ".hypothesis", "build", "dist", "*.egg-info",
                                    "cache")
    shutil.copytree(REPO, dest, ignore=ignore)


def _env(cwd: Path, bin_dir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HYDRA_", "WANDB_", "SLURM_"))}
    env.update(
        PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}",
        PYTHONPATH=str(cwd),
        WANDB_MODE="offline",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        MPLBACKEND="Agg",
    )
    return env


def _run_page(page: Path, root: Path, bin_dir: Path) -> dict[str, tuple[int, str, str]]:
    """Run a page's bash blocks in order in its own scratch copy: block id -> (exit status, script, output)."""
    cwd = root / page.stem
    _copy_repo(cwd)
    env = _env(cwd, bin_dir)
    results = {}
    for block in (b for b in BASH_BLOCKS if b.page == page and not b.skip):
        script = render(block)
        try:
            proc = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=cwd, env=env, capture_output=True,
                                  text=True, timeout=BLOCK_TIMEOUT_S)  # fmt: skip
            results[block.id] = (proc.returncode, script, proc.stdout + proc.stderr)
        except subprocess.TimeoutExpired as error:
            results[block.id] = (124, script, f"timed out after {BLOCK_TIMEOUT_S} s\n{error.stdout or ''}{error.stderr or ''}")
    return results


@pytest.fixture(scope="module")
def page_results(tmp_path_factory):
    """Every page's blocks, run once: pages in parallel (``NEMOFP4_DOCS_TEST_JOBS``, default 2), each in order."""
    root = tmp_path_factory.mktemp("docs")
    bin_dir = root / "bin"
    _write_shims(bin_dir)
    runnable = [b.page for b in BASH_BLOCKS if not b.skip]
    # the pages with the most blocks first, so that no long page starts after the others are done
    pages = sorted(set(runnable), key=lambda page: (-runnable.count(page), page))
    jobs = int(os.environ.get("NEMOFP4_DOCS_TEST_JOBS", "2"))
    with ThreadPoolExecutor(max_workers=max(jobs, 1)) as pool:
        per_page = list(pool.map(lambda page: _run_page(page, root, bin_dir), pages))
    return {block_id: result for results in per_page for block_id, result in results.items()}


@pytest.mark.parametrize("block", BASH_BLOCKS, ids=[block.id for block in BASH_BLOCKS])
def test_documented_commands_run(block, request):
    if block.skip:
        pytest.skip(f"docs-test: skip: {block.skip}")
    returncode, script, output = request.getfixturevalue("page_results")[block.id]
    if returncode != 0:
        pytest.fail(f"{block.id}: exit {returncode}\n--- script ---\n{script}--- output (tail) ---\n{output[-4000:]}")
