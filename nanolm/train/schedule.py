"""Learning-rate schedules as pure functions of the optimizer step."""

from __future__ import annotations

import math

from nanolm.config import OptimConfig


def lr_at(step: int, cfg: OptimConfig, max_steps: int) -> float:
    """Learning rate for optimizer step `step` (0-based).

    Linear warmup from lr/warmup_steps to lr over the first `warmup_steps`
    steps, then either constant or a half cosine from lr down to min_lr, which
    is reached at `max_steps` and held after it.
    """
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    decay_steps = max(1, max_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - cfg.min_lr)
