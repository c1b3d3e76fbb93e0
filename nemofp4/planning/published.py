"""Published, measured training runs the step-cost model is checked against: each run's own model,
GPUs, parallelism, sequence length and batch, its measured throughput and where it is published.
They are the test of the model, never its data: no efficiency in :mod:`nemofp4.planning.efficiency`
is fitted to them."""

from __future__ import annotations

from dataclasses import dataclass

from nemofp4.models import NemotronHConfig, get_model_config
from nemofp4.recipes import get_recipe
from nemofp4.training.parallel import DistributedConfig

from .cost import step_cost
from .devices import get_device
from .efficiency import get_efficiency

__all__ = ["PUBLISHED_RUNS", "SPEED_UPS", "PublishedRun", "llama3_8b", "predict"]

MEGATRON_BRIDGE = (
    "NVIDIA-NeMo/Megatron-Bridge docs/performance-summary.md, 25.11 NeMo Container, "
    "commit 00b7660be0254ac6f95f44164ddd0c3e9cc798ed"
)
TORCHTITAN = (
    "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Table 1, "
    "commit 31a17bfdb70bab6f62a13d21816a5339b911d6e3"
)
TORCHTITAN_OP_SAC = (("k_proj", 1.0), ("o_proj", 1.0), ("gate_up_proj", 0.5))
"""TorchTitan's ``selective_ac_option = 'op'`` (train_configs/llama3_8b.toml and parallelize_llama.py's
``_save_list`` at its benchmark's commit 9dec370): a block saves every op's output of its save list (matmuls,
flash attention) except every second matmul, and recomputes the rest. Its block's matmuls in forward order are
wq, wk, wv, wo, w1, w3, w2: wk, wo and w3 are recomputed, w3 being half of our fused gate_up_proj."""
MEGATRON_H100_RECOMPUTED_LAYERS = 5
"""Megatron-Bridge's H100 FP8-CS Llama 3 8B recipe (Megatron-Bridge/scripts/performance/configs/llama/
llama3_workload_base_configs.py at the commit above): ``recompute_num_layers=5`` with full granularity and the
block method (Megatron-Bridge/scripts/performance/utils/overrides.py): the first 5 of its 32 layers recompute in
backward."""


def llama3_8b() -> NemotronHConfig:
    """Llama 3 (3.1) 8B in our layer language: 32 blocks of attention then a SwiGLU MLP, d 4096, FFN
    14,336, 32 query and 8 KV heads of 128, vocabulary 128,256, untied head (Meta's config.json of
    meta-llama/Meta-Llama-3-8B)."""
    return get_model_config(
        "nemotron_h_8b",
        hybrid_layer_pattern="*-" * 32,
        hidden_size=4096,
        ffn_hidden_size=14336,
        mlp_activation="swiglu",
        num_attention_heads=32,
        num_key_value_heads=8,
        attention_head_dim=128,
        vocab_size=128256,
        max_position_embeddings=8192,
    )


@dataclass(frozen=True, kw_only=True)
class PublishedRun:
    """One published, measured training run, as its source states it."""

    name: str
    source: str
    device: str
    """Our device preset closest to the run's GPUs."""
    gpus: int
    recipe: str
    """Our recipe running the run's precision (fp8_te: Transformer Engine's FP8 current scaling)."""
    parallelism: str
    """As the source says: FSDP (sharded), DDP (replicated)."""
    seq_len: int
    global_batch: int
    micro_batch: int
    activation_checkpointing: str
    attention_kernel: str
    """``cudnn`` (Megatron's Transformer Engine attention) or ``sdpa`` (PyTorch's flash SDPA)."""
    compiled: bool
    """Elementwise kernels fused (torch.compile, or Megatron's and Transformer Engine's fused kernels) rather
    than launched op by op (eager PyTorch)."""
    recompute_linears: tuple[tuple[str, float], ...] = ()
    """An op-level selective checkpointing policy (:func:`nemofp4.planning.cost.step_cost`)."""
    recomputed_layers: int = 0
    """Megatron's full recompute of its first n transformer layers (two of our blocks each)."""
    framework: str
    """``megatron`` (Megatron-Core: a fused Adam, and data-parallel buffers its parameters and gradients are views
    of) or ``torchtitan`` (torch's AdamW with its foreach default, and FSDP2, which copies around its
    collectives)."""
    measured_tokens_per_s_per_gpu: float

    @property
    def grad_accum(self) -> int:
        return self.global_batch // (self.micro_batch * self.gpus)


