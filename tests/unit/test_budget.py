import pytest

from nemofp4.training.config import TrainConfig, batch_layouts, compute_budget


def test_paper_budget_is_30000_steps_with_accumulation_over_32_ranks():
    train = TrainConfig(tokens=188_743_680_000, seq_len=8192, global_batch=768, micro_batch=1)
    budget = compute_budget(train, dp_size=32)
    assert budget.total_steps == 30_000
    assert budget.grad_accum == 24
    assert budget.tokens_per_step == 768 * 8192
    assert budget.budget_remainder_tokens == 0


def test_budget_that_does_not_divide_is_reported_not_rounded_up():
    train = TrainConfig(tokens=188.7e9, seq_len=8192, global_batch=768, micro_batch=1)
    budget = compute_budget(train, dp_size=32)
    assert budget.total_steps == 29_993  # floor(188.7e9 / 6,291,456) = 29,993.06
    assert budget.budget_remainder_tokens == int(188.7e9) - 29_993 * 768 * 8192


def test_max_steps_caps_the_budget():
    train = TrainConfig(tokens=1e9, seq_len=256, global_batch=16, micro_batch=8, max_steps=40)
    assert compute_budget(train, dp_size=1).total_steps == 40
    assert compute_budget(train, dp_size=1).grad_accum == 2
    assert compute_budget(train, dp_size=2).grad_accum == 1


def test_batch_geometry_that_does_not_divide_names_the_numbers():
    train = TrainConfig(max_steps=10, global_batch=10, micro_batch=4)
    with pytest.raises(ValueError, match=r"global_batch=10 .* 4 x 1"):
        compute_budget(train, dp_size=1)
    with pytest.raises(ValueError, match="less than one step"):
        compute_budget(TrainConfig(tokens=100, seq_len=256, global_batch=16, micro_batch=16), dp_size=1)


def test_missing_budget_is_an_error():
    with pytest.raises(ValueError, match="no budget"):
        compute_budget(TrainConfig(), dp_size=1)


def test_a_batch_that_does_not_divide_names_the_nearest_layouts_that_do():
    """768 sequences on 512 ranks: 384 or 768 ranks divide it, or 512 / 1024 sequences at 512."""
    train = TrainConfig(tokens=188_743_680_000, seq_len=8192, global_batch=768, micro_batch=1)
    with pytest.raises(ValueError) as error:
        compute_budget(train, dp_size=512)
    message = str(error.value)
    assert (
        "nearest world sizes that divide it: 384 (2 micro-batch(es) per rank) or 768 (1 micro-batch(es) per rank)"
        in message
    )
    assert "at 512 ranks: train.global_batch=512 or 1024" in message
    for world in (384, 768):
        assert compute_budget(train, dp_size=world).grad_accum == 768 // world
    assert batch_layouts(train, 512, ranks_per_node=8).startswith(
        "nearest world sizes that divide it: 48 nodes (384 ranks"
    )


def test_a_micro_batch_that_does_not_divide_names_one_that_does():
    with pytest.raises(ValueError, match=r"at 2 ranks: train.global_batch=32, or train.micro_batch=8"):
        compute_budget(TrainConfig(max_steps=10, global_batch=16, micro_batch=16), dp_size=2)
    assert compute_budget(TrainConfig(max_steps=10, global_batch=16, micro_batch=8), dp_size=2).grad_accum == 1
