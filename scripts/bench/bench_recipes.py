"""Training-step time and saved-activation memory of every emulated precision recipe vs bf16.

    python scripts/bench/bench_recipes.py [--repeats 7] [--batch 4] [--seq-len 256] [--threads 1]
                                    [--kernels auto|compiled|eager]
    python scripts/bench/bench_recipes.py --run-steps 120 [--recipe ue5m3] [--stats-interval 50]
    python scripts/bench/bench_recipes.py --profile --recipe nvfp4 [--profile-rows 25]
    python scripts/bench/bench_recipes.py --linears [--repeats 15]

Two workloads, all recipes side by side in one run:

* ``tiny``: one training step (forward, loss, backward, AdamW) of the ``tiny`` Nemotron-H
  preset. Its 6 layers are fewer than the 8 final layers NVFP4 keeps in BF16, so the recipes
  with a BF16 tail by default keep ``--tiny-bf16-last-layers`` (1) instead; the table says so.
* ``linear4096``: forward + backward of one 4096 x 4096 linear on ``--linear-tokens`` tokens.

Time: float32 on CPU (the trainer's CPU default), recipes interleaved round after round, median
of ``--repeats`` rounds after a warm-up round (which also compiles the CPU quantizer); ratios are
against bf16 in the same run. "quantizing" is the median share of a tiny step spent inside the
kernels backend's quantizers (:func:`timing_quantizers`). ``--kernels eager`` times the torch quantization program run
eagerly instead of compiled, as ``train.kernels=eager`` does. Threads
default to 1: the CI machine's 2 cores are shared, and with 2 intra-op threads many small ops
mostly wait on each other. The header says whether ``THP_MEM_ALLOC_ENABLE=1`` was set (see
``scripts/bench/bench_quant.py``).

``--run-steps N`` instead times every step of one N-step run of the tiny model under ``--recipe``
(held-reference refreshes and quantization statistics every ``--stats-interval`` steps, as the
trainer collects them): the first step (which compiles), the median of the others and the
slowest of them against that median. ``--profile`` prints torch.profiler's op table of one
tiny-model step of ``--recipe``, and the Python function calls a step makes (``cProfile`` over the
five steps after it).

``--linears`` times the tiny model's FP4 linears alone, each recipe's against the same linears in
bf16: one forward + backward of every linear the recipe turns into FP4, at its shapes in the tiny
step (the input shapes of one forward), inputs that need gradients as in the model, recipes
interleaved round after round; and the same FP4 linears called through their custom ops (the path
of compiled graphs and dispatch modes; plain eager skips the dispatcher's layers). The rest of the
step (the SSD scan, attention, the LM head, the optimizer) costs the same in every recipe and only
adds noise to a step's ratio; this isolates what an FP4 linear adds, and how much of it is the
quantizers (:func:`timing_quantizers`).

"page faults" is the median count of minor page faults a tiny step takes (``ru_minflt``): pages the
step touches for the first time, which the kernel zeroes first. ``--keep-freed-memory`` asks glibc's
malloc to serve every allocation from its heap and never to return freed memory (``mallopt``:
``M_MMAP_MAX=0``, ``M_TRIM_THRESHOLD`` at its largest), to measure what those faults cost; the
trainer does not do this: repeated aligned allocations can then grow the heap without bound
(docs/benchmarks.md, "Freed memory kept").

Memory: the tensors autograd saves during one forward pass, counted once per storage
(parameters excluded), run under CPU autocast to bfloat16 as a GPU run would be: an
``nn.Linear`` then saves a BF16 copy of its input, an FP4 linear its packed codes. "FP4
linears" sums the saves made inside the linears a recipe converts to FP4, against the same
linears in bf16. (The memory pass of the 4096 linear uses ``--memory-tokens`` tokens: BF16
matmuls are slow on CPU, and every saved size is proportional to the tokens.)
"""

from __future__ import annotations

import argparse
import ctypes
import os
import platform
import resource
import statistics
import time
import warnings
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from nemofp4.kernels import BACKENDS, backend_for
from nemofp4.models import build_model, get_model_config
from nemofp4.quant import set_quant_backend, set_quant_stats, set_step
from nemofp4.quant.linear_op import register_ops
from nemofp4.recipes import apply_recipe, get_recipe, recipe_knobs

RECIPES = [
    "bf16",
    "ue5m3",
    "ue5m3_te_settings",
    "nvfp4",
    "nvfp4_delayed",
    "nvfp4_all_fp4_no_rht",
    "mxfp4",
    "fp8",
    "mxfp8",
]


