"""The dependency rules of docs/architecture.md §2: lower layers never import higher ones.

Every package has a rule: the set of nemofp4 packages it may import. A new package without a
rule fails the test, so the rules keep covering the whole tree.
"""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "nemofp4"
ARCHITECTURE = ROOT.parent / "docs" / "architecture.md"

# package -> the nemofp4 packages it may import (besides itself), as docs/architecture.md §2 states them:
# formats imports nothing of the project; kernels formats only; quant never recipes or training;
# models and data never quant, recipes or training; evaluation never training (shared pieces such as
# the LM loss and checkpoint reading live below both); only training and cli import everything.
BELOW_TRAINING = {"formats", "kernels", "quant", "recipes", "models", "data", "checkpointing"}
ALLOWED = {
    "formats": set(),
    "kernels": {"formats"},
    "quant": {"formats", "kernels"},
    "recipes": {"formats", "kernels", "quant"},
    "models": set(),
    "data": set(),
    "checkpointing": set(),
    "evaluation": BELOW_TRAINING,
    # the trainer's start-up log calls the planner; the planner runs training's own parallelize,
    # optimizer and budget (no module cycle: nothing planning imports imports the trainer)
    "training": BELOW_TRAINING | {"evaluation", "planning"},
    "planning": BELOW_TRAINING | {"training"},
    "cli": BELOW_TRAINING | {"evaluation", "training", "planning"},
}


def _imports(path: Path):
    """Every nemofp4 module ``path`` imports, absolute, including ``from nemofp4 import kernels``
    (which names the subpackage only in the imported names)."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                # resolve relative imports against the module's package
                pkg = path.relative_to(ROOT.parent).with_suffix("").parts[: -node.level]
                module = ".".join(pkg + ((node.module,) if node.module else ()))
            else:
                module = node.module or ""
            yield module
            for alias in node.names:
                yield f"{module}.{alias.name}"


def _project_imports(package: str):
    """(file, imported nemofp4 package) for every import in ``package`` of another package."""
    for path in sorted((ROOT / package).rglob("*.py")):
        for name in _imports(path):
            parts = name.split(".")
            if parts[0] == "nemofp4" and len(parts) > 1 and parts[1] in ALLOWED and parts[1] != package:
                yield path.relative_to(ROOT.parent), parts[1]


def _documented_rules() -> dict[str, set[str]]:
    """The rule table of docs/architecture.md §2: package(s) -> the packages they may import."""
    text = ARCHITECTURE.read_text()
    table = text[text.index("| package | may import (of nemofp4) |") :].split("\n\n")[0]
    rules = {}
    for row in table.splitlines()[2:]:
        packages, allowed = row.strip("|").split("|")
        for package in re.findall(r"`(\w+)`", packages):
            rules[package] = set(re.findall(r"`(\w+)`", allowed))
    return rules


def test_the_rules_are_the_ones_docs_architecture_states():
    assert _documented_rules() == ALLOWED


def test_every_package_has_a_rule():
    packages = {p.name for p in ROOT.iterdir() if (p / "__init__.py").exists()}
    assert packages == set(ALLOWED), f"packages without a dependency rule: {sorted(packages - set(ALLOWED))}"


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_package_respects_dependency_rules(package):
    offenders = sorted(
        {
            f"{path} imports nemofp4.{target}"
            for path, target in _project_imports(package)
            if target not in ALLOWED[package]
        }
    )
    assert not offenders, "\n".join(offenders)


def test_evaluation_does_not_import_training():
    """Evaluation reads checkpoints (nemofp4.checkpointing), the LM loss (nemofp4.models) and the
    run's config (its own typed view, evaluation/run_config.py) through pieces below training."""
    offenders = sorted(
        f"{path.relative_to(ROOT.parent)} imports {name}"
        for path in sorted((ROOT / "evaluation").rglob("*.py"))
        for name in _imports(path)
        if name.split(".")[:2] == ["nemofp4", "training"]
    )
    assert not offenders, "\n".join(offenders)


def test_the_package_entry_point_imports_no_other_package():
    """``nemofp4/__init__.py`` and ``nemofp4/train.py`` sit outside the packages: the top-level
    init imports nothing (so ``import nemofp4.formats`` stays light), train.py only the cli."""
    assert not {n for n in _imports(ROOT / "__init__.py") if n.startswith("nemofp4.")}
    assert {n.split(".")[1] for n in _imports(ROOT / "train.py") if n.startswith("nemofp4.")} <= {"cli"}


def test_the_rules_see_package_imports():
    """``from nemofp4 import kernels`` counts as importing kernels (a rule that missed it could not fail)."""
    names = set(_imports(ROOT / "quant" / "linear.py"))
    assert "nemofp4.kernels" in names


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _module_graph() -> dict[str, set[str]]:
    """nemofp4 module -> the nemofp4 modules it imports (a ``from m import name`` of a submodule
    counts the submodule; of any other name, ``m``)."""
    paths = {_module_name(p): p for p in ROOT.rglob("*.py")}
    return {name: {n for n in _imports(path) if n in paths} for name, path in paths.items()}


def test_nothing_planning_imports_imports_planning():
    """training and planning import each other's packages (the trainer's start-up log calls the
    planner; the planner runs training's parallelize and optimizer), so no module planning reaches
    may reach back: that would be an import cycle."""
    graph = _module_graph()
    planning = {m for m in graph if m == "nemofp4.planning" or m.startswith("nemofp4.planning.")}
    seen, todo = set(), [t for m in planning for t in graph[m] if t not in planning]
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo += [t for t in graph[module] if t not in planning]
    offenders = sorted(m for m in seen if graph[m] & planning)
    assert not offenders, f"imported (transitively) by nemofp4.planning and importing it: {offenders}"
