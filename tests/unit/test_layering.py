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
    "training": BELOW_TRAINING | {"evaluation"},
    # the planner runs training's own parallelize, optimizer and budget; the CLI plans the job and
    # hands the trainer what it needs (the trainer never calls the planner)
    "planning": BELOW_TRAINING | {"training"},
    "cli": BELOW_TRAINING | {"evaluation", "training", "planning"},
}


def _imports(path: Path):
    """Every nemofp4 module ``path`` imports, absolute, including ``from nemofp4 import kernels``
    (which names the subpackage only in the imported names)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name
        elif isinstance(node, ast.ImportFrom):
            module = _from_module(path, node)
            yield module
            for alias in node.names:
                yield f"{module}.{alias.name}"


def _from_module(path: Path, node: ast.ImportFrom) -> str:
    """The absolute module of ``from <module> import ...`` in ``path`` (relative ones resolved against
    the module's package)."""
    if not node.level:
        return node.module or ""
    package = path.relative_to(ROOT.parent).with_suffix("").parts[: -node.level]
    return ".".join(package + ((node.module,) if node.module else ()))


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
    names = set(_imports(ROOT / "quant" / "linear_state.py"))
    assert "nemofp4.kernels" in names


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_targets(path: Path, modules) -> set[str]:
    """The nemofp4 modules ``path`` imports: ``from m import name`` counts the submodule ``m.name``
    when there is one, else ``m`` itself (so ``from . import program`` does not count the package)."""
    targets = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            module = _from_module(path, node)
            for alias in node.names:
                targets.add(f"{module}.{alias.name}" if f"{module}.{alias.name}" in modules else module)
    return targets & set(modules)


def _module_graph() -> dict[str, set[str]]:
    """nemofp4 module -> the nemofp4 modules it imports, at module level or inside a function."""
    paths = {_module_name(p): p for p in ROOT.rglob("*.py")}
    return {name: _import_targets(path, paths) for name, path in paths.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module: each holds an import cycle. (A
    module importing itself, as ``python -m`` entry points do to name their own classes, is none.)"""
    order, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(root: str) -> None:  # iterative Tarjan: the graph is a few hundred modules deep at most
        work = [(root, iter(sorted(graph[root])))]
        order[root] = low[root] = len(order)
        stack.append(root)
        on_stack.add(root)
        while work:
            module, targets = work[-1]
            target = next(targets, None)
            if target is not None:
                if target not in order:
                    order[target] = low[target] = len(order)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph[target]))))
                elif target in on_stack:
                    low[module] = min(low[module], order[target])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[module])
            if low[module] == order[module]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == module:
                        break
                if len(component) > 1:
                    found.append(sorted(component))

    for module in sorted(graph):
        if module not in order:
            visit(module)
    return found


def test_no_module_import_cycle():
    """No nemofp4 module reaches itself through imports, lazy (function-level) ones included: a cycle
    works only while its import order happens to, and makes two modules one."""
    assert _cycles(_module_graph()) == []


def test_the_cycle_check_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a", "e"}, "e": {"e", "f"}, "f": {"e"}}
    assert sorted(_cycles(graph)) == [["a", "b", "c"], ["e", "f"]]


def test_training_imports_nothing_of_planning():
    """The plan sits above the trainer: whoever builds the job (the CLI) plans it and hands the
    trainer the resolved policy and the plan's summary."""
    graph = _module_graph()
    offenders = sorted(
        f"{m} imports {t}"
        for m in graph
        if m.startswith("nemofp4.training")
        for t in graph[m]
        if t.startswith("nemofp4.planning")
    )
    assert not offenders, "\n".join(offenders)
