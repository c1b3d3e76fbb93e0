"""mamba_ssm's Triton SSD kernels on CPU tensors, in Triton's interpreter (test support only).

mamba-ssm is installed without its CUDA build (``MAMBA_SKIP_CUDA_BUILD=TRUE``), so three things stand
in for what a CPU process lacks, while :func:`mamba_ssm_kernels` is open:

* ``selective_scan_cuda``: ``mamba_ssm/__init__.py`` imports the CUDA extension of the Mamba-1 scan,
  which the SSD kernels never call; an empty module satisfies the import;
* ``torch.cuda.device(t.device.index)`` (``None`` for a CPU tensor) and
  ``torch.cuda.get_device_properties(...).multi_processor_count``, which the launchers call around
  every kernel: a no-op context and the SM count the planner's stand-in assumes (``standins.SM_COUNT``);
* autotuning, whose benchmarker needs a device: every autotuned kernel keeps its first config.

The kernels run in the interpreter only when ``TRITON_INTERPRET=1`` was set before triton was first
imported (tests/conftest.py does it for a CPU session). Nothing here is imported by ``nemofp4``.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import sys
import types
from collections.abc import Iterator

import torch

from nemofp4.planning.standins import SM_COUNT

HAVE_MAMBA_SSM = importlib.util.find_spec("mamba_ssm") is not None
"""The mamba-ssm package is installed (with or without its CUDA build)."""

_SSD_MODULES = ("ssd_bmm", "ssd_chunk_state", "ssd_state_passing", "ssd_chunk_scan", "ssd_combined")
_cuda_device = torch.cuda.device
_cuda_properties = torch.cuda.get_device_properties


def _cpu_device(index):
    return contextlib.nullcontext() if index is None else _cuda_device(index)


def _cpu_properties(device=None):
    if isinstance(device, torch.device) and device.type == "cpu":
        return types.SimpleNamespace(multi_processor_count=SM_COUNT, name="cpu (interpreter)")
    return _cuda_properties(device)


@contextlib.contextmanager
def mamba_ssm_kernels() -> Iterator[types.ModuleType]:
    """Inside: ``mamba_ssm.ops.triton.ssd_combined`` imported and runnable on CPU tensors, and
    ``nemofp4``'s ``ssd_scan(impl="mamba_ssm")`` calling it. On exit the stand-ins are removed and
    every module the import added is dropped again, so a later ``import`` in this process sees the
    installation as it is (no CUDA extension: mamba_ssm does not import)."""
    from nemofp4.models.nemotron_h import ssd

    ssd._import_chunk_scan_kernel()  # what this installation imports, cached before the stand-ins exist
    before = set(sys.modules)
    stub_added = "selective_scan_cuda" not in sys.modules
    if stub_added:
        sys.modules["selective_scan_cuda"] = types.ModuleType("selective_scan_cuda")
    saved_kernel = ssd._chunk_scan_kernel
    try:
        from triton.runtime.autotuner import Autotuner

        combined = importlib.import_module("mamba_ssm.ops.triton.ssd_combined")
        for name in _SSD_MODULES:
            for value in vars(importlib.import_module(f"mamba_ssm.ops.triton.{name}")).values():
                if isinstance(value, Autotuner):
                    value.configs = value.configs[:1]
        torch.cuda.device, torch.cuda.get_device_properties = _cpu_device, _cpu_properties
        ssd._chunk_scan_kernel = lambda: combined.mamba_chunk_scan_combined
        yield combined
    finally:
        torch.cuda.device, torch.cuda.get_device_properties = _cuda_device, _cuda_properties
        ssd._chunk_scan_kernel = saved_kernel
        for name in set(sys.modules) - before:
            if name.startswith("mamba_ssm") or name == "selective_scan_cuda":
                del sys.modules[name]
