"""Loader: batch layout, exact resume (also across data-parallel sizes), fingerprints, blending, caching."""

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from nemofp4.data import (
    CorruptDataError,
    DataConfig,
    DataSourceConfig,
    build_train_loader,
    build_validation_batches,
    write_indexed_dataset,
)
from nemofp4.data.config import as_data_config
from nemofp4.data.paths import REPO_ROOT

SEQ, GLOBAL, SAMPLES = 32, 8, 160


def write_source(prefix, seed, count=60, low=1, high=8000):
    rng = np.random.default_rng(seed)
    docs = [rng.integers(low, high, size=int(rng.integers(5, 80))) for _ in range(count)]
    write_indexed_dataset(prefix, docs, np.uint16)
    return docs


@pytest.fixture
def cfg(tmp_path):
    write_source(tmp_path / "a", 0)
    write_source(tmp_path / "b", 1)
    return DataConfig(
        sources=[
            DataSourceConfig(prefix=str(tmp_path / "a"), weight=0.75, name="a"),
            DataSourceConfig(prefix=str(tmp_path / "b"), weight=0.25, name="b"),
        ],
        validation_fraction=0.2,
        cache_dir=str(tmp_path / "cache"),
    )


def loader(cfg, dp_rank=0, dp_size=1, micro=4, seed=0, seq_len=SEQ, global_batch=GLOBAL):
    return build_train_loader(
        cfg,
        seq_len=seq_len,
        global_batch=global_batch,
        micro_batch=micro,
        num_samples=SAMPLES,
        seed=seed,
        dp_rank=dp_rank,
        dp_size=dp_size,
    )


def global_batches(loaders, steps=None):
    """Reassemble global batches from the per-rank micro-batches of every rank."""
    per_rank = [list(ld) for ld in loaders]
    m = loaders[0].micro_batches_per_step
    n_steps = len(per_rank[0]) // m if steps is None else steps
    return [
        torch.cat([mb["input_ids"] for rank in per_rank for mb in rank[s * m : (s + 1) * m]]) for s in range(n_steps)
    ]


def test_batches_shape_and_shifted_labels(cfg):
    ld = loader(cfg)
    batches = list(ld)
    assert len(batches) == SAMPLES // GLOBAL * 2 == len(loader(cfg))
    for b in batches:
        assert b["input_ids"].shape == (4, SEQ) and b["input_ids"].dtype == torch.long
        assert torch.equal(b["input_ids"][:, 1:], b["labels"][:, :-1])
    assert ld.consumed_samples == SAMPLES


def same(batches_a, batches_b):
    return len(batches_a) == len(batches_b) and all(torch.equal(a, b) for a, b in zip(batches_a, batches_b))


def test_same_global_batches_for_any_dp_size_and_micro_batch(cfg):
    reference = global_batches([loader(cfg)])
    assert same(global_batches([loader(cfg, micro=8)]), reference)
    assert same(global_batches([loader(cfg, r, 2, micro=2) for r in range(2)]), reference)
    assert not same(global_batches([loader(cfg, seed=1)]), reference)


