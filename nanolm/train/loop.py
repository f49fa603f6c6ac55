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
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from nanolm import checkpoint as ckpt
from nanolm.config import Config
from nanolm.data.loader import PackedData, iter_eval_batches
from nanolm.data.sources import DataStream
from nanolm.errors import UserError
from nanolm.io import first_line, write_json_atomic
from nanolm.model import lora
from nanolm.model.moe import moe_layers
from nanolm.model.transformer import Transformer, count_params, flops_per_token
from nanolm.progress import fmt_count, fmt_duration
from nanolm.runtime import attention_kernel, autocast, resolve_dtype, seed_everything
from nanolm.train import distributed
from nanolm.train.metrics import MetricsWriter, log, make_trackers, peak_flops
from nanolm.train.numerics import locate_nonfinite, step_is_finite, weights_are_finite
from nanolm.train.stages import DistillObjective, DPOObjective, LMObjective, Objective
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


def _reference_model(cfg: Config, device: torch.device, say: Callable[[str], None]) -> torch.nn.Module:
    """DPO's frozen reference without adapters: dpo.ref_from, else the initial weights (train.init_from)."""
    src = ckpt.resolve_checkpoint(cfg.dpo.ref_from or cfg.train.init_from, "best")
    ref = ckpt.build_model(cfg.model, src)
    say(f"DPO reference: {src}")
    return ref.to(device).eval().requires_grad_(False)


def _teacher_model(cfg: Config, data: PackedData, device: torch.device, say: Callable[[str], None]
                   ) -> torch.nn.Module:
    """The frozen distillation teacher, refused unless it was trained with the data's tokenizer."""
    from nanolm.tokenizer import Tokenizer
    teacher, src = ckpt.load_model(cfg.distill.teacher, "best", device)
    if not (src / "tokenizer.json").is_file():
        raise UserError(f"{src}: the teacher checkpoint holds no tokenizer.json, so its tokenizer cannot be checked "
                        f"against the data's; use a checkpoint written by nanolm train")
    theirs, ours = Tokenizer.load(src).fingerprint, data.manifest["tokenizer"]["fingerprint"]
    if theirs != ours:
        raise UserError(f"{src}: the teacher was trained with another tokenizer ({theirs[:12]}) than the data's "
                        f"({ours[:12]}); distillation compares token distributions, so both must use the same "
                        f"tokenizer: prepare the data with the teacher's tokenizer")
    say(f"distillation teacher: {src} ({count_params(teacher)['total'] / 1e6:.2f}M parameters)")
    return teacher.eval().requires_grad_(False)


def _objective(cfg: Config, model: torch.nn.Module, data: PackedData, device: torch.device,
               say: Callable[[str], None]) -> Objective:
    """The stage's batch -> loss function, checked against the kind of data it is given."""
    stage, kind = cfg.train.stage, data.kind
    if (stage == "dpo") != (kind == "dpo"):
        fix = ("prepare preference pairs with `nanolm prepare --format dpo`" if stage == "dpo"
               else "preference data trains with --stage dpo")
        where = cfg.data.path or ", ".join(s.path for s in cfg.data.sets)
        raise UserError(f"{where}: train.stage={stage} cannot train on {kind} data; {fix}")
    lm = LMObjective(model, cfg.model.aux_loss_coef)
    if stage == "dpo":
        if cfg.uses_lora:
            return DPOObjective(cfg.dpo.beta, None, lora.disable_adapters)
        return DPOObjective(cfg.dpo.beta, _reference_model(cfg, device, say))
    if stage == "distill":
        teacher = _teacher_model(cfg, data, device, say)
        return DistillObjective(teacher, cfg.distill.temperature, cfg.distill.alpha, data.vocab_size, lm)
    return lm


def _rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


def _replay(objective: Objective, model: torch.nn.Module, batches: list, units: list[int], step_units: int,
            world_size: int, compute: Callable, rng: tuple[torch.Tensor, torch.Tensor | None],
            device: torch.device) -> list[torch.Tensor]:
    """The step's forward and backward passes again, with the RNG (dropout) as the step began; the run's own
    RNG stream is left as it was. Runs on the model itself, not its DDP wrapper: no gradient all-reduce."""
    losses = []
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.set_rng_state(rng[0])
        if rng[1] is not None:
            torch.cuda.set_rng_state(rng[1], device)
        for batch, n in zip(batches, units):
            with compute():
                out = objective(model, batch)
            loss = out.weighted(n, step_units, world_size, len(batches))
            loss.backward()
            losses.append(loss.detach())
    return losses


