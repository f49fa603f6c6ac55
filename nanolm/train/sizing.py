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
ranges with that in mind. A run resumed in its directory keeps the width,
weight decay and schedule it was started with; under torchrun nothing is sized
(each process would time its own step).

Past USEFUL_PASSES passes even the wide model only memorises: on a held-out
English novel (about 1.1 MB, 294 K tokens) 10 minutes of the default path
planned 12.5 passes, was best at step 700 of 1,521 (about 5.8 passes, with the
learning rate still high) and ended at 2.38 bits per byte against its best 1.95
(issue 55). So where the chosen model would see the data more than
USEFUL_PASSES times, the default path shortens the schedule instead of
warning: `train.max_tokens` becomes USEFUL_PASSES x the training tokens (the
time budget stays as a ceiling), so the learning rate decays over the passes
the model can use and the best validation falls at the end of the run. The
passes are counted at the chosen model's own timed rate (the wide model's
when the width changed). `choose` is the rule alone, a pure function of the
data's size, the budget and the timed rates; bench/small_data.py measures it
against nanoGPT's recipe given the same whole budget.
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
USEFUL_PASSES = 6.0  # the schedule is cut to this many passes of the chosen model (the trainer warns past it)
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


def choose(n_tokens: int, minutes: float, rate: float, wide_rate: float | None, d_model: int,
           weight_decay: float, decay_given: bool = False, tokens_given: bool = False
           ) -> tuple[dict[str, dict[str, Any]], str]:
    """The rule alone: the settings the default path changes for `n_tokens` training tokens and a budget of
    `minutes`, and the sentence that says what and why. `rate`: tokens/s of the `d_model`-wide preset;
    `wide_rate`: of the WIDE_D_MODEL-wide one, read only where the preset would see the data more than
    WIDE_PASSES times (then required). `decay_given` / `tokens_given`: the user set optim.weight_decay /
    train.max_tokens, which is then kept."""
    seen = passes(minutes, rate, n_tokens)
    measured = (f"at {rate:,.0f} tokens/s (timed here) the {d_model}-wide model would see the {n_tokens:,} "
                f"training tokens about {seen:.1f} times in {minutes:g} minutes")
    changed: dict[str, dict[str, Any]] = {}
    if seen > WIDE_PASSES:
        if wide_rate is None:
            raise ValueError(f"{seen:.1f} passes > WIDE_PASSES: the wide model's rate is needed")
        changed["model"] = {"d_model": WIDE_D_MODEL}
        why = (f"width {WIDE_D_MODEL}: {measured}, more than {WIDE_PASSES:g}; a wider model learns more from each "
               f"pass")
    else:
        why = f"width {d_model}: {measured}, at most {WIDE_PASSES:g}"
    if seen > DECAY_PASSES and not decay_given:
        changed["optim"] = {"weight_decay": MANY_PASSES_WEIGHT_DECAY}
        why += (f"; weight decay {MANY_PASSES_WEIGHT_DECAY:g} (not {weight_decay:g}): more than "
                f"{DECAY_PASSES:g} passes")
    chosen_rate, chosen_width = (wide_rate, WIDE_D_MODEL) if "model" in changed else (rate, d_model)
    assert chosen_rate is not None
    chosen_seen = passes(minutes, chosen_rate, n_tokens)
    if chosen_seen > USEFUL_PASSES and not tokens_given:
        cut = int(USEFUL_PASSES * n_tokens)
        changed["train"] = {"max_tokens": cut}
        why += (f"; schedule cut to {cut:,} tokens ({USEFUL_PASSES:g} passes; the time budget stays the ceiling): "
                f"at {chosen_rate:,.0f} tokens/s the {chosen_width}-wide model would see the data "
                f"{chosen_seen:.1f} times, and past {USEFUL_PASSES:g} it memorises, so the learning rate decays "
                f"over the passes it can use and the run ends early")
    return changed, why


def widened(cfg: Config) -> Config:
    """cfg with the model WIDE_D_MODEL wide (head width and MLP follow the width, as a --model.d_model would)."""
    d = cfg.to_dict()
    d["model"]["d_model"] = WIDE_D_MODEL
    return Config.from_dict(d, "budget sizing")


def shape_for_budget(cfg: Config, decay_given: bool = False) -> tuple[dict[str, dict[str, Any]], str]:
    """The settings the default path changes for cfg's budget and data (`choose`: the model's width, the weight
    decay, the schedule's token cap; or {}), and the sentence that says why (start-up); ({}, "") when the data
    cannot be read. `decay_given`: the user set optim.weight_decay, which is then kept; a train.max_tokens in
    cfg is the user's and is kept too."""
    saved = checkpoint.step_dirs(Path(cfg.train.out_dir))
    if saved:  # the checkpoint the trainer resumes from, and whose config its resume check compares
        try:
            old = checkpoint.read_run_config(saved[-1])
        except UserError:
            pass  # unreadable: sized below as a new run would be
        else:
            return resumed(old, cfg, decay_given)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # each process would time its own step, and might differ
        return {}, f"width {cfg.model.d_model}: under torchrun the width is not sized (pass --model.d_model)"
    n = train_tokens(cfg)
    if n is None:
        return {}, ""
    rate = step_rate(cfg)
    wide_rate = step_rate(widened(cfg)) if passes(cfg.train.max_minutes, rate, n) > WIDE_PASSES else None
    return choose(n, cfg.train.max_minutes, rate, wide_rate, cfg.model.d_model, cfg.optim.weight_decay,
                  decay_given, tokens_given=bool(cfg.train.max_tokens))


def resumed(old: Config, cfg: Config, decay_given: bool) -> tuple[dict[str, dict[str, Any]], str]:
    """What a run resumed in its directory keeps of the sizing it was started with (`old`: its config)."""
    changed: dict[str, dict[str, Any]] = {}
    if old.model.d_model != cfg.model.d_model:
        changed["model"] = {"d_model": old.model.d_model}
    if not decay_given and old.optim.weight_decay != cfg.optim.weight_decay:
        changed["optim"] = {"weight_decay": old.optim.weight_decay}
    kept = [f"width {old.model.d_model}"] + ([] if decay_given else [f"weight decay {old.optim.weight_decay:g}"])
    if not cfg.train.max_tokens and old.train.max_tokens:  # the schedule cut it was sized with
        changed["train"] = {"max_tokens": old.train.max_tokens}
        kept.append(f"schedule cut to {old.train.max_tokens:,} tokens")
    plural = "it" if len(kept) == 1 else "them"
    return changed, f"{', '.join(kept)}: the run in {cfg.train.out_dir} was started with {plural}"
