"""The committed locks (requirements/*.txt, scripts/lock.sh) agree with pyproject.toml's ranges and with
each other, and the environment the suite runs in is the lock's: what CI tests is what a new machine gets."""

import re
from importlib import metadata
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11, as the locks

REPO = Path(__file__).resolve().parents[2]
LOCKED_PLATFORM = {
    "python_version": "3.11",
    "python_full_version": "3.11.0",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "os_name": "posix",
}
LOCK_EXTRAS = {"cpu": [], "dev": ["dev"], "gpu": ["dev", "gpu"]}


def pins(name: str) -> dict[str, str]:
    """A lock's ``name==version`` lines, each of which must carry at least one sha256 hash."""
    text = (REPO / "requirements" / f"{name}.txt").read_text()
    blocks = re.findall(r"^([A-Za-z0-9_.-]+)==(\S+) \\\n((?:\s+--hash=sha256:[0-9a-f]{64}(?: \\)?\n)+)", text, re.M)
    requirement_lines = re.findall(r"^[A-Za-z0-9_.-]+==", text, re.M)
    assert len(blocks) == len(requirement_lines), f"{name}.txt has a pin without a hash"
    return {canonicalize_name(n): v for n, v, _ in blocks}


def project_requirements(extras: list[str]) -> list[Requirement]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    lines = project["dependencies"] + [r for e in extras for r in project["optional-dependencies"][e]]
    return [Requirement(line) for line in lines]


@pytest.mark.parametrize("lock", sorted(LOCK_EXTRAS), ids=lambda lock: f"{lock}.txt")
def test_each_lock_pins_every_requirement_within_its_range(lock):
    locked = pins(lock)
    for req in project_requirements(LOCK_EXTRAS[lock]):
        if req.marker is not None and not req.marker.evaluate(LOCKED_PLATFORM):
            continue
        name = canonicalize_name(req.name)
        assert name in locked, f"{lock}.txt lacks {req}"
        assert req.specifier.contains(locked[name], prereleases=True), f"{lock}.txt: {name}=={locked[name]} not {req}"


def test_the_locks_share_versions():
    """cpu.txt is a subset of dev.txt; gpu.txt differs from dev.txt only in its PyTorch build and
    the Triton that build pins; the CPU mamba-ssm is the GPU lock's."""
    dev, cpu, gpu = pins("dev"), pins("cpu"), pins("gpu")
    assert {n: v for n, v in cpu.items() if dev.get(n) != v} == {}
    assert {n for n in dev if n in gpu and gpu[n] != dev[n]} <= {"torch", "triton"}
    assert dev["torch"] == "2.13.0+cpu" and gpu["torch"] == "2.13.0"
    assert pins("mamba-ssm") == {"mamba-ssm": gpu["mamba-ssm"]}


def installed(name: str) -> str | None:
    """The version an import would load: the first on sys.path (setuptools puts the .dist-info of the
    packages it vendors on sys.path too once it is imported, so listing every distribution misleads)."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def test_this_environment_is_the_lock():
    lock = "gpu" if torch.version.cuda else "dev"
    expected = pins(lock) | (pins("mamba-ssm") if lock == "dev" else {})
    differ = {n: f"{installed(n)} installed, {v} locked" for n, v in expected.items() if installed(n) != v}
    assert differ == {}, f"this environment is not requirements/{lock}.txt (make setup installs it): {differ}"
