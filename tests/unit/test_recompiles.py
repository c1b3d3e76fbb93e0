"""Steady-state training compiles nothing new: over 120 ue5m3 steps (held-reference refreshes at
steps 1, 51 and 101, quantization statistics on steps 50 and 100, as a run logging them every 50
steps collects them) no graph is compiled after the first step."""

import pytest
import torch

from nemofp4.kernels import cpu_compile_available
from nemofp4.models import build_model, get_model_config
from nemofp4.quant import set_quant_backend, set_quant_stats, set_step
from nemofp4.recipes import apply_recipe, get_recipe

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS, STATS_INTERVAL = 120, 50


def _small_ue5m3_model(**recipe_knobs):
    config = get_model_config(
        "tiny",
        hybrid_layer_pattern="M*-",
        hidden_size=64,
        ffn_hidden_size=128,
        vocab_size=256,
        mamba_num_heads=4,
        mamba_head_dim=32,
        ssm_state_size=16,
        num_attention_heads=2,
        num_key_value_heads=1,
        attention_head_dim=32,
        chunk_size=16,
    )
    torch.manual_seed(0)
    model = build_model(config, device="cpu")
    model.init_weights()
    apply_recipe(model, get_recipe("ue5m3", **recipe_knobs), log=False)
    set_quant_backend(model, "compiled")
    ids = torch.randint(0, config.vocab_size, (1, 33), generator=torch.Generator().manual_seed(1))
    return model, ids


def _graphs_per_step(model, ids, steps: int, stats_interval: int) -> tuple[int, dict[int, int]]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch._dynamo.reset()  # graphs other tests compiled would make step 1 compile nothing
    counters = torch._dynamo.utils.counters
    graphs_before, graphs_after = counters["stats"]["unique_graphs"], {}
    for step in range(1, steps + 1):
        set_step(model, step, seed=0)
        set_quant_stats(model, step % stats_interval == 0)
        logits = model(ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        graphs_after[step] = counters["stats"]["unique_graphs"]
    assert torch.isfinite(loss)
    return graphs_before, graphs_after


@pytest.mark.skipif(not cpu_compile_available(), reason="needs a C++ compiler for torch.compile")
def test_no_graph_is_compiled_after_the_first_step_of_120():
    model, ids = _small_ue5m3_model()
    graphs_before, graphs_after = _graphs_per_step(model, ids, STEPS, STATS_INTERVAL)
    assert graphs_after[1] > graphs_before, "step 1 compiled nothing: the counter does not see the program"
    new = {step: n - graphs_after[1] for step, n in graphs_after.items() if n != graphs_after[1]}
    assert not new, f"graphs compiled after step 1 (step: how many so far): {new}"


@pytest.mark.skipif(not cpu_compile_available(), reason="needs a C++ compiler for torch.compile")
def test_compiled_blocks_do_not_recompile_across_steps_refreshes_and_statistics():
    """distributed.compile compiles each block (training.parallel.apply_compile): the FP4 linears
    inside must not make dynamo recompile the block as steps, held-reference refreshes (every 2
    steps here) and statistics steps go by."""
    model, ids = _small_ue5m3_model(reference_interval=2)
    for i, block in enumerate(model.layers):
        model.layers[i] = torch.compile(block, fullgraph=False)
    graphs_before, graphs_after = _graphs_per_step(model, ids, 8, 3)
    new = {step: n - graphs_after[1] for step, n in graphs_after.items() if n != graphs_after[1]}
    assert not new, f"graphs compiled after step 1 (step: how many so far): {new}"