def _recipe(name: str, bf16_last_layers: int | None):
    """The recipe with its BF16 tail set to ``bf16_last_layers`` where it has one by default (the FP8
    recipes' default is none, and they keep it)."""
    knobs = {}
    if bf16_last_layers is not None and recipe_knobs(name).get("num_bf16_last_layers", 0) > 0:
        knobs["num_bf16_last_layers"] = bf16_last_layers
    return get_recipe(name, **knobs), knobs


def build_tiny(name: str, bf16_last_layers: int, seed: int = 0):
    torch.manual_seed(seed)
    model = build_model(get_model_config("tiny"), device="meta")
    recipe, knobs = _recipe(name, bf16_last_layers)
    table = apply_recipe(model, recipe, log=False)
    model.to_empty(device="cpu")
    model.init_weights()
    return model, table, knobs


class _Single(nn.Module):
    """One linear named like a model's, so the recipes' rules select it (plus a small unused
    lm_head for the rule that every FP4 recipe has for it)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Module()])
        self.layers[0].mixer = nn.Module()
        self.layers[0].mixer.up_proj = nn.Linear(width, width, bias=False)
        self.lm_head = nn.Linear(16, 16, bias=False)

    def forward(self, x):
        return self.layers[0].mixer.up_proj(x)


def build_linear(name: str, width: int):
    torch.manual_seed(0)
    model = _Single(width)
    recipe, _ = _recipe(name, 0)
    table = apply_recipe(model, recipe, log=False)
    return model, table


# ----------------------------------------------------------------------------------- timing
def _tiny_step(model, optimizer, ids, step):
    set_step(model, step)
    logits = model(ids[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten())
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()


@contextmanager
def timing_quantizers(kernels: str):
    """Yields a one-element list that accumulates the seconds spent inside the quantizers of the
    ``kernels`` backend (quantize, amax, hadamard_transform; an outer call's inner calls are not counted twice): the quantization share of
    a step."""
    backend = backend_for(kernels, "cpu")
    spent, depth = [0.0], [0]

    def timed(method):
        def run(*args, **kwargs):
            depth[0] += 1
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                depth[0] -= 1
                if not depth[0]:
                    spent[0] += time.perf_counter() - start

        return run

    names = ("quantize", "amax", "hadamard_transform")
    for name in names:  # instance attributes shadow the class's methods (the backends are singletons)
        setattr(backend, name, timed(getattr(backend, name)))
    try:
        yield spent
    finally:
        for name in names:
            delattr(backend, name)


def keep_freed_memory() -> None:
    """glibc's malloc serves every allocation from its heap and keeps freed memory (see the docstring)."""
    mallopt = ctypes.CDLL("libc.so.6").mallopt
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    m_trim_threshold, m_mmap_max = -1, -4
    if not (mallopt(m_mmap_max, 0) and mallopt(m_trim_threshold, (1 << 31) - 1)):
        raise RuntimeError("glibc's mallopt refused M_MMAP_MAX=0 or M_TRIM_THRESHOLD")


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def time_tiny(args) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
    """(recipe -> median step seconds, recipe -> median share of the step spent quantizing, recipe ->
    median minor page faults of a step)."""
    vocab = get_model_config("tiny").vocab_size
    ids = torch.randint(0, vocab, (args.batch, args.seq_len + 1), generator=torch.Generator().manual_seed(1))
    runs = {}
    for name in RECIPES:
        model, _, _ = build_tiny(name, args.tiny_bf16_last_layers)
        set_quant_stats(model, args.stats)  # the trainer collects them only on logging steps
        set_quant_backend(model, args.kernels)
        runs[name] = (model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    times = {name: [] for name in RECIPES}
    shares = {name: [] for name in RECIPES}
    faults = {name: [] for name in RECIPES}
    with timing_quantizers(args.kernels) as spent:
        for round_index in range(args.repeats + 1):
            for name, (model, optimizer) in runs.items():
                quantizing, faulted = spent[0], _minor_faults()
                start = time.perf_counter()
                _tiny_step(model, optimizer, ids, round_index + 1)
                if round_index:  # round 0 warms up
                    times[name].append(time.perf_counter() - start)
                    shares[name].append((spent[0] - quantizing) / times[name][-1])
                    faults[name].append(_minor_faults() - faulted)
    return (
        {name: statistics.median(t) for name, t in times.items()},
        {name: statistics.median(s) for name, s in shares.items()},
        {name: statistics.median(f) for name, f in faults.items()},
    )


def time_run(args) -> None:
    """Every step of one run: a step much slower than the median would be a recompile."""
    vocab = get_model_config("tiny").vocab_size
    ids = torch.randint(0, vocab, (args.batch, args.seq_len + 1), generator=torch.Generator().manual_seed(1))
    model, _, knobs = build_tiny(args.recipe, args.tiny_bf16_last_layers)
    set_quant_backend(model, args.kernels)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times = []
    for step in range(1, args.run_steps + 1):
        set_quant_stats(model, step % args.stats_interval == 0)
        start = time.perf_counter()
        _tiny_step(model, optimizer, ids, step)
        times.append(time.perf_counter() - start)
    rest = times[1:]
    median = statistics.median(rest)
    slowest = max(range(len(rest)), key=rest.__getitem__)
    label = args.recipe + (f" ({', '.join(f'{k}={v}' for k, v in knobs.items())})" if knobs else "")
    print(
        f"\n## {label}: {args.run_steps} training steps of the tiny model, {args.batch}x{args.seq_len} tokens, "
        f"statistics every {args.stats_interval} steps"
    )
    print("| step 1 s | median s (steps 2+) | slowest step | slowest s | slowest / median |")
    print("|---|---|---|---|---|")
    print(f"| {times[0]:.3f} | {median:.3f} | {slowest + 2} | {rest[slowest]:.3f} | {rest[slowest] / median:.2f}x |")


def profile_step(args) -> None:
    """torch.profiler over one tiny-model step of ``--recipe`` (after three warm-up steps): where
    an FP4 recipe's time goes, op by op, against the same table for bf16; then the Python function
    calls of a step, the interpreter's share of that time."""
    import cProfile
    import pstats

    from torch.profiler import ProfilerActivity, profile

    vocab = get_model_config("tiny").vocab_size
    ids = torch.randint(0, vocab, (args.batch, args.seq_len + 1), generator=torch.Generator().manual_seed(1))
    model, _, knobs = build_tiny(args.recipe, args.tiny_bf16_last_layers)
    set_quant_stats(model, False)
    set_quant_backend(model, args.kernels)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for step in range(1, 4):
        _tiny_step(model, optimizer, ids, step)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _tiny_step(model, optimizer, ids, 4)
    print(f"\n## profile of one {args.recipe} step of the tiny model, {args.batch}x{args.seq_len} tokens")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.profile_rows))
    steps = range(5, 10)
    calls = cProfile.Profile()
    with calls:
        for step in steps:
            _tiny_step(model, optimizer, ids, step)
    per_step = pstats.Stats(calls).total_calls / len(steps)
    print(f"Python function calls a step (cProfile, steps {steps[0]}-{steps[-1]}): {per_step:,.0f}")


