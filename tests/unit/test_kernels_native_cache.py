"""The C++ compiler and the native CPU quantizer's availability as the kernels' resolution sees them
(nemofp4.kernels.resolve_backend): an unusable ``CXX`` is an error naming it; an explicit
``kernels='native'`` that cannot run is one error, ``auto`` one warning saying why."""

import warnings

import pytest
import torch

from nemofp4 import kernels
from nemofp4.kernels import backend as kernel_backends
from nemofp4.kernels import native, program


@pytest.fixture
def cache(monkeypatch, tmp_path):
    """An empty library cache, fresh compiler and library look-ups and no warning of ``auto`` given
    yet; the process's own again after the test."""
    monkeypatch.setenv("NEMOFP4_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(kernel_backends, "_warned", set())
    native._load.cache_clear()
    program._compiler_on_path.cache_clear()
    yield tmp_path / "cache" / "kernels"
    monkeypatch.undo()
    native._load.cache_clear()
    program._compiler_on_path.cache_clear()


# ------------------------------------------------------------------------------------ the compiler setting
@pytest.mark.parametrize("cxx,message", [
    ("no-such-c++", "CXX='no-such-c\\+\\+' is not an executable on PATH; set it to a C\\+\\+ compiler"),
    ("ccache g++", "CXX='ccache g\\+\\+' is a command with arguments; .* run CXX as one executable"),
])  # fmt: skip
def test_an_unusable_cxx_is_an_error_naming_it(cache, monkeypatch, cxx, message):
    """A set CXX that cannot run as one program (torch.compile runs it so) is never replaced by another
    compiler: the native library, the compiled program's check and every setting that compiles on CPU
    raise, naming it."""
    monkeypatch.setenv("CXX", cxx)
    checks = [native.available, program.cpu_compile_available]
    checks += [lambda setting=setting: kernels.resolve_backend(setting, "cpu") for setting in ("auto", "native", "compiled")]
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
    match = ("kernels='native' \\(train.kernels, or nemofp4-eval's kernels\\) cannot run here: no C\\+\\+ compiler "
             "\\(CXX is unset and none of c\\+\\+, g\\+\\+, clang\\+\\+ is on PATH\\); use 'auto' or 'eager'")
    with pytest.raises(ValueError, match=match):
        kernels.describe("cpu", "native")
    with pytest.raises(ValueError, match=match):
        _standin_step("native")
    assert kernels.resolve_backend("compiled", "cpu") == "eager"


def test_auto_without_a_compiler_warns_once_and_runs_eagerly(no_compiler):
    """``auto`` on a CPU without a compiler: the eager program, one warning for the whole process (every
    module resolves the setting), saying why."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert kernels.resolve_backend("auto", "cpu") == "eager"
        _standin_step("auto")
        assert kernels.resolve_backend("auto", "cpu") == "eager"
    messages = [str(w.message) for w in caught if "kernels=" in str(w.message)]
    assert messages == ["kernels='auto': no C++ compiler (CXX is unset and none of c++, g++, clang++ is on PATH); "
                        "the eager torch program (op by op, slower) quantizes instead (the same numerics)"]