def _resume_source(cfg: Config, run_dir: Path, resume: bool) -> Path | None:
    """The checkpoint a resume continues from (the run's newest), after checking it fits this config; None for
    a fresh start, which a run directory that already holds checkpoints refuses."""
    tc = cfg.train
    resume_src: Path | None = None
    if resume:
        steps = ckpt.step_dirs(run_dir)
        if not steps:
            raise UserError(f"{run_dir}: nothing to resume (no checkpoints/step-*); drop --resume to start anew")
        resume_src = steps[-1]
        saved_cfg = ckpt.read_run_config(resume_src)
        if saved_cfg.model != cfg.model:
            raise UserError(f"{resume_src}/config.json: the checkpoint's model config differs from this run's; "
                            f"resume with the same model settings (saved: {saved_cfg.model})")
    elif ckpt.step_dirs(run_dir):
        raise UserError(f"{run_dir}: already holds checkpoints of a run; pass --resume to continue it, or choose "
                        f"another --out for a new run")
    if tc.stage in ("sft", "lora", "dpo") and not tc.init_from:
        raise UserError(f"train.stage={tc.stage} fine-tunes a trained model; pass --init-from <pretrained run or "
                        f"checkpoint>")
    return resume_src


def _build_model(cfg: Config, resume_src: Path | None, data_fingerprint: str, say: Callable[[str], None]
                 ) -> tuple[Transformer, dict[str, Any] | None]:
    """The model with its weights from a checkpoint of this run (resume), from train.init_from, or fresh; for
    LoRA, the frozen base with its adapters. Returns it (on the CPU) and, for LoRA, what its adapter
    checkpoints record about their base."""
    tc = cfg.train
    adapter_base, weights = None, None
    if tc.init_from and (resume_src is None or cfg.uses_lora):
        # A LoRA run always rebuilds its frozen base from init_from; other runs resume all weights.
        weights = ckpt.resolve_checkpoint(tc.init_from, "best")
        if ckpt.is_adapter(weights):
            raise UserError(f"{weights}: --init-from needs a full checkpoint, not a LoRA adapter; merge it first "
                            f"with `nanolm lora merge`")
        if (weights / "tokenizer.json").is_file():  # its weights are tied to the ids of its tokenizer
            from nanolm.tokenizer import Tokenizer
            theirs = Tokenizer.load(weights).fingerprint
            if theirs != data_fingerprint:
                raise UserError(f"{weights}: --init-from was trained with tokenizer {theirs[:12]}, but the data was "
                                f"prepared with {data_fingerprint[:12]}, so its token ids mean other text; prepare "
                                f"the data with {weights / 'tokenizer.json'}")
    elif resume_src is not None:
        weights = resume_src
    model = ckpt.build_model(cfg.model, weights)
    if weights is not None and weights != resume_src:
        say(f"initialised weights from {weights}")
        if cfg.uses_lora:
            adapter_base = {"base_fingerprint": lora.base_fingerprint(model), "base_checkpoint": str(weights)}
    if cfg.uses_lora:
        if adapter_base is None:
            raise UserError("LoRA trains adapters on a trained base; pass --init-from <run or checkpoint>")
        if resume_src is not None:
            ckpt.load_adapter(resume_src, model)
        else:
            lora.apply_lora(model, cfg.lora.rank, cfg.lora.alpha, cfg.lora.dropout, cfg.lora.targets)
        lora.mark_only_lora_as_trainable(model)
    return model, adapter_base


def _restore_state(resume_src: Path, loader: DataStream) -> tuple[int, int, float, float]:
    """Read state.json back into the data stream and the RNG; returns (step, tokens, best val loss, elapsed s)."""
    state = ckpt.read_json(resume_src / "state.json", "training state")
    try:  # a damaged state.json: a missing field, a wrong type, an RNG state of the wrong size
        step, tokens = int(state["step"]), int(state["tokens"])
        if step < 0 or tokens < 0:
            raise ValueError(f"step {step}, tokens {tokens}")
        best_val = float(state.get("best_val_loss") or float("inf"))
        elapsed_before = float(state.get("elapsed_s", 0.0))
        loader.load_state_dict(state["loader"])
        ckpt.set_rng_state(state["rng"])
    except UserError as e:  # the data position does not fit this data
        raise UserError(f"{resume_src}/state.json: {e}") from None
    except (KeyError, TypeError, ValueError, AttributeError, RuntimeError) as e:
        raise UserError(f"{resume_src}/state.json: damaged training state ({type(e).__name__}: {first_line(e)}); "
                        "resume from an earlier checkpoint (move this one away) or start a new run") from None
    return step, tokens, best_val, elapsed_before


