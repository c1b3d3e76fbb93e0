"""The nemofp4 commands ask torch's CPU allocator for transparent huge pages (nemofp4/cli/__init__.py),
before torch's first allocation, and keep a value the user set."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")

# what a command's process does: import the CLI package, then torch, then allocate a large tensor;
# prints the setting it ran with and how many kB of the tensor's memory are huge pages
PROBE = """
import nemofp4.cli, os, torch
def huge_kb():
    for line in open("/proc/self/smaps_rollup"):
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
before = huge_kb()
x = torch.empty(64 << 20, dtype=torch.uint8)
x.fill_(1)
print(os.environ["THP_MEM_ALLOC_ENABLE"], huge_kb() - before)
"""


@functools.cache
def probe(setting: str | None) -> tuple[str, int]:
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    if setting is not None:
        env["THP_MEM_ALLOC_ENABLE"] = setting
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)
    value, huge_kb = out.stdout.split()
    return value, int(huge_kb)


def thp_mode() -> str | None:
    """The kernel's transparent-huge-page mode (always, madvise, never), None where it has none."""
    if not THP_MODE.is_file():
        return None
    text = THP_MODE.read_text()
    return text[text.index("[") + 1 : text.index("]")]


def test_the_cli_package_sets_it_unless_the_environment_does():
    assert probe(None)[0] == "1"
    assert probe("0")[0] == "0"


@pytest.mark.skipif(thp_mode() != "madvise", reason="needs the kernel's THP mode madvise (huge pages only on request)")
def test_a_large_tensor_gets_huge_pages_only_when_asked():
    asked, not_asked = probe(None)[1], probe("0")[1]
    assert asked >= 32 << 10, asked  # at least half of the 64 MiB in 2 MiB pages
    assert not_asked < 4 << 10, not_asked