@pytest.mark.parametrize("resume_dp_size", [1, 2, 4])
def test_resume_after_n_batches_is_exact_across_dp_sizes(cfg, resume_dp_size):
    uninterrupted = global_batches([loader(cfg)])
    first = loader(cfg)
    it = iter(first)
    for _ in range(5 * first.micro_batches_per_step):
        next(it)
    state = first.state_dict()
    assert state["consumed_samples"] == 5 * GLOBAL
    resumed = [loader(cfg, r, resume_dp_size, micro=8 // resume_dp_size // 2 or 1) for r in range(resume_dp_size)]
    for ld in resumed:
        ld.load_state_dict(state)
    assert same(global_batches(resumed), uninterrupted[5:])


def test_state_mid_step_and_fingerprint_mismatch_are_errors(cfg):
    ld = loader(cfg)
    it = iter(ld)
    next(it)
    with pytest.raises(ValueError, match="between optimizer steps"):
        ld.state_dict()
    next(it)
    state = ld.state_dict()
    with pytest.raises(ValueError, match="seed: saved 0, now 1"):
        loader(cfg, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="seq_len: saved 32, now 16"):
        loader(cfg, seq_len=16).load_state_dict(state)
    with pytest.raises(ValueError, match="global_batch"):
        loader(cfg, global_batch=16).load_state_dict(state)
    cfg.sources[0].weight = 0.5
    with pytest.raises(ValueError, match="data: saved"):
        loader(cfg).load_state_dict(state)


def test_blend_proportions_and_holdout(cfg, tmp_path):
    ld = loader(cfg)
    blend = ld.micro_batches.blend
    counts = np.bincount(np.asarray(blend.dataset_index), minlength=2)
    assert counts.tolist() == [120, 40]
    # validation documents never appear in training samples: check via the sample index
    for packed in blend.datasets:
        used = np.unique(np.asarray(packed.document_index))
        from nemofp4.data.datasets import holdout_mask

        assert not holdout_mask(used, 0.2, 0).any()
    val = build_validation_batches(cfg, seq_len=SEQ, num_sequences=10, batch_size=4)
    assert [b["input_ids"].shape[0] for b in val] == [4, 4, 2]
    again = build_validation_batches(cfg, seq_len=SEQ, num_sequences=10, batch_size=4)
    assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(val, again))


def test_index_cache_is_reused_and_deterministic(cfg, tmp_path):
    loader(cfg)
    files = sorted((tmp_path / "cache").rglob("*.npy"))
    before = {f: f.read_bytes() for f in files}
    mtimes = {f: f.stat().st_mtime_ns for f in files}
    loader(cfg)
    assert sorted((tmp_path / "cache").rglob("*.npy")) == files
    assert all(f.stat().st_mtime_ns == mtimes[f] for f in files)  # loaded, not rebuilt
    cfg.cache_dir = str(tmp_path / "cache2")
    loader(cfg)
    after = {f.relative_to(tmp_path / "cache2"): f.read_bytes() for f in (tmp_path / "cache2").rglob("*.npy")}
    assert after == {f.relative_to(tmp_path / "cache"): b for f, b in before.items()}


def test_worker_processes_give_the_same_batches(cfg):
    plain = [b["input_ids"] for b in loader(cfg)]
    cfg.num_workers = 2
    workers = [b["input_ids"] for b in loader(cfg)]
    assert same(plain, workers)


def test_token_ids_beyond_vocabulary_are_named_when_served(tmp_path):
    write_source(tmp_path / "bad", 0, low=9000, high=9001)
    cfg = DataConfig(sources=[DataSourceConfig(prefix=str(tmp_path / "bad"))], cache_dir=str(tmp_path / "c"))
    ld = loader(cfg)
    with pytest.raises(CorruptDataError, match=r"bad\.bin: document \d+ holds token id 9000"):
        next(iter(ld))


def test_bad_configurations_are_named(cfg):
    cfg.sources[0].weight = cfg.sources[1].weight = 0.0
    with pytest.raises(ValueError, match="must sum to a positive number"):
        loader(cfg)
    with pytest.raises(ValueError, match="multiple of dp_size"):
        build_train_loader(DataConfig(), seq_len=8, global_batch=6, micro_batch=4, num_samples=60, seed=0)
    with pytest.raises(ValueError, match="no validation documents"):
        build_validation_batches(
            DataConfig(sources=[DataSourceConfig(prefix="data/tokens/austen_train")]),
            seq_len=8,
            num_sequences=1,
            batch_size=1,
        )


def test_shipped_default_needs_no_preprocessing(tmp_path):
    cfg = DataConfig(cache_dir=str(tmp_path / "cache"))
    ld = build_train_loader(cfg, seq_len=64, global_batch=4, micro_batch=2, num_samples=40, seed=0)
    batch = next(iter(ld))
    assert batch["input_ids"].max() < 8192
    val = build_validation_batches(cfg, seq_len=64, num_sequences=8, batch_size=4)
    assert len(val) == 2


@pytest.mark.parametrize("name", ["tiny", "olmo_mix_189b"])
def test_data_yaml_validates_against_the_schema(name):
    node = OmegaConf.load(REPO_ROOT / "configs" / "data" / f"{name}.yaml")
    cfg = as_data_config(node)
    cfg.check()
    assert isinstance(cfg.sources[0], DataSourceConfig)
    if name == "olmo_mix_189b":
        assert cfg.seq_len == 8192 and len(cfg.sources) == 7


def test_explicit_cpu_device_gives_the_same_batches(cfg):
    assert same(
        [b["labels"] for b in loader(cfg)],
        [
            b["labels"]
            for b in build_train_loader(
                cfg, seq_len=SEQ, global_batch=GLOBAL, micro_batch=4, num_samples=SAMPLES, seed=0, device="cpu"
            )
        ],
    )


@pytest.mark.gpu
def test_cuda_prefetch_gives_the_same_batches(cfg):
    host = [b["input_ids"] for b in loader(cfg)]
    ld = build_train_loader(
        cfg, seq_len=SEQ, global_batch=GLOBAL, micro_batch=4, num_samples=SAMPLES, seed=0, device="cuda"
    )
    device = [b["input_ids"] for b in ld]
    assert all(d.is_cuda for d in device)
    assert same(host, [d.cpu() for d in device])
