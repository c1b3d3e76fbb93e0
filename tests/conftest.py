"""The test session's settings and the helpers test modules share (imported from here, never from
another test module).

Triton: on a machine without CUDA the whole session runs Triton kernels in the CPU interpreter.
The interpreter is chosen when a kernel module is first imported, so it is set here, before any
test module is collected; ``needs_triton_interpreter`` marks the tests that need it (skipped on a
CUDA machine, where ``tests/gpu`` runs the kernels compiled, in a session of its own:
``scripts/gpu/gpu_check.sh``).
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

# as every nemofp4 command does (nemofp4/cli/__init__.py): huge pages for torch's large CPU
# allocations, set before torch's first allocation
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

import torch  # noqa: E402
import torch.nn.functional as F
from torch import nn

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parents[1]
TRITON_INTERPRETER = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0") and bool(
    importlib.util.find_spec("triton")
)
"""Triton is importable and this session runs its kernels in the CPU interpreter."""
needs_triton_interpreter = pytest.mark.skipif(
    not TRITON_INTERPRETER,
    reason="needs triton and its CPU interpreter (on a CUDA machine tests/gpu run the kernels compiled)",
)

pytest_plugins = ["tests.parallel"]


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def assert_interpreted(kernel) -> None:
    """A Triton kernel of this session is the interpreter's (not compiled for a GPU it cannot run on)."""
    from triton.runtime.interpreter import InterpretedFunction

    assert isinstance(kernel, InterpretedFunction), (
        "a Triton kernel module was imported before tests/conftest.py set TRITON_INTERPRET=1"
    )


