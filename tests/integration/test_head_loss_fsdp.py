"""The chunked LM-head loss under FSDP2: run through the head's FSDP hooks, it gathers the sharded
head and reduces its gradient exactly as calling the head does (2 gloo ranks, different batches)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from nemofp4.models import build_model, get_model_config
from nemofp4.quant import FP32Linear
from nemofp4.training.parallel import DistributedConfig, parallelize


def _grads(model) -> dict[str, torch.Tensor]:
    return {name: p.grad.full_tensor().clone() for name, p in model.named_parameters()}


def _rank_main(rank: int, world: int, folder: str, fp32_head: bool) -> None:
    dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=world)
    try:
        cfg = get_model_config("tiny", vocab_size=512)
        model = build_model(cfg, device="meta")
        if fp32_head:
            FP32Linear.from_linear(model.lm_head)
        model.to_empty(device="cpu")
        torch.manual_seed(0)
        model.init_weights()
        model = parallelize(model, DistributedConfig(backend="fsdp"), device_type="cpu")
        g = torch.Generator().manual_seed(100 + rank)  # each rank its own batch: the reduction matters
        ids = torch.randint(0, 512, (2, 32), generator=g)
        labels = torch.randint(0, 512, (2, 32), generator=g)
        logits = model(ids)
        plain = F.cross_entropy(logits.float().reshape(-1, 512), labels.reshape(-1))
        plain.backward()
        want = _grads(model)
        model.zero_grad(set_to_none=True)
        hidden = model(ids, return_hidden=True)
        chunked = model.lm_head.chunked_cross_entropy(hidden, labels, chunk_tokens=7)
        chunked.backward()
        got = _grads(model)
        gaps = {name: ((got[name] - want[name]).norm() / want[name].norm()).item() for name in want}
        with open(f"{folder}/rank{rank}.json", "w") as f:
            json.dump({"loss": [plain.item(), chunked.item()], "gaps": gaps}, f)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("fp32_head", [False, True], ids=["model-dtype-head", "fp32-head"])
def test_chunked_head_loss_under_fsdp_matches_calling_the_head(tmp_path, fp32_head):
    mp.spawn(_rank_main, args=(2, str(tmp_path), fp32_head), nprocs=2, join=True)
    for rank in range(2):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        plain, chunked = result["loss"]
        assert chunked == pytest.approx(plain, rel=1e-6)
        assert "lm_head.weight" in result["gaps"]
        assert max(result["gaps"].values()) < 1e-5, result["gaps"]


def _keep_gathered_main(rank: int, world: int, folder: str) -> None:
    """Forward + backward of the chunked loss with and without distributed.keep_head_gathered, counting
    FSDP2's all-gathers in each phase."""
    dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=world)
    counts = {"n": 0}
    all_gather = dist.all_gather_single

    def counting(*args, **kwargs):
        counts["n"] += 1
        return all_gather(*args, **kwargs)

    dist.all_gather_single = counting  # what FSDP2's default all-gather calls
    out = {}
    try:
        for keep in (False, True):
            model = build_model(get_model_config("tiny", vocab_size=512), device="meta")
            model.to_empty(device="cpu")
            torch.manual_seed(0)
            model.init_weights()
            model = parallelize(model, DistributedConfig(backend="fsdp", keep_head_gathered=keep), device_type="cpu")
            g = torch.Generator().manual_seed(100 + rank)
            ids, labels = torch.randint(0, 512, (2, 32), generator=g), torch.randint(0, 512, (2, 32), generator=g)
            phases = []
            for _ in range(2):  # two micro-batches: gathered again in each forward
                counts["n"] = 0
                loss = model.lm_head.chunked_cross_entropy(model(ids, return_hidden=True), labels, chunk_tokens=7)
                phases.append(counts["n"])
                counts["n"] = 0
                loss.backward()
                phases.append(counts["n"])
            out[str(keep)] = {
                "loss": loss.item(),
                "gathers": phases,
                "grads": {
                    n: p.grad.full_tensor().tolist()
                    for n, p in model.named_parameters()
                    if n.startswith(("lm_head", "norm_f", "embeddings"))
                },
            }
        with open(f"{folder}/rank{rank}.json", "w") as f:
            json.dump(out, f)
    finally:
        dist.destroy_process_group()


def test_keep_head_gathered_saves_the_head_and_root_regathers_and_changes_nothing_else(tmp_path):
    """distributed.keep_head_gathered: the head's group and the root (embedding + final norm) are gathered
    once per micro-batch instead of twice (2 all-gathers fewer in each backward), with bit-identical
    losses and gradients; the blocks still reshard after forward."""
    mp.spawn(_keep_gathered_main, args=(2, str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        plain, kept = result["False"], result["True"]
        layers = len(get_model_config("tiny").hybrid_layer_pattern)
        assert plain["gathers"] == [layers + 2, layers + 2] * 2  # blocks, head and root, in each phase
        assert kept["gathers"] == [layers + 2, layers] * 2  # backward re-gathers the blocks only
        assert kept["loss"] == plain["loss"] and kept["grads"] == plain["grads"]