def train(cfg: Config, *, resume: bool = False, quiet: bool = False) -> TrainResult:
    """Run (or resume) training as configured. Returns where it stopped and what it saved."""
    t_setup = time.perf_counter()
    tc, run_dir = cfg.train, Path(cfg.train.out_dir)
    info = distributed.setup(tc.device)  # one process, or this rank of a torchrun launch
    device = info.device
    dtype = resolve_dtype(tc.dtype, device)
    seed_everything(tc.seed)
    accum = distributed.per_rank_accum(tc.grad_accum, info)
    say = lambda msg: log(msg, not quiet and info.is_main)  # noqa: E731

    # One data set (data.path) or a curriculum/mixture of several (data.sets); see nanolm/data/sources.py.
    loader = DataStream.from_config(cfg, rank=info.rank, world_size=info.world_size)
    train_data = loader  # what the loop asks of the data (kind, is_chat, vocab_size, manifest), for all sets
    several = len(loader.sets) > 1
    if train_data.vocab_size > cfg.model.vocab_size:
        raise UserError(f"{loader.sets[0].path}: the data's tokenizer has {train_data.vocab_size} tokens but "
                        f"model.vocab_size is {cfg.model.vocab_size}; set --model.vocab_size {train_data.vocab_size}")
    # An attention kernel this device cannot run stops the run here, before anything is written.
    attention = attention_kernel(tc.sdpa_backend, device, dtype, cfg.model.head_dim, masked=train_data.is_chat)
    val_sets = loader.val_sets(tc.seq_len)  # [(set name, val split)] of the sets that have one
    tok_dir = _tokenizer_dir(train_data)
    token_bytes = _token_bytes(tok_dir, cfg.model.vocab_size) if val_sets else None

    # Where the weights come from: a checkpoint of this run (resume), init_from, or a fresh init.
    resume_src = _resume_source(cfg, run_dir, resume)
    model, adapter_base = _build_model(cfg, resume_src, train_data.manifest["tokenizer"]["fingerprint"], say)
    model.to(device)
    if tc.parallel == "fsdp" and info.enabled and cfg.uses_lora:
        raise UserError("train.parallel=fsdp does not shard LoRA runs (their base is frozen and adapters are small); "
                        "use --train.parallel ddp")
    # DDP or FSDP2 and activation checkpointing wrap the model before the optimizer sees its parameters.
    train_model = distributed.parallelize(model, info, parallel=tc.parallel,
                                          activation_checkpointing=tc.activation_checkpointing)
    optimizer = build_optimizer(model, cfg.optim, device)
    objective = _objective(cfg, model, train_data, device, say)
    scaler = torch.amp.GradScaler(device.type) if dtype == torch.float16 else None

    step, tokens, best_val, elapsed_before = 0, 0, float("inf"), 0.0
    if resume_src is None and info.is_main:  # a fresh start: what a run killed before its first save logged goes
        (run_dir / "metrics.jsonl").unlink(missing_ok=True)
    metrics = MetricsWriter(run_dir, enabled=info.is_main,
                            trackers=make_trackers(cfg, run_dir) if info.is_main else ())
    if resume_src is not None:
        try:
            distributed.load_full_optimizer_state(model, optimizer, ckpt.read_optimizer(resume_src))
        except (KeyError, ValueError, RuntimeError) as e:
            raise UserError(f"{resume_src}/optimizer.pt: does not match this run's trainable parameters "
                            f"({type(e).__name__}: {e}); resume with the settings the run was saved with") from None
        step, tokens, best_val, elapsed_before = _restore_state(resume_src, loader)
        metrics.truncate_after(step)
        say(f"resumed from {resume_src} at step {step} ({fmt_count(tokens)} tokens seen)")

    # Derived settings, printed once.
    rows = tc.batch_size * (2 if train_data.kind == "dpo" else 1)  # DPO: batch_size counts (chosen, rejected) pairs
    tokens_per_step = rows * tc.seq_len * tc.grad_accum
    fpt = flops_per_token(cfg.model, tc.seq_len)
    peak, peak_src = peak_flops(device, dtype)
    params = count_params(model)
    if info.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        write_json_atomic(run_dir / "config.json", cfg.to_dict())
    say(f"run dir: {run_dir.resolve()} (config saved as config.json)")
    for line in cfg.summary():
        say(f"  {line}")
    if info.enabled:
        say(f"data parallel: {info.world_size} processes ({tc.parallel}) | {accum} micro-batch(es) per rank per step | "
            f"global batch {tokens_per_step:,} tokens/step as configured")
    say(f"stage: {tc.stage} | device: {device} | compute dtype: {str(dtype).removeprefix('torch.')} | "
        f"compile: {tc.compile} | activation checkpointing: {tc.activation_checkpointing} | "
        f"attention kernel: {tc.sdpa_backend}")
    active = f", {params['active'] / 1e6:.2f}M active per token" if params["active"] != params["total"] else ""
    say(f"model: {params['total'] / 1e6:.2f}M parameters ({params['trainable'] / 1e6:.2f}M trainable, "
        f"{params['non_embedding'] / 1e6:.2f}M non-embedding{active}) | {fpt / 1e6:.1f} MFLOPs/token (train)")
    val_tokens = sum(v.n_tokens for _, v in val_sets)
    say(f"data: {f'{len(loader.sets)} sets as a {loader.mode}, ' if several else ''}"
        f"{fmt_count(train_data.n_tokens)} train tokens, {fmt_count(val_tokens)} val tokens | "
        f"batch {tc.batch_size} x seq {tc.seq_len} x accum {tc.grad_accum} = {tokens_per_step:,} tokens/step"
        + ("" if several else f" | one epoch = {loader.epoch_windows / (tc.batch_size * tc.grad_accum):.1f} steps"))
    for line in loader.describe():
        say(f"data stream: {line}")
    for tracker in metrics.trackers:
        say(f"tracking: {tracker.describe()}")
    say(f"schedule: {cfg.optim.schedule}, lr {cfg.optim.lr:g} -> {cfg.optim.min_lr:g}, "
        f"warmup {cfg.optim.warmup_steps}, max_steps {tc.max_steps}"
        + (f", max_tokens {tc.max_tokens:,}" if tc.max_tokens else "")
        + (f", max_minutes {tc.max_minutes:g}" if tc.max_minutes else "")
        + f" | MFU peak: {peak / 1e12:.2f} TFLOP/s ({peak_src})")

    def compute() -> ExitStack:
        """The forward's context: mixed precision and the attention kernel."""
        stack = ExitStack()
        stack.enter_context(autocast(device, dtype))
        stack.enter_context(attention())
        return stack

    if tc.compile:
        from torch import _dynamo
        # Where the compiler cannot run (no C++ compiler for the CPU backend, an unsupported device), the
        # model runs uncompiled, with PyTorch's warning, instead of the run failing.
        _dynamo.config.suppress_errors = True
        train_model = torch.compile(train_model)
    model.train()

    def save(is_best: bool = False) -> Path:
        """Rank 0 writes (every rank holds the same weights and data position); the others wait for it."""
        path = run_dir / "checkpoints" / f"step-{step:08d}"
        if not weights_are_finite(model):
            raise UserError(f"step {step}: the weights hold NaN or inf values, so no checkpoint was written; the "
                            f"previous checkpoints are untouched: resume from them with a lower optim.lr "
                            f"(now {cfg.optim.lr:g})")
        # Gathered on every rank (a collective under FSDP); rank 0 gets the full tensors.
        weights = distributed.full_model_state(model) if distributed.is_sharded(model) else None
        optim_state = distributed.full_optimizer_state(model, optimizer)
        if info.is_main:
            state = {"tokens": tokens, "loader": loader.state_dict(), "rng": ckpt.rng_state(),
                     "best_val_loss": best_val if math.isfinite(best_val) else None,
                     "elapsed_s": elapsed_before + time.perf_counter() - t_start}
            path = ckpt.save_checkpoint(run_dir, step, model, optim_state, cfg, state, tokenizer_dir=tok_dir,
                                        keep_last=tc.keep_last, is_best=is_best, adapter_base=adapter_base,
                                        weights=weights)
        distributed.barrier(info)
        return path

    def run_eval() -> dict[str, float]:
        """Validation on each set's val split (eval_batches each); with several sets, per-set metrics as
        `val_loss/<name>` and their (mixture: weighted) mean as `val_loss`, which picks the best checkpoint."""
        if not val_sets:
            return {}
        t0 = time.perf_counter()
        model.eval()
        per_set = {}
        for name, val_data in val_sets:
            batches = (b.to(device) for b in
                       iter_eval_batches(val_data, tc.batch_size, tc.seq_len, tc.eval_batches))
            per_set[name] = objective.evaluate(model, batches, compute, token_bytes)
        res = loader.combine_eval(per_set)
        model.train()
        if not res:
            return {}
        res["eval_s"] = time.perf_counter() - t0
        metrics.write({"step": step, "tokens": tokens, **res})
        def shown(k: str) -> str:  # with several sets: the mean, then each set's value
            per = ", ".join(f"{name} {res[f'{k}/{name}']:.4f}" for name, _ in val_sets if f"{k}/{name}" in res)
            return f"{k.replace('_', ' ')} {res[k]:.4f}" + (f" ({per})" if per else "")
        line = " | ".join(shown(k) for k in res if k != "eval_s" and "/" not in k)
        say(f"step {step:>6} | {line} | eval {res['eval_s']:.1f}s")
        return res

    last_saved: Path | None = None
    evaluated_at = -1
    nonfinite_in_row, nonfinite_total, first_nonfinite = 0, 0, ""
    losses: dict[int, float] = {}
    stop_reason = "max_steps"
    t_start = time.perf_counter()
    t_window, tokens_window, tokens_step, steps_done_here = time.perf_counter(), 0, 0, 0
    say(f"setup took {t_start - t_setup:.1f}s; training from step {step}")

    with _StopFlag() as flag:
        while step < tc.max_steps:
            for event in loader.pop_events():  # a curriculum moved on during the last step
                say(f"step {step:>6} | {event['message']}")
                metrics.write({"step": step, "tokens": tokens, "event": "data_set", **event})
            if loader.exhausted:
                stop_reason = "data_done"
                break
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
            # Every target token (DPO: every pair) of the step weighs the same, whichever micro-batch and rank
            # it falls in: the step's units are counted first, over all ranks (see objectives.step_share).
            step_batches = [loader.next_batch() for _ in range(accum)]
            units = [objective.units(b) for b in step_batches]  # counted on the host: no device sync
            step_batches = [b.to(device, non_blocking=True) for b in step_batches]
            step_units = distributed.sum_across_ranks(sum(units), info)
            sums: dict[str, torch.Tensor] = {}  # metrics summed over the step's units, on this rank
            means: dict[str, torch.Tensor] = {}  # metrics of one micro-batch each (aux_loss), summed
            rng_at_start = _rng_state(device)  # to replay the step the same way if it turns out non-finite
            for micro, (batch, n) in enumerate(zip(step_batches, units)):
                # Gradients are reduced over the ranks in the last micro-batch's backward only.
                with distributed.grad_sync(train_model, sync=micro == accum - 1):
                    with compute():
                        out = objective(train_model, batch)
                    loss = out.weighted(n, step_units, info.world_size, accum)
                    (scaler.scale(loss) if scaler else loss).backward()
                for acc, values in ((sums, out.sums), (means, out.means)):
                    for k, v in values.items():
                        acc[k] = acc[k] + v if k in acc else v.clone()
                tokens_step += batch.x.numel()
            if scaler:
                scaler.unscale_(optimizer)
            max_norm = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else float("inf")
            grad_norm = distributed.local_value(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
            # A NaN/inf loss or gradient skips the update (fp16: the scaler already skips inf gradients).
            finite = step_is_finite(sums["loss"], None if scaler else grad_norm)
            if finite:
                nonfinite_in_row = 0
                if scaler:
                    scaler.step(optimizer)
                    scaler.update()
                else:
                    optimizer.step()
            else:
                if scaler:
                    scaler.update()
                optimizer.zero_grad(set_to_none=True)
                nonfinite_in_row += 1
                nonfinite_total += 1
                where = ""
                if nonfinite_in_row == 1:  # the first of a streak: replay it with hooks to name the layer
                    where = locate_nonfinite(model, lambda: _replay(objective, model, step_batches, units, step_units,
                                                                    info.world_size, compute, rng_at_start, device))
                loss_now = distributed.sum_across_ranks(sums["loss"], info).item() / max(step_units, 1)
                metrics.write({"step": step + 1, "tokens": tokens, "event": "nonfinite", "loss": str(loss_now),
                               "grad_norm": str(grad_norm.item()), "in_a_row": nonfinite_in_row,
                               "total": nonfinite_total, **({"where": where} if where else {})})
                say(f"step {step + 1:>6} | non-finite step (loss {loss_now}, grad norm {grad_norm.item()}): update "
                    f"skipped, {nonfinite_in_row} in a row of at most {tc.max_nonfinite_steps}"
                    + (f" | {where}" if where else ""))
                if where:
                    first_nonfinite = f"step {step + 1}, {where}"
            optimizer.zero_grad(set_to_none=True)
            step += 1
            steps_done_here += 1
            tokens_step *= info.world_size  # every rank consumed the same number of positions
            tokens += tokens_step
            tokens_window += tokens_step
            tokens_step = 0
            if nonfinite_in_row >= tc.max_nonfinite_steps:
                stop_reason = "nonfinite"
                break

            if step % tc.log_interval == 0 or step == tc.max_steps:
                # The host sync per log interval: the step's metrics over all ranks, each per unit of the step
                # (the loss is the token-weighted mean the gradient is of) or per micro-batch.
                logged = {k: distributed.sum_across_ranks(v, info).item() / max(step_units, 1)
                          for k, v in sums.items()}
                logged.update({k: distributed.sum_across_ranks(v, info).item() / (accum * info.world_size)
                               for k, v in means.items()})
                loss_val = logged.pop("loss")
                losses[step] = loss_val
                extra = "".join(f" | {k.replace('_', ' ')} {v:.4f}" for k, v in logged.items())
                loads = [layer.expert_load.tolist() for layer in moe_layers(model) if layer.expert_load is not None]
                if loads:
                    logged["expert_load"] = loads
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
                # With several data sets: where the step's last micro-batch came from (DataStream.position).
                where = {"data": loader.position()} if several else {}
                metrics.write({"step": step, "tokens": tokens, "loss": loss_val, **logged, "lr": lr,
                               "grad_norm": grad_norm.item(), "tokens_per_s": tok_s, "mfu": mfu,
                               "elapsed_s": elapsed, **where})
                shown_set = f" [{where['data']['set']} epoch {where['data']['epoch']}]" if several else ""
                say(f"step {step:>6}/{tc.max_steps}{shown_set} | loss {loss_val:.4f}{extra} | lr {lr:.2e} | "
                    f"grad {grad_norm.item():.3f} | {fmt_count(tok_s)} tok/s | MFU {mfu * 100:.1f}% | "
                    f"ETA {fmt_duration(remaining)}")
                t_window, tokens_window = time.perf_counter(), 0

            is_best = False
            if tc.eval_interval and step % tc.eval_interval == 0 and step < tc.max_steps:
                res = run_eval()
                evaluated_at = step
                if res and res["val_loss"] < best_val:
                    best_val, is_best = res["val_loss"], True
            if is_best or (tc.save_interval and step % tc.save_interval == 0):
                last_saved = save(is_best=is_best)

    # Final evaluation and checkpoint, unless this exact step is already evaluated (a run stopped by
    # max_tokens, max_minutes or Ctrl-C right after an evaluation) or saved.
    if steps_done_here or not ckpt.step_dirs(run_dir):
        res = run_eval() if evaluated_at != step else {}
        is_best = bool(res) and res["val_loss"] < best_val
        if is_best:
            best_val = res["val_loss"]
        if is_best or last_saved is None or last_saved.name != f"step-{step:08d}":
            last_saved = save(is_best=is_best)
    else:
        last_saved = ckpt.step_dirs(run_dir)[-1]
    metrics.write({"step": step, "tokens": tokens, "event": "stop", "reason": stop_reason})
    metrics.close()
    distributed.teardown(info)
    say(f"stopped at step {step} ({stop_reason}); {fmt_count(tokens)} tokens; "
        f"checkpoint: {last_saved}" + (f"; best val loss {best_val:.4f}" if math.isfinite(best_val) else ""))
    if stop_reason == "nonfinite":
        raise UserError(f"stopped: {nonfinite_in_row} steps in a row had a NaN/inf loss or gradient (first at "
                        f"{first_nonfinite}); their updates were skipped, so {last_saved} holds finite weights; "
                        f"lower optim.lr (now {cfg.optim.lr:g}) or raise optim.warmup_steps, check the data near "
                        f"that step, or raise train.max_nonfinite_steps, then --resume")
    return TrainResult(run_dir, step, tokens, last_saved, best_val, losses, stop_reason)