PUBLISHED_RUNS: tuple[PublishedRun, ...] = (
    PublishedRun(
        name="Llama 3 8B FP8-CS, DGX-H100",
        source=MEGATRON_BRIDGE,
        framework="megatron",
        device="h100",
        gpus=8,
        recipe="fp8_te",
        parallelism="FSDP",
        seq_len=8192,
        global_batch=128,
        micro_batch=1,
        activation_checkpointing="none",
        attention_kernel="cudnn",
        compiled=True,
        recomputed_layers=MEGATRON_H100_RECOMPUTED_LAYERS,
        measured_tokens_per_s_per_gpu=14451,
    ),
    PublishedRun(
        name="Llama 3 8B FP8-CS, DGX-B200",
        source=MEGATRON_BRIDGE,
        framework="megatron",
        device="b200",
        gpus=8,
        recipe="fp8_te",
        parallelism="DDP",
        seq_len=8192,
        global_batch=128,
        micro_batch=2,
        activation_checkpointing="none",
        attention_kernel="cudnn",
        compiled=True,
        measured_tokens_per_s_per_gpu=30624,
    ),
    PublishedRun(
        name="Llama 3 8B FP8-CS, DGX-GB200",
        source=MEGATRON_BRIDGE,
        framework="megatron",
        device="gb200",
        gpus=8,
        recipe="fp8_te",
        parallelism="DDP",
        seq_len=8192,
        global_batch=128,
        micro_batch=2,
        activation_checkpointing="none",
        attention_kernel="cudnn",
        compiled=True,
        measured_tokens_per_s_per_gpu=31508,
    ),
    PublishedRun(
        name="Llama 3.1 8B BF16, FSDP, eager",
        source=TORCHTITAN,
        framework="torchtitan",
        device="h100_hbm2e_500w",
        gpus=8,
        recipe="bf16",
        parallelism="FSDP",
        seq_len=8192,
        global_batch=16,
        micro_batch=2,
        activation_checkpointing="none",
        attention_kernel="sdpa",
        compiled=False,
        recompute_linears=TORCHTITAN_OP_SAC,
        measured_tokens_per_s_per_gpu=5762,
    ),
    PublishedRun(
        name="Llama 3.1 8B BF16, FSDP, torch.compile",
        source=TORCHTITAN,
        framework="torchtitan",
        device="h100_hbm2e_500w",
        gpus=8,
        recipe="bf16",
        parallelism="FSDP",
        seq_len=8192,
        global_batch=16,
        micro_batch=2,
        activation_checkpointing="none",
        attention_kernel="sdpa",
        compiled=True,
        recompute_linears=TORCHTITAN_OP_SAC,
        measured_tokens_per_s_per_gpu=6667,
    ),
    PublishedRun(
        name="Llama 3.1 8B FP8 (torchao), FSDP, torch.compile",
        source=TORCHTITAN,
        framework="torchtitan",
        device="h100_hbm2e_500w",
        gpus=8,
        recipe="fp8_te",
        parallelism="FSDP",
        seq_len=8192,
        global_batch=16,
        micro_batch=2,
        activation_checkpointing="none",
        attention_kernel="sdpa",
        compiled=True,
        recompute_linears=TORCHTITAN_OP_SAC,
        measured_tokens_per_s_per_gpu=8532,
    ),
)
"""The runs. No Megatron-Bridge or NeMo performance summary has a BF16 row for Llama 3 8B (every release's 8B
rows are FP8: Megatron-Bridge's docs/performance-summary.md and its archive, 25.09 to 26.08, NeMo's 24.07 to
25.07 tables); the BF16-over-FP8 comparison is TorchTitan's. TorchTitan's H100s are 500 W HBM2e parts, planned on
their own preset (``h100_hbm2e_500w``), with its op-level selective checkpointing (:data:`TORCHTITAN_OP_SAC`)
and, for its torch.compile rows, fused elementwise kernels. Megatron's runs use Transformer Engine's fused
kernels (planned as fused) and, on the Blackwells, CUDA graphs (their launch cost is planned as eager's)."""


SPEED_UPS: tuple[tuple[str, str], ...] = (
    ("Llama 3.1 8B BF16, FSDP, torch.compile", "Llama 3.1 8B FP8 (torchao), FSDP, torch.compile"),
)
"""(BF16 run, FP8 run) pairs measured alike but for the precision: their FP8-over-BF16 speed-up, measured and
predicted (the only such pair published: no BF16 Megatron row, see :data:`PUBLISHED_RUNS`)."""


def predict(run: PublishedRun, *, efficiency: str = "achieved") -> dict[str, float]:
    """The step-cost model's prediction for ``run``: tokens/s per GPU end to end and of the model body, MFU."""
    model = llama3_8b()
    replicate = run.gpus if run.parallelism == "DDP" else 1
    dist_cfg = DistributedConfig(
        backend="fsdp",
        activation_checkpointing=run.activation_checkpointing,
        replicate_degree=replicate,
        compile=run.compiled,
    )
    device = get_device(run.device)
    cost = step_cost(
        model,
        get_recipe(run.recipe),
        dist_cfg,
        world_size=run.gpus,
        seq_len=run.seq_len,
        micro_batch=run.micro_batch,
        grad_accum=run.grad_accum,
        head_precision="bf16",
        gpus_per_node=device.gpus_per_node,
        attention_kernel=run.attention_kernel,
        recompute_linears=run.recompute_linears,
        recompute_blocks=tuple(range(2 * run.recomputed_layers)),
        optimizer="fused" if run.framework == "megatron" else "foreach",
        fsdp_copies=run.framework == "torchtitan",
    )
    p = cost.project(device, cost.configured, get_efficiency(efficiency, run.device))
    return {
        "tokens_per_s_per_gpu": cost.tokens / p.step_s,
        "body_tokens_per_s_per_gpu": p.body_tokens_per_s,
        "mfu": p.mfu,
        "step_s": p.step_s,
    }
