"""The default path's model width and weight decay, chosen for the time budget and the data.

A time budget with no preset and no model settings trains the `cpu-small` preset
(nanolm/config/load.py, BUDGET_PRESET). How wide that model should be depends on
how many times the budget lets it see the training text. Measured with
bench/quality.py on built-in English and Chinese text, cut to about 1 MB and
whole, at 3, 6 and 10 minutes (bench/RESULTS.md, "The default path's width:
budget and data"): where the 128-wide preset saw its training tokens 3 to 6
times it was better than the same model 256 wide (by 0.03-0.10 bits per byte),
and where it saw them 8 to 20 times the 256-wide one was better (by 0.01-0.03):
it learns more from each pass and overfits later. Around the preset, at the
tokens each shape trains in 3 minutes (5 and 7 passes; bench/RESULTS.md, "The
default path's neighbourhood, at equal time"), depth, sequence length, batch,
learning rate and dropout changed nothing or lost on one of the two texts, and
weight decay 0.3 instead of 0.1 won on both (and at 10 minutes' tokens on the
wide model), so the default path decays by 0.3 where the data is seen more than
DECAY_PASSES times; fewer passes keep the preset's 0.1 (not measured there).

How many times is not known before training, so `shape_for_budget` times the preset's
step on this machine (a few steps of its model, micro-batch and optimizer on
random tokens, about a second before the run's clock starts) and divides the
tokens the budget buys at that rate by the data's training tokens; this
estimate runs 10-25% above the passes a run makes (evaluations, data loading
and checkpoints are left out), and WIDE_PASSES sits between the two measured
ranges with that in mind. A run resumed in its directory keeps the width and
weight decay it was started with; under torchrun nothing is sized (each process
would time its own step).
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from nanolm import checkpoint
from nanolm.config import Config
from nanolm.errors import UserError

WIDE_PASSES = 7.0
WIDE_D_MODEL = 256
DECAY_PASSES, MANY_PASSES_WEIGHT_DECAY = 5.0, 0.3
TIMED_STEPS = 3  # after one untimed step (the optimizer's first use pays one-time costs)


def train_tokens(cfg: Config) -> int | None:
    """The training tokens of the run's data (all sets of a curriculum or mixture), from their manifests; None
    when one cannot be read (the trainer then says what is wrong with it)."""
    from nanolm.data.shards import Manifest

    paths = [cfg.data.path] if cfg.data.path else [s.path for s in cfg.data.sets]
    total = 0
    for p in paths:
        try:
            total += int(Manifest.read(Path(p)).splits["train"]["n_tokens"])
        except (UserError, KeyError, TypeError, ValueError):
            return None
    return total or None


def step_rate(cfg: Config, steps: int = TIMED_STEPS) -> float:
    """Training tokens per second of cfg's model, micro-batch and optimizer on this machine (its device and
    compute dtype as the trainer picks them), timed over `steps` steps on random tokens after an untimed one."""
    from nanolm.model.transformer import Transformer
    from nanolm.runtime import autocast, resolve_device, train_dtype
    from nanolm.train.optim import build_optimizer

    device = resolve_device(cfg.train.device)
    dtype, _ = train_dtype(cfg.train.dtype, device, cfg.model.d_model)
    model = Transformer(cfg.model).to(device)
    optimizer = build_optimizer(model, cfg.optim, device)
    batch, seq = cfg.train.batch_size, cfg.train.seq_len
    tokens = torch.randint(cfg.model.vocab_size, (batch, seq + 1), generator=torch.Generator().manual_seed(0))
    x, y = tokens[:, :-1].to(device), tokens[:, 1:].to(device)
    times = []
    for i in range(steps + 1):
        t0 = time.perf_counter()
        with autocast(device, dtype):
            loss = model(x, targets=y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i:
            times.append(time.perf_counter() - t0)
    return batch * seq / statistics.median(times)


def passes(minutes: float, tokens_per_s: float, n_train_tokens: int) -> float:
    """How many times a budget of `minutes` at `tokens_per_s` sees `n_train_tokens` training tokens."""
    return minutes * 60 * tokens_per_s / n_train_tokens


def shape_for_budget(cfg: Config, decay_given: bool = False) -> tuple[dict[str, dict[str, Any]], str]:
    """The settings the default path changes for cfg's budget and data ({"model": {"d_model": WIDE_D_MODEL}}
    and/or {"optim": {"weight_decay": MANY_PASSES_WEIGHT_DECAY}}, or {}), and the sentence that says why
    (start-up); ({}, "") when the data cannot be read. `decay_given`: the user set optim.weight_decay, which
    is then kept."""
    saved = checkpoint.step_dirs(Path(cfg.train.out_dir))
    if saved:  # the checkpoint the trainer resumes from, and whose config its resume check compares
        try:
            old = checkpoint.read_run_config(saved[-1])
        except UserError:
            pass  # unreadable: sized below as a new run would be
        else:
            changed: dict[str, dict[str, Any]] = {}
            if old.model.d_model != cfg.model.d_model:
                changed["model"] = {"d_model": old.model.d_model}
            if not decay_given and old.optim.weight_decay != cfg.optim.weight_decay:
                changed["optim"] = {"weight_decay": old.optim.weight_decay}
            kept = f"width {old.model.d_model}" + ("" if decay_given else f", weight decay {old.optim.weight_decay:g}")
            return changed, f"{kept}: the run in {cfg.train.out_dir} was started with {'it' if decay_given else 'them'}"
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # each process would time its own step, and might differ
        return {}, f"width {cfg.model.d_model}: under torchrun the width is not sized (pass --model.d_model)"
    n = train_tokens(cfg)
    if n is None:
        return {}, ""
    rate = step_rate(cfg)
    seen = passes(cfg.train.max_minutes, rate, n)
    measured = (f"at {rate:,.0f} tokens/s (timed here) the {cfg.model.d_model}-wide model would see the {n:,} "
                f"training tokens about {seen:.1f} times in {cfg.train.max_minutes:g} minutes")
    changed = {}
    if seen > WIDE_PASSES:
        changed["model"] = {"d_model": WIDE_D_MODEL}
        why = (f"width {WIDE_D_MODEL}: {measured}, more than {WIDE_PASSES:g}; a wider model learns more from each "
               f"pass")
    else:
        why = f"width {cfg.model.d_model}: {measured}, at most {WIDE_PASSES:g}"
    if seen > DECAY_PASSES and not decay_given:
        changed["optim"] = {"weight_decay": MANY_PASSES_WEIGHT_DECAY}
        why += (f"; weight decay {MANY_PASSES_WEIGHT_DECAY:g} (not {cfg.optim.weight_decay:g}): more than "
                f"{DECAY_PASSES:g} passes")
    return changed, why
