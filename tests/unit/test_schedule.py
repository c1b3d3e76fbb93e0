import math

import pytest

from nemofp4.training.schedule import ScheduleConfig, lr_multiplier


def test_wsd_holds_peak_for_85_percent_then_decays_linearly_to_one_percent():
    cfg = ScheduleConfig(name="wsd", warmup_steps=0, decay_fraction=0.15, min_lr_ratio=0.01)
    total = 30_000
    assert lr_multiplier(cfg, 1, total) == 1.0
    assert lr_multiplier(cfg, 25_500, total) == 1.0  # last step at the peak
    assert lr_multiplier(cfg, total, total) == pytest.approx(0.01, abs=1e-12)
    # linear: halfway through the decay the multiplier is halfway between 1 and 0.01
    assert lr_multiplier(cfg, 25_500 + 2_250, total) == pytest.approx(1 - 0.5 * 0.99, abs=1e-12)
    values = [lr_multiplier(cfg, s, total) for s in range(25_500, total + 1)]
    assert all(a > b for a, b in zip(values, values[1:]))


def test_warmup_is_linear_from_zero():
    cfg = ScheduleConfig(name="wsd", warmup_steps=10)
    assert [lr_multiplier(cfg, s, 100) for s in (1, 5, 10, 11)] == [0.1, 0.5, 1.0, 1.0]


def test_cosine_ends_at_min_ratio():
    cfg = ScheduleConfig(name="cosine", warmup_steps=0, min_lr_ratio=0.1)
    assert lr_multiplier(cfg, 100, 100) == pytest.approx(0.1)
    assert lr_multiplier(cfg, 50, 100) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 0.5)))


def test_bad_schedule_names_the_value():
    with pytest.raises(ValueError, match="'linear'"):
        ScheduleConfig(name="linear")
    with pytest.raises(ValueError, match="1-based"):
        lr_multiplier(ScheduleConfig(), 0, 10)
