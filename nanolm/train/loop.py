"""The one training loop.

Every stage runs through `train(cfg)`: it builds the model, the data stream
and the optimizer from the config, then repeats optimizer steps of
`grad_accum` micro-batches with mixed precision, gradient clipping and the LR
schedule; it evaluates, logs and checkpoints on the configured intervals and
stops at `max_steps`, the token budget or the time budget, whichever comes
first. `resume=True` continues the newest checkpoint of `out_dir` exactly:
weights, optimizer, step, data position and RNG are all restored, so the
losses after a resume equal those of an uninterrupted run.
"""

from __future__ import annotations

import math
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from nanolm.config import Config
from nanolm.data.loader import Loader, PackedData, iter_eval_batches
from nanolm.errors import UserError
from nanolm.io import write_json_atomic
from nanolm.model import lora
from nanolm.model.transformer import Transformer, count_params, flops_per_token
from nanolm.progress import fmt_count, fmt_duration
from nanolm.runtime import autocast, resolve_device, resolve_dtype, seed_everything
from nanolm.train import checkpoint as ckpt
from nanolm.train.metrics import MetricsWriter, log, peak_flops
from nanolm.train.objectives import IGNORE_INDEX, lm_loss
from nanolm.train.optim import build_optimizer
from nanolm.train.schedule import lr_at


@dataclass
class TrainResult:
    run_dir: Path
    step: int
    tokens: int
    last_checkpoint: Path | None
    best_val_loss: float
    train_losses: dict[int, float] = field(default_factory=dict)
    stop_reason: str = ""


class _StopFlag:
    """First Ctrl-C finishes the current step, saves and exits; a second one aborts at once."""

    def __init__(self) -> None:
        self.stop = False
        self._old = None

    def __enter__(self) -> "_StopFlag":
        try:
            self._old = signal.signal(signal.SIGINT, self._handle)
        except ValueError:  # not the main thread
            self._old = None
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.stop:
            raise KeyboardInterrupt
        self.stop = True
        print("\ninterrupt: finishing this step and saving a checkpoint (Ctrl-C again to abort)",
              file=sys.stderr, flush=True)

    def __exit__(self, *exc: object) -> None:
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)


def _tokenizer_dir(data: PackedData) -> Path | None:
    tok = data.manifest.get("tokenizer", {})
    path = Path(tok.get("path", ""))
    if path.is_file():
        path = path.parent
    return path if (path / "tokenizer.json").is_file() else None


def _token_bytes(tok_dir: Path | None, vocab_size: int) -> torch.Tensor | None:
    """UTF-8 bytes per token id, for bits-per-byte; None when the tokenizer is not at hand."""
    if tok_dir is None:
        return None
    from nanolm.tokenizer import Tokenizer
    lengths = torch.zeros(vocab_size, dtype=torch.float64)
    tb = torch.tensor(Tokenizer.load(tok_dir).token_byte_lengths(), dtype=torch.float64)
    lengths[: len(tb)] = tb[:vocab_size]
    return lengths


@torch.no_grad()
def evaluate(model: torch.nn.Module, data: PackedData, cfg: Config, device: torch.device, dtype: torch.dtype,
             token_bytes: torch.Tensor | None) -> dict[str, float]:
    """Mean validation loss over the first `eval_batches` windows, and bits per byte."""
    was_training = model.training
    model.eval()
    loss_sum, n_tokens, n_bytes = 0.0, 0, 0.0
    for batch in iter_eval_batches(data, cfg.train.batch_size, cfg.train.seq_len, cfg.train.eval_batches):
        batch = batch.to(device)
        x, y = batch.x, batch.y
        with autocast(device, dtype):
            logits = model(x, pos=batch.pos, seg=batch.seg)
        loss_sum += lm_loss(logits, y, reduction="sum").item()
        targets = y[y != IGNORE_INDEX].cpu()  # chat data: only the assistant tokens carry a loss
        n_tokens += targets.numel()
        if token_bytes is not None:
            n_bytes += token_bytes[targets].sum().item()
    model.train(was_training)
    if n_tokens == 0:
        return {}
    out = {"val_loss": loss_sum / n_tokens}
    if n_bytes > 0:
        out["val_bpb"] = loss_sum / (math.log(2) * n_bytes)
    return out


