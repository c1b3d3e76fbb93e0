"""The design's dependency rules (docs/design.md §3): lower layers never import higher ones.

Every package has a rule: the set of nemofp4 packages it may import. A new package without a
rule fails the test, so the rules keep covering the whole tree.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "nemofp4"

# package -> the nemofp4 packages it may import (besides itself)
ALLOWED = {
    "formats": set(),
    "kernels": {"formats"},
    "quant": {"formats", "kernels"},
    "recipes": {"formats", "kernels", "quant"},
    "models": set(),
    "data": set(),
    "checkpointing": set(),
    # evaluation may import training's config schema only: test_evaluation_does_not_import_training
    "evaluation": {"formats", "kernels", "quant", "recipes", "models", "data", "checkpointing", "training"},
    "training": {"formats", "kernels", "quant", "recipes", "models", "data", "checkpointing", "evaluation"},
    "cli": {"formats", "kernels", "quant", "recipes", "models", "data", "checkpointing", "evaluation", "training"},
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


# The one edge left from evaluation to training: the typed schema of a run's config (JobConfig), which
# evaluation needs to rebuild a run's model and recipe. The schema is to move below both packages.
EVALUATION_MAY_USE_FROM_TRAINING = {"nemofp4.training.config", "nemofp4.training.config.JobConfig"}


def test_evaluation_does_not_import_training():
    """Evaluation reads checkpoints (nemofp4.checkpointing) and computes the LM loss (nemofp4.models)
    through pieces below both packages; of training it may name only the config schema."""
    offenders = sorted(
        f"{path.relative_to(ROOT.parent)} imports {name}"
        for path in sorted((ROOT / "evaluation").rglob("*.py"))
        for name in _imports(path)
        if name.split(".")[:2] == ["nemofp4", "training"] and name not in EVALUATION_MAY_USE_FROM_TRAINING
    )
    assert not offenders, "\n".join(offenders)


def test_the_rules_see_package_imports():
    """``from nemofp4 import kernels`` counts as importing kernels (a rule that missed it could not fail)."""
    names = set(_imports(ROOT / "quant" / "linear.py"))
    assert "nemofp4.kernels" in names
