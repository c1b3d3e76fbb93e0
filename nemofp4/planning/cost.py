"""The step-cost model: FLOPs, quantizer traffic and collective bytes of one optimizer step per rank,
and the step time and MFU they project on a device given by its peak numbers.

FLOPs count every multiply-add of a matmul-like op as 2, as ``torch.utils.flop_counter`` does (a
test holds the two together on the tiny model and on an 8B slice): linears 6 T K N (forward, dgrad,
wgrad), attention 4 + 10 B H L^2 d (SDPA forward, and its backward with the score recompute, no
causal discount), the chunked SSD scan's four matmuls and the depthwise conv, three times their
forward, the LM head 6 T D V (8 T D V chunked: the backward recomputes the logits), and the forward
of every block activation checkpointing recomputes. Quantization is elementwise and memory-bound:
counted as elements through the quantizer and HBM bytes.

The projection is a roofline: each component at its peak (linears and the scan at the BF16 peak,
Transformer Engine's GEMMs at the FP4 or FP8 peak on hardware that runs their recipe natively, the
head at its precision's; attention at half its FLOPs, as a causal flash kernel skips masked tiles),
quantization at HBM bandwidth, collectives at the link bandwidth (NVLink inside an NVLink domain, the
scale-out NIC beyond), overlapped with compute as FSDP2 prefetches. A lower bound on the step time:
real kernels reach a fraction of peak. With achieved efficiencies (:mod:`nemofp4.planning.efficiency`,
``nemofp4-plan``'s default) each term is divided by its kernels' measured fraction of peak (a GEMM's by its
size and precision), and the elementwise kernels, the optimizer step and the kernel launches are added, the
launches and the eager elementwise bytes counted from our code path (:mod:`nemofp4.planning.launches`).

Overlap: the GPU runs compute, quantizer passes, elementwise kernels, FSDP2's copy-out of gathered parameters
and accumulation of kept gradients, the optimizer step and the launches one after another (one stream);
collectives and FSDP2's copies into their buffers run on their own streams beside them (FSDP2's prefetch, DDP's
bucketed all-reduce), so the step is the larger of the two sums, plus the collectives nothing overlaps (the
root group's all-gather before each micro-batch's first op and its reduction after the step's last).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from nemofp4.models import NemotronHConfig
from nemofp4.models.loss import check_head_precision, head_keeps_fp32_parameters
from nemofp4.quant import TE_RECIPES
from nemofp4.recipes import Recipe, runs_in_transformer_engine
from nemofp4.training.parallel import DistributedConfig, checkpointed_blocks

from .devices import Device
from .efficiency import PEAK, Efficiency
from .launches import count_block_launches, optimizer_step_bytes
from .layers import LinearSpec, head_is_fp32_part, linear_specs
from .te_linear import HADAMARD_FLOPS_PER_ELEMENT, te_quantizations

__all__ = [
    "COMPONENTS",
    "BODY_COMPONENTS",
    "FSDP_COPIES",
    "Projection",
    "QuantPass",
    "StepCost",
    "block_forward_flops",
    "step_cost",
]

COMPONENTS = ("linear GEMMs", "attention", "SSD scan", "head and loss", "recompute")
BODY_COMPONENTS = ("linear GEMMs", "attention", "SSD scan", "recompute")
"""The model body's: everything but the embedding, the LM head and loss, the optimizer and communication."""
QUANT_BYTES_PER_ELEMENT = 12.5
"""HBM bytes per quantized operand element on the Triton path: the BF16 input read (2), the FP32
scaled values written (4), packed codes and scales (0.5625), and the GEMM's read of the scaled values
and their BF16 copy (6)."""
FP8_CODE_EXTRA_BYTES = 0.5
"""What an emulated FP8 operand element adds to :data:`QUANT_BYTES_PER_ELEMENT`: its code is a byte where
E2M1's is half of one."""
HADAMARD_REFERENCE_BYTES_PER_ELEMENT = 10
"""The emulated recipes' current amax of a transformed wgrad operand: the token-major tensor read and its
transpose written (4), the transform read and written (4), the amax's read (2), in BF16."""
ROLES = ("x", "w", "dy_dgrad", "dy_wgrad", "x_wgrad")
FSDP_COPIES = {
    "all-gather copy-in": "collectives",
    "all-gather copy-out": "compute",
    "reduce-scatter copy-in": "collectives",
    "gradient accumulation": "compute",
}
"""FSDP2's copies around its collectives and the stream each runs on: the shard cast and copied into the
all-gather's buffer, and the unsharded gradients into the reduce-scatter's, on the collectives' streams; the
gathered buffer copied out into the parameters, and the gradients kept across micro-batches upcast and
accumulated (``gradient_sync=per_step``), on the compute stream."""


