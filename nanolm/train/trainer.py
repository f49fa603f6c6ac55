"""The one training loop, in parts that can be called and tested alone.

Every stage runs through a `Trainer`:

- `Trainer(cfg, resume=...)` sets everything up from the config: this
  process's place in a torchrun launch, the data stream, the model with its
  weights (a checkpoint of this run when resuming, `train.init_from`, or a
  fresh init), the stage's objective, the optimizer (and one for each module
  the objective trains beside the model, its `companions`: PPO's critic), and
  on a resume the optimizer state, companions, data position and RNG, so that
  the losses after a resume equal those of an uninterrupted run;
- `report()` prints the derived settings once;
- `train_step(batches)` is one optimizer step over this rank's micro-batches
  (the next `grad_accum / processes` of the stream when none are given): the
  learning rate of the step, every target token weighed alike over all
  micro-batches and ranks, mixed precision, gradient clipping, and the update,
  or its skip when the loss or gradient is not finite;
- `evaluate()` scores each data set's validation split; `save()` writes a
  checkpoint;
- `run()` repeats steps until `max_steps`, the token or time budget, the end
  of a curriculum or Ctrl-C, logging, evaluating and saving on the configured
  intervals, and evaluates and saves once more at the end.

What differs between stages is the stage's (nanolm/train/stages.py: its data
kinds, defaults and objective); the loop's components are apart: validation
and the best checkpoint's metric (validation.py), the schedule's length fitted
to a budget (budget.py), metrics and trackers (metrics.py), where a resume
continues from, its restored state and each step's checkpoint (resume.py), and
the start-of-run report and each logged step's line (runlog.py).

`train(cfg)` is `Trainer(cfg).run()`.
"""

from __future__ import annotations

import contextlib
import math
import signal
import sys
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from nanolm import checkpoint as ckpt
from nanolm.config import Config
from nanolm.data.shards import Batch
from nanolm.data.stream import DataStream
from nanolm.errors import UserError
from nanolm.io import write_json_atomic
from nanolm.model import lora
from nanolm.model.transformer import count_params, flops_per_token, head_flops_per_token
from nanolm.progress import fmt_count
from nanolm.runtime import attention_kernel, autocast, seed_everything, train_dtype
from nanolm.train import distributed, memory
from nanolm.train.metrics import MetricsWriter, log, make_trackers, peak_flops
from nanolm.train.numerics import locate_nonfinite, step_is_finite
from nanolm.train.optim import build_optimizer
from nanolm.train.budget import Budget
from nanolm.train.schedule import lr_at, probe_steps
from nanolm.train.sizing import USEFUL_PASSES
from nanolm.train.validation import Best, Validation
from nanolm.train import stages
from nanolm.train.objectives import Companion, Objective
from nanolm.train.resume import restore, resume_source, save_step
from nanolm.train.runlog import log_step, start_report


@dataclass
class TrainResult:
    run_dir: Path
    step: int
    tokens: int
    last_checkpoint: Path | None
    best_metric: str  # what picked the best checkpoint: val_loss, val_reward (GRPO) or task/<name>/<metric>
    best_value: float | None  # its best value (None: never evaluated)
    train_losses: dict[int, float] = field(default_factory=dict)
    stop_reason: str = ""


@dataclass
class StepResult:
    """What one optimizer step did. `sums` are this rank's metrics summed over its target tokens (DPO: pairs),
    `means` those of one micro-batch each (the MoE balance loss); `logged()` reduces them over the ranks."""

    lr: float
    units: int  # target tokens (DPO: pairs) of the step on all ranks
    micro_batches: int  # of the step on all ranks
    tokens: int  # input positions of the step on all ranks
    projected: int  # positions whose output projection the step computed, on all ranks (for MFU)
    grad_norm: torch.Tensor
    finite: bool
    sums: dict[str, torch.Tensor]
    means: dict[str, torch.Tensor]
    extra: dict[str, float] = field(default_factory=dict)  # GRPO: the rollout's metrics, over all ranks

    def logged(self, info: distributed.DistInfo) -> dict[str, float]:
        """The step's metrics over all ranks (a host sync): each per unit of the step (the loss is the
        token-weighted mean the gradient is of), or per micro-batch."""
        out = {k: distributed.sum_across_ranks(v, info).item() / max(self.units, 1) for k, v in self.sums.items()}
        out.update({k: distributed.sum_across_ranks(v, info).item() / self.micro_batches
                    for k, v in self.means.items()})
        return out


