"""Every shell command in README.md and docs/*.md runs as written, as a user following the docs would.

Each ```bash block is one test. The blocks run as a user runs them: in one shared scratch checkout of
the repository, page after page in the order the README lists them, each page's blocks in order,
every block in a shell that carries on from the previous one (its exported variables and working
directory). The first shell starts as a fresh login would (``env -i``: ``HOME``, ``PATH=/usr/bin:/bin``
and offline switches for the hub), so a command the docs do not make reachable fails here as it does
for a user. The README's skipped ``make train`` stands for itself by a ``.venv`` in the checkout whose
``bin/`` holds this interpreter's ``python``, ``torchrun`` and ``nemofp4-*`` (importing the checkout's
code) and a plain ``activate``; only the README's own ``source .venv/bin/activate`` puts it on PATH.

Two lanes share the checkout to halve the wall time (:data:`LANES`, ``NEMOFP4_DOCS_TEST_JOBS``,
default 2; 1 runs all pages in one shell): both start from the shell the README's set-up block
leaves, each with its share of the cores as ``OMP_NUM_THREADS`` (two lanes of commands that each
spin a thread per core used 1.5 times the CPU time, 637 s against 427 s, on two cores). A page
belongs in the lane of the pages whose files or run directories it uses, or waits
for them (:data:`AFTER`). Later pages reuse earlier ones' runs where the docs name the same run (a
finished run is not trained again), which keeps the test as cheap as running pages apart.

The HTML comment on the line just before a block controls it:

* ``<!-- docs-test: skip: REASON -->``: not run (needs a GPU, a cluster, a long run); the
  reason shows in the doc and in pytest's skip report.
* ``<!-- docs-test: append: OVERRIDES -->``: OVERRIDES are appended to every ``nemofp4-*``,
  ``python -m nemofp4.*`` and ``torchrun ... -m nemofp4.*`` command of the block, so a
  300-step example runs two steps here.

Commands and examples that are not to be run belong in ```text blocks; a fence without a
language is an error, so no command escapes the check, and so is text after a closing fence (it
does not close the block in Markdown). Training commands also get ``train.kernels=eager``
(:data:`TRAIN_APPEND`): the eager CPU quantizer has the compiled one's numerics bit for bit and
saves each command its compile time (a safe key: a run trained either way resumes either way).
``NEMOFP4_DOCS_TEST_TIMES=<file>`` writes every block's wall time there as JSON.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
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
        if lines[end].strip() != fence:
            raise ValueError(
                f"{page}:{end + 1}: text after a closing code fence ({lines[end]!r}): in Markdown it "
                "does not close the block; put the text on the next line"
            )
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
            assert block.skip is None and not block.append, (
                f"{block.id}: a docs-test comment on a ```{block.lang} block"
            )


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
    assert not is_nemofp4_command("python scripts/study/compare_recipes.py --steps 2")
    assert is_nemofp4_command("nemofp4-eval checkpoint=runs/demo") and not is_train_command("nemofp4-eval checkpoint=x")


def test_text_after_a_closing_fence_is_an_error(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("```bash\nls\n``` and then some text\n")
    with pytest.raises(ValueError, match="text after a closing code fence"):
        parse_blocks(page)
    page.write_text("```bash\nls\n```  \n")
    assert [b.text for b in parse_blocks(page)] == ["ls"]


def _console_scripts() -> dict[str, str]:
    """[project.scripts] of pyproject.toml: name -> "module:function"."""
    text = (REPO / "pyproject.toml").read_text()
    section = text.split("[project.scripts]", 1)[1].split("\n[", 1)[0]
    return dict(re.findall(r'^([\w-]+)\s*=\s*"([\w.]+:\w+)"', section, flags=re.M))


def _write_venv(checkout: Path) -> None:
    """`.venv/bin` of the checkout, as `make setup` leaves it for these commands: nemofp4-*, python and
    torchrun run this interpreter on the checkout's code; `activate` puts the folder first on PATH."""
    bin_dir = checkout / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    py, code = shlex.quote(sys.executable), shlex.quote(str(checkout))
    run = f"PYTHONPATH={code}${{PYTHONPATH:+:$PYTHONPATH}} exec {py}"
    shims = {"python": f'{run} "$@"', "python3": f'{run} "$@"', "torchrun": f'{run} -m torch.distributed.run "$@"'}
    for name, target in _console_scripts().items():
        module, func = target.split(":")
        shims[name] = (
            f'{run} -c "import sys; sys.argv[0] = \'{name}\'; from {module} import {func}; sys.exit({func}())" "$@"'
        )
    for name, body in shims.items():
        path = bin_dir / name
        path.write_text(f"#!/bin/bash\n{body}\n")
        path.chmod(0o755)
    venv = shlex.quote(str(checkout / ".venv"))
    (bin_dir / "activate").write_text(
        f'export VIRTUAL_ENV={venv}\nexport PATH="$VIRTUAL_ENV/bin:$PATH"\n'
        'deactivate() { export PATH="${PATH#"$VIRTUAL_ENV/bin:"}"; unset VIRTUAL_ENV; }\n'
    )


