"""The CPU quantizer as one native call: ``cpu_quantize.cpp``, the quantization program's core
(``_quantize_core`` of :mod:`nemofp4.kernels.program`) for the operands most CPU steps quantize: float32,
1-D blocks of 16 along the rows or down the columns (the wgrad operands) or 16x16 weight tiles,
E4M3 or UE5M3 block scales, RNE, ``sr`` or ``sr8``. Bit for bit the program
(``tests/unit/test_kernels_native.py``); the program quantizes every other operand.

Why: a compiled quantizer call runs Dynamo's guards and Inductor's Python wrapper before its
kernel, which on the tiny model's operands weigh as much as the kernel; a ctypes call is a few
Python operations. The kernel also does the program's arithmetic in fewer instructions: each
block's amax as an integer maximum of the magnitudes' bits, 16 blocks' scales in one vector, the
codes from the rounded values' bits.

The library is built on first use with the C++ compiler that ``torch.compile`` uses on CPU
(``CXX``, else ``c++``/``g++``/``clang++``) for this machine's instruction set, into
``$NEMOFP4_CACHE_DIR`` (default ``~/.cache/nemofp4``) under a name hashed from the source, the
flags, the compiler and the CPU's features, so every process on a node, and every later run, loads
the same file. A cached library is trusted only once proven, since a broken one mapped into a
process kills it with SIGBUS, no message: the build writes a unique temporary file, flushes it to
disk, loads it once in a throwaway process, renames it into place and then records its size and
SHA-256 beside it (``<name>.json``, also written and renamed atomically). A process loads the file
only if it matches that record and has every kernel; anything else (truncated by a crash, empty,
foreign, without a record) is rebuilt. Concurrent builders (a node's ranks) compile into their own
temporary files and the compiler writes the same bytes each time, so the last rename wins
harmlessly (bytes that differed from the record would only mean a rebuild). A crash leaves at most a
``.partial`` file, removed by a later build once it is :data:`STALE_PARTIAL_S` old.

:class:`NativeCores` is the runner of a native backend: it quantizes the operands the kernel
covers (:func:`supports`) and hands the others to the runner it is given (the compiled program's),
in the same call.

A set ``CXX`` that is not one executable on PATH is an error
(:func:`nemofp4.kernels.toolchain.compiler`, the one finder ``torch.compile``'s check shares). Without a
compiler, or when the build fails, :func:`available` is false and :func:`unavailable_reason` says
why; the kernels' resolution (:func:`nemofp4.kernels.resolve_backend`) raises for an explicit
``native`` and warns once for ``auto``, whose compiled torch program gives the same bits.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import math
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from nemofp4.formats.minifloat import HASH_MULTIPLIER, HASH_ROUNDS
from nemofp4.formats.scaling import scale_grid
from nemofp4.formats.spec import SCALE_FORMAT_TABLE

from .request import CoreOperand, CoreRunner, CoreSpec
from .toolchain import NO_COMPILER, compiler

__all__ = [
    "NativeCores",
    "amax",
    "available",
    "library_path",
    "quantize_core",
    "supports",
    "supports_amax",
    "unavailable_reason",
]

SOURCE = Path(__file__).with_name("cpu_quantize.cpp")
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-std=c++17", "-shared", "-fPIC", "-fopenmp")
"""No fast-math and no FMA contraction: every float operation rounds as the program's does. OpenMP:
the library's libgomp.so.1 is the one torch has already loaded, whose threads torch's kernels use."""

KERNELS = ("nf4_amax", "nf4_quantize_rows", "nf4_quantize_tiles", "nf4_quantize_columns")
"""The library's symbols: one lacking any of them is not ours (or not this source's)."""
STALE_PARTIAL_S = 600
"""A build's temporary file older than this is a crashed build's (a build takes seconds)."""
_ROUNDINGS = {"rne": 0, "sr": 1, "sr8": 2}
_P = ctypes.c_void_p


class _Grid(ctypes.Structure):
    """``nf4_grid`` of cpu_quantize.cpp."""

    _fields_ = [
        ("mantissa_bits", ctypes.c_int32),
        ("bias", ctypes.c_int32),
        ("zero_code_to_one", ctypes.c_int32),
        ("min_normal", ctypes.c_float),
        ("min_subnormal", ctypes.c_float),
        ("max_finite", ctypes.c_float),
        ("subnormal_magic", ctypes.c_float),
        ("hash_multiplier", ctypes.c_uint32),
        ("hash_rounds", ctypes.c_int32),
    ]


@functools.cache
def _grid(scale_format: str) -> _Grid:
    grid, row = scale_grid(scale_format), SCALE_FORMAT_TABLE[scale_format]
    magic = 1.5 * 2.0 ** (23 + math.log2(grid.min_subnormal))  # formats.scaling.round_scale_rne's
    return _Grid(
        grid.mantissa_bits,
        grid.bias,
        int(row.zero_code_to_one),
        grid.min_normal,
        grid.min_subnormal,
        grid.max_finite,
        magic,
        HASH_MULTIPLIER,
        HASH_ROUNDS,
    )


def _cpu_features() -> str:
    """The CPU's feature flags (what ``-march=native`` compiles for), or the machine's name."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cache_dir() -> Path:
    root = (
        os.environ.get("NEMOFP4_CACHE_DIR")
        or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "nemofp4"
    )
    return Path(root) / "kernels"