def _elementwise_elements(model: NemotronHConfig, block_type: str) -> float:
    """Elements read and written per token by one block's elementwise kernels, forward and backward, fused as
    ``torch.compile`` (or Transformer Engine's and Megatron's fused kernels) runs them, each reading its inputs
    and writing its outputs once: the pre-norm (forward read and write, backward two reads and a write) and
    the residual add (three each way), 11 x d; rotary embedding on q and k (a read and a write each way);
    the MLP's activation (relu2 5 x F, SwiGLU 8 x F); the Mamba mixer's conv activation, gate, gated norm
    and skip (5 x conv width + 12.5 x inner width)."""
    d = model.hidden_size
    out = 11.0 * d
    if block_type == "attention":
        out += 4.0 * (model.num_attention_heads + model.num_key_value_heads) * model.attention_head_dim
    elif block_type == "mlp":
        out += (8.0 if model.mlp_activation == "swiglu" else 5.0) * model.ffn_hidden_size
    elif block_type == "mamba":
        out += 5.0 * model.mamba_conv_dim + 12.5 * model.mamba_intermediate_size
    return out


@dataclass(frozen=True, kw_only=True)
class QuantPass:
    """A pass over memory a quantizer makes, ``count`` times per step on this rank."""

    role: str
    """The operand role it serves (:data:`ROLES`)."""
    nbytes: float
    """HBM bytes read and written."""
    hadamard_flops: float
    """FLOPs of the random Hadamard transform in it."""
    count: float
    hadamard_only: bool = False
    """The pass exists only for the transform (without the RHT it is not made)."""
    emulated: bool = False
    """A pass of the emulated quantizer (:data:`QUANT_BYTES_PER_ELEMENT` per element)."""
    elements: float = 0.0
    """Operand elements an emulated pass quantizes."""
    tn_only: bool = False
    """Transformer Engine's per-tensor FP8 transpose: written only on a device whose FP8 GEMMs are TN-only
    (:attr:`Device.fp8_gemm_any_layout` false)."""
    launches: int = 1
    """Kernels the pass starts each time (an emulated pass is one kernel; Transformer Engine's:
    :attr:`nemofp4.planning.te_linear.TEPass.launches`)."""

    def seconds(self, device: Device) -> float:
        """Roofline: the larger of its memory and its transform time, ``count`` times."""
        if self.tn_only and device.fp8_gemm_any_layout:
            return 0.0
        return self.count * max(
            self.nbytes / (device.hbm_tb_s * 1e12), self.hadamard_flops / (device.matmul_tflops("bf16") * 1e12)
        )

    def hadamard_seconds(self, device: Device) -> float:
        """What the transform adds: the whole pass if it exists for it, else its FLOPs' excess over its
        memory time."""
        if self.hadamard_only:
            return self.seconds(device)
        return max(0.0, self.seconds(device) - self.count * self.nbytes / (device.hbm_tb_s * 1e12))


def _attention_forward(model: NemotronHConfig, batch: int, seq_len: int) -> float:
    return 4.0 * batch * model.num_attention_heads * seq_len * seq_len * model.attention_head_dim