def train(cfg: Config, *, resume: bool = False, quiet: bool = False) -> TrainResult:
    """Run (or resume) training as configured. Returns where it stopped and what it saved."""
    t_setup = time.perf_counter()
    tc, run_dir = cfg.train, Path(cfg.train.out_dir)
    device = resolve_device(tc.device)
    dtype = resolve_dtype(tc.dtype, device)
    seed_everything(tc.seed)
    say = lambda msg: log(msg, not quiet)  # noqa: E731

    if not cfg.data.path:
        raise UserError("data.path is empty; pass --data <dir made by `nanolm prepare`>")
    train_data = PackedData(Path(cfg.data.path), "train")
    if train_data.vocab_size > cfg.model.vocab_size:
        raise UserError(f"{cfg.data.path}: the data's tokenizer has {train_data.vocab_size} tokens but "
                        f"model.vocab_size is {cfg.model.vocab_size}; set --model.vocab_size {train_data.vocab_size}")
    try:
        val_data: PackedData | None = PackedData(Path(cfg.data.path), "val")
        if val_data.n_tokens <= tc.seq_len:
            val_data = None
    except UserError:
        val_data = None
    loader = Loader(train_data, tc.batch_size, tc.seq_len, seed=tc.seed)
    tok_dir = _tokenizer_dir(train_data)
    token_bytes = _token_bytes(tok_dir, cfg.model.vocab_size) if val_data is not None else None

    # Where the weights come from: a checkpoint of this run (resume), init_from, or a fresh init.
    resume_src: Path | None = None
    if resume:
        steps = ckpt.step_dirs(run_dir)
        if not steps:
            raise UserError(f"{run_dir}: nothing to resume (no checkpoints/step-*); drop --resume to start anew")
        resume_src = steps[-1]
        saved_cfg = ckpt.load_run_config(resume_src)
        if saved_cfg.model != cfg.model:
            raise UserError(f"{resume_src}/config.json: the checkpoint's model config differs from this run's; "
                            f"resume with the same model settings (saved: {saved_cfg.model})")
    if tc.stage in ("sft", "lora") and not tc.init_from:
        raise UserError(f"train.stage={tc.stage} fine-tunes a trained model; pass --init-from <pretrained run or "
                        f"checkpoint>")

    model = Transformer(cfg.model)
    adapter_base = None  # LoRA: what its adapter checkpoints record about their base
    if tc.init_from and (resume_src is None or tc.stage == "lora"):
        # A LoRA run always rebuilds its frozen base from init_from; other stages resume all weights.
        src = ckpt.resolve_checkpoint(tc.init_from, "best")
        if ckpt.is_adapter(src):
            raise UserError(f"{src}: --init-from needs a full checkpoint, not a LoRA adapter; merge it first "
                            f"with `nanolm lora merge`")
        ckpt.load_weights(model, src)
        say(f"initialised weights from {src}")
        if tc.stage == "lora":
            adapter_base = {"base_fingerprint": lora.base_fingerprint(model), "base_checkpoint": str(src)}
    if tc.stage == "lora":
        if resume_src is not None:
            lora.load_adapter(resume_src, model)
        else:
            lora.apply_lora(model, cfg.lora.rank, cfg.lora.alpha, cfg.lora.dropout, cfg.lora.targets)
        lora.mark_only_lora_as_trainable(model)
    elif resume_src is not None:
        ckpt.load_weights(model, resume_src)
    model.to(device)
    optimizer = build_optimizer(model, cfg.optim, device)
    scaler = torch.amp.GradScaler(device.type) if dtype == torch.float16 else None

    step, tokens, best_val, elapsed_before = 0, 0, float("inf"), 0.0
    metrics = MetricsWriter(run_dir)
    if resume_src is not None:
        ckpt.load_optimizer(optimizer, resume_src)
        state = ckpt.read_json(resume_src / "state.json", "training state")
        step, tokens = int(state["step"]), int(state["tokens"])
        best_val = float(state.get("best_val_loss") or float("inf"))
        elapsed_before = float(state.get("elapsed_s", 0.0))
        loader.load_state_dict(state["loader"])
        ckpt.set_rng_state(state["rng"])
        metrics.truncate_after(step)
        say(f"resumed from {resume_src} at step {step} ({fmt_count(tokens)} tokens seen)")

    # Derived settings, printed once.
    tokens_per_step = tc.batch_size * tc.seq_len * tc.grad_accum
    fpt = flops_per_token(cfg.model, tc.seq_len)
    peak, peak_src = peak_flops(device, dtype)
    params = count_params(model)
    run_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(run_dir / "config.json", cfg.to_dict())
    say(f"run dir: {run_dir.resolve()} (config saved as config.json)")
    for line in cfg.summary():
        say(f"  {line}")
    say(f"stage: {tc.stage} | device: {device} | compute dtype: {str(dtype).removeprefix('torch.')} | "
        f"compile: {tc.compile}")
    say(f"model: {params['total'] / 1e6:.2f}M parameters ({params['trainable'] / 1e6:.2f}M trainable, "
        f"{params['non_embedding'] / 1e6:.2f}M non-embedding) | {fpt / 1e6:.1f} MFLOPs/token (train)")
    say(f"data: {fmt_count(train_data.n_tokens)} train tokens, "
        f"{fmt_count(val_data.n_tokens) if val_data else 0} val tokens | "
        f"batch {tc.batch_size} x seq {tc.seq_len} x accum {tc.grad_accum} = {tokens_per_step:,} tokens/step | "
        f"one epoch = {loader.epoch_windows * tc.seq_len / tokens_per_step:.1f} steps")
    say(f"data stream: {loader.describe()}")
    say(f"schedule: {cfg.optim.schedule}, lr {cfg.optim.lr:g} -> {cfg.optim.min_lr:g}, "
        f"warmup {cfg.optim.warmup_steps}, max_steps {tc.max_steps}"
        + (f", max_tokens {tc.max_tokens:,}" if tc.max_tokens else "")
        + (f", max_minutes {tc.max_minutes:g}" if tc.max_minutes else "")
        + f" | MFU peak: {peak / 1e12:.2f} TFLOP/s ({peak_src})")

    train_model = torch.compile(model) if tc.compile else model
    model.train()

    def save(is_best: bool = False) -> Path:
        state = {"tokens": tokens, "loader": loader.state_dict(), "rng": ckpt.rng_state(),
                 "best_val_loss": best_val if math.isfinite(best_val) else None,
                 "elapsed_s": elapsed_before + time.perf_counter() - t_start}
        return ckpt.save_checkpoint(run_dir, step, model, optimizer, cfg, state, tokenizer_dir=tok_dir,
                                    keep_last=tc.keep_last, is_best=is_best, adapter_base=adapter_base)

    def run_eval() -> dict[str, float]:
        nonlocal best_val
        if val_data is None:
            return {}
        t0 = time.perf_counter()
        res = evaluate(model, val_data, cfg, device, dtype, token_bytes)
        res["eval_s"] = time.perf_counter() - t0
        metrics.write({"step": step, "tokens": tokens, **res})
        bpb = f" | val bpb {res['val_bpb']:.4f}" if "val_bpb" in res else ""
        say(f"step {step:>6} | val loss {res['val_loss']:.4f}{bpb} | eval {res['eval_s']:.1f}s")
        return res

    last_saved: Path | None = None
    losses: dict[int, float] = {}
    stop_reason = "max_steps"
    t_start = time.perf_counter()
    t_window, tokens_window, steps_done_here = time.perf_counter(), 0, 0
    say(f"setup took {t_start - t_setup:.1f}s; training from step {step}")

    with _StopFlag() as flag:
        while step < tc.max_steps:
            if tc.max_tokens and tokens >= tc.max_tokens:
                stop_reason = "max_tokens"
                break
            if tc.max_minutes and (elapsed_before + time.perf_counter() - t_start) >= tc.max_minutes * 60:
                stop_reason = "max_minutes"
                break
            if flag.stop:
                stop_reason = "interrupted"
                break

            lr = lr_at(step, cfg.optim, tc.max_steps)
            for group in optimizer.param_groups:
                group["lr"] = lr
            loss_acc = torch.zeros((), device=device)
            for _ in range(tc.grad_accum):
                batch = loader.next_batch().to(device, non_blocking=True)
                with autocast(device, dtype):
                    logits = train_model(batch.x, pos=batch.pos, seg=batch.seg)
                loss = lm_loss(logits, batch.y) / tc.grad_accum
                (scaler.scale(loss) if scaler else loss).backward()
                loss_acc += loss.detach()
            if scaler:
                scaler.unscale_(optimizer)
            max_norm = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else float("inf")
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            if scaler:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            steps_done_here += 1
            tokens += tokens_per_step
            tokens_window += tokens_per_step

            if step % tc.log_interval == 0 or step == tc.max_steps:
                loss_val = loss_acc.item()  # the one host sync per log interval
                losses[step] = loss_val
                if device.type == "cuda":
                    torch.cuda.synchronize()
                now = time.perf_counter()
                tok_s = tokens_window / (now - t_window)
                mfu = tok_s * fpt / peak
                elapsed = elapsed_before + now - t_start
                remaining = (tc.max_steps - step) * tokens_per_step / tok_s
                if tc.max_tokens:
                    remaining = min(remaining, max(0, tc.max_tokens - tokens) / tok_s)
                if tc.max_minutes:
                    remaining = min(remaining, max(0.0, tc.max_minutes * 60 - elapsed))
                metrics.write({"step": step, "tokens": tokens, "loss": loss_val, "lr": lr,
                               "grad_norm": grad_norm.item(), "tokens_per_s": tok_s, "mfu": mfu,
                               "elapsed_s": elapsed})
                say(f"step {step:>6}/{tc.max_steps} | loss {loss_val:.4f} | lr {lr:.2e} | "
                    f"grad {grad_norm.item():.3f} | {fmt_count(tok_s)} tok/s | MFU {mfu * 100:.1f}% | "
                    f"ETA {fmt_duration(remaining)}")
                t_window, tokens_window = time.perf_counter(), 0

            is_best = False
            if tc.eval_interval and step % tc.eval_interval == 0 and step < tc.max_steps:
                res = run_eval()
                if res and res["val_loss"] < best_val:
                    best_val, is_best = res["val_loss"], True
            if is_best or (tc.save_interval and step % tc.save_interval == 0):
                last_saved = save(is_best=is_best)

    # Final evaluation and checkpoint, unless this exact step is already saved.
    if steps_done_here or not ckpt.step_dirs(run_dir):
        res = run_eval()
        is_best = bool(res) and res["val_loss"] < best_val
        if is_best:
            best_val = res["val_loss"]
        if is_best or last_saved is None or last_saved.name != f"step-{step:08d}":
            last_saved = save(is_best=is_best)
    else:
        last_saved = ckpt.step_dirs(run_dir)[-1]
    metrics.write({"step": step, "tokens": tokens, "event": "stop", "reason": stop_reason})
    metrics.close()
    say(f"stopped at step {step} ({stop_reason}); {fmt_count(tokens)} tokens; "
        f"checkpoint: {last_saved}" + (f"; best val loss {best_val:.4f}" if math.isfinite(best_val) else ""))
    return TrainResult(run_dir, step, tokens, last_saved, best_val, losses, stop_reason)
