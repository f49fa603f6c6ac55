"""What a training run prints and logs as it goes (nanolm/train/trainer.py): the start-of-run report (the
configuration's summary, the device and precision, the model's size and FLOPs, memory, the data and its split
rules, the stage's own line, trackers and the schedule, each a line printed once) and each logged step's line and
metrics.jsonl record (loss, the stage's metrics, lr, gradient norm, throughput, MFU, the time left)."""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from nanolm import checkpoint as ckpt
from nanolm.model.moe import moe_layers
from nanolm.model.transformer import count_params
from nanolm.progress import fmt_count, fmt_duration
from nanolm.train.schedule import probe_steps

Trainer = Any  # nanolm/train/trainer.py's, which imports this module


def start_report(t: Trainer) -> list[str]:
    """The derived settings of a run, printed once at its start (Trainer.report)."""
    lines: list[str] = []
    cfg, tc, info, data = t.cfg, t.cfg.train, t.info, t.data
    several = len(data.sets) > 1
    params = count_params(t.model)
    lines.append(f"run dir: {t.run_dir.resolve()} (config saved as config.json)")
    for line in cfg.summary():
        lines.append(f"  {line}")
    if cfg.note:
        lines.append(cfg.note)
    if info.enabled:
        lines.append(f"data parallel: {info.world_size} processes ({tc.parallel}) | {t.accum} micro-batch(es) per "
                     f"rank per step | global batch {t.tokens_per_step:,} tokens/step as configured")
    lines.append(f"stage: {tc.stage} | device: {t.device} | compute dtype: {str(t.dtype).removeprefix('torch.')}"
                 f" ({t.dtype_why}) | compile: {tc.compile} | activation checkpointing: "
                 f"{tc.activation_checkpointing} | attention kernel: {tc.sdpa_backend}")
    active = f", {params['active'] / 1e6:.2f}M active per token" if params["active"] != params["total"] else ""
    lines.append(f"model: {params['total'] / 1e6:.2f}M parameters ({params['trainable'] / 1e6:.2f}M trainable, "
                 f"{params['non_embedding'] / 1e6:.2f}M non-embedding{active}) | {t.fpt / 1e6:.1f} MFLOPs/token "
                 "(train)")
    lines.append(t.memory_line)
    for name, c in t.companions.items():
        lines.append(f"{name}: {count_params(c.module)['trainable'] / 1e6:.2f}M parameters trained beside the model "
                     f"(lr x {c.lr_scale:g}), saved as {ckpt.companion_files(name)[0]} in each checkpoint")
    val_tokens = sum(v.n_tokens for _, v in t.val_sets)
    lines.append(f"data: {f'{len(data.sets)} sets as a {data.mode}, ' if several else ''}"
                 f"{fmt_count(data.n_tokens)} train tokens, {fmt_count(val_tokens)} val tokens | "
                 f"batch {tc.batch_size} x seq {tc.seq_len} x accum {tc.grad_accum} = {t.tokens_per_step:,} "
                 f"tokens/step" + ("" if several else
                                   f" | one epoch = {data.epoch_windows / (tc.batch_size * tc.grad_accum):.1f} steps"))
    for line in data.describe():
        lines.append(f"data stream: {line}")
    if (line := t.stage.describe(cfg)) is not None:
        lines.append(line)
    for s in data.sets:  # which rule made each set's val split (the manifest's split_policy)
        rule = s.data.manifest.split_policy.get("summary")
        if rule:
            lines.append(f"val split{f' of {s.name}' if several else ''}: {rule}")
    for tracker in t.metrics.trackers:
        lines.append(f"tracking: {tracker.describe()}")
    steps = t.budget.describe(probe_steps(cfg.optim.warmup_steps))
    muon = (f" (AdamW; Muon matrices {cfg.optim.muon_lr:g} x the same factor)" if cfg.optim.name == "muon"
            else "")
    lines.append(f"schedule: {cfg.optim.schedule}, lr {cfg.optim.lr:g} -> {cfg.optim.min_lr:g}{muon}, "
                 f"warmup {cfg.optim.warmup_steps}, {steps}"
                 + (f", max_tokens {tc.max_tokens:,}" if tc.max_tokens else "")
                 + (f", max_minutes {tc.max_minutes:g}" if tc.max_minutes else "")
                 + f" | MFU peak: {t.peak / 1e12:.2f} TFLOP/s ({t.peak_src})")
    return lines


def log_step(t: Trainer, res: Any, window: tuple[float, int, int]) -> None:
    """The step's line and metrics.jsonl record (res: its StepResult); window: (start time, tokens,
    projected positions) of the log window."""
    tc, info = t.cfg.train, t.info
    logged = res.logged(info)
    logged.update(res.extra)
    loss = logged.pop("loss")
    if (warning := t.objective.warning(res.extra)) is not None:
        t.say(f"step {t.step:>6} | {warning}")
    t.losses[t.step] = loss
    shown = {k: v for k, v in logged.items() if not (k.endswith("_std") or k in ("generate_s", "score_s"))}
    extra = "".join(f" | {k.replace('_', ' ')} {v:.4f}" for k, v in shown.items())
    loads = [layer.expert_load.tolist() for layer in moe_layers(t.model) if layer.expert_load is not None]
    if loads:
        logged["expert_load"] = loads
    if t.device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - window[0]
    tok_s = window[1] / elapsed
    # useful FLOPs: the model at every position read, the output projection at those it computed
    mfu = (window[1] * (t.fpt - t.fpt_head) + window[2] * t.fpt_head) / elapsed / t.peak
    max_steps = t.budget.max_steps
    remaining = (max_steps - t.step) * t.tokens_per_step / tok_s if max_steps else math.inf
    if tc.max_tokens:
        remaining = min(remaining, max(0, tc.max_tokens - t.tokens) / tok_s)
    if tc.max_minutes:
        remaining = min(remaining, max(0.0, tc.max_minutes * 60 - t.elapsed()))
    several = len(t.data.sets) > 1
    # With several data sets: where the step's last micro-batch came from (DataStream.position).
    where = {"data": t.data.position()} if several else {}
    t.metrics.write({"step": t.step, "tokens": t.tokens, "loss": loss, **logged, "lr": res.lr,
                     "grad_norm": res.grad_norm.item(), "tokens_per_s": tok_s, "mfu": mfu,
                     "elapsed_s": t.elapsed(), **where})
    shown_set = f" [{where['data']['set']} epoch {where['data']['epoch']}]" if several else ""
    t.say(f"step {t.step:>6}/{max_steps or '?'}{shown_set} | loss {loss:.4f}{extra} | lr {res.lr:.2e} | "
          f"grad {res.grad_norm.item():.3f} | {fmt_count(tok_s)} tok/s | MFU {mfu * 100:.1f}% | "
          f"ETA {fmt_duration(remaining)}")
