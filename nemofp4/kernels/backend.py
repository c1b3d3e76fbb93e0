"""The kernel backends: one object per path, resolved once from the ``kernels`` knob and a device.

A :class:`Backend` does what a quantized linear asks of the kernels: quantize the operands of one
call (:meth:`Backend.quantize`, one :class:`~nemofp4.kernels.request.OperandRequest` per operand),
measure an amax, apply the wgrad Hadamard transform, run the hardware GEMM model, and
:func:`nemofp4.formats.quantize_blocks` on its fast path. Four implementations, with the same
numerics, each the torch program (:mod:`nemofp4.kernels.program`) with a different runner of its
cores, composed rather than flagged:

* :class:`EagerBackend`: the program op by op (:data:`~nemofp4.kernels.program.EAGER`);
* :class:`CompiledBackend`: the program compiled by Inductor (C++ on CPU). A spec whose build
  fails warns once, naming the spec, and runs eagerly from then on; every other spec still compiles;
* :class:`NativeBackend`: on CPU, :class:`~nemofp4.kernels.native.NativeCores`: the native kernel
  for the operands it covers (checked bit for bit against the program), the compiled program for
  the rest;
* :class:`TritonBackend`: the fused Triton kernels (CUDA, or Triton's CPU interpreter in tests) for
  the requests they cover, the eager program for the rest (FP8 payloads, other block sizes).

:data:`BACKENDS` is the one list of the knob's values, :func:`check_backend` its one check, and
:func:`resolve_backend` the one place that chooses among the paths: :func:`backend_for` turns the
knob (the trainer's ``train.kernels``, the evaluator's ``kernels``) and a device into one of the four;
a QuantLinear calls it once per device and keeps the result
(:meth:`nemofp4.quant.QuantLinearState.kernels_for`). An explicit ``native`` or ``compiled`` that
cannot run here (no C++ compiler, the native build failed) is an error naming the cause; ``auto``
then falls back to the compiled program (or, without a compiler, the eager one) with one warning
naming it. :func:`gpu_quantizer` is the path the planner plans a CUDA job's quantizer with.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import inspect
import os
import warnings
from typing import Protocol

import torch

from nemofp4.formats import QuantizedBlocks, amax, quantize_blocks, wgrad_hadamard_transform
from nemofp4.formats.spec import BlockSpec

from . import native, program
from .quantize import SUPPORTED_BLOCK_SIZES
from .request import CoreRunner, OperandRequest, tokens_transposed
from .toolchain import NO_COMPILER, cpu_compile_available

__all__ = [
    "BACKENDS",
    "Backend",
    "CompiledBackend",
    "EagerBackend",
    "NativeBackend",
    "TritonBackend",
    "backend_for",
    "check_backend",
    "describe",
    "gpu_quantizer",
    "planned_path",
    "resolve_backend",
    "triton_available",
]

BACKENDS = ("auto", "triton", "native", "compiled", "eager")
"""The values of the ``kernels`` knob (``train.kernels``, nemofp4-eval's ``kernels``): the one list."""


class Backend(Protocol):
    """What a quantized linear asks of the kernels."""

    name: str
    """One of :data:`BACKENDS` other than 'auto'."""
    reads_packed_codes: bool
    """Its hardware GEMM reads packed FP4 codes (so its operands are always packed)."""

    def quantize(
        self, *requests: OperandRequest, generator: torch.Generator | None = None, stats: bool = True
    ) -> tuple[QuantizedBlocks, ...]: ...

    def quantize_blocks(self, x: torch.Tensor, *args, **kwargs) -> QuantizedBlocks: ...

    def amax(self, x: torch.Tensor) -> torch.Tensor: ...

    def hadamard_transform(self, x: torch.Tensor) -> torch.Tensor: ...

    def gemm_hardware(self, a: QuantizedBlocks, b: QuantizedBlocks, **options) -> torch.Tensor: ...


class EagerBackend:
    """The torch quantization program run op by op (the reference's numerics, bit for bit)."""

    name = "eager"
    reads_packed_codes = False
    cores: CoreRunner = program.EAGER
    """What runs the program's cores."""

    def __repr__(self) -> str:
        return f"<{self.name} FP4 kernels>"

    def quantize(self, *requests, generator=None, stats=True):
        """The requests' :class:`QuantizedBlocks`, quantized as one call (one compiled graph where
        the program compiles), random bits drawn in request order: :func:`nemofp4.kernels.program.quantize`."""
        return program.quantize(requests, generator=generator, stats=stats, cores=self.cores)

    def quantize_blocks(self, x, *args, **kwargs):
        """:func:`nemofp4.formats.quantize_blocks` (same arguments), by the program on this backend's
        runner: the same bits (random draws included) without the reference's float64 checks and
        NaN/Inf check (no synchronization); its counts are the block counts alone. The reference
        for what the program has no core for (E2M1 UE8M0 blocks in 'ceil' mode)."""
        request = _blocks_request(x, *args, **kwargs)
        if request is None:
            return quantize_blocks(x, *args, **kwargs)
        (q,) = self.quantize(request[0], generator=request[1])
        return _as_blocks_result(q, x)

    def amax(self, x):
        """max |x| as a float32 0-d tensor on x's device (exact)."""
        return amax(x)

    def hadamard_transform(self, x):
        """:func:`nemofp4.formats.wgrad_hadamard_transform` (TE's wgrad signs, rounded to BF16)."""
        return wgrad_hadamard_transform(x)

    def gemm_hardware(self, a, b, **options):
        """float32 ``A @ B^T`` under the probe-matched hardware model (the vectorized torch twin)."""
        from .hardware_gemm import hardware_gemm_torch

        return hardware_gemm_torch(a, b, **options)


class CompiledBackend(EagerBackend):
    """The same program compiled by Inductor, one graph per call's specs (the same bits)."""

    name = "compiled"
    cores = program.COMPILED

    def hadamard_transform(self, x):
        return program.compiled_hadamard_transform(x)


class NativeBackend(CompiledBackend):
    """The native CPU kernel (:mod:`nemofp4.kernels.native`) for the operands it supports, one ctypes
    call each; the compiled program for the rest (the same bits)."""

    name = "native"
    cores = native.NativeCores(program.COMPILED)

    def amax(self, x):
        """max |x| in one native pass for a contiguous float32 tensor (exact), else the program's."""
        return native.amax(x) if native.supports_amax(x) else super().amax(x)


_QUANTIZE_BLOCKS = inspect.signature(quantize_blocks)


def _blocks_request(x, *args, **kwargs) -> tuple[OperandRequest, torch.Generator | None] | None:
    """:func:`quantize_blocks`'s arguments as a ``rows`` request of ``x`` viewed 2-D (and its
    generator), checked as the reference checks them; None where the program has no core for them."""
    a = _QUANTIZE_BLOCKS.bind(x, *args, **kwargs)
    a.apply_defaults()
    a = a.arguments
    spec = BlockSpec(
        scale_format=a["scale_format"],
        block_size=a["block_size"],
        two_d=a["two_d"],
        rounding=a["rounding"],
        scale_target=a["scale_target"],
        mx_scale_mode=a["mx_scale_mode"],
    )
    spec.check_input(x, a["tensor_amax"], name=a["name"], stacklevel=4)
    if spec.format.power_of_two and spec.mx_scale_mode != "floor":
        return None
    g = a["tensor_amax"]
    if g is not None:
        g = torch.as_tensor(g, dtype=torch.float32, device=x.device).reshape(())
    x2 = x.reshape(-1, x.shape[-1]) if x.dim() != 1 else x.view(1, -1)
    return OperandRequest(x2, spec, pack=True, values=False, tensor_amax=g), a["generator"]


def _as_blocks_result(q: QuantizedBlocks, x: torch.Tensor) -> QuantizedBlocks:
    """``q`` of ``x`` viewed 2-D, in ``x``'s own leading dims (the reference's layout)."""
    if q.two_d:
        return q
    lead = tuple(x.shape[:-1])
    padded = (*lead, q.padded_shape[-1])
    return QuantizedBlocks(
        element_format=q.element_format,
        shape=tuple(x.shape),
        padded_shape=padded,
        block_size=q.block_size,
        two_d=False,
        scale_format=q.scale_format,
        tensor_scale=q.tensor_scale,
        tensor_amax=q.tensor_amax,
        scale_target=q.scale_target,
        codes=q.codes.view(*lead, -1),
        scale_codes=q.scale_codes.view(*lead, -1),
        counts=q.counts,
        num_blocks=q.num_blocks,
        num_elements=q.num_elements,
    )


def _triton_covers(spec: BlockSpec) -> bool:
    """The Triton kernels quantize FP4 (E2M1) payloads in the block sizes they have kernels for."""
    return spec.block_size in SUPPORTED_BLOCK_SIZES and not spec.is_fp8


def _fused_pair(x: OperandRequest, xt: OperandRequest) -> bool:
    """Whether one Triton launch quantizes the two: X along K (with its values) and X^T along the
    tokens of the same tensor and reference, in the same format, block and rounding, 1-D blocks
    without a Hadamard transform."""
    return (
        x.layout == "rows"
        and xt.layout == "tokens"
        and x.tensor is xt.tensor
        and x.tensor_amax is xt.tensor_amax
        and x.values
        and not x.tiles
        and x.spec.blocks_like(xt.spec)
        and _triton_covers(x.spec)
        and not (x.spec.two_d or xt.spec.two_d or x.spec.hadamard or xt.spec.hadamard)
    )


class TritonBackend(EagerBackend):
    """Fused Triton kernels for the requests they cover; the eager program for the others (FP8
    payloads, the block sizes they have no kernel for), request by request in order."""

    name = "triton"
    reads_packed_codes = True

    def quantize(self, *requests, generator=None, stats=True):
        """Each request by a Triton launch, an X / X^T pair (:func:`_fused_pair`) by one fused launch,
        the others by the program; launches have no per-call guards to share, so one call is the
        launches in request order (each stochastic one draws its Philox seed from ``generator`` then)."""
        from .operand import triton_quantize_operand, triton_quantize_operand_pair

        out: list[QuantizedBlocks] = []
        i = 0
        while i < len(requests):
            r = requests[i]
            if i + 1 < len(requests) and _fused_pair(r, requests[i + 1]):
                xt = requests[i + 1]
                out += triton_quantize_operand_pair(
                    r.tensor,
                    r.spec,
                    xt.spec,
                    tensor_amax=r.tensor_amax,
                    generator=generator,
                    pack_x=r.pack,
                    pack_xt=xt.pack,
                    values_xt=xt.values,
                    stats=stats,
                )
                i += 2
                continue
            if not _triton_covers(r.spec):
                out += program.quantize((r,), generator=generator, stats=stats, cores=program.EAGER)
            else:
                x = r.tensor
                if r.layout == "tokens":
                    x = tokens_transposed(x)
                    x = wgrad_hadamard_transform(x) if r.spec.hadamard else x
                out.append(
                    triton_quantize_operand(
                        x,
                        r.spec,
                        tensor_amax=r.tensor_amax,
                        generator=generator,
                        two_d=r.tiles,
                        pack=r.pack,
                        values=r.values,
                        stats=stats,
                    )
                )
            i += 1
        return tuple(out)

    def quantize_blocks(self, x, *args, **kwargs):
        """The Triton kernel for the block sizes it has; its stochastic roundings seed Philox with one
        draw from ``generator`` (same rule, other bits). It skips the reference's NaN/Inf check."""
        arguments = _QUANTIZE_BLOCKS.bind(x, *args, **kwargs)
        arguments.apply_defaults()
        a = arguments.arguments
        if a["block_size"] not in (None, *SUPPORTED_BLOCK_SIZES):
            return quantize_blocks(x, *args, **kwargs)
        from .operand import _seed
        from .quantize import triton_quantize_blocks

        return triton_quantize_blocks(
            x,
            scale_format=a["scale_format"],
            block_size=a["block_size"],
            two_d=a["two_d"],
            scale_target=a["scale_target"],
            tensor_amax=a["tensor_amax"],
            rounding=a["rounding"],
            seed=_seed(a["rounding"], a["generator"], x.device),
            mx_scale_mode=a["mx_scale_mode"],
        )

    def amax(self, x):
        from .quantize import triton_amax

        return triton_amax(x)

    def gemm_hardware(self, a, b, **options):
        """The Triton kernel when both operands have packed codes, else the torch twin."""
        if a.codes is None or b.codes is None:
            return super().gemm_hardware(a, b, **options)
        from .hardware_gemm import triton_hardware_gemm

        return triton_hardware_gemm(a, b, **options)


_BACKENDS = {backend.name: backend for backend in (EagerBackend(), CompiledBackend(), NativeBackend(), TritonBackend())}


# ------------------------------------------------------------------------------------ resolution
@functools.cache
def _triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_available() -> bool:
    """Triton is importable and has somewhere to run: a CUDA device, or ``TRITON_INTERPRET=1``."""
    interpret = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    return _triton_importable() and (torch.cuda.is_available() or interpret)


def check_backend(backend: str, knob: str | None = None) -> str:
    """``backend`` if it is one of :data:`BACKENDS`, else a ValueError naming it (as the value of
    ``knob``, the config field, when given) and the valid values: the one check of the setting, which
    the typed configs and a module's setter call."""
    if backend not in BACKENDS:
        what = f"{knob}={backend!r}" if knob else f"unknown FP4 kernel backend {backend!r}"
        raise ValueError(f"{what}; valid: {', '.join(BACKENDS)}")
    return backend


_FALLBACKS = {"compiled": "the compiled torch program", "eager": "the eager torch program (op by op, slower)"}
_warned: set[str] = set()


def _fall_back(path: str, why: str) -> str:
    """``auto``'s ``path`` when a faster one cannot run here, with one warning per cause in the process
    (each module resolves the setting for itself)."""
    message = f"kernels='auto': {why}; {_FALLBACKS[path]} quantizes instead (the same numerics)"
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, stacklevel=3)
    return path