def _copy_repo(dest: Path) -> None:
    ignore = shutil.ignore_patterns(
        ".git",
        ".venv",
        "runs",
        "wandb",
        "outputs",
        "multirun",
        "__pycache__",
        ".pytest_cache",
        ".ruff_cache",
        ".hypothesis",
        "build",
        "dist",
        "*.egg-info",
        "cache",
    )
    shutil.copytree(REPO, dest, ignore=ignore)


FRESH_SHELL = {"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
"""The environment of a fresh login (with HOME), as `env -i HOME=$HOME PATH=/usr/bin:/bin bash` gives it, plus
the hub's offline switches (CI has no network; offline, a lookup fails at once instead of after a timeout)."""

LANES = (
    ("README.md", "docs/training.md", "docs/recipes.md"),
    ("docs/evaluation.md", "docs/data.md", "docs/model.md", "docs/distributed.md", "docs/planning.md", "docs/slurm.md"),
)
"""Pages in the README's order, in two lanes of about equal cost. The first is a user's path through
the README and the two training pages (they share runs/demo, runs/tiny-ue5m3 and what they reuse);
the second lane's pages write only their own files, but for runs/tiny-ue5m3 (see :data:`AFTER`)."""
AFTER = {"docs/training.md": "docs/evaluation.md"}
"""A page starts only once another has finished: both train runs/tiny-ue5m3 (the run `make train`
makes, which evaluation.md evaluates), and one trainer at a time may hold a run directory."""


class Shell:
    """A user's shell over several `bash -c` calls: exported variables and the working directory carry
    from one block to the next (each block runs under `bash -euo pipefail`, the fail-fast a test needs)."""

    def __init__(self, state: Path, threads: int | None = None):
        self.state = state
        """A script that restores the shell: `export -p` of the last block, and a `cd`."""
        self.threads = threads
        """Torch's intra-op threads for the commands (``OMP_NUM_THREADS``): the lane's share of the cores, so
        that lanes side by side do not each spin a thread per core; None leaves torch's default."""

    @classmethod
    def fresh(cls, state: Path, cwd: Path) -> Shell:
        state.write_text(f"cd {shlex.quote(str(cwd))}\n")
        return cls(state)

    def fork(self, state: Path, threads: int | None = None) -> Shell:
        """Another shell that carries on from where this one is."""
        shutil.copyfile(self.state, state)
        return Shell(state, threads)

    def run(self, script: str) -> tuple[int, str]:
        state = shlex.quote(str(self.state))
        wrapped = f"source {state}\n{script}\n{{ export -p; printf 'cd %q\\n' \"$PWD\"; }} > {state}\n"
        env = {"HOME": os.environ.get("HOME", "/root"), **FRESH_SHELL}
        if self.threads:
            env["OMP_NUM_THREADS"] = str(self.threads)
        # A session of its own, so that a block that runs out of time is stopped with everything it started
        # (a trainer left running would hold its run directory and the machine).
        proc = subprocess.Popen(
            ["bash", "--noprofile", "--norc", "-euo", "pipefail", "-c", wrapped],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        try:
            output, _ = proc.communicate(timeout=BLOCK_TIMEOUT_S)
            return proc.returncode, output
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
            return 124, f"timed out after {BLOCK_TIMEOUT_S} s\n{output}"


def _runnable(page: str) -> list[Block]:
    return [b for b in BASH_BLOCKS if b.page == REPO / page and not b.skip]


def _run_blocks(blocks: list[Block], shell: Shell, results: dict, times: dict) -> None:
    for block in blocks:
        script = render(block)
        start = time.perf_counter()
        returncode, output = shell.run(script)
        times[block.id] = round(time.perf_counter() - start, 1)
        results[block.id] = (returncode, script, output)


def _one_lane(lanes: tuple[tuple[str, ...], ...]) -> list[str]:
    """The lanes' pages in one order that keeps each lane's order and :data:`AFTER`."""
    queues, order = [list(lane) for lane in lanes], []
    while any(queues):
        ready = next(q for q in queues if q and (q[0] not in AFTER or AFTER[q[0]] in order))
        order.append(ready.pop(0))
    return order


def test_every_page_with_commands_is_in_one_lane():
    pages = {str(b.page.relative_to(REPO)) for b in BASH_BLOCKS if not b.skip}
    laned = [page for lane in LANES for page in lane]
    assert len(laned) == len(set(laned)) and pages <= set(laned), (
        f"pages with commands but no lane: {sorted(pages - set(laned))} (add them to LANES)"
    )
    assert _one_lane(LANES)[:3] == ["README.md", "docs/evaluation.md", "docs/training.md"]  # one job: AFTER holds
    setup = _runnable("README.md")[0]
    assert not any(is_nemofp4_command(split_comment(line)[0]) for line in logical_lines(setup.text)), (
        "the README's first runnable block is the set-up both lanes start from: it runs no nemofp4 command"
    )


@pytest.fixture(scope="module")
def page_results(tmp_path_factory):
    """Every runnable block, run once: README's set-up, then the lanes side by side (``NEMOFP4_DOCS_TEST_JOBS``,
    default 2), each lane's pages and blocks in order in the one checkout."""
    root = tmp_path_factory.mktemp("docs")
    checkout = root / "checkout"
    _copy_repo(checkout)
    _write_venv(checkout)
    results: dict = {}
    times: dict = {}
    readme = _runnable("README.md")
    setup = Shell.fresh(root / "shell-setup.sh", checkout)
    _run_blocks(readme[:1], setup, results, times)
    done = {page: threading.Event() for lane in LANES for page in lane}

    def run_pages(pages: tuple[str, ...] | list[str], shell: Shell) -> None:
        for page in pages:
            if page in AFTER:
                done[AFTER[page]].wait()
            try:
                _run_blocks([b for b in _runnable(page) if b not in readme[:1]], shell, results, times)
            finally:
                done[page].set()  # a failure shows in that page's tests, never as a hang of the other lane

    jobs = int(os.environ.get("NEMOFP4_DOCS_TEST_JOBS", "2"))
    start = time.perf_counter()
    if jobs > 1:
        cores = int(os.environ.get("OMP_NUM_THREADS") or os.cpu_count() or 1)  # this worker's share (tests/parallel.py)
        shells = [setup.fork(root / f"shell-lane{i}.sh", max(1, cores // len(LANES))) for i in range(len(LANES))]
        with ThreadPoolExecutor(max_workers=len(LANES)) as pool:
            list(pool.map(lambda lane_shell: run_pages(*lane_shell), zip(LANES, shells)))
    else:
        run_pages(_one_lane(LANES), setup)
    times["total"] = round(time.perf_counter() - start + sum(times.get(b.id, 0) for b in readme[:1]), 1)
    if os.environ.get("NEMOFP4_DOCS_TEST_TIMES"):
        Path(os.environ["NEMOFP4_DOCS_TEST_TIMES"]).write_text(json.dumps(times, indent=1) + "\n")
    return results


@pytest.mark.parametrize("block", BASH_BLOCKS, ids=[block.id for block in BASH_BLOCKS])
def test_documented_commands_run(block, request):
    if block.skip:
        pytest.skip(f"docs-test: skip: {block.skip}")
    returncode, script, output = request.getfixturevalue("page_results")[block.id]
    if returncode != 0:
        pytest.fail(f"{block.id}: exit {returncode}\n--- script ---\n{script}--- output (tail) ---\n{output[-4000:]}")


def test_a_block_out_of_time_is_stopped_with_all_it_started(tmp_path, monkeypatch):
    # A trainer left running after its block timed out would hold its run directory and the machine.
    monkeypatch.setattr(sys.modules[__name__], "BLOCK_TIMEOUT_S", 1)
    returncode, output = Shell.fresh(tmp_path / "shell.sh", tmp_path).run(f"sleep 60 & echo $! > {tmp_path}/pid; wait")
    assert returncode == 124 and "timed out after 1 s" in output
    pid = int((tmp_path / "pid").read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    pytest.fail(f"the block's background process {pid} outlived its block")