def library_path(compiler: str) -> Path:
    """Where the library built by ``compiler`` for this CPU lives (its name hashes what it is built from)."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=False).stdout
    key = hashlib.sha256("\0".join([SOURCE.read_text(), *FLAGS, version, _cpu_features()]).encode()).hexdigest()
    return _cache_dir() / f"cpu_quantize-{key[:20]}.so"


def _record_path(path: Path) -> Path:
    """The record of a library's size and SHA-256, beside it."""
    return path.with_suffix(".json")


def _digest(path: Path | str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _fsync_dir(directory: Path) -> None:
    """Make the renames in ``directory`` durable (best effort: some filesystems cannot sync a folder)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _has_kernels(lib: ctypes.CDLL) -> bool:
    return all(hasattr(lib, name) for name in KERNELS)


def _load_cached(path: Path) -> ctypes.CDLL | None:
    """The cached library, loaded only if it matches its record (size, then digest) and has every
    kernel; None when it must be built (again). Every file renamed to ``path`` by :func:`_build` is
    complete and was loaded once already, so a rename between the check and the load swaps one proven
    library for another."""
    try:
        record = json.loads(_record_path(path).read_text())
        if path.stat().st_size != record["size"] or _digest(path) != record["sha256"]:
            return None
        lib = ctypes.CDLL(str(path))
    except (OSError, ValueError, KeyError, TypeError):  # missing, unreadable, malformed, or it does not load
        return None
    return lib if _has_kernels(lib) else None


def _remove_stale_partials(directory: Path) -> None:
    """Remove the temporary files of builds that crashed (older than :data:`STALE_PARTIAL_S`); a
    build under way elsewhere is younger and keeps its own."""
    now = time.time()
    for partial in directory.glob("*.partial"):
        try:
            if now - partial.stat().st_mtime > STALE_PARTIAL_S:
                partial.unlink()
        except OSError:  # another process removed it first
            pass


_PROBE = "import sys, ctypes, torch; lib = ctypes.CDLL(sys.argv[1]); [getattr(lib, k) for k in sys.argv[2:]]"
"""A first load in a throwaway process, the way this one loads it: after torch, whose libgomp it shares."""


def _probe(compiler: str, partial: str) -> None:
    """Load the fresh library once in a throwaway process: one that is broken kills that process, not this one."""
    result = subprocess.run(
        [sys.executable, "-c", _PROBE, partial, *KERNELS], capture_output=True, text=True, check=False
    )
    if result.returncode < 0:
        try:
            how = signal.Signals(-result.returncode).name
        except ValueError:
            how = f"signal {-result.returncode}"
        raise OSError(f"the library {compiler} built kills a process that loads it ({how})")
    if result.returncode:
        raise OSError(f"the library {compiler} built does not load: {result.stderr.strip()[-2000:]}")


def _write_atomically(path: Path, text: str) -> None:
    fd, partial = tempfile.mkstemp(dir=path.parent, prefix=f"{path.name}.", suffix=".partial")
    try:
        with os.fdopen(fd, "w") as f:
            os.fchmod(f.fileno(), 0o644)  # mkstemp's 0600 would hide it from the others sharing the cache
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, path)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    _fsync_dir(path.parent)


def _build(compiler: str, path: Path) -> ctypes.CDLL:
    """Build the library into a unique temporary file, prove it, publish it at ``path`` and its record
    beside it; the library, loaded from the file this call wrote (no other process writes it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_partials(path.parent)
    fd, partial = tempfile.mkstemp(dir=path.parent, prefix=f"{path.stem}.", suffix=".partial")
    os.close(fd)
    try:
        result = subprocess.run(
            [compiler, *FLAGS, str(SOURCE), "-o", partial], capture_output=True, text=True, check=False
        )
        if result.returncode:
            raise OSError(f"{compiler} failed: {result.stderr.strip()[-2000:]}")
        size = os.path.getsize(partial)
        if size == 0:
            raise OSError(f"{compiler} exited 0 but wrote an empty library")
        with open(partial, "rb+") as f:
            os.fchmod(f.fileno(), 0o755)
            os.fsync(f.fileno())
        _probe(compiler, partial)
        digest = _digest(partial)
        lib = ctypes.CDLL(partial)
        os.replace(partial, path)
        _fsync_dir(path.parent)
        _write_atomically(_record_path(path), json.dumps({"size": size, "sha256": digest}))
        return lib
    finally:
        if os.path.exists(partial):
            os.unlink(partial)


@functools.cache
def _load() -> tuple[ctypes.CDLL | None, str]:
    """(the library, "") or (None, why it is not available here). A cached library that fails its
    check is rebuilt, once."""
    cxx = compiler()
    if cxx is None:
        return None, NO_COMPILER
    try:
        path = library_path(cxx)
        lib = _load_cached(path)
        if lib is None:
            lib = _build(cxx, path)
    except OSError as error:
        return None, f"could not build the native CPU FP4 quantizer ({error})"
    lib.nf4_amax.argtypes, lib.nf4_amax.restype = [_P, ctypes.c_int64, ctypes.c_int32], ctypes.c_float
    layout = [
        _P,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.POINTER(_Grid),
        ctypes.c_int32,
        ctypes.c_uint32,
        ctypes.c_float,
        ctypes.c_float,
        _P,
        _P,
        _P,
        _P,
        _P,
        ctypes.c_int32,
    ]
    for kernel in (lib.nf4_quantize_rows, lib.nf4_quantize_tiles, lib.nf4_quantize_columns):
        kernel.argtypes, kernel.restype = layout, None
    return lib, ""


def _library() -> ctypes.CDLL | None:
    return _load()[0]


def available() -> bool:
    """The native library is built (or can be) and loads here (a ValueError for an unusable ``CXX``)."""
    return _library() is not None


def unavailable_reason() -> str:
    """Why :func:`available` is false ("" when it is true)."""
    return _load()[1]


def supports_amax(x: torch.Tensor) -> bool:
    """Whether :func:`amax` measures ``x``: a plain contiguous non-empty float32 CPU tensor, outside
    ``torch.compile``."""
    return (
        type(x) is torch.Tensor
        and x.device.type == "cpu"
        and x.dtype == torch.float32
        and x.is_contiguous()
        and x.numel() > 0
        and not torch.compiler.is_compiling()
        and _library() is not None
    )


def amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| as a float32 0-d tensor (exact; a NaN wins), in one pass on torch's intra-op threads
    (:func:`supports_amax` must hold)."""
    return torch.tensor(_library().nf4_amax(x.data_ptr(), x.numel(), torch.get_num_threads()), dtype=torch.float32)


def supports(spec: CoreSpec, blocks: torch.Tensor) -> bool:
    """Whether the native kernel quantizes this operand (``blocks``: its padded input viewed as blocks): a
    plain float32 CPU tensor, outside ``torch.compile``, in blocks of 16 (or 16x16 tiles) without the Hadamard transform, E2M1 payloads with E4M3/UE5M3 scales,
    RNE/sr/sr8."""
    return (
        not spec.is_fp8
        and type(blocks) is torch.Tensor
        and blocks.device.type == "cpu"
        and blocks.dtype == torch.float32
        and spec.block_size == 16
        and not (spec.hadamard or spec.power_of_two)
        and spec.rounding in _ROUNDINGS
        and blocks.is_contiguous()
        and not torch.compiler.is_compiling()
        and _library() is not None
    )


def quantize_core(
    spec: CoreSpec, blocks: torch.Tensor, g: torch.Tensor | None, target: torch.Tensor, key: torch.Tensor | None
) -> tuple:
    """The program's FP4 core's outputs for ``(blocks, g, target, key, spec)``, from the native kernel
    (:func:`supports` must hold): (values shaped like ``blocks`` | None, tensor_scale, g, packed codes
    (flat) | None, scale codes, counts)."""
    lib = _library()
    flat = blocks.view(-1)
    if g is None:  # current scaling: max |x| (the padding is zero)
        g = amax(flat)
    if spec.columns:  # [Tp / 16, 16, D, 1]: x [Tp, D], token-major
        rows, cols, kernel = blocks.shape[0] * blocks.shape[1], blocks.shape[2], lib.nf4_quantize_columns
        scale_shape = (cols, rows // 16)
    elif spec.two_d:  # [R / 16, 16, C / 16, 16]
        rows, cols, kernel = (
            blocks.shape[0] * blocks.shape[1],
            blocks.shape[2] * blocks.shape[3],
            lib.nf4_quantize_tiles,
        )
        scale_shape = (rows // 16, cols // 16)
    else:  # [R, 1, C / 16, 16]
        rows, cols, kernel = blocks.shape[0], blocks.shape[2] * blocks.shape[3], lib.nf4_quantize_rows
        scale_shape = (rows, cols // 16)
    values = torch.empty(blocks.shape, dtype=torch.float32) if spec.values else None
    packed = torch.empty(flat.numel() // 2, dtype=torch.uint8) if spec.pack else None
    scale_codes = torch.empty(scale_shape, dtype=torch.uint8)
    counts = torch.empty(3, dtype=torch.int64)
    tensor_scale = torch.empty((), dtype=torch.float32)
    kernel(
        flat.data_ptr(),
        rows,
        cols,
        _grid(spec.scale_format),
        _ROUNDINGS[spec.rounding],
        0 if key is None else int(key) & 0xFFFFFFFF,
        float(g),
        float(target),
        None if values is None else values.data_ptr(),
        None if packed is None else packed.data_ptr(),
        scale_codes.data_ptr(),
        counts.data_ptr(),
        tensor_scale.data_ptr(),
        torch.get_num_threads(),
    )
    return values, tensor_scale, g, packed, scale_codes, counts


class NativeCores:
    """A :class:`~nemofp4.kernels.request.CoreRunner`: the native kernel for each operand it covers
    (:func:`supports`), one ctypes call each, and ``rest`` (another runner) for the others, as one
    call of its own."""

    name = "native"

    def __init__(self, rest: CoreRunner) -> None:
        self.rest = rest

    def __repr__(self) -> str:
        return f"NativeCores(rest={getattr(self.rest, 'name', self.rest)!r})"

    def run(self, operands: tuple[CoreOperand, ...], args: list[tuple]) -> list[tuple]:
        outputs: list = [
            quantize_core(o.spec, *a) if supports(o.spec, o.blocks) else None for o, a in zip(operands, args)
        ]
        rest = [i for i, output in enumerate(outputs) if output is None]
        if rest:
            for i, output in zip(rest, self.rest.run(tuple(operands[i] for i in rest), [args[i] for i in rest])):
                outputs[i] = output
        return outputs
