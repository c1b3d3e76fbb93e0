"""The design's dependency rules: lower layers never import higher ones."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "nemofp4"

FORBIDDEN = {
    "formats": ("nemofp4.",),
    "models": ("nemofp4.quant", "nemofp4.recipes", "nemofp4.training", "nemofp4.cli"),
    "data": ("nemofp4.quant", "nemofp4.recipes", "nemofp4.training", "nemofp4.models", "nemofp4.cli"),
    "quant": ("nemofp4.recipes", "nemofp4.training", "nemofp4.cli", "nemofp4.data"),
}


def _imports(path: Path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                # resolve relative imports against the module's package
                pkg = path.relative_to(ROOT.parent).with_suffix("").parts[: -node.level]
                yield ".".join(pkg + ((node.module,) if node.module else ()))
            elif node.module:
                yield node.module


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_respects_dependency_rules(package):
    offenders = []
    for path in (ROOT / package).rglob("*.py"):
        for name in _imports(path):
            if name.startswith(FORBIDDEN[package]) and not name.startswith(f"nemofp4.{package}"):
                offenders.append(f"{path.relative_to(ROOT.parent)} imports {name}")
    assert not offenders, "\n".join(offenders)
