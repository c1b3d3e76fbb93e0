"""The native library's cache (nemofp4.kernels.native): a library is loaded only once proven, so a
broken one (truncated by a crash, empty, foreign, half-written) is rebuilt and never kills the
process that finds it; a kill at each point of the build leaves a cache the next process repairs;
an unusable ``CXX`` is an error naming it; an explicit ``kernels='native'`` that cannot run is one
error, ``auto`` one warning (nemofp4.kernels.resolve_backend).

Most tests build with a stand-in compiler that copies the real library (built once per module), so
a build costs a copy and the throwaway load; the crash tests run in child processes, since the
crash they guard against (SIGBUS on a truncated library) kills the process that meets it."""

import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

from nemofp4 import kernels
from nemofp4.kernels import native, toolchain

ROOT = Path(__file__).resolve().parents[2]
TRUNCATED = 60000
"""A cut library: its ELF header and the start of its segments (of about 116 kB), so mapping it is SIGBUS."""


@pytest.fixture(scope="module")
def real_library() -> bytes:
    """The bytes of the library this process built with the real compiler (the tests that build need it)."""
    if not native.available():
        pytest.skip("needs a C++ compiler to build the native quantizer")
    return native.library_path(native.compiler()).read_bytes()


@pytest.fixture
def cache(empty_native_cache):
    """The test's empty library cache (``empty_native_cache``), named for this file's tests."""
    return empty_native_cache


def _compiler(tmp_path: Path, name: str, body: str) -> Path:
    """A stand-in C++ compiler: ``--version`` prints its name; a build runs ``body`` with ``$out`` the
    output file (the last argument)."""
    script = tmp_path / name
    script.write_text(
        f'#!/bin/sh\nif [ "$1" = --version ]; then echo {name} 1.0; exit 0; fi\nfor out; do :; done\n{body}\n'
    )
    script.chmod(0o755)
    return script


@pytest.fixture
def copier(tmp_path, real_library, monkeypatch):
    """``CXX``: a stand-in compiler that writes the real library's bytes."""
    library = tmp_path / "real.so"
    library.write_bytes(real_library)
    cxx = _compiler(tmp_path, "copy-c++", f'cp "{library}" "$out"')
    monkeypatch.setenv("CXX", str(cxx))
    return cxx