def _linear_inputs(model: nn.Module, ids: torch.Tensor) -> dict[str, tuple[int, ...]]:
    """fqn -> input shape of every ``nn.Linear`` (QuantLinear included) in one forward of ``model``."""
    shapes = {}

    def record(fqn: str):
        def hook(module, args) -> None:
            shapes.setdefault(fqn, tuple(args[0].shape))

        return hook

    handles = [
        module.register_forward_pre_hook(record(fqn))
        for fqn, module in model.named_modules()
        if isinstance(module, nn.Linear)
    ]
    with torch.no_grad():
        model(ids)
    for handle in handles:
        handle.remove()
    return shapes


def time_linears(args) -> dict[str, tuple[int, float, float, float, float]]:
    """recipe -> (FP4 linears, median seconds of their forward + backward, of the same through the
    custom ops, of the same linears in bf16, of the quantizers' share) for every FP4 recipe (see the
    docstring: ``--linears``)."""
    vocab = get_model_config("tiny").vocab_size
    ids = torch.randint(0, vocab, (args.batch, args.seq_len), generator=torch.Generator().manual_seed(1))
    models = {}
    for name in RECIPES:
        model, table, _ = build_tiny(name, args.tiny_bf16_last_layers)
        set_quant_stats(model, args.stats)
        set_quant_backend(model, args.kernels)
        models[name] = (model, [row.fqn for row in table.rows if row.kind == "fp4"])
    shapes = _linear_inputs(models["bf16"][0], ids)
    g = torch.Generator().manual_seed(2)
    inputs = {}
    for fqn, shape in shapes.items():
        out_features = models["bf16"][0].get_submodule(fqn).out_features
        inputs[fqn] = (
            torch.randn(shape, generator=g).requires_grad_(),
            torch.randn(*shape[:-1], out_features, generator=g),
        )

    def through_ops(linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The FP4 linear called through its custom ops, as compiled graphs and dispatch modes call it."""
        return register_ops().forward(
            x,
            linear.weight,
            linear.bias,
            linear.quant_state,
            True,
            x.dtype,
            x.requires_grad,
            linear.weight.requires_grad,
        )[0]

    def run(model: nn.Module, fqns: list[str], step: int, ops: bool = False) -> float:
        set_step(model, step)
        start = time.perf_counter()
        for fqn in fqns:
            x, dy = inputs[fqn]
            linear = model.get_submodule(fqn)
            (through_ops(linear, x) if ops else linear(x)).backward(dy)
            x.grad = None
        elapsed = time.perf_counter() - start
        model.zero_grad(set_to_none=True)
        return elapsed

    fp4_names = [name for name in RECIPES if models[name][1]]
    times = {name: [] for name in fp4_names}
    op_times = {name: [] for name in fp4_names}
    bf16_times = {name: [] for name in fp4_names}
    shares = {name: [] for name in fp4_names}
    with timing_quantizers(args.kernels) as spent:
        for round_index in range(args.repeats + 1):
            for name in fp4_names:
                model, fqns = models[name]
                quantizing = spent[0]
                fp4 = run(model, fqns, round_index + 1)
                quantizing = spent[0] - quantizing
                ops = run(model, fqns, round_index + 1, ops=True)
                bf16 = run(models["bf16"][0], fqns, round_index + 1)
                if round_index:  # round 0 warms up
                    times[name].append(fp4)
                    op_times[name].append(ops)
                    bf16_times[name].append(bf16)
                    shares[name].append(quantizing)
    return {
        name: (
            len(models[name][1]),
            statistics.median(times[name]),
            statistics.median(op_times[name]),
            statistics.median(bf16_times[name]),
            statistics.median(shares[name]),
        )
        for name in fp4_names
    }


def print_linears(args) -> None:
    linears = time_linears(args)
    print(
        f"\n## the tiny model's FP4 linears alone, {args.batch}x{args.seq_len} tokens, forward + backward "
        f"(median of {args.repeats})"
    )
    print(
        "| recipe | FP4 linears | FP4 ms | through the custom ops ms | same linears in bf16 ms | vs bf16 | FP4 adds ms "
        "| of which quantizing ms |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, (count, fp4, ops, bf16, quantizing) in linears.items():
        print(
            f"| {name} | {count} | {fp4 * 1e3:.1f} | {ops * 1e3:.1f} | {bf16 * 1e3:.1f} | {fp4 / bf16:.2f}x "
            f"| {(fp4 - bf16) * 1e3:.1f} | {quantizing * 1e3:.1f} |"
        )


def time_linear(args) -> dict[str, float]:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(args.linear_tokens, args.width, generator=g)
    dy = torch.randn(args.linear_tokens, args.width, generator=g)
    runs = {name: build_linear(name, args.width)[0] for name in RECIPES}
    for model in runs.values():
        set_quant_stats(model, args.stats)
        set_quant_backend(model, args.kernels)
    times = {name: [] for name in RECIPES}
    for round_index in range(args.repeats + 1):
        for name, model in runs.items():
            set_step(model, round_index + 1)
            xi = x.clone().requires_grad_()
            start = time.perf_counter()
            model(xi).backward(dy)
            if round_index:
                times[name].append(time.perf_counter() - start)
            model.zero_grad(set_to_none=True)
    return {name: statistics.median(t) for name, t in times.items()}


# ----------------------------------------------------------------------------------- memory
@contextmanager
def saved_tensor_accounting(model: nn.Module):
    """Yields {module fqn or '(other)': bytes} of tensors saved for backward, unique storages."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: set[int] = set()
    totals: dict[str, int] = {}
    stack: list[str] = []
    handles = []
    for fqn, module in model.named_modules():
        if isinstance(module, nn.Linear):
            handles.append(module.register_forward_pre_hook(lambda m, a, fqn=fqn: stack.append(fqn) and None))
            handles.append(module.register_forward_hook(lambda m, a, o: stack.pop() and None))

    def pack(t: torch.Tensor):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params and ptr not in seen:
            seen.add(ptr)
            owner = stack[-1] if stack else "(other)"
            totals[owner] = totals.get(owner, 0) + t.untyped_storage().nbytes()
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield totals
    finally:
        for handle in handles:
            handle.remove()


def memory(build, inputs) -> dict[str, tuple[int, int, dict[str, int]]]:
    """recipe -> (all saved bytes, bytes saved inside linears, per-linear bytes)."""
    out = {}
    for name in RECIPES:
        model, table = build(name)
        set_step(model, 1)
        with saved_tensor_accounting(model) as totals, torch.autocast("cpu", dtype=torch.bfloat16):
            result = model(inputs)
        del result
        linears = {k: v for k, v in totals.items() if k != "(other)"}
        fp4 = {row.fqn for row in table.rows if row.kind == "fp4"}
        out[name] = (sum(totals.values()), sum(linears.values()), linears, fp4)
    return out


def _fp4_ratio(mem, name) -> str:
    _, _, linears, fp4 = mem[name]
    if not fp4:
        return "-"
    bf16_linears = mem["bf16"][2]
    ours = sum(linears.get(f, 0) for f in fp4)
    theirs = sum(bf16_linears.get(f, 0) for f in fp4)
    return f"{theirs / ours:.2f}x"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--linear-tokens", type=int, default=1024)
    parser.add_argument("--memory-tokens", type=int, default=64)
    parser.add_argument("--tiny-bf16-last-layers", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--kernels",
        choices=list(BACKENDS),
        default="auto",
        help="FP4 kernels backend, as train.kernels (eager: the torch program run op by op)",
    )
    parser.add_argument(
        "--stats",
        action="store_true",
        help="collect quantization statistics every step (the trainer does so only on logging steps)",
    )
    parser.add_argument("--run-steps", type=int, default=0, help="time every step of one run of this many steps")
    parser.add_argument("--recipe", choices=RECIPES, default="ue5m3", help="the recipe of --run-steps")
    parser.add_argument("--stats-interval", type=int, default=50, help="statistics steps of --run-steps")
    parser.add_argument(
        "--keep-freed-memory",
        action="store_true",
        help="glibc's malloc keeps freed memory (mallopt), to measure what page faults cost",
    )
    parser.add_argument("--profile", action="store_true", help="profile one tiny-model step of --recipe instead")
    parser.add_argument("--profile-rows", type=int, default=25, help="ops listed by --profile")
    parser.add_argument("--linears", action="store_true", help="time the tiny model's FP4 linears alone instead")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    if args.keep_freed_memory:
        keep_freed_memory()
    print(
        f"# torch {torch.__version__}, {platform.processor() or platform.machine()}, threads={args.threads}, "
        f"kernels={args.kernels}, THP_MEM_ALLOC_ENABLE={os.environ.get('THP_MEM_ALLOC_ENABLE', 'unset')}, "
        f"{'freed memory kept (mallopt), ' if args.keep_freed_memory else ''}"
        f"load average {os.getloadavg()[0]:.2f}"
    )
    if args.run_steps:
        time_run(args)
        return
    if args.profile:
        profile_step(args)
        return
    if args.linears:
        print_linears(args)
        return

    tiny_time, tiny_share, tiny_faults = time_tiny(args)
    linear_time = time_linear(args)
    vocab = get_model_config("tiny").vocab_size
    tiny_ids = torch.randint(0, vocab, (args.batch, args.seq_len), generator=torch.Generator().manual_seed(3))
    tiny_mem = memory(lambda n: build_tiny(n, args.tiny_bf16_last_layers)[:2], tiny_ids)
    linear_mem = memory(lambda n: build_linear(n, args.width), torch.randn(args.memory_tokens, args.width))

    print(f"\n## tiny model, {args.batch}x{args.seq_len} tokens, training step (median of {args.repeats})")
    print(
        "| recipe | FP4 linears | step s | vs bf16 | quantizing | page faults | saved MiB (all) | saved MiB (linears) "
        "| FP4 linears vs bf16 |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name in RECIPES:
        _, table, knobs = build_tiny(name, args.tiny_bf16_last_layers)
        total, lin, _, _ = tiny_mem[name]
        label = name + (f" ({', '.join(f'{k}={v}' for k, v in knobs.items())})" if knobs else "")
        print(
            f"| {label} | {table.count('fp4')} | {tiny_time[name]:.3f} | {tiny_time[name] / tiny_time['bf16']:.2f}x | "
            f"{tiny_share[name]:.0%} | {tiny_faults[name]:.0f} | {total / 2**20:.2f} | {lin / 2**20:.2f} | {_fp4_ratio(tiny_mem, name)} |"
        )
    print(
        f"\n## one {args.width}x{args.width} linear, {args.linear_tokens} tokens, forward+backward "
        f"(memory at {args.memory_tokens} tokens)"
    )
    print("| recipe | fwd+bwd s | vs bf16 | saved KiB | vs bf16 |")
    print("|---|---|---|---|---|")
    for name in RECIPES:
        total = linear_mem[name][0]
        print(
            f"| {name} | {linear_time[name]:.3f} | {linear_time[name] / linear_time['bf16']:.2f}x | "
            f"{total / 2**10:.1f} | {_fp4_ratio(linear_mem, name) if name != 'bf16' else '1.00x'} |"
        )


if __name__ == "__main__":
    main()
