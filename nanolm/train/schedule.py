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


# Steps timed before a time budget fixes max_steps: few enough to end inside the warmup (where the learning rate
# does not depend on max_steps), enough for a steady rate once the first step's one-time costs are left out.
PROBE_STEPS = 8


def probe_steps(warmup_steps: int) -> int:
    """How many steps run before a time budget fixes max_steps: at most warmup_steps + 1 (lr_at of those steps
    does not read max_steps) and at most PROBE_STEPS."""
    return max(1, min(warmup_steps + 1, PROBE_STEPS))


def steps_for_tokens(max_tokens: int, tokens_per_step: int) -> int:
    """The optimizer steps a token budget buys: the last one may run past it (the run stops after it)."""
    return max(1, math.ceil(max_tokens / tokens_per_step))


def steps_for_time(budget_s: float, elapsed_s: float, steps_done: int, step_s: float, *, eval_interval: int = 0,
                   eval_step_fraction: float = 0.0) -> int:
    """max_steps that fill the rest of a time budget: the steps done, plus what the remaining seconds buy at
    `step_s` seconds a step, each step also paying its share of the validation passes (one every eval_interval
    steps, and one at the end, each costing eval_step_fraction steps). At least steps_done + 1."""
    per_step = step_s * (1.0 + (eval_step_fraction / eval_interval if eval_interval else 0.0))
    left = budget_s - elapsed_s - step_s * eval_step_fraction  # the final evaluation
    return steps_done + max(1, math.floor(left / per_step))