def _child(code: str, cache: Path, **env: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh Python process on this cache (and this checkout's nemofp4)."""
    environment = {**os.environ, "NEMOFP4_CACHE_DIR": str(cache.parent), "PYTHONPATH": str(ROOT), **env}
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


LOADS = "from nemofp4.kernels import native; assert native.available(), native.unavailable_reason(); print('loaded')"


def _rewrite(path: Path, data: bytes) -> None:
    """Put ``data`` at ``path`` as a new file: the library's old file is mapped into this process, and
    changing it in place would change (or, cut, crash) the process's own copy."""
    path.with_suffix(".tmp").write_bytes(data)
    os.replace(path.with_suffix(".tmp"), path)


def _assert_proven(cache: Path, real_library: bytes) -> None:
    """The cache holds the real library, its record matching it, and no temporary file."""
    (library,) = cache.glob("*.so")
    record = json.loads(library.with_suffix(".json").read_text())
    assert library.read_bytes() == real_library
    assert record == {"size": len(real_library), "sha256": native._digest(library)}
    assert not list(cache.glob("*.partial"))


# ------------------------------------------------------------------------------------ broken libraries
@pytest.mark.parametrize("record", ["kept", "missing"])
def test_a_truncated_library_is_rebuilt_and_the_process_lives(cache, copier, real_library, record):
    """A library cut to 60000 bytes (what a crash after an unflushed rename leaves: with its record, or
    without one as before records) is never mapped; the next process rebuilds it and runs."""
    assert native.available()
    (library,) = cache.glob("*.so")
    _rewrite(library, real_library[:TRUNCATED])
    if record == "missing":
        library.with_suffix(".json").unlink()
    result = _child(LOADS, cache, CXX=str(copier))
    assert result.returncode == 0 and "loaded" in result.stdout, (result.returncode, result.stderr[-2000:])
    _assert_proven(cache, real_library)


def test_a_compiler_that_writes_nothing_caches_nothing(cache, tmp_path, monkeypatch):
    """A compiler that exits 0 without output: no library is cached (a later process tries again), and
    the reason is the one message of ``auto`` and ``native``."""
    monkeypatch.setenv("CXX", str(_compiler(tmp_path, "silent-c++", "exit 0")))
    assert not native.available()
    assert "silent-c++ exited 0 but wrote an empty library" in native.unavailable_reason()
    assert not list(cache.iterdir())
    with pytest.warns(UserWarning, match="kernels='auto': could not build .* wrote an empty library"):
        assert kernels.resolve_backend("auto", "cpu") == "compiled"
    with pytest.raises(ValueError, match="kernels='native' .* wrote an empty library"):
        kernels.resolve_backend("native", "cpu")


def test_a_compiler_that_writes_a_truncated_library_does_not_kill_the_process(cache, tmp_path, real_library):
    """A library that kills whoever maps it (cut to 60000 bytes), from a compiler that exits 0: its first
    load, in a throwaway process, dies instead of this one; nothing is cached."""
    library = tmp_path / "real.so"
    library.write_bytes(real_library)
    cxx = _compiler(tmp_path, "cut-c++", f'head -c {TRUNCATED} "{library}" > "$out"')
    code = "from nemofp4.kernels import native; assert not native.available(); print(native.unavailable_reason())"
    result = _child(code, cache, CXX=str(cxx))
    assert result.returncode == 0, (result.returncode, result.stderr[-2000:])
    assert "cut-c++ built kills a process that loads it (SIGBUS)" in result.stdout
    assert not list(cache.iterdir())


@pytest.fixture(scope="module")
def foreign_library(tmp_path_factory) -> bytes:
    """A C++ library that is not ours, built by the real compiler: one function, none of the kernels."""
    folder = tmp_path_factory.mktemp("foreign")
    (folder / "foreign.cpp").write_text('extern "C" int not_a_quantizer() { return 7; }\n')
    subprocess.run(
        [native.compiler(), "-shared", "-fPIC", str(folder / "foreign.cpp"), "-o", str(folder / "foreign.so")],
        check=True,
    )
    return (folder / "foreign.so").read_bytes()


@pytest.mark.parametrize("record", ["none", "matching"])
def test_a_foreign_library_under_the_name_is_rebuilt(cache, copier, real_library, foreign_library, record):
    """Another library under the library's name, without a record or with one that matches it: rebuilt
    (after the kernels are found missing, for the matching record), never an AttributeError."""
    path = native.library_path(str(copier))
    path.parent.mkdir(parents=True)
    path.write_bytes(foreign_library)
    assert b"nf4_amax" not in foreign_library
    if record == "matching":
        path.with_suffix(".json").write_text(json.dumps({"size": path.stat().st_size, "sha256": native._digest(path)}))
    assert native.available()
    _assert_proven(cache, real_library)
    assert native.amax(torch.tensor([1.0, -3.0])) == 3.0


def test_a_library_whose_record_differs_is_rebuilt(cache, copier, real_library):
    """A library of the recorded size whose bytes differ (a flipped byte) fails the digest: rebuilt."""
    assert native.available()
    (library,) = cache.glob("*.so")
    data = bytearray(real_library)
    data[-1] ^= 0xFF
    _rewrite(library, bytes(data))
    native._load.cache_clear()
    assert native.available()
    _assert_proven(cache, real_library)


# ------------------------------------------------------------------------------------ a kill during the build
_KILL_AT_RENAME = """
import os
from nemofp4.kernels import native
renames, real = [], os.replace
def replace(*args):
    renames.append(args)
    if len(renames) == {n}:
        os._exit(137)  # killed here: the rename does not happen
    real(*args)
os.replace = replace
native.available()
raise SystemExit('not killed')
"""


KILLS = {
    "while compiling": {".partial"},
    "before the library's rename": {".partial"},
    "before the record's rename": {".so", ".partial"},
}
"""Where the kill lands, and what the cache holds after it."""


def _kill(where: str, cache: Path, copier: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    """A child process building the library, killed at ``where``."""
    if where == "while compiling":  # the compiler is half-way through its output
        library = tmp_path / "real.so"
        cxx = _compiler(tmp_path, "dying-c++", f'head -c {TRUNCATED} "{library}" > "$out"; kill -KILL $PPID; sleep 1')
        return _child(LOADS, cache, CXX=str(cxx))
    renames = {"before the library's rename": 1, "before the record's rename": 2}[where]
    return _child(_KILL_AT_RENAME.format(n=renames), cache, CXX=str(copier))


@pytest.mark.parametrize("where", KILLS)
def test_a_kill_during_the_build_leaves_a_cache_the_next_process_repairs(cache, copier, real_library, tmp_path, where):
    """A kill at each point of the build: the next process does not trust what it left (a temporary
    file, a library without its record), builds, loads, and removes the temporary file once stale."""
    killed = _kill(where, cache, copier, tmp_path)
    assert killed.returncode in (137, -9), (killed.returncode, killed.stderr[-2000:])
    assert {p.suffix for p in cache.iterdir()} == KILLS[where]
    stale = time.time() - native.STALE_PARTIAL_S - 60
    for partial in cache.glob("*.partial"):
        os.utime(partial, (stale, stale))
    result = _child(LOADS, cache, CXX=str(copier))
    assert result.returncode == 0 and "loaded" in result.stdout, (result.returncode, result.stderr[-2000:])
    _assert_proven(cache, real_library)


def test_a_build_removes_stale_partial_files_and_keeps_fresh_ones(cache, copier, real_library):
    """A build removes the temporary files of crashed builds (older than STALE_PARTIAL_S), library or
    record, and keeps a younger one (a build under way elsewhere)."""
    cache.mkdir(parents=True)
    stale = time.time() - native.STALE_PARTIAL_S - 60
    for name in ("cpu_quantize-0123.abcd.partial", "cpu_quantize-0123.json.ef01.partial"):
        (cache / name).write_bytes(b"\x7fELF")
        os.utime(cache / name, (stale, stale))
    (cache / "cpu_quantize-4567.fresh.partial").write_bytes(b"\x7fELF")
    assert native.available()
    assert sorted(p.name for p in cache.glob("*.partial")) == ["cpu_quantize-4567.fresh.partial"]


# ------------------------------------------------------------------------------------ the compiler setting
@pytest.mark.parametrize(
    "cxx,message",
    [
        ("no-such-c++", "CXX='no-such-c\\+\\+' is not an executable on PATH; set it to a C\\+\\+ compiler"),
        ("ccache g++", "CXX='ccache g\\+\\+' is a command with arguments; .* run CXX as one executable"),
    ],
)
def test_an_unusable_cxx_is_an_error_naming_it(cache, monkeypatch, cxx, message):
    """A set CXX that cannot run as one program (torch.compile runs it so) is never replaced by another
    compiler: the native library, the compiled program's check and every setting that compiles on CPU
    raise, naming it."""
    monkeypatch.setenv("CXX", cxx)
    checks = [native.available, toolchain.cpu_compile_available]
    checks += [
        lambda setting=setting: kernels.resolve_backend(setting, "cpu") for setting in ("auto", "native", "compiled")
    ]
    for check in checks:
        with pytest.raises(ValueError, match=message):
            check()
    assert kernels.resolve_backend("eager", "cpu") == "eager"  # needs no compiler
    assert not cache.exists()


@pytest.fixture
def no_compiler(cache, monkeypatch):
    """A machine without a C++ compiler: CXX unset and nothing on PATH."""
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("PATH", "")


def _standin_step(backend: str) -> None:
    from nemofp4.quant import set_quant_backend, set_step
    from nemofp4.recipes import apply_recipe, get_recipe
    from tests.conftest import StandInModel

    model = StandInModel()
    apply_recipe(model, get_recipe("ue5m3"), log=False)
    set_quant_backend(model, backend)
    set_step(model, 1)
    ids = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(1))
    model(ids).sum().backward()


def test_explicit_native_without_a_compiler_is_one_error(no_compiler):
    """``native`` cannot run: the error names the setting, the cause and what can run instead, both
    where the start-up log resolves it and in a model's first step."""
    match = (
        "kernels='native' \\(train.kernels, or nemofp4-eval's kernels\\) cannot run here: no C\\+\\+ compiler "
        "\\(CXX is unset and none of c\\+\\+, g\\+\\+, clang\\+\\+ is on PATH\\); use 'auto' or 'eager'"
    )
    with pytest.raises(ValueError, match=match):
        kernels.describe("cpu", "native")
    with pytest.raises(ValueError, match=match):
        _standin_step("native")
    with pytest.raises(ValueError, match=match.replace("native", "compiled")):  # the compiled program needs one too
        kernels.resolve_backend("compiled", "cpu")


def test_auto_without_a_compiler_warns_once_and_runs_eagerly(no_compiler):
    """``auto`` on a CPU without a compiler: the eager program, one warning for the whole process (every
    module resolves the setting), saying why."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert kernels.resolve_backend("auto", "cpu") == "eager"
        _standin_step("auto")
        assert kernels.resolve_backend("auto", "cpu") == "eager"
    messages = [str(w.message) for w in caught if "kernels=" in str(w.message)]
    assert messages == [
        "kernels='auto': no C++ compiler (CXX is unset and none of c++, g++, clang++ is on PATH); "
        "the eager torch program (op by op, slower) quantizes instead (the same numerics)"
    ]
