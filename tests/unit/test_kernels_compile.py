"""The Triton kernels compile for a Hopper GPU (sm_90) on a machine without one.

The interpreter tests run the kernels' Python; they cannot see what only the compiler checks
(constexpr globals, layouts of reshapes and splits, types of shifts, what lowers to PTX). This
test compiles every launch variant ahead of time for ``cuda:90`` with Triton's bundled
toolchain, in a subprocess: the interpreter tests set ``TRITON_INTERPRET=1`` for this process.
Run this file as a script to also print each kernel's registers and spills (ptxas -v).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from nemofp4.formats import SCALE_FORMATS

_QUANTIZE_TYPES = {
    "x_ptr": "*bf16",
    "g_ptr": "*fp32",
    "seed_ptr": "*i64",
    "amax_out_ptr": "*i32",
    "codes_ptr": "*u8",
    "scales_ptr": "*u8",
    "scaled_ptr": "*fp32",
    "draws_ptr": "*i64",
    "counts_ptr": "*i32",
    "ts_ptr": "*fp32",
    "codes_t_ptr": "*u8",
    "scales_t_ptr": "*u8",
    "scaled_t_ptr": "*bf16",
    "draws_t_ptr": "*i64",
    "counts_t_ptr": "*i32",
    "ts_t_ptr": "*fp32",
    "rows": "i32",
    "cols": "i32",
    "stride_x": "i32",
    "rows_out": "i32",
    "cols_p": "i32",
    "rows_p": "i32",
    "numerator": "fp32",
    "numerator_t": "fp32",
}
_GEMM_TYPES = {
    "a_codes": "*u8",
    "a_scales": "*u8",
    "b_codes": "*u8",
    "b_scales": "*u8",
    "out_ptr": "*fp32",
    "a_ts_ptr": "*fp32",
    "b_ts_ptr": "*fp32",
    "M": "i32",
    "N": "i32",
    "K_a": "i32",
    "K_b": "i32",
    "K": "i32",
    "stride_a_codes": "i32",
    "stride_a_scales": "i32",
    "stride_b_codes": "i32",
    "stride_b_scales": "i32",
    "stride_out": "i32",
}


def _quantize_constants(scale_format: str, **overrides) -> dict:
    from nemofp4.kernels.quantize import _tile_config

    fmt = SCALE_FORMATS[scale_format]
    is_mx = scale_format == "ue8m0"
    constants = {
        "BS": 32 if is_mx else 16,
        "IS_MX": is_mx,
        "MX_CEIL": False,
        "SCALE_MAX": 0.0 if is_mx else fmt.max_finite,
        "SCALE_BIAS": fmt.bias,
        "SCALE_MANT": fmt.mantissa_bits,
        "SCALE_MIN_NORMAL": fmt.min_normal,
        "SCALE_SUB_STEP": fmt.min_subnormal,
        "ZERO_CODE_TO_ONE": scale_format != "e4m3",
        "ROUNDING": 0,
        "TWO_D": False,
        "ROWWISE": True,
        "TRANSPOSED": False,
        "WRITE_SCALED": False,
        "WRITE_DRAWS": False,
        "STATS": True,
        "MEASURE_AMAX": is_mx,
    }
    constants.update(overrides)
    config = _tile_config(constants["BS"], constants["TWO_D"], constants["TRANSPOSED"], interpret=False)
    return {**constants, **config}


def _variants():
    from nemofp4.kernels import _gemm_kernels, _quantize_kernels

    quantize = _quantize_kernels.quantize_kernel
    ue5m3 = SCALE_FORMATS["ue5m3"]
    gemm = {
        "A_BS": 16,
        "A_TWO_D": False,
        "A_TRANSPOSED": False,
        "A_IS_MX": False,
        "A_BIAS": 15,
        "A_MANT": 3,
        "A_SUB_STEP": ue5m3.min_subnormal,
        "B_BS": 16,
        "B_TWO_D": True,
        "B_TRANSPOSED": True,
        "B_IS_MX": False,
        "B_BIAS": 15,
        "B_MANT": 3,
        "B_SUB_STEP": ue5m3.min_subnormal,
        "SUB": 16,
        "LATTICE_SNAP": True,
        "BM": 64,
        "BN": 64,
        "num_warps": 8,
        "enable_fp_fusion": False,
    }
    return [
        ("quantize ue5m3 rne", quantize, _QUANTIZE_TYPES, _quantize_constants("ue5m3")),
        ("quantize e4m3 16x16", quantize, _QUANTIZE_TYPES, _quantize_constants("e4m3", TWO_D=True)),
        ("quantize ue8m0 ceil", quantize, _QUANTIZE_TYPES, _quantize_constants("ue8m0", MX_CEIL=True)),
        ("quantize ue5m3 sr8", quantize, _QUANTIZE_TYPES, _quantize_constants("ue5m3", ROUNDING=1)),
        (
            "quantize ue5m3 sr8 +transposed +scaled +draws",
            quantize,
            _QUANTIZE_TYPES,
            _quantize_constants("ue5m3", ROUNDING=1, TRANSPOSED=True, WRITE_SCALED=True, WRITE_DRAWS=True),
        ),
        (
            "quantize ue5m3 rne +transposed",
            quantize,
            _QUANTIZE_TYPES,
            _quantize_constants("ue5m3", TRANSPOSED=True),
        ),
        ("quantize e4m3 sr", quantize, _QUANTIZE_TYPES, _quantize_constants("e4m3", ROUNDING=2)),
        (
            "amax",
            _quantize_kernels.amax_kernel,
            {"x_ptr": "*bf16", "n": "i32", "out_ptr": "*i32", "num_programs": "i32", "iterations": "i32"},
            {"BLOCK": 4096},
        ),
        ("hardware gemm", _gemm_kernels.hardware_gemm_kernel, _GEMM_TYPES, gemm),
    ]


def compile_all(report: bool = False) -> None:
    """Compile every variant for sm_90; with ``report``, print ptxas's register/spill summary."""
    import re
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", 90, 32)
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    for name, fn, types, constants in _variants():
        options = {k: constants.pop(k) for k in ("num_warps", "enable_fp_fusion") if k in constants}
        signature = {arg: ("constexpr" if arg in constants else types[arg]) for arg in fn.arg_names}
        # what the launcher specializes at run time for 16-aligned pointers and sizes divisible
        # by 16 (it is what makes the bf16 loads 16-byte vectors)
        attrs = {(i,): [["tt.divisibility", 16]] for i, arg in enumerate(fn.arg_names) if arg in types}
        source = ASTSource(fn=fn, signature=signature, constexprs=constants, attrs=attrs)
        kernel = triton.compile(source, target=target, options=options)
        if not report:
            continue
        with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
            f.write(kernel.asm["ptx"])
        usage = "ptxas not found"
        for ptxas in ("ptxas-blackwell", "ptxas"):
            path = os.path.join(bin_dir, ptxas)
            if os.path.exists(path):
                out = subprocess.run(
                    [path, "-v", "--gpu-name", "sm_90a", f.name, "-o", os.devnull],
                    capture_output=True,
                    text=True,
                )
                found = re.findall(r"(\d+ bytes spill stores|Used \d+ registers)", out.stderr)
                if found:
                    usage = ", ".join(found)
                    break
        os.unlink(f.name)
        loads = sorted(set(re.findall(r"\bld\.global[a-z0-9.]*", kernel.asm["ptx"])))
        print(f"{name}: {usage}, shared {kernel.metadata.shared} B, loads {loads}")


def test_kernels_compile_for_sm90():
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "0"
    result = subprocess.run(
        [sys.executable, "-m", "tests.unit.test_kernels_compile"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    )
    assert result.returncode == 0, result.stderr[-4000:]


if __name__ == "__main__":
    os.environ.pop("TRITON_INTERPRET", None)
    compile_all(report="--report" in sys.argv)
