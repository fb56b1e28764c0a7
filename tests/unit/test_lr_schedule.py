"""``tidal.trainer.schedule.LRSchedule``: warmup then constant / linear / cosine decay, built from the trainer's flags."""

from __future__ import annotations

import math

import pytest

from tidal.config.schema import TrainerConfig
from tidal.errors import ConfigError
from tidal.trainer.schedule import LRSchedule


@pytest.mark.parametrize(
    "style, step, expect",
    [
        ("constant", 0, 0.5e-3),  # warmup: lr * (step + 1) / warmup_steps
        ("constant", 1, 1e-3),
        ("constant", 9, 1e-3),
        ("linear", 6, 1e-4 + (1e-3 - 1e-4) * 0.5),  # halfway through the 8 steps after warmup
        ("linear", 10, 1e-4),
        ("cosine", 6, 1e-4 + 0.5 * (1e-3 - 1e-4) * (1 + math.cos(math.pi * 0.5))),
        ("cosine", 50, 1e-4),  # past the end: min_lr
    ],
)
def test_rates_follow_the_flags(style, step, expect):
    cfg = TrainerConfig(lr=1e-3, min_lr=1e-4, lr_warmup_steps=2, lr_decay_style=style)
    assert LRSchedule.of(cfg, total_steps=10).lr_at(step) == pytest.approx(expect, rel=1e-12)


def test_the_critics_schedule_scales_min_lr_with_its_peak():
    cfg = TrainerConfig(lr=1e-3, min_lr=1e-4, lr_warmup_steps=0, lr_decay_style="linear")
    critic = LRSchedule.of(cfg, 10, lr=4e-3)
    assert critic.lr == 4e-3 and critic.min_lr == pytest.approx(4e-4) and critic.lr_at(10) == pytest.approx(4e-4)


def test_decay_without_a_step_count_is_refused():
    with pytest.raises(ConfigError, match="needs the number of optimizer steps"):
        LRSchedule.of(TrainerConfig(lr_decay_style="cosine"), None)