def _cannot_run(backend: str, why: str, use: str) -> ValueError:
    return ValueError(
        f"kernels={backend!r} (train.kernels, or nemofp4-eval's kernels) cannot run here: {why}; use {use}"
    )


_PLANNED_PATH: str | None = None
"""Set by :func:`planned_path`: the path every backend resolves to, whatever the device."""


@contextlib.contextmanager
def planned_path(path: str):
    """Inside: every backend resolves to ``path`` (``triton`` or ``eager``) whatever the tensors' device, so the
    planner can run a CUDA run's quantizer path on fake CPU tensors (the Triton kernels by their registered fake
    implementations)."""
    global _PLANNED_PATH
    if path not in ("triton", "eager"):
        raise ValueError(f"quantizer={path!r}; valid: triton, eager")
    saved, _PLANNED_PATH = _PLANNED_PATH, path
    try:
        yield
    finally:
        _PLANNED_PATH = saved


def resolve_backend(backend: str, device: torch.device | str) -> str:
    """The path (``triton``, ``native``, ``compiled`` or ``eager``) that ``backend`` takes for tensors on
    ``device``: the one place the choice is made. An explicit ``native`` or ``compiled`` that cannot
    run is a ValueError saying why; ``auto`` falls back to the compiled program, or without a C++
    compiler to the eager one, with one warning saying why. Inside :func:`planned_path`, its path."""
    check_backend(backend)
    if _PLANNED_PATH is not None:
        return _PLANNED_PATH
    device = torch.device(device)
    if backend == "auto":
        if device.type == "cuda":
            return "triton" if _triton_importable() else "eager"
        if device.type != "cpu":
            return "eager"
        if not cpu_compile_available():
            return _fall_back("eager", NO_COMPILER)
        if native.available():
            return "native"
        return _fall_back("compiled", native.unavailable_reason())
    if backend == "triton" and not (device.type == "cuda" and _triton_importable()):
        raise ValueError(
            f"backend 'triton' needs CUDA tensors and an importable triton; got a {device.type} tensor"
            f"{'' if _triton_importable() else ' and no triton'} (use 'auto', 'native', 'compiled' or 'eager')"
        )
    if backend == "native":
        if device.type != "cpu":
            raise _cannot_run(
                backend,
                f"it quantizes CPU tensors, and these are on {device.type}",
                "'auto', 'triton', 'compiled' or 'eager'",
            )
        if not cpu_compile_available():
            raise _cannot_run(backend, NO_COMPILER, "'auto' or 'eager' (the eager torch program: the same numerics)")
        if not native.available():
            raise _cannot_run(
                backend,
                native.unavailable_reason(),
                "'auto', 'compiled' (the compiled torch program: the same numerics) or 'eager'",
            )
    if backend == "compiled" and device.type == "cpu" and not cpu_compile_available():
        raise _cannot_run(backend, NO_COMPILER, "'auto' or 'eager' (the eager torch program: the same numerics)")
    return backend