# ------------------------------------------------------------------------------------ threads
@pytest.fixture
def one_thread():
    """The quant tests run many small ops; with the 2 CI cores shared, intra-op threads mostly wait
    on each other (10x slower). A module uses it with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def empty_native_cache(monkeypatch, tmp_path):
    """An empty native-library cache for this test (its ``kernels`` folder), fresh compiler and library
    look-ups and no warning of ``kernels='auto'`` given yet; the process's own again after the test."""
    from nemofp4.kernels import backend, native, toolchain

    monkeypatch.setenv("NEMOFP4_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(backend, "_warned", set())
    native._load.cache_clear()
    toolchain.cpu_compile_available.cache_clear()
    yield tmp_path / "cache" / "kernels"
    monkeypatch.undo()
    native._load.cache_clear()
    toolchain.cpu_compile_available.cache_clear()


@pytest.fixture
def eager_quantizer(monkeypatch):
    """'auto' takes the eager torch quantizer on CPU, as on a machine without a C++ compiler, for the
    modules whose subject is not the quantizer's path (``pytestmark = pytest.mark.usefixtures(...)``).
    The compiled program is bitwise the eager one (tests/unit/test_kernels_program.py); each of its
    graphs costs a cold machine about 10 s to build (test_quant_linear, test_eval_policies and
    test_quant_sr on an empty cache: 263 s before they used it, 9.5 s after)."""
    from nemofp4.kernels import backend

    monkeypatch.setattr(backend, "cpu_compile_available", lambda: False)


# ------------------------------------------------------------------------------------ stand-in model
_SYMBOLS = {"M": "mamba", "*": "attention", "-": "mlp"}


class _Mixer(nn.Module):
    def __init__(self, kind: str, d: int) -> None:
        super().__init__()
        self.kind = kind
        if kind == "mamba":
            self.in_proj = nn.Linear(d, 4 * d, bias=False)
            self.out_proj = nn.Linear(2 * d, d, bias=False)
        elif kind == "attention":
            self.q_proj = nn.Linear(d, d, bias=False)
            self.k_proj = nn.Linear(d, d // 2, bias=False)
            self.v_proj = nn.Linear(d, d // 2, bias=False)
            self.o_proj = nn.Linear(d, d, bias=False)
        else:
            self.up_proj = nn.Linear(d, 2 * d, bias=False)
            self.down_proj = nn.Linear(2 * d, d, bias=False)

    def forward(self, x_BLD: torch.Tensor) -> torch.Tensor:
        if self.kind == "mamba":  # gated mixing along the sequence (a stand-in for the scan)
            z, u = self.in_proj(x_BLD).chunk(2, dim=-1)
            u = torch.cumsum(u, dim=1) / torch.arange(1, u.shape[1] + 1, device=u.device)[:, None]
            return self.out_proj(u * F.silu(z))
        if self.kind == "attention":
            b, n, d = x_BLD.shape
            q = self.q_proj(x_BLD).view(b, n, 2, d // 2).transpose(1, 2)
            k = self.k_proj(x_BLD).view(b, n, 1, d // 2).transpose(1, 2).expand(b, 2, n, d // 2)
            v = self.v_proj(x_BLD).view(b, n, 1, d // 2).transpose(1, 2).expand(b, 2, n, d // 2)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.o_proj(y.transpose(1, 2).reshape(b, n, d))
        return self.down_proj(F.relu(self.up_proj(x_BLD)).square())


class _Block(nn.Module):
    def __init__(self, symbol: str, d: int) -> None:
        super().__init__()
        self.block_type = _SYMBOLS[symbol]
        self.norm = nn.RMSNorm(d)
        self.mixer = _Mixer(self.block_type, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mixer(self.norm(x))


class StandInModel(nn.Module):
    """A small stand-in for the Nemotron-H model with the same module names (embeddings,
    layers.{i}.{norm,mixer.*_proj}, norm_f, lm_head), for fast quant tests: the recipes select on it
    what they select on the real model (tests/unit/test_quant_standin.py holds the names equal)."""

    def __init__(self, pattern: str = "M-*-", d: int = 32, vocab: int = 64) -> None:
        super().__init__()
        self.embeddings = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(_Block(s, d) for s in pattern)
        self.norm_f = nn.RMSNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids_BL: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(ids_BL)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm_f(x))


def linear_names(model: nn.Module) -> list[tuple[str, str]]:
    """(fqn, block type of its layer) of every nn.Linear."""
    out = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            block = ""
            if name.startswith("layers."):
                block = model.layers[int(name.split(".")[1])].block_type
            out.append((name, block))
    return out


def standin_batch(step: int) -> torch.Tensor:
    return torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(step))


def train_standin(model, optimizer, steps):
    """Train the stand-in model on :func:`standin_batch` for ``steps`` (1-based optimizer steps)."""
    from nemofp4.quant import set_step

    for step in steps:
        set_step(model, step, seed=5, rank=0)
        ids = standin_batch(step)
        logits = model(ids[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()


def fresh_standin(recipe="ue5m3"):
    """A two-layer stand-in model under ``recipe`` and its AdamW, from seed 0."""
    from nemofp4.recipes import apply_recipe, get_recipe

    torch.manual_seed(0)
    model = StandInModel("M-", d=32, vocab=64)
    apply_recipe(model, get_recipe(recipe), log=False)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


# ------------------------------------------------------------------------------------ quantizer inputs
def quant_inputs():
    """(label, 2-D tensor) inputs for the bitwise quantizer tests: ragged, wide-range, edge and tie blocks."""
    g = torch.Generator().manual_seed(0)
    yield "gaussian, ragged", torch.randn(37, 70, generator=g)
    yield "wide dynamic range", torch.randn(48, 48, generator=g) * torch.logspace(-8, 8, 48)
    x = torch.randn(32, 64, generator=g)
    x[3] = 0.0  # zero blocks
    x[5, :16] = 1e-30  # scale underflow
    x[7] = 1e30  # saturation against a small held reference
    x[9, :8] = -0.0
    yield "edge blocks", x
    # Block maxima of 6 put these exactly on E2M1 midpoints and grid points (ties to even).
    ties = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.99, 0.1, 2.0, 4.0, 3.0, 1.5, 0.5, 1.0])
    yield "ties", torch.cat([ties, -ties]).repeat(32, 2)
    yield "bf16 input", torch.randn(32, 48, generator=g).bfloat16()


QUANT_CASES = [
    (fmt, 32 if fmt == "ue8m0" else 16, two_d, rounding, 448.0)
    for fmt in ["e4m3", "ue5m3", "ue5m3_cuda", "ue8m0"]
    for two_d in [False, True]
    for rounding in ["rne", "sr8", "sr"]
] + [
    ("ue5m3", 16, False, "sr8", 2048.0),
    ("ue5m3", 32, True, "rne", 2048.0),
    ("e4m3", 32, False, "rne", 448.0),
    ("e4m3", 16, False, "sr_exact", 448.0),
]
"""(scale format, block, 2-D tiles, rounding, scale target) of the bitwise quantizer tests."""


def ue5m3_reference(x, max_finite: float):
    """Values and codes of RNE-rounding non-negative x to UE5M3, from the definition alone:
    unsigned, 5 exponent bits (bias 15), 3 fraction bits, subnormals (quantum 2^-17),
    saturating at ``max_finite``. Computed in float64, where every step here is exact."""
    import numpy as np

    x = np.asarray(x, dtype=np.float64)
    _, frexp_exp = np.frexp(np.where(x > 0, x, 1.0))
    exponent = np.maximum(frexp_exp - 1, -14)  # floor(log2 x), clamped to the subnormal binade
    quantum = np.exp2(exponent - 3.0)
    value = np.minimum(np.rint(x / quantum) * quantum, max_finite)  # np.rint: ties to even
    value = np.where(x >= max_finite, max_finite, value)
    _, value_exp = np.frexp(np.where(value > 0, value, 1.0))
    value_exponent = value_exp - 1
    normal = value >= 2.0**-14
    fraction = np.where(normal, value / np.exp2(value_exponent - 3.0) - 8, 0)
    codes = np.where(normal, (value_exponent + 15) * 8 + fraction, value / 2.0**-17)
    return value, codes.astype(np.uint8)


# ------------------------------------------------------------------------------------ scripts and checkpoints
def load_script(relative_path: str) -> ModuleType:
    """A repository script (scripts/*.py, data/tasks/*.py) as a module, for tests of its functions."""
    path = ROOT / relative_path
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def plot_script() -> ModuleType:
    return load_script("scripts/study/plot_quant_stats.py")


def held_references(folder: Path) -> dict[str, torch.Tensor]:
    """The held tensor references of a checkpoint folder (its FP4 linears' extra state in the DCP model
    state), without a model: '<fqn>.<ref>.amax' / '.refresh_step' -> tensor, as
    :meth:`nemofp4.quant.ReferenceState.state_dict` saved them (a reference not sampled: refresh step 0)."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    state = {
        k: torch.empty(m.size, dtype=m.properties.dtype)
        for k, m in metadata.items()
        if k.startswith("model.") and "._extra_state." in k
    }
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        dcp.load(state, checkpoint_id=str(folder), no_dist=True)
    return {k.removeprefix("model.").replace("._extra_state.", "."): v for k, v in state.items()}


# ------------------------------------------------------------------------------------ training runs
SMALL = [
    "model=tiny",
    "data=tiny",
    "train.seq_len=64",
    "train.global_batch=4",
    "eval.num_sequences=8",
    "eval.batch_size=4",
    "eval.interval=0",
    "logging.wandb=false",
    "logging.console=false",
    "logging.plots=false",
    "optim.lr=3e-3",
]
"""Overrides of a small multi-process run of the tiny model (:func:`launch`)."""
FAST_IN_PROCESS = [
    "model=tiny",
    "data=tiny",
    "train.seq_len=32",
    "train.global_batch=2",
    "train.micro_batch=2",
    "eval.num_sequences=4",
    "eval.batch_size=4",
    "eval.interval=0",
    "eval.at_start=false",
    "logging.wandb=false",
    "logging.console=false",
    "logging.plots=false",
    "optim.lr=3e-3",
    "precision=bf16",
    "train.kernels=reference",
]
"""Overrides of a tiny run trained in the test process (:func:`train_here`)."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def process_gone(pid: int) -> bool:
    """True once ``pid`` has exited (a zombie not yet reaped by its parent counts as gone)."""
    try:
        return "State:\tZ" in Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True


def launch(nproc: int, run_dir: Path, *overrides: str, expect_rc: int = 0) -> None:
    """``nemofp4.train`` with :data:`SMALL` in ``nproc`` processes (torchrun for more than one)."""
    if nproc == 1:
        cmd = [sys.executable, "-m", "nemofp4.train"]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={nproc}",
            f"--master_port={free_port()}",
            "-m",
            "nemofp4.train",
        ]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run(
        [*cmd, *SMALL, f"run_dir={run_dir}", *overrides], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900
    )
    if proc.returncode != expect_rc:
        raise AssertionError(f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")


def train_here(run_dir: Path, *overrides: str) -> dict:
    """A tiny run (:data:`FAST_IN_PROCESS`) trained in this process; its summary."""
    from nemofp4.cli.train import compose_job_config
    from nemofp4.training.trainer import train

    return train(compose_job_config([*FAST_IN_PROCESS, f"run_dir={run_dir}", *overrides]))


def losses(run_dir: Path) -> dict[int, float]:
    from nemofp4.training.metrics import read_metrics

    return {r["step"]: r["loss"] for r in read_metrics(run_dir, "train")}


def curve(run_dir: Path) -> dict[int, tuple[float, float]]:
    from nemofp4.training.metrics import read_metrics

    return {r["step"]: (r["loss"], r["grad_norm"]) for r in read_metrics(run_dir, "train")}


def relative_gap(a: dict[int, float], b: dict[int, float], steps) -> float:
    return max(abs(a[s] - b[s]) / abs(b[s]) for s in steps)


# ------------------------------------------------------------------------------------ data
def _shipped_root() -> Path:
    from nemofp4.data.paths import REPO_ROOT

    return REPO_ROOT


TOKENIZER = str(_shipped_root() / "data" / "tokenizer")


def shipped_chapters(count):
    with gzip.open(_shipped_root() / "data" / "corpus" / "austen_validation.jsonl.gz", "rt") as f:
        return [json.loads(line)["text"][:3000] for line, _ in zip(f, range(count))]


def read_all(prefix):
    import numpy as np

    from nemofp4.data import open_token_source

    source = open_token_source(prefix, verify="full")
    return [source.get(d, 0, int(source.lengths_of(np.array([d]))[0])).tolist() for d in range(source.num_documents)]


def perturbed_tiny(seed: int = 0, **overrides) -> nn.Module:
    """The tiny model at random init, then every parameter moved off its init value (norm gains, D,
    A_log, dt_bias, conv), so that a weight not loaded or mismatched shows in the logits."""
    from nemofp4.models import build_model, get_model_config

    torch.manual_seed(seed)
    model = build_model(get_model_config("tiny", **overrides))
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * (0.3 if p.dim() == 1 else 0.03))
    return model