# A planned run that sees its training tokens more often than this is warned about at the start: the passes past
# which the default path cuts its schedule (measured, nanolm/train/sizing.py), so the default path never warns.
SEEN_TIMES_WARNING = USEFUL_PASSES


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


def _tokenizer_dir(data: DataStream) -> Path | None:
    path = Path(data.manifest.tokenizer.path or "")
    if path.is_file():
        path = path.parent
    return path if (path / "tokenizer.json").is_file() else None


class Trainer:
    """One run of the one training loop (see the module doc)."""

    def __init__(self, cfg: Config, *, resume: bool = False, quiet: bool = False) -> None:
        self.t_setup = time.perf_counter()
        self.cfg, tc = cfg, cfg.train
        self.run_dir = Path(tc.out_dir)
        self.info = info = distributed.setup(tc.device)  # one process, or this rank of a torchrun launch
        self.device = info.device
        self.dtype, self.dtype_why = train_dtype(tc.dtype, self.device, cfg.model.d_model)
        seed_everything(tc.seed)
        self.accum = distributed.per_rank_accum(tc.grad_accum, info)  # this rank's micro-batches per step
        self.quiet = quiet
        self.stage = stages.get(tc.stage)  # what this run trains: nanolm/train/stages.py
        self.stage.check(cfg)
        # A run that cannot fit in memory stops now, with the figures and the fix (nanolm/train/memory.py).
        self.memory_line = memory.check_fit(cfg, self.device, self.dtype, info.world_size)

        # One data set (data.path) or a curriculum/mixture of several (data.sets); see nanolm/data/stream.py.
        self.data = DataStream.from_config(cfg, rank=info.rank, world_size=info.world_size)
        if self.data.vocab_size > cfg.model.vocab_size:
            raise UserError(f"{self.data.sets[0].path}: the data's tokenizer has {self.data.vocab_size} tokens but "
                            f"model.vocab_size is {cfg.model.vocab_size}; set --model.vocab_size "
                            f"{self.data.vocab_size}")
        # An attention kernel this device cannot run stops the run here, before anything is written.
        self.attention = attention_kernel(tc.sdpa_backend, self.device, self.dtype, cfg.model.head_dim,
                                          masked=self.data.segments)
        # [(set name, val split)] of the sets that have one (RL prompts: any held-out prompt is one to decode)
        self.tok_dir = _tokenizer_dir(self.data)
        # held-out data, benchmarks and degeneration samples: read now, so a bad task file stops the start
        self.validation = Validation(cfg, self.data, self.stage.val_seq_len(cfg), self.tok_dir,
                                     self.device, fsdp=tc.parallel == "fsdp" and info.enabled)
        self.val_sets = self.validation.val_sets

        resume_src, skipped = resume_source(cfg, self.run_dir, resume)
        if skipped and info.is_main:  # said even when quiet: a newer checkpoint is passed over
            print("\n".join(skipped) + f"\nresuming from {resume_src} instead, the newest checkpoint that verifies",
                  file=sys.stderr, flush=True)
        self.model, self.adapter_base = self._policy(resume_src)
        self.model.to(self.device)
        if tc.parallel == "fsdp" and info.enabled and cfg.optim.name == "muon":
            raise UserError("optim.name=muon orthogonalises each whole weight matrix, which train.parallel=fsdp "
                            "shards over the processes; use --train.parallel ddp (or --optim.name adamw)")
        if tc.parallel == "fsdp" and info.enabled and cfg.uses_lora:
            raise UserError("train.parallel=fsdp does not shard LoRA runs (their base is frozen and adapters are "
                            "small); use --train.parallel ddp")
        # DDP or FSDP2 and activation checkpointing wrap the model before the optimizer sees its parameters.
        self.train_model = distributed.parallelize(self.model, info, parallel=tc.parallel,
                                                   activation_checkpointing=tc.activation_checkpointing)
        self.objective = self._objective()
        self.optimizer = build_optimizer(self.model, cfg.optim, self.device)
        # Modules the objective trains beside the model (PPO's critic), each with an optimizer of its own.
        self.companions = self.objective.companions()
        self.companion_optimizers = {name: self._companion_optimizer(c) for name, c in self.companions.items()}
        self.scaler = torch.amp.GradScaler(self.device.type) if self.dtype == torch.float16 else None

        self.step, self.tokens, self.elapsed_before = 0, 0, 0.0
        self.best = Best.of(cfg, self.objective)  # what picks the best checkpoint, and its best value so far
        self.clock = time.perf_counter  # the clock of max_minutes, elapsed_s and the step rate of a budget fit
        # The steps the schedule decays over: configured, or fitted to the budget (nanolm/train/budget.py).
        self.budget = Budget(cfg, self.tokens_per_step, self.accum, bool(self.val_sets), self.say, self._warn_repeats)
        if resume_src is None and info.is_main:  # a fresh start: what a run killed before its first save logged
            (self.run_dir / "metrics.jsonl").unlink(missing_ok=True)
        self.metrics = MetricsWriter(self.run_dir, enabled=info.is_main,
                                     trackers=make_trackers(cfg, self.run_dir) if info.is_main else ())
        if resume_src is not None:
            restore(self, resume_src)
        if info.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            write_json_atomic(self.run_dir / "config.json", cfg.to_dict())
        if tc.compile:
            self.train_model = torch.compile(self.train_model)
        self.model.train()
        self.fpt = flops_per_token(cfg.model, tc.seq_len)  # training FLOPs per token, for MFU
        # of which the output projection's, counted only at the positions a step projects (StepResult.projected)
        self.fpt_head = head_flops_per_token(cfg.model)
        self.peak, self.peak_src = peak_flops(self.device, self.dtype)

        self.nonfinite_in_row, self.nonfinite_total, self.first_nonfinite = 0, 0, ""
        self.t_start = self.clock()  # the clock of max_minutes and of elapsed_s

    # ------------------------------------------------------------------------------------------ set-up

    def say(self, msg: str) -> None:
        log(msg, not self.quiet and self.info.is_main)

    def _policy(self, resume_src: Path | None) -> tuple[torch.nn.Module, dict[str, Any] | None]:
        """The model with its weights from a checkpoint of this run (resume), from train.init_from, or fresh;
        for LoRA, the frozen base with its adapters. Returns it (on the CPU) and, for LoRA, what its adapter
        checkpoints record about their base."""
        cfg, tc = self.cfg, self.cfg.train
        adapter_base, weights = None, resume_src
        if tc.init_from and (resume_src is None or cfg.uses_lora):
            # A LoRA run always rebuilds its frozen base from init_from; other runs resume all weights.
            weights = ckpt.resolve_checkpoint(tc.init_from, "best")
            if ckpt.is_adapter(weights):
                raise UserError(f"{weights}: --init-from needs a full checkpoint, not a LoRA adapter; merge it "
                                f"first with `nanolm lora merge`")
            self.check_tokenizer(weights, "--init-from", f"prepare the data with {weights / 'tokenizer.json'}")
        model = ckpt.build_model(cfg.model, weights)
        if weights is not None and weights != resume_src:
            self.say(f"initialised weights from {weights}")
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
            base_dtype, why = lora.base_dtype(cfg.lora.base_dtype, self.dtype)
            if base_dtype != torch.float32:
                n = lora.cast_base(model, base_dtype)
                self.say(f"LoRA: the frozen base ({n / 1e6:.2f}M weights: projections, embedding, head) kept in "
                         f"{str(base_dtype).removeprefix('torch.')} ({why})")
        return model, adapter_base

    def frozen(self, model: torch.nn.Module, src: Path, what: str) -> torch.nn.Module:
        """`model` (a DPO reference, a distillation teacher, built from checkpoint `src`) frozen on this device."""
        self.say(f"{what}: {src} ({count_params(model)['total'] / 1e6:.2f}M parameters)")
        return model.to(self.device).eval().requires_grad_(False)

    def check_tokenizer(self, src: Path, what: str, fix: str) -> None:
        """Checkpoint `src`'s weights are tied to the ids of its tokenizer: refuse one other than the data's."""
        theirs, ours = ckpt.tokenizer_fingerprint(src), self.data.manifest.tokenizer.fingerprint
        if theirs not in (None, ours):
            raise UserError(f"{src}: {what} was trained with another tokenizer ({theirs[:12]}) than the data's "
                            f"({ours[:12]}), so its token ids mean other text; {fix}")

    def _objective(self) -> Objective:
        """The stage's batch -> loss function, checked against the kind of data it is given."""
        cfg, stage = self.cfg, self.stage
        if not cfg.model.causal and not stage.trains_non_causal:
            ways = " or ".join(f"--stage {s.name} on `nanolm prepare --format {s.kinds[0]}` data"
                               for s in map(stages.get, stages.names()) if s.trains_non_causal)
            raise UserError(f"model.causal is false: a non-causal model trains only with {ways}, not "
                            f"train.stage={stage.name}; drop --model.causal false for this stage")
        stages.check_data(stage, self.data.kind, cfg.data.path or ", ".join(s.path for s in cfg.data.sets))
        return stage.objective(self)

    def _companion_optimizer(self, companion: Companion) -> torch.optim.Optimizer:
        """The optimizer of a module trained beside the model: optim.* as the model's, its lr scaled."""
        companion.module.to(self.device)
        optimizer = build_optimizer(companion.module, self.cfg.optim, self.device)
        for group in optimizer.param_groups:
            group["lr_scale"] = group.get("lr_scale", 1.0) * companion.lr_scale
        return optimizer

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The model's optimizer, then each companion's."""
        return [self.optimizer, *self.companion_optimizers.values()]

    @property
    def tokens_per_step(self) -> int:
        """Input positions of one optimizer step as configured (the stage counts them)."""
        return self.stage.tokens_per_step(self.cfg)

    def report(self) -> None:
        """The derived settings, printed once at the start (nanolm/train/runlog.py)."""
        for line in start_report(self):
            self.say(line)
        self._warn_repeats()

    # ------------------------------------------------------------------------------------------ one step

    def compute(self) -> ExitStack:
        """The forward's context: mixed precision and the attention kernel."""
        stack = ExitStack()
        stack.enter_context(autocast(self.device, self.dtype))
        stack.enter_context(self.attention())
        return stack

    def _compiler_fallback(self) -> contextlib.AbstractContextManager:
        """While a compiled model runs: where the compiler cannot (no C++ compiler for the CPU backend, an
        unsupported device), the model runs uncompiled with PyTorch's warning instead of the run failing.
        Scoped to the step: nothing else in the process is changed."""
        if not self.cfg.train.compile:
            return contextlib.nullcontext()
        import torch._dynamo
        return torch._dynamo.config.patch(suppress_errors=True)

    def _micro_batches(self, model: torch.nn.Module, batches: list[Batch], units: list[int], step_units: int,
                       sync: bool) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], list[torch.Tensor]]:
        """Forward and backward of each micro-batch, each weighed by its share of the step's units (see
        losses.step_share). Returns this rank's metric sums, its per-micro-batch sums and the weighted
        losses. With `sync`, gradients are reduced over the ranks in the last micro-batch's backward only;
        without, the passes run on the bare model as they are (the replay of a non-finite step)."""
        sums: dict[str, torch.Tensor] = {}
        means: dict[str, torch.Tensor] = {}
        losses = []
        for micro, (batch, n) in enumerate(zip(batches, units)):
            with distributed.grad_sync(model, sync=not sync or micro == len(batches) - 1):
                with self.compute():
                    out = self.objective(model, batch)
                loss = out.weighted(n, step_units, self.info.world_size, len(batches))
                (self.scaler.scale(loss) if self.scaler and sync else loss).backward()
            losses.append(loss.detach())
            for acc, values in ((sums, out.sums), (means, out.means)):
                for k, v in values.items():
                    acc[k] = acc[k] + v if k in acc else v.clone()
        return sums, means, losses

    def train_step(self, batches: list[Batch] | None = None) -> StepResult:
        """One optimizer step over this rank's micro-batches (the data stream's next ones when none are given).

        Every target token (DPO: every pair) of the step weighs the same whichever micro-batch and rank it falls
        in: the step's units are counted first, over all ranks. A step whose loss or gradient norm is not finite
        is not applied (the first of a streak is replayed to name the layer where it began).
        """
        cfg, info, device = self.cfg, self.info, self.device
        # Before a time budget's fit, only warmup steps run, whose lr does not depend on max_steps.
        lr = lr_at(self.step, cfg.optim, self.budget.max_steps or cfg.optim.warmup_steps + 1)
        for group in (g for opt in self.optimizers for g in opt.param_groups):
            group["lr"] = lr * group.get("lr_scale", 1.0)  # Muon's groups scale the schedule (nanolm/train/optim.py)
        if batches is None:
            batches = [self.data.next_batch() for _ in range(self.accum)]
        # GRPO: prompts -> scored completions of the current policy, and the rollout's metrics
        batches, extra = self.objective.before_step(self.model, batches, self.info)
        units = [self.objective.units(b) for b in batches]  # counted on the host: no device sync
        # a compiled model projects every position (a shape that depends on the data would break its graph)
        projected = None if self.cfg.train.compile else sum(self.objective.projected(b) for b in batches)
        batches = [b.to(device, non_blocking=True) for b in batches]
        step_units = distributed.sum_across_ranks(sum(units), info)
        t0 = time.perf_counter()
        for _ in range(self.objective.updates):  # RL: several updates over one rollout
            sums, means, grad_norm, finite = self._update(batches, units, step_units)
            if not finite or self.objective.stop_updates(sums, step_units, info):
                break
        extra = self.objective.after_step(extra, time.perf_counter() - t0)
        # the input positions the model read (an objective may read part of a batch); every rank takes as many
        tokens = sum(self.objective.positions(b) for b in batches) * info.world_size
        projected = tokens if projected is None else projected * info.world_size
        self.step += 1
        self.tokens += tokens
        return StepResult(lr, step_units, len(batches) * info.world_size, tokens, projected, grad_norm, finite, sums,
                          means, extra)

    def _update(self, batches: list[Any], units: list[int], step_units: int
                ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], torch.Tensor, bool]:
        """One optimizer update over the micro-batches (forward, backward, clip, step or skip)."""
        cfg, device = self.cfg, self.device
        rng = torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        with self._compiler_fallback():
            sums, means, _ = self._micro_batches(self.train_model, batches, units, step_units, sync=True)
        companion_params = [p for c in self.companions.values() for p in c.module.parameters() if p.requires_grad]
        distributed.average_gradients(companion_params, self.info)  # the model's DDP wrapper reduces its own
        if self.scaler:
            for opt in self.optimizers:
                self.scaler.unscale_(opt)
        max_norm = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else float("inf")
        # One norm over the model's gradients and its companions' (as TRL clips a policy and its value model).
        params = [*self.model.parameters(), *companion_params]
        grad_norm = distributed.local_value(torch.nn.utils.clip_grad_norm_(params, max_norm))
        # A NaN/inf loss or gradient skips the update (fp16: the scaler already skips inf gradients).
        finite = step_is_finite(sums["loss"], None if self.scaler else grad_norm)
        if finite:
            self.nonfinite_in_row = 0
            for opt in self.optimizers:
                if self.scaler:
                    self.scaler.step(opt)
                else:
                    opt.step()
            if self.scaler:
                self.scaler.update()
        else:
            if self.scaler:
                self.scaler.update()
            self._skipped(batches, units, step_units, rng, sums, grad_norm)
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        return sums, means, grad_norm, finite

    def _skipped(self, batches: list[Batch], units: list[int], step_units: int,
                 rng: tuple[torch.Tensor, torch.Tensor | None], sums: dict[str, torch.Tensor],
                 grad_norm: torch.Tensor) -> None:
        """Count and report a non-finite step; at the first of a streak, name where its first NaN/inf arose."""
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        self.nonfinite_in_row += 1
        self.nonfinite_total += 1
        where = ""
        if self.nonfinite_in_row == 1:
            where = locate_nonfinite(self.model, lambda: self._replay(batches, units, step_units, rng))
        loss_now = distributed.sum_across_ranks(sums["loss"], self.info).item() / max(step_units, 1)
        self.metrics.write({"step": self.step + 1, "tokens": self.tokens, "event": "nonfinite", "loss": str(loss_now),
                            "grad_norm": str(grad_norm.item()), "in_a_row": self.nonfinite_in_row,
                            "total": self.nonfinite_total, **({"where": where} if where else {})})
        self.say(f"step {self.step + 1:>6} | non-finite step (loss {loss_now}, grad norm {grad_norm.item()}): update "
                 f"skipped, {self.nonfinite_in_row} in a row of at most {self.cfg.train.max_nonfinite_steps}"
                 + (f" | {where}" if where else ""))
        if where:
            self.first_nonfinite = f"step {self.step + 1}, {where}"

    def _replay(self, batches: list[Batch], units: list[int], step_units: int,
                rng: tuple[torch.Tensor, torch.Tensor | None]) -> list[torch.Tensor]:
        """The step's forward and backward passes again, with the RNG (dropout) as the step began; the run's own
        RNG stream is left as it was. Runs on the model itself, not its DDP wrapper: no gradient all-reduce."""
        device = self.device
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.set_rng_state(rng[0])
            if rng[1] is not None:
                torch.cuda.set_rng_state(rng[1], device)
            return self._micro_batches(self.model, batches, units, step_units, sync=False)[2]

    # ------------------------------------------------------------------------------------------ evaluate, save

    def evaluate(self) -> dict[str, float]:
        """Validation (nanolm/train/validation.py): each set's val split (eval_batches each; with several sets,
        per-set metrics as `val_loss/<name>` and their (mixture: weighted) mean as `val_loss`), the benchmarks
        and degeneration samples; logged and printed."""
        if not self.validation.active:
            return {}
        t0 = time.perf_counter()
        res = self.validation.scores(self.model, self.objective, self.compute)
        if not res:
            return {}
        res["eval_s"] = time.perf_counter() - t0
        self.metrics.write({"step": self.step, "tokens": self.tokens, **res})
        self.say(f"step {self.step:>6} | {self.validation.line(res)} | eval {res['eval_s']:.1f}s")
        return res

    def save(self, is_best: bool = False) -> Path:
        """A checkpoint of this step. Rank 0 writes (every rank holds the same weights and data position); the
        others wait for it."""
        return save_step(self, is_best)

    def elapsed(self) -> float:
        """Seconds of training in this run so far, the runs it resumed included."""
        return self.elapsed_before + self.clock() - self.t_start

    def _warn_repeats(self) -> None:
        """Warn when the planned steps see the training data more than SEEN_TIMES_WARNING times."""
        max_steps = self.budget.max_steps
        if max_steps is None or len(self.data.sets) > 1 or not self.stage.pretrains:
            return
        epochs = (max_steps - self.step) * self.tokens_per_step / max(1, self.data.n_tokens)
        # Compared as printed: a token cap rounded up to whole steps may pass the limit by a fraction of a step.
        if round(epochs, 1) > SEEN_TIMES_WARNING and len(self.data.sets) == 1:
            self.say(f"warning: the planned {max_steps} steps see the {fmt_count(self.data.n_tokens)} training "
                     f"tokens {epochs:.1f} times; past ~{SEEN_TIMES_WARNING:g} a model this size starts to memorise "
                     "them: use more data, or a smaller model or budget")

    # ------------------------------------------------------------------------------------------ the loop

    def _stop_reason(self, flag: _StopFlag) -> str | None:
        """Why the run stops before its next step, or None."""
        tc = self.cfg.train
        if self.budget.max_steps is not None and self.step >= self.budget.max_steps:
            return "max_steps"
        for event in self.data.pop_events():  # a curriculum moved on during the last step
            self.say(f"step {self.step:>6} | {event['message']}")
            self.metrics.write({"step": self.step, "tokens": self.tokens, "event": "data_set", **event})
        if self.data.exhausted:
            return "data_done"
        if tc.max_tokens and self.tokens >= tc.max_tokens:
            return "max_tokens"
        if tc.max_minutes and self.elapsed() >= tc.max_minutes * 60:
            return "max_minutes"
        return "interrupted" if flag.stop else None

    def run(self) -> TrainResult:
        """Train until a stop condition, then evaluate and save once more; returns where it stopped."""
        tc = self.cfg.train
        self.report()
        self.losses: dict[int, float] = {}
        last_saved: Path | None = None
        evaluated_at, steps_done, stop_reason = -1, 0, "max_steps"
        self.t_start = self.clock()
        window = (time.perf_counter(), 0, 0)
        step_times: list[float] = []  # of this run's first steps, while a time budget's fit waits for them
        self.say(f"setup took {self.t_start - self.t_setup:.1f}s; training from step {self.step}")
        with _StopFlag() as flag:
            while (reason := self._stop_reason(flag)) is None:
                t0 = self.clock()
                res = self.train_step()
                steps_done += 1
                if self.budget.max_steps is None:
                    step_times.append(self.clock() - t0)
                    if len(step_times) >= probe_steps(self.cfg.optim.warmup_steps) or self.step > \
                            self.cfg.optim.warmup_steps:
                        self.budget.fit_time(step_times, self.step, self.elapsed())
                window = (window[0], window[1] + res.tokens, window[2] + res.projected)
                if self.nonfinite_in_row >= tc.max_nonfinite_steps:
                    reason = "nonfinite"
                    break
                if self.step % tc.log_interval == 0 or self.step == self.budget.max_steps:
                    log_step(self, res, window)
                    window = (time.perf_counter(), 0, 0)
                is_best = False
                if tc.eval_interval and self.step % tc.eval_interval == 0 and \
                        self.step < (self.budget.max_steps or math.inf):
                    val = self.evaluate()
                    evaluated_at = self.step
                    is_best = self.best.improves(val)
                if self.budget.refit_due(self.step):  # after this step's eval
                    self.budget.refit_time(self.step, self.elapsed())
                if is_best or (tc.save_interval and self.step % tc.save_interval == 0):
                    last_saved = self.save(is_best=is_best)
            stop_reason = reason

        # Final evaluation and checkpoint, unless this exact step is already evaluated (a run stopped by
        # max_tokens, max_minutes or Ctrl-C right after an evaluation) or saved.
        if steps_done or not ckpt.step_dirs(self.run_dir):
            val = self.evaluate() if evaluated_at != self.step else {}
            is_best = self.best.improves(val)
            if is_best or last_saved is None or last_saved.name != f"step-{self.step:08d}":
                last_saved = self.save(is_best=is_best)
        else:
            last_saved = ckpt.step_dirs(self.run_dir)[-1]
        self.metrics.write({"step": self.step, "tokens": self.tokens, "event": "stop", "reason": stop_reason})
        self.metrics.close()
        distributed.teardown(self.info)
        best = f"; best {self.best.shown()}" if self.best.value is not None else ""
        self.say(f"stopped at step {self.step} ({stop_reason}); {fmt_count(self.tokens)} tokens; checkpoint: "
                 f"{last_saved}{best}")
        if stop_reason == "nonfinite":
            raise UserError(f"stopped: {self.nonfinite_in_row} steps in a row had a NaN/inf loss or gradient (first "
                            f"at {self.first_nonfinite}); their updates were skipped, so {last_saved} holds finite "
                            f"weights; lower optim.lr (now {self.cfg.optim.lr:g}) or raise optim.warmup_steps, check "
                            f"the data near that step, or raise train.max_nonfinite_steps, then --resume")
        return TrainResult(self.run_dir, self.step, self.tokens, last_saved, self.best.metric, self.best.value,
                           self.losses, stop_reason)


def train(cfg: Config, *, resume: bool = False, quiet: bool = False) -> TrainResult:
    """Run (or resume) training as configured. Returns where it stopped and what it saved."""
    return Trainer(cfg, resume=resume, quiet=quiet).run()