def gpu_quantizer(backend: str) -> str:
    """The quantizer a CUDA job's FP4 operands take under ``backend``, as the planner models it on a
    machine that may have neither CUDA nor Triton: 'eager' (the torch program op by op) for
    ``eager``, else 'triton' (what ``auto`` resolves to on a GPU node; the compiled program's
    buffers are planned as the Triton kernels', and a CPU-only ``native`` job plans as one of a
    GPU node would)."""
    return "eager" if check_backend(backend, "train.kernels") == "eager" else "triton"


def backend_for(backend: str, device: torch.device | str) -> Backend:
    """The :class:`Backend` that the knob ``backend`` resolves to for tensors on ``device``."""
    return _BACKENDS[resolve_backend(backend, device)]


def describe(device: torch.device | str, backend: str = "auto") -> str:
    """One line for the start-up log: which quantizer FP4 operands on ``device`` will use."""
    path = resolve_backend(backend, device)
    if path == "triton":
        return "FP4 quantization: fused Triton kernels"
    if path == "native":
        return (
            "FP4 quantization: native CPU kernel (built on first use), the compiled torch program for the "
            "operands it does not cover"
        )
    if path == "compiled":
        return "FP4 quantization: compiled torch program (torch.compile; the first step builds it)"
    if backend == "eager":
        return "FP4 quantization: eager torch program (kernels=eager)"
    return "FP4 quantization: eager torch program (no Triton on this device, no C++ compiler for torch.compile)"
