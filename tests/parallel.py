"""How the suite shares the machine's cores when pytest-xdist runs it (``make test`` passes ``-n``).

- Each test module is one unit of work (``--dist loadfile``), so a module's fixtures (a trained tiny
  run, a built checkpoint) are made once, in one worker, as in a serial run; the one module that
  submits jobs to the local SLURM cluster (two nodes) never competes with itself.
- The longest modules are handed out first, so the two workers finish close together instead of one
  starting the longest module last. The list only orders work; a module missing from it still runs.
- A worker gets its share of the cores as torch intra-op threads (``OMP_NUM_THREADS`` for the
  processes it starts), instead of every worker spinning threads over all of them.
"""

from __future__ import annotations

import os

import pytest

LONGEST_FIRST = (
    "tests/integration/test_docs_commands.py",
    "tests/integration/test_slurm_cluster.py",
    "tests/unit/test_kernels_program.py",
    "tests/integration/test_train.py",
    "tests/integration/test_gradient_sync.py",
    "tests/integration/test_distributed.py",
    "tests/unit/test_recompiles.py",
    "tests/integration/test_eval_cli.py",
    "tests/unit/test_numerics_oracle.py",
    "tests/integration/test_head_loss_fsdp.py",
    "tests/integration/test_async_checkpoint.py",
    "tests/integration/test_eval_compare_recipes.py",
    "tests/unit/test_launch.py",
    "tests/integration/test_run_dirs.py",
    "tests/integration/test_lr_sweep.py",
    "tests/integration/test_distributed_eval.py",
)
"""The modules that took longest in a measured CI run, longest first (``.ci/run`` prints the slowest)."""


def _module(item: pytest.Item) -> str:
    return item.nodeid.split("::", 1)[0]


def _workers() -> int:
    return int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))


def _in_worker(config) -> bool:
    return hasattr(config, "workerinput")


def pytest_collection_modifyitems(config, items):
    if not _in_worker(config):
        return  # a serial run keeps pytest's order
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(_module(item), len(rank)))  # stable: file order kept within


def pytest_configure(config):
    if not _in_worker(config):
        return
    threads = str(max(1, (os.cpu_count() or 1) // _workers()))
    os.environ.setdefault("OMP_NUM_THREADS", threads)
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