def _ssd_forward(model: NemotronHConfig, batch: int, seq_len: int) -> float:
    """The chunked scan's matmuls (C B^T, scores x values, chunk states, state to output) and the conv."""
    q = min(model.chunk_size, seq_len)
    length = -(-seq_len // q) * q  # padded to whole chunks
    g, n, h, p = model.mamba_num_groups, model.ssm_state_size, model.mamba_num_heads, model.mamba_head_dim
    scan = 2.0 * batch * length * (g * q * n + h * q * p + 2 * h * p * n)
    conv = 2.0 * batch * seq_len * model.mamba_conv_dim * model.conv_kernel
    return scan + conv


def block_forward_flops(model: NemotronHConfig, recipe: Recipe, *, batch: int, seq_len: int) -> list[float]:
    """Forward FLOPs of each block for one micro-batch (what activation checkpointing recomputes)."""
    tokens = batch * seq_len
    flops = [0.0] * model.num_layers
    for spec in linear_specs(model, recipe):
        if spec.layer is not None:
            flops[spec.layer] += 2.0 * tokens * spec.in_features * spec.out_features
    for i, t in enumerate(model.layer_types):
        if t.block_type == "attention":
            flops[i] += _attention_forward(model, batch, seq_len)
        elif t.block_type == "mamba":
            flops[i] += _ssd_forward(model, batch, seq_len)
    return flops


@dataclass(frozen=True, kw_only=True)
class Projection:
    """Step time and MFU of a :class:`StepCost` on one device and layout."""

    device: Device
    layout: str
    compute_s: dict[str, float]
    quant_s: float
    comm_s: float
    step_s: float
    mfu: float
    exposed_comm_s: float = 0.0
    """Of ``comm_s``: what no compute overlaps (:attr:`StepCost.exposed`), added to the step."""
    quant_s_by_role: dict[str, float] = field(default_factory=dict)
    """Of ``quant_s``: each operand role's passes."""
    hadamard_s: float = 0.0
    """Of ``quant_s``: what the random Hadamard transform adds (:meth:`QuantPass.hadamard_seconds`)."""
    body_s: float = 0.0
    """The model body's time: ``compute_s`` of :data:`BODY_COMPONENTS` plus ``quant_s`` (no head and
    loss, optimizer or communication)."""
    body_tokens_per_s: float = 0.0
    """This rank's tokens over ``body_s``."""


@dataclass(frozen=True, kw_only=True)
class StepCost:
    """One optimizer step on one rank."""

    world_size: int
    tokens: int
    """Tokens this rank trains on per step (micro_batch x seq_len x grad_accum)."""
    flops: dict[str, float]
    """By :data:`COMPONENTS`."""
    precision: dict[str, str]
    """The GEMM precision each component runs in ('bf16', 'fp32', 'tf32'), Transformer Engine's aside."""
    native_flops: dict[str, dict[str, float]] = field(default_factory=dict)
    """Of the linear GEMMs and of the recompute (by component), the FLOPs Transformer Engine runs natively,
    by its recipe (:data:`nemofp4.quant.TE_RECIPES`): at its GEMMs' FP4 or FP8 peak on a device that runs
    the recipe, else at the BF16 peak."""
    quantized_elements: float
    """Operand elements through the emulated quantizer (forward, recompute and backward)."""
    quant_passes: tuple[QuantPass, ...] = ()
    """Every quantizer pass of the step (emulated and Transformer Engine's), by role."""
    collectives: dict[str, dict[str, float]]
    """Layout name -> collective -> bytes this rank sends per step (ring algorithms)."""
    layouts: dict[str, tuple[int, int]]
    """Layout name -> (replicate, shard) group sizes."""
    configured: str
    """The layout the config trains with (``distributed.replicate_degree``)."""
    model_flops: float
    """The trainer's MFU numerator for this rank's tokens (``NemotronHConfig.flops_per_token``)."""
    recompute_by_policy: dict[str, float] = field(default_factory=dict)
    gemm_shapes: tuple[tuple[float, float, float, float], ...] = ()
    """(M, K, N, FLOPs per step) of the body's linear GEMMs, forward shape per micro-batch: their achieved
    efficiency (:meth:`Efficiency.gemm_fraction`) is FLOP-weighted over them."""
    head_shape: tuple[float, float, float] = (1.0, 1.0, 1.0)
    """(M, K, N) of the LM head's forward GEMM (per micro-batch, or per chunk when chunked)."""
    elementwise_bytes: float = 0.0
    """HBM bytes of the step's elementwise kernels outside the GEMMs and quantizers (norms, residual adds,
    activations, rotary embedding, the Mamba mixer's gates, the loss' softmax), forward and backward, in
    the compute dtype; counted only with achieved efficiencies (the roofline leaves them out)."""
    optimizer_bytes: float = 0.0
    """HBM bytes of the gradient clipping and the AdamW step over this rank's shard, counted from torch's
    implementation (:func:`nemofp4.planning.launches.optimizer_step_bytes`)."""
    exposed: dict[str, dict[str, float]] = field(default_factory=dict)
    """By layout, of :attr:`collectives`, the bytes no compute overlaps: the root group's all-gather before each
    micro-batch's first op (the embedding's), and its reduction after the step's last backward op."""
    fsdp_copy_bytes: dict[str, dict[str, float]] = field(default_factory=dict)
    """By layout, HBM bytes FSDP2 copies around its collectives, by copy (:data:`FSDP_COPIES`); counted only with
    achieved efficiencies."""
    kernels: float = 0.0
    """Kernel launches of the step: each block's, counted from our code path
    (:func:`nemofp4.planning.launches.count_block_launches`), eager or compiled."""
    attention_kernel: str = "sdpa"
    """The attention kernel the run uses (:attr:`Efficiency.attention`)."""

    @property
    def total_flops(self) -> float:
        return sum(self.flops.values())

    def native_by_recipe(self) -> dict[str, float]:
        """:attr:`native_flops` of the linear GEMMs and the recompute together, by TE recipe."""
        out: dict[str, float] = {}
        for by_recipe in self.native_flops.values():
            for recipe, flops in by_recipe.items():
                out[recipe] = out.get(recipe, 0.0) + flops
        return out

    @property
    def fp4_native_flops(self) -> float:
        """Of :attr:`native_flops`, those of FP4 GEMMs (TE's NVFP4)."""
        return sum(f for recipe, f in self.native_by_recipe().items() if TE_RECIPES[recipe].gemm == "fp4")

    def native_precision(self, te_recipe: str, device: Device) -> str:
        """The peak a Transformer Engine recipe's GEMMs run at on ``device``: its GEMMs' precision where
        the device runs the recipe, else BF16."""
        return TE_RECIPES[te_recipe].gemm if device.runs(te_recipe) else "bf16"

    def linear_fraction(self, efficiency: Efficiency, precision: str = "bf16") -> float:
        """The FLOP-weighted achieved fraction of ``precision``'s peak of the body's linear GEMMs (harmonic: time
        adds)."""
        total = sum(f for *_, f in self.gemm_shapes)
        if efficiency is PEAK or not total:
            return 1.0
        return total / sum(f / efficiency.gemm_fraction(m, k, n, precision) for m, k, n, f in self.gemm_shapes)

    def project(self, device: Device, layout: str, efficiency: Efficiency = PEAK) -> Projection:
        """Step time and MFU on ``device`` in ``layout``: with :data:`~nemofp4.planning.efficiency.PEAK`
        the roofline; with achieved efficiencies each component's time over its kernels' fraction of peak,
        plus the elementwise kernels, the optimizer step and the launches (module docstring)."""
        if layout not in self.collectives:
            raise ValueError(f"layout={layout!r}; valid: {', '.join(self.collectives)}")
        achieved = efficiency is not PEAK
        fraction = {
            "linear GEMMs": self.linear_fraction(efficiency),
            "recompute": self.linear_fraction(efficiency),
            "attention": efficiency.attention[self.attention_kernel],
            "SSD scan": efficiency.scan,
            "head and loss": efficiency.gemm_fraction(*self.head_shape) if achieved else 1.0,
        }
        compute = {}
        for name, flops in self.flops.items():
            precision = self.precision[name]
            if name == "attention":
                flops = flops / 2  # causal: the flash kernel skips the masked half
            seconds = 0.0
            for recipe, native in self.native_flops.get(name, {}).items():  # TE's GEMMs, at its recipe's peak here
                native_precision = self.native_precision(recipe, device)
                seconds += (
                    native / device.matmul_tflops(native_precision) / self.linear_fraction(efficiency, native_precision)
                )
                flops -= native
            compute[name] = (seconds + flops / device.matmul_tflops(precision) / fraction[name]) / 1e12
        hbm = device.hbm_tb_s * 1e12 * efficiency.hbm
        if achieved:
            compute["elementwise"] = self.elementwise_bytes / hbm
            compute["optimizer"] = self.optimizer_bytes / hbm
            compute["kernel launches"] = self.kernels * efficiency.launch_s
        copies = self.fsdp_copy_bytes.get(layout, {}) if achieved else {}
        on_compute = sum(nbytes for name, nbytes in copies.items() if FSDP_COPIES[name] == "compute")
        if on_compute:
            compute["FSDP copies"] = on_compute / hbm
        by_role = dict.fromkeys(ROLES, 0.0)
        hadamard = 0.0
        for p in self.quant_passes:
            by_role[p.role] += p.seconds(device) / efficiency.hbm
            hadamard += p.hadamard_seconds(device) / efficiency.hbm
        quant = sum(by_role.values())
        body = sum(compute.get(name, 0.0) for name in (*BODY_COMPONENTS, "elementwise")) + quant
        _, shard = self.layouts[layout]

        def link_seconds(collectives: dict[str, float]) -> float:
            seconds = 0.0
            for collective, nbytes in collectives.items():
                # the ranks a collective spans: the shard group, or every rank for the all-reduce across replicas
                spanned = self.world_size if collective == "all-reduce" else shard
                if spanned <= device.nvlink_domain:
                    link = device.nvlink_gb_s * efficiency.link
                else:
                    link = device.scale_out_gb_s * efficiency.scale_out
                seconds += nbytes / (link * 1e9)
            return seconds

        comm = link_seconds(self.collectives[layout])
        comm += sum(nbytes for name, nbytes in copies.items() if FSDP_COPIES[name] == "collectives") / hbm
        exposed = link_seconds(self.exposed.get(layout, {})) if achieved else 0.0
        step = max(sum(compute.values()) + quant, comm - exposed) + exposed
        mfu = self.model_flops / (step * device.bf16_tflops * 1e12)
        return Projection(
            device=device,
            layout=layout,
            compute_s=compute,
            quant_s=quant,
            comm_s=comm,
            exposed_comm_s=exposed,
            step_s=step,
            mfu=mfu,
            quant_s_by_role=by_role,
            hadamard_s=hadamard,
            body_s=body,
            body_tokens_per_s=self.tokens / body if body else 0.0,
        )


def _fsdp_groups(
    model: NemotronHConfig, recipe: Recipe, *, head_precision: str, param_bytes: int
) -> list[tuple[str, int, int]]:
    """(group, parameters, bytes per gathered parameter) of each FSDP2 group: every block, the LM
    head (FP32 parameters when the recipe's head part is FP32 and it computes in FP32/TF32, else the
    compute dtype), and the root (embedding and final norm)."""
    groups = []
    from nemofp4.models import build_model

    meta = build_model(model, device="meta")
    for i, block in enumerate(meta.layers):
        groups.append((f"layers.{i}", sum(p.numel() for p in block.parameters()), param_bytes))
    if not model.tie_word_embeddings:
        keeps_fp32 = head_keeps_fp32_parameters(head_precision, fp32_part=head_is_fp32_part(model, recipe))
        head_bytes = 4 if keeps_fp32 else param_bytes
        groups.append(("lm_head", meta.lm_head.weight.numel(), head_bytes))
    root = sum(p.numel() for p in meta.embeddings.parameters()) + sum(p.numel() for p in meta.norm_f.parameters())
    groups.append(("root", root, param_bytes))
    return groups


def _traffic(
    groups, *, replicate: int, shard: int, grad_accum: int, dist_cfg: DistributedConfig, keep_head_gathered: bool
) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
    """A layout's collective bytes per rank, the HBM bytes of FSDP2's copies around them (:data:`FSDP_COPIES`),
    and the collective bytes nothing overlaps (:attr:`StepCost.exposed`).

    Each all-gather copies this rank's shard in (the FP32 shard cast to the gathered dtype, then copied into the
    buffer) and the gathered buffer out into the parameters; each reduce-scatter copies the unsharded gradients
    in, cast to the reduce dtype; with ``gradient_sync=per_step`` the gradients of the micro-batches that do not
    reduce are upcast to the reduce dtype and accumulated (``foreach_all_gather``, ``foreach_all_gather_copy_out``,
    ``foreach_reduce_scatter_copy_in`` and ``FSDPParam.to_accumulated_grad_if_needed`` of torch's FSDP2). A
    layout with unsharded parameters gathers nothing."""
    reduce_bytes = 4 if dist_cfg.reduce_dtype == "float32" else 2
    ring = (shard - 1) / shard
    gather = scatter = reduce = gather_in = gather_out = scatter_in = accumulate = 0.0
    exposed: dict[str, float] = {}
    reductions = grad_accum if dist_cfg.gradient_sync == "per_micro_batch" else 1
    for name, numel, nbytes in groups:
        per_micro = 1
        # every group, the root too, is resharded after forward and gathered again for backward
        kept = (name == "lm_head" and keep_head_gathered) or not dist_cfg.reshard_after_forward
        if not kept:
            per_micro += 1  # gathered again for backward
        gathers = per_micro * grad_accum
        gather += ring * numel * nbytes * gathers
        scatter += ring * numel * reduce_bytes * reductions
        if replicate > 1:
            reduce += 2 * (replicate - 1) / replicate * numel / shard * reduce_bytes * reductions
        if name == "root":  # the embedding's: gathered before each forward's first op, reduced after the last
            exposed["all-gather"] = ring * numel * nbytes * grad_accum
            exposed["reduce-scatter"] = ring * numel * reduce_bytes
            if replicate > 1:
                exposed["all-reduce"] = 2 * (replicate - 1) / replicate * numel / shard * reduce_bytes
        if shard > 1:
            # gradients kept across micro-batches are upcast to the reduce dtype, then added to, by FSDP2's hook
            upcast = reductions < grad_accum and reduce_bytes != nbytes
            cast = 4 + nbytes if nbytes != 4 else 0  # the FP32 shard read, its cast written
            gather_in += numel / shard * (cast + 2 * nbytes) * gathers
            gather_out += 2 * numel * nbytes * gathers
            scatter_in += numel * ((reduce_bytes if upcast else nbytes) + reduce_bytes) * reductions
            if upcast:
                accumulate += numel * ((nbytes + reduce_bytes) + (grad_accum - 1) * (nbytes + 2 * reduce_bytes))
    out = {"all-gather": gather, "reduce-scatter": scatter}
    if replicate > 1:
        out["all-reduce"] = reduce
    copies = {
        "all-gather copy-in": gather_in,
        "all-gather copy-out": gather_out,
        "reduce-scatter copy-in": scatter_in,
        "gradient accumulation": accumulate,
    }
    return out, copies, exposed


def _current(op) -> bool:
    """The operand's tensor amax is measured at every quantization (a held one is measured once in D steps)."""
    return op.uses_tensor_reference and op.reference_interval == 0


def _quant_passes(
    spec: LinearSpec, tokens: int, *, forward_count: int, backward_count: int, weight_count: int | None = None
) -> list[QuantPass]:
    """The quantizer passes of one linear, per step: its forward's ``forward_count`` times (activation
    checkpointing recomputes it), its backward's ``backward_count`` times; an emulated FP4 weight's
    (W, and a 1-D weight's W^T) ``weight_count`` times when given (``train.weight_cache``: once)."""
    k, n = spec.in_features, spec.out_features
    if runs_in_transformer_engine(spec.part):
        return [
            QuantPass(
                role=p.role,
                nbytes=p.nbytes,
                hadamard_flops=p.hadamard_flops,
                hadamard_only=p.hadamard_only,
                tn_only=p.tn_only,
                launches=p.launches,
                count=forward_count if q.phase == "forward" else backward_count,
            )
            for q in te_quantizations(tokens, k, n, spec.part)
            for p in q.passes()
        ]
    if spec.kind != "fp4":
        return []
    config = spec.part
    per_element = QUANT_BYTES_PER_ELEMENT + (FP8_CODE_EXTRA_BYTES if config.precision == "fp8" else 0.0)

    def emulated(role: str, elements: float, count: int, *, hadamard: bool = False, only: bool = False) -> QuantPass:
        flops = elements * HADAMARD_FLOPS_PER_ELEMENT if hadamard else 0.0
        return QuantPass(
            role=role,
            nbytes=elements * per_element,
            hadamard_flops=flops,
            count=count,
            hadamard_only=only,
            emulated=True,
            elements=elements,
        )

    def reference(role: str, elements: float, count: int) -> QuantPass:  # the transformed copy's current amax
        return QuantPass(
            role=role,
            nbytes=elements * HADAMARD_REFERENCE_BYTES_PER_ELEMENT,
            hadamard_flops=elements * HADAMARD_FLOPS_PER_ELEMENT,
            count=count,
            hadamard_only=True,
        )

    out = [
        emulated("x", tokens * k, forward_count),
        emulated("w", n * k, weight_count or forward_count),
    ]  # X (with X^T without RHT)
    if config.x_wgrad.hadamard:  # X^T quantized on its own, through the transform
        out.append(emulated("x_wgrad", tokens * k, forward_count, hadamard=True, only=True))
        if _current(config.x_wgrad):
            out.append(reference("x_wgrad", tokens * k, forward_count))
    out.append(emulated("dy_dgrad", tokens * n, backward_count))
    out.append(emulated("dy_wgrad", tokens * n, backward_count, hadamard=config.dy_wgrad.hadamard))
    if config.dy_wgrad.hadamard and _current(config.dy_wgrad):
        out.append(reference("dy_wgrad", tokens * n, backward_count))
    if not config.w.two_d:  # W^T quantized afresh for dgrad
        out.append(emulated("w", n * k, weight_count or backward_count))
    return out


def step_cost(
    model: NemotronHConfig,
    recipe: Recipe,
    dist_cfg: DistributedConfig,
    *,
    world_size: int,
    seq_len: int,
    micro_batch: int,
    grad_accum: int,
    head_chunk_tokens: int = 0,
    head_precision: str = "fp32",
    keep_head_gathered: bool = False,
    gpus_per_node: int = 8,
    compute_dtype: str = "bfloat16",
    policies: tuple[str, ...] = (),
    weight_cache: bool = True,
    attention_kernel: str = "sdpa",
    recompute_linears: tuple[tuple[str, float], ...] = (),
    recompute_blocks: tuple[int, ...] = (),
    optimizer: str = "foreach",
    fsdp_copies: bool = True,
) -> StepCost:
    """The cost of one optimizer step per rank (see the module docstring). ``head_precision``: how the
    LM head's GEMMs compute (fp32, tf32 or bf16); ``keep_head_gathered``: the head and final norm stay
    gathered from forward to backward. The HSDP layout shards within ``gpus_per_node`` ranks and
    replicates across nodes; ``policies`` adds the recompute FLOPs of other checkpointing policies;
    ``weight_cache``: each emulated FP4 weight quantized once per step (``train.weight_cache``).
    ``recompute_linears``: an op-level selective checkpointing policy, as (linear name, share of its forward
    GEMM) that every block the block policy leaves stored recomputes in backward, with the forward's
    elementwise ops (TorchTitan's ``selective_ac_option="op"``: every second matmul and every elementwise op);
    ``recompute_blocks``: blocks (by index) recomputed whole besides the checkpointing policy's (Megatron's
    ``recompute_num_layers`` with the block method). ``optimizer``: how AdamW runs its step
    (:data:`~nemofp4.planning.launches.ADAMW_IMPLEMENTATIONS`); ``fsdp_copies``: the sharded layouts copy
    parameters and gradients around their collectives as FSDP2 does (false: a data-parallel implementation whose
    parameters and gradients are views of its communication buffers, as Megatron's are).
    ``dist_cfg.compile``: the elementwise kernels fused (else each op's bytes as eager PyTorch moves them)."""
    check_head_precision(head_precision)
    tokens = micro_batch * seq_len
    specs = linear_specs(model, recipe)
    linear = 0.0
    native: dict[str, dict[str, float]] = {"linear GEMMs": {}, "recompute": {}}
    passes: list[QuantPass] = []
    forward = block_forward_flops(model, recipe, batch=micro_batch, seq_len=seq_len)
    chosen = checkpointed_blocks(dist_cfg.activation_checkpointing, [t.block_type for t in model.layer_types])
    chosen = [c or i in recompute_blocks for i, c in enumerate(chosen)]
    op_recompute = dict(recompute_linears)
    selective = 0.0  # the op-level policy's recomputed GEMM FLOPs, per micro-batch
    for spec in specs:
        if spec.layer is None:
            continue
        gemm = 6.0 * tokens * spec.in_features * spec.out_features
        linear += gemm
        share = 0.0 if chosen[spec.layer] else op_recompute.get(spec.fqn.rsplit(".", 1)[-1], 0.0)
        selective += share * gemm / 3
        if runs_in_transformer_engine(spec.part):  # its GEMMs, and its recompute's forward GEMM
            te_recipe = spec.part.te_recipe
            recomputed = gemm / 3 if chosen[spec.layer] else share * gemm / 3
            for component, flops in (("linear GEMMs", gemm), ("recompute", recomputed)):
                if flops:
                    native[component][te_recipe] = native[component].get(te_recipe, 0.0) + flops
        # the weight cache: a round-to-nearest FP4 weight quantized once per step, its recompute reading the cache
        once = weight_cache and grad_accum > 1 and spec.kind == "fp4" and spec.part.w.rounding == "rne"
        passes += _quant_passes(
            spec,
            tokens,
            forward_count=(2 if chosen[spec.layer] else 1) * grad_accum,
            backward_count=grad_accum,
            weight_count=1 if once else None,
        )
    attention = ssd = 0.0
    for t in model.layer_types:
        if t.block_type == "attention":
            attention += 3.5 * _attention_forward(model, micro_batch, seq_len)
        elif t.block_type == "mamba":
            ssd += 3.0 * _ssd_forward(model, micro_batch, seq_len)
    head = (8.0 if head_chunk_tokens > 0 else 6.0) * tokens * model.hidden_size * model.vocab_size
    compute_bytes = 2 if compute_dtype == "bfloat16" else 4
    elementwise = kernels = 0.0
    for i, t in enumerate(model.layer_types):
        counted = count_block_launches(
            model, t.block_type, micro_batch=micro_batch, seq_len=seq_len, compute_dtype=compute_dtype
        )
        forward_share = (
            counted.forward_eager_elementwise_bytes / counted.eager_elementwise_bytes
            if counted.eager_elementwise_bytes
            else 0.0
        )
        block = (
            _elementwise_elements(model, t.block_type) * tokens * compute_bytes
            if dist_cfg.compile
            else counted.eager_elementwise_bytes
        )
        recomputed = chosen[i] or bool(op_recompute)  # a checkpointed block, or the op-level policy's
        elementwise += block * (1 + forward_share) if recomputed else block
        kernels += counted.compiled_kernels if dist_cfg.compile else counted.eager_kernels
        if recomputed:  # the recompute launches the forward's kernels again
            kernels += counted.forward_compiled_kernels if dist_cfg.compile else counted.forward_eager_kernels
    elementwise += (
        4.0 * 4 * tokens * model.vocab_size
    )  # the loss: FP32 logits' softmax read, written, read, gradient written
    gemm_shapes = tuple(
        (
            float(tokens),
            float(s.in_features),
            float(s.out_features),
            6.0 * tokens * s.in_features * s.out_features * grad_accum,
        )
        for s in specs
        if s.layer is not None
    )
    head_rows = min(head_chunk_tokens, tokens) if head_chunk_tokens > 0 else tokens
    kernels *= grad_accum
    kernels += sum(p.launches * p.count for p in passes)  # the quantizers' (their counts are per step)
    recompute = sum(f for f, c in zip(forward, chosen) if c) + selective
    flops = {
        "linear GEMMs": linear,
        "attention": attention,
        "SSD scan": ssd,
        "head and loss": head,
        "recompute": recompute,
    }
    flops = {k: v * grad_accum for k, v in flops.items()}
    precision = {
        "linear GEMMs": "bf16",
        "attention": "bf16",
        "SSD scan": "bf16",
        "head and loss": head_precision,
        "recompute": "bf16",
    }
    block_types = [t.block_type for t in model.layer_types]
    recompute_by_policy = {
        p: grad_accum * sum(f for f, c in zip(forward, checkpointed_blocks(p, block_types)) if c) for p in policies
    }
    param_bytes = 2 if compute_dtype == "bfloat16" else 4
    groups = _fsdp_groups(model, recipe, head_precision=head_precision, param_bytes=param_bytes)
    nodes = max(1, world_size // gpus_per_node)
    layouts = {"FSDP": (1, world_size)}
    for replicate in (nodes, dist_cfg.replicate_degree):  # HSDP across nodes, and the configured one
        if 1 < replicate < world_size and world_size % replicate == 0:
            layouts[f"HSDP {replicate}x{world_size // replicate}"] = (replicate, world_size // replicate)
    if world_size > 1 and dist_cfg.replicate_degree == world_size:  # replicated, unsharded: DDP's all-reduce
        layouts["DDP"] = (world_size, 1)
    traffic = {
        name: _traffic(
            groups,
            replicate=r,
            shard=s,
            grad_accum=grad_accum,
            dist_cfg=dist_cfg,
            keep_head_gathered=keep_head_gathered,
        )
        for name, (r, s) in layouts.items()
    }
    collectives = {name: bytes_ for name, (bytes_, _, _) in traffic.items()}
    copies = {name: copied if fsdp_copies else dict.fromkeys(copied, 0.0) for name, (_, copied, _) in traffic.items()}
    exposed = {name: bytes_ for name, (_, _, bytes_) in traffic.items()}
    replicate = dist_cfg.replicate_degree
    configured = (
        "FSDP"
        if replicate == 1
        else "DDP"
        if replicate == world_size
        else f"HSDP {replicate}x{world_size // replicate}"
    )
    shard = world_size // replicate if world_size % replicate == 0 else world_size
    optimizer_bytes = optimizer_step_bytes(optimizer) * model.num_parameters() / shard
    return StepCost(
        world_size=world_size,
        tokens=tokens * grad_accum,
        flops=flops,
        precision=precision,
        configured=configured,
        native_flops={
            component: {recipe: flops * grad_accum for recipe, flops in by_recipe.items()}
            for component, by_recipe in native.items()
            if by_recipe
        },
        quantized_elements=sum(p.count * p.elements for p in passes),
        quant_passes=tuple(passes),
        collectives=collectives,
        layouts=layouts,
        model_flops=model.flops_per_token(seq_len) * tokens * grad_accum,
        recompute_by_policy=recompute_by_policy,
        gemm_shapes=gemm_shapes,
        head_shape=(float(head_rows), float(model.hidden_size), float(model.vocab_size)),
        elementwise_bytes=elementwise * grad_accum,
        optimizer_bytes=optimizer_bytes,
        fsdp_copy_bytes=copies,
        exposed=exposed,
        kernels=kernels,
        attention_kernel=attention_kernel,
    )
