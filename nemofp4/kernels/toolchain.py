"""The one C++ compiler finder, shared by ``torch.compile``'s CPU kernels and the native CPU kernel.

``torch.compile`` builds its CPU kernels with the compiler in ``CXX`` (else the first of
:data:`COMPILERS` on PATH), and :mod:`nemofp4.kernels.native` builds its library with the same one,
so the two paths agree on whether the machine can compile at all.
"""

from __future__ import annotations

import functools
import os
import shlex
import shutil

__all__ = ["COMPILERS", "NO_COMPILER", "compiler", "cpu_compile_available"]

COMPILERS = ("c++", "g++", "clang++")
"""Searched on PATH when ``CXX`` is unset."""
NO_COMPILER = f"no C++ compiler (CXX is unset and none of {', '.join(COMPILERS)} is on PATH)"


def compiler() -> str | None:
    """The C++ compiler's path: ``CXX`` when set, else the first of :data:`COMPILERS` on PATH; None
    without one. A set ``CXX`` that is not one executable on PATH is a ValueError naming it: another
    compiler in its place would build with a toolchain nobody chose, and ``torch.compile`` (which
    runs ``CXX`` as one program) would fail on it anyway."""
    cxx = os.environ.get("CXX")
    if not cxx:
        return next((path for path in map(shutil.which, COMPILERS) if path), None)
    path = shutil.which(cxx)
    if path is not None:
        return path
    if len(shlex.split(cxx)) > 1:
        raise ValueError(
            f"CXX={cxx!r} is a command with arguments; torch.compile and the native CPU quantizer run "
            "CXX as one executable: set it to the compiler (e.g. CXX=g++), or to a launcher's compiler "
            "link (ccache: e.g. CXX=/usr/lib/ccache/g++), or unset it"
        )
    raise ValueError(
        f"CXX={cxx!r} is not an executable on PATH; set it to a C++ compiler (e.g. g++ or clang++, a "
        f"name on PATH or a path), or unset it to use the first of {', '.join(COMPILERS)} on PATH"
    )


@functools.cache
def cpu_compile_available() -> bool:
    """``torch.compile`` can build CPU kernels here: a C++ compiler is on PATH, or in ``CXX`` (a set
    ``CXX`` that is not one executable on PATH is a ValueError naming it: :func:`compiler`). Asked once
    per process (``cache_clear`` asks again)."""
    return compiler() is not None
