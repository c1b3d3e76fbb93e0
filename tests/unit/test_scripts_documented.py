"""scripts/ is grouped (bench/, plan/, study/, gpu/, the tools at the top) and every script is named,
by its path, in the page of the docs that uses it; every ``scripts/...`` path the repository names
exists, so a moved script cannot leave a stale command behind in a doc, the Makefile, CI or a test."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", ROOT / "data" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
GROUPS = {"bench": "bench_", "plan": "plan_", "study": "", "gpu": "gpu_"}
_SCRIPT_PATH = re.compile(r"(?<![\w/.])scripts/[\w./-]+?\.(?:py|sh)\b")


def _scripts() -> list[str]:
    return sorted(
        str(p.relative_to(ROOT))
        for p in (ROOT / "scripts").rglob("*")
        if p.is_file() and p.suffix in (".py", ".sh") and "__pycache__" not in p.parts
    )


def test_every_script_is_named_in_the_docs():
    docs = "\n".join(page.read_text() for page in DOCS)
    assert [s for s in _scripts() if s not in docs] == []


def test_scripts_are_grouped_by_what_they_are_for():
    for script in _scripts():
        parts = Path(script).parts
        if len(parts) == 2:  # a tool: no benchmark, plan, study or GPU check at the top
            assert not parts[1].startswith(("bench_", "plan_", "gpu_")), script
        else:
            assert len(parts) == 3 and parts[1] in GROUPS and parts[2].startswith(GROUPS[parts[1]]), script


def test_every_script_path_the_repository_names_exists():
    texts = [
        *DOCS,
        ROOT / "Makefile",
        ROOT / ".ci" / "run",
        ROOT / "pyproject.toml",
        *(ROOT / "tests").rglob("*.py"),
        *(ROOT / "scripts").rglob("*.py"),
        *(ROOT / "scripts").rglob("*.sh"),
        *(ROOT / "nemofp4").rglob("*.py"),
    ]
    missing = {}
    for path in texts:
        if not path.is_file() or "__pycache__" in path.parts:
            continue
        for named in set(_SCRIPT_PATH.findall(path.read_text(errors="replace"))):
            if not (ROOT / named).is_file():
                missing.setdefault(str(path.relative_to(ROOT)), []).append(named)
    assert missing == {}
