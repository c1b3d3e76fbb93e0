"""Transformer Engine's NVFP4 linear as the planner models it without TE: its FP4 operands are the
emulated ``nvfp4`` recipe's (same roles, GEMMs, shapes, packed sizes, transforms and rounding), the
stand-in allocates and saves what ``te.Linear`` does, a plan of ``nvfp4_te`` runs where TE is not
installed, and the cost model charges its quantizer passes and the Hadamard transform per role."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from nemofp4.models import get_model_config
from nemofp4.planning import get_device, step_cost
from nemofp4.planning.ablation import recipe_ablation
from nemofp4.planning.te_linear import (
    HADAMARD_FLOPS_PER_ELEMENT,
    te_linear_operands,
    te_quantizations,
)
from nemofp4.quant import QuantLinear, set_step
from nemofp4.recipes import get_recipe
from nemofp4.training.parallel import DistributedConfig

TOKENS, K, N = 128, 256, 128  # eligible for TE's fused RHT cast (rows % 64, cols % 128)


def _emulated_operands(disable_rht: bool) -> dict[tuple[str, int], object]:
    """(GEMM, operand position) -> the QuantizedBlocks the emulated nvfp4 linear multiplies, and
    whether each was read transposed."""
    config = get_recipe("nvfp4", disable_rht=disable_rht).parts["fp4"]
    layer = QuantLinear.from_linear(nn.Linear(K, N, bias=False), config)
    layer.quant_backend = "eager"
    set_step(layer, 1)
    layer._capture = []
    x = torch.randn(TOKENS, K, requires_grad=True)
    layer(x).backward(torch.randn(TOKENS, N))
    out = {}
    for name, qa, qb, b_transposed, _ in layer._capture:
        out[(name, 0)] = (qa, False)
        out[(name, 1)] = (qb, b_transposed)
    return out, config


@pytest.mark.parametrize("disable_rht", [False, True])
def test_te_operands_are_the_emulated_nvfp4_operands(disable_rht):
    emulated, config = _emulated_operands(disable_rht)
    part = get_recipe("nvfp4_te", disable_rht=disable_rht).parts["fp4"]
    te = te_linear_operands(TOKENS, K, N, part)
    position = {"x": 0, "w": 1, "dy_dgrad": 0, "dy_wgrad": 0, "x_wgrad": 1}
    assert sorted((op.gemm, position[op.role]) for op in te) == sorted(emulated)
    for op in te:
        q, transposed = emulated[(op.gemm, position[op.role])]
        shape = tuple(reversed(q.shape)) if transposed else tuple(q.shape)
        assert shape == op.shape, op
        assert math.prod(q.padded_shape) // 2 == op.code_bytes, op  # packed E2M1 codes
        tiles = 16 if q.two_d else 1  # a 16x16 tile's scale stands for 16 of TE's per-row block scales
        assert q.scale_codes.numel() * tiles == op.blocks and q.block_size == 16 and q.scale_format == "e4m3", op
        emulated_op = config.operand(op.role)
        assert (emulated_op.hadamard, emulated_op.rounding != "rne", q.two_d) == (
            op.hadamard,
            op.stochastic,
            op.two_d,
        ), op
    # TE keeps X^T for wgrad; under FSDP2 it re-quantizes W in backward rather than keep it
    assert [op.role for op in te if op.saved] == ["x_wgrad"]


def test_nvfp4_te_is_measured_without_transformer_engine():
    """The plan's block measurements of nvfp4_te (what ``nemofp4-plan`` adds up; the docs test runs the
    command itself): each FP4 block keeps what the emulated nvfp4's keeps, less W and with TE's padding."""
    from nemofp4.planning.layers import linear_specs
    from nemofp4.planning.measure import measure_blocks
    from nemofp4.quant import transformer_engine_status

    if transformer_engine_status()[0]:
        pytest.skip("Transformer Engine is usable here")
    model, tokens = get_model_config("tiny"), 128
    te_recipe, emulated_recipe = (
        get_recipe("nvfp4_te", num_bf16_last_layers=0),
        get_recipe("nvfp4", num_bf16_last_layers=0),
    )
    te, emulated = (
        measure_blocks(model, r, seq_len=tokens, micro_batch=1, dtype=torch.bfloat16)
        for r in (te_recipe, emulated_recipe)
    )
    part = te_recipe.parts["fp4"]
    specs = linear_specs(model, te_recipe)
    assert te and all(block.quantized_linears for block in te)
    for te_block, emu_block in zip(te, emulated, strict=True):
        assert (te_block.kind, te_block.layers, te_block.quantized_linears) == (
            emu_block.kind,
            emu_block.layers,
            emu_block.quantized_linears,
        )
        # the emulation keeps X^T (codes, a scale per block, tensor scale and amax) and W's 16x16 tiles
        # (zero-padded to whole tiles); TE keeps X^T (codes, padded scales, amax) alone
        difference = 0
        for s in (s for s in specs if s.layer == te_block.layers[0]):
            k, n = s.in_features, s.out_features
            emulated_xt = k * tokens // 2 + k * tokens // 16 + 8
            tiles = math.ceil(n / 16) * math.ceil(k / 16)
            emulated_w = tiles * 16 * 16 // 2 + tiles + 8
            difference += emulated_xt + emulated_w - te_linear_operands(tokens, k, n, part)[-1].nbytes
        # to a few bytes per linear: what the emulated linear's own state creates in forward (its amaxes)
        assert 0 <= emu_block.saved_bytes - te_block.saved_bytes - difference <= 8 * te_block.quantized_linears, (
            te_block.kind
        )


def test_te_quantizer_passes_and_the_hadamard_transform_per_role():
    part = get_recipe("nvfp4_te").parts["fp4"]
    x, w_fwd, w_bwd, dy = te_quantizations(TOKENS, K, N, part)
    assert (x.source, x.phase, w_fwd.phase, w_bwd.phase, dy.phase) == (
        "x",
        "forward",
        "forward",
        "backward",
        "backward",
    )
    passes = x.passes()
    # fused: an amax pass (the transformed copy's amax in the same read) and one cast pass; the transform
    # is computed in both, charged to X^T
    assert sum(p[1] for p in passes) == 2 * TOKENS * K * 2 + sum(c.nbytes for c in x.copies)
    assert {p[0]: p[2] for p in passes if p[2]} == {"x_wgrad": 2 * TOKENS * K * HADAMARD_FLOPS_PER_ELEMENT / 2}
    assert sum(p[2] for p in passes) == 2 * TOKENS * K * HADAMARD_FLOPS_PER_ELEMENT
    # unfused (rows not a multiple of 64): the BF16 transform of the transpose is written and read back
    unfused = te_quantizations(100, K, N, part)[0].passes()
    extra = [p for p in unfused if p[3]]
    assert len(extra) == 1 and extra[0][0] == "x_wgrad" and extra[0][1] == 3 * 100 * K * 2
    # without the RHT: no FLOPs, the same bytes as the fused transform's
    plain = te_quantizations(TOKENS, K, N, get_recipe("nvfp4_te", disable_rht=True).parts["fp4"])[0].passes()
    assert sum(p[2] for p in plain) == 0 and sum(p[1] for p in plain) == sum(p[1] for p in passes)


def test_native_fp4_is_costed_per_device_and_the_ablation_splits_the_difference():
    assert get_device("gb200").fp32_tflops == 90 and get_device("b200").fp32_tflops == 80
    assert {d: (get_device(d).fp4_tflops, get_device(d).fp8_tflops) for d in ("h100", "h200", "b200", "gb200")} == {
        "h100": (0, 1979),
        "h200": (0, 1979),
        "b200": (9000, 4500),
        "gb200": (10000, 5000),
    }
    model = get_model_config("nemotron_h_8b_paper")
    step = dict(world_size=64, seq_len=8192, micro_batch=1, grad_accum=2, head_chunk_tokens=1024)
    dist_cfg = DistributedConfig(backend="fsdp", activation_checkpointing="none")
    te = step_cost(model, get_recipe("nvfp4_te"), dist_cfg, **step)
    gb200, h200 = te.project(get_device("gb200"), "FSDP"), te.project(get_device("h200"), "FSDP")
    assert (
        gb200.compute_s["linear GEMMs"]
        < get_device("h200").bf16_tflops / get_device("gb200").fp4_tflops * h200.compute_s["linear GEMMs"] * 1.5
    )
    assert te.quantized_elements == 0 and all(not p.emulated for p in te.quant_passes)
    assert {p.role for p in te.quant_passes} == {"x", "w", "dy_dgrad", "dy_wgrad", "x_wgrad"}
    # the body excludes the head and loss
    assert gb200.body_s == pytest.approx(
        gb200.quant_s + sum(v for k, v in gb200.compute_s.items() if k != "head and loss")
    )
    # emulated: the RHT is a separate X^T quantization and the transformed copies' amax passes
    emulated = step_cost(model, get_recipe("nvfp4"), dist_cfg, **step).project(get_device("h200"), "FSDP")
    plain = step_cost(model, get_recipe("nvfp4", disable_rht=True), dist_cfg, **step).project(
        get_device("h200"), "FSDP"
    )
    assert emulated.quant_s - plain.quant_s == pytest.approx(emulated.hadamard_s) and plain.hadamard_s == 0


@pytest.mark.parametrize("device, recipe", [("gb200", "nvfp4_te"), ("h200", "nvfp4")])
def test_recipe_ablation(device, recipe):
    from nemofp4.cli.train import compose_job_config

    # the preset as docs/planning.md projects it (its own auto would plan the device's policy first)
    job = compose_job_config(["experiment=nemotron_h_8b_nvfp4", "distributed.activation_checkpointing=full"])
    ablation = recipe_ablation(job, device=get_device(device), world_size=64)
    assert ablation.recipe == recipe
    base, no_rht, all_fp4, both = (r.projection.body_s for r in ablation.rows)
    assert [r.fp4_linears for r in ablation.rows] == [96, 96, 112, 112]
    assert ablation.rows[0].hadamard_flops > 0 and ablation.rows[1].hadamard_flops == 0
    shares = ablation.shares()
    assert sum(shares.values()) == pytest.approx(1)
    if recipe == "nvfp4_te":  # fused transform: memory-bound passes it shares; FP4 GEMMs faster than BF16
        assert no_rht == pytest.approx(base) and all_fp4 < base and both == pytest.approx(all_fp4)
    else:  # emulated: every FP4 linear adds quantizer passes to a BF16 GEMM; the RHT adds passes
        assert no_rht < base < all_fp4 and shares["interaction"] > 0
    assert "| both changes | 112 |" in ablation.format()


def test_the_recommendation_names_every_kth_block_in_english():
    from nemofp4.planning.job import _policy_words

    assert [_policy_words(f"every_{k}") for k in (2, 3, 4, 11, 21)] == [
        f"with checkpointing on every {k} block" for k in ("2nd", "3rd", "4th", "11th", "21st")
    ]
