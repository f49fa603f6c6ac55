"""The learning-rate schedule's exact values."""

import math

import pytest

from nanolm.config import OptimConfig
from nanolm.train.schedule import lr_at


def test_warmup_then_cosine_exact_values():
    cfg = OptimConfig(lr=1e-3, min_lr=1e-4, warmup_steps=10, schedule="cosine")
    assert lr_at(0, cfg, 110) == pytest.approx(1e-4)  # 1/10 of lr on the first step
    assert lr_at(4, cfg, 110) == pytest.approx(5e-4)
    assert lr_at(9, cfg, 110) == pytest.approx(1e-3)  # warmup ends at full lr
    assert lr_at(10, cfg, 110) == pytest.approx(1e-3)  # cosine starts at lr
    assert lr_at(60, cfg, 110) == pytest.approx(1e-4 + 0.5 * 9e-4)  # halfway: the mean of lr and min_lr
    assert lr_at(35, cfg, 110) == pytest.approx(1e-4 + 0.5 * (1 + math.cos(math.pi / 4)) * 9e-4)
    assert lr_at(110, cfg, 110) == pytest.approx(1e-4)
    assert lr_at(500, cfg, 110) == pytest.approx(1e-4)  # held at min_lr after max_steps


def test_constant_schedule_and_no_warmup():
    cfg = OptimConfig(lr=3e-4, min_lr=0.0, warmup_steps=0, schedule="constant")
    assert [lr_at(s, cfg, 100) for s in (0, 50, 99, 1000)] == [3e-4] * 4
    cos = OptimConfig(lr=3e-4, min_lr=0.0, warmup_steps=0)
    assert lr_at(0, cos, 100) == pytest.approx(3e-4)
    assert lr_at(100, cos, 100) == pytest.approx(0.0)
