"""The one training loop, in parts that can be called and tested alone.

Every stage runs through a `Trainer`:

- `Trainer(cfg, resume=...)` sets everything up from the config: this
  process's place in a torchrun launch, the data stream, the model with its
  weights (a checkpoint of this run when resuming, `train.init_from`, or a
  fresh init), the optimizer, the stage's objective, and on a resume the
  optimizer state, data position and RNG, so that the losses after a resume
  equal those of an uninterrupted run;
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
  intervals, and evaluates and saves once more at the end. With
  `train.max_steps = 0` the schedule is fitted to the budget: a token budget
  fixes max_steps at the start, a time budget after the first
  `schedule.probe_steps` steps (all inside the warmup, whose learning rates do
  not depend on it) from their measured rate, and once more a quarter into
  that plan from the rate of the whole loop since (evaluations included, and
  robust to a busy moment in the probe); state.json records the decision, so a
  resumed run keeps it.

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
from nanolm.data.loader import iter_eval_batches
from nanolm.data.shards import Batch
from nanolm.data.sources import DataStream
from nanolm.errors import UserError
from nanolm.io import first_line, write_json_atomic
from nanolm.model import lora
from nanolm.model.moe import moe_layers
from nanolm.model.transformer import count_params, flops_per_token
from nanolm.progress import fmt_count, fmt_duration
from nanolm.runtime import attention_kernel, autocast, seed_everything, train_dtype
from nanolm.train import distributed
from nanolm.train.metrics import MetricsWriter, log, make_trackers, peak_flops
from nanolm.train.numerics import locate_nonfinite, step_is_finite, weights_are_finite
from nanolm.train.optim import build_optimizer
from nanolm.train.schedule import lr_at, probe_steps, steps_for_time, steps_for_tokens
from nanolm.train.grpo import GRPOObjective, step_metrics
from nanolm.train.objectives import BlocksObjective, DistillObjective, DPOObjective, LMObjective, Objective


@dataclass
class TrainResult:
    run_dir: Path
    step: int
    tokens: int
    last_checkpoint: Path | None
    best_val_loss: float  # the best value of train.best_metric as minimised: val_loss, or minus a task score
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


# A planned run that sees its training tokens more often than this is warned about at the start.
SEEN_TIMES_WARNING = 4


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


def _tokenizer_of(src: Path) -> str | None:
    """The fingerprint of the tokenizer checkpoint `src` was trained with; None when it does not hold it."""
    from nanolm.tokenizer import Tokenizer
    return Tokenizer.load(src).fingerprint if (src / "tokenizer.json").is_file() else None


def _newest_that_verifies(steps: list[Path]) -> tuple[Path, list[str]]:
    """The newest checkpoint whose weights and optimizer state match the CRC-32s its state.json recorded, and a
    line for each newer one that did not (left in place: the resumed run writes those steps again)."""
    skipped: list[str] = []
    for src in reversed(steps):
        try:
            ckpt.verify_checkpoint(src)
            return src, skipped
        except UserError as e:
            skipped.append(str(e))
    raise UserError(f"{skipped[0]} (and no earlier checkpoint of the run verifies either; start anew, or from "
                    "its weights with --init-from if only the optimizer state is damaged)")


def _resume_source(cfg: Config, run_dir: Path, resume: bool) -> tuple[Path | None, list[str]]:
    """The checkpoint a resume continues from (the run's newest that verifies), after checking it fits this
    config, and the newer ones passed over; None for a fresh start, which a run directory that already holds
    checkpoints refuses. Workers that torchrun restarted (`--max-restarts`, after a process died) resume from
    the newest checkpoint of the run they were started for, or start it anew when it saved none."""
    tc = cfg.train
    resume_src: Path | None = None
    skipped: list[str] = []
    if not resume and distributed.restart_count() and ckpt.step_dirs(run_dir):
        resume = True
    if resume:
        steps = ckpt.step_dirs(run_dir)
        if not steps:
            raise UserError(f"{run_dir}: nothing to resume (no checkpoints/step-*); drop --resume to start anew")
        resume_src, skipped = _newest_that_verifies(steps)
        saved_cfg = ckpt.read_run_config(resume_src)
        if saved_cfg.model != cfg.model:
            raise UserError(f"{resume_src}/config.json: the checkpoint's model config differs from this run's; "
                            f"resume with the same model settings (saved: {saved_cfg.model})")
    elif ckpt.step_dirs(run_dir):
        raise UserError(f"{run_dir}: already holds checkpoints of a run; pass --resume to continue it, or choose "
                        f"another --out for a new run")
    if tc.stage in ("sft", "lora", "dpo", "grpo") and not tc.init_from:
        raise UserError(f"train.stage={tc.stage} fine-tunes a trained model; pass --init-from <pretrained run or "
                        f"checkpoint>")
    return resume_src, skipped


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

        # One data set (data.path) or a curriculum/mixture of several (data.sets); see nanolm/data/sources.py.
        self.data = DataStream.from_config(cfg, rank=info.rank, world_size=info.world_size)
        if self.data.vocab_size > cfg.model.vocab_size:
            raise UserError(f"{self.data.sets[0].path}: the data's tokenizer has {self.data.vocab_size} tokens but "
                            f"model.vocab_size is {cfg.model.vocab_size}; set --model.vocab_size "
                            f"{self.data.vocab_size}")
        # An attention kernel this device cannot run stops the run here, before anything is written.
        self.attention = attention_kernel(tc.sdpa_backend, self.device, self.dtype, cfg.model.head_dim,
                                          masked=self.data.is_chat)
        # [(set name, val split)] of the sets that have one (RL prompts: any held-out prompt is one to decode)
        self.val_sets = self.data.val_sets(1 if tc.stage == "grpo" else tc.seq_len)
        self.tok_dir = _tokenizer_dir(self.data)
        self.token_bytes = _token_bytes(self.tok_dir, cfg.model.vocab_size) if self.val_sets else None
        self.tasks, self.task_tok = self._eval_tasks()  # train.eval_tasks: read now, so a bad file stops the start

        resume_src, skipped = _resume_source(cfg, self.run_dir, resume)
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
        self.optimizer = build_optimizer(self.model, cfg.optim, self.device)
        self.objective = self._objective()
        self.scaler = torch.amp.GradScaler(self.device.type) if self.dtype == torch.float16 else None

        self.step, self.tokens, self.best_val, self.elapsed_before = 0, 0, float("inf"), 0.0
        self.clock = time.perf_counter  # the clock of max_minutes, elapsed_s and the step rate of a budget fit
        # The steps the schedule decays over: configured, or fitted to the budget (None until the fit is made).
        self.max_steps: int | None = tc.max_steps or None
        self.budget_fit: dict[str, Any] | None = None  # how a fitted max_steps was chosen (state.json)
        if self.max_steps is None and tc.max_tokens and not tc.max_minutes:
            self._fit(steps_for_tokens(tc.max_tokens, self.tokens_per_step), {"rule": "max_tokens"}, announce=False)
        if resume_src is None and info.is_main:  # a fresh start: what a run killed before its first save logged
            (self.run_dir / "metrics.jsonl").unlink(missing_ok=True)
        self.metrics = MetricsWriter(self.run_dir, enabled=info.is_main,
                                     trackers=make_trackers(cfg, self.run_dir) if info.is_main else ())
        if resume_src is not None:
            self._restore(resume_src)
        if info.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            write_json_atomic(self.run_dir / "config.json", cfg.to_dict())
        if tc.compile:
            self.train_model = torch.compile(self.train_model)
        self.model.train()
        self.fpt = flops_per_token(cfg.model, tc.seq_len)  # training FLOPs per token, for MFU
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
            theirs, ours = _tokenizer_of(weights), self.data.manifest["tokenizer"]["fingerprint"]
            if theirs not in (None, ours):  # its weights are tied to the ids of its tokenizer
                raise UserError(f"{weights}: --init-from was trained with tokenizer {theirs[:12]}, but the data was "
                                f"prepared with {ours[:12]}, so its token ids mean other text; prepare the data "
                                f"with {weights / 'tokenizer.json'}")
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
        return model, adapter_base

    def _eval_tasks(self) -> tuple[list, Any]:
        """The benchmarks of train.eval_tasks (each its first eval_task_items items unless its spec says n) and
        the tokenizer they are scored with; ([], None) when there are none."""
        tc = self.cfg.train
        if not tc.eval_tasks and not tc.degeneration_samples:
            return [], None
        if self.tok_dir is None:
            raise UserError("train.eval_tasks / train.degeneration_samples need the data's tokenizer, which its "
                            "manifest does not point to; prepare the data with `nanolm prepare --tokenizer DIR` and "
                            "keep that directory")
        from nanolm.eval.runner import load_task, parse_task_spec
        from nanolm.tokenizer import Tokenizer
        tasks = []
        for spec in tc.eval_tasks:
            parsed = parse_task_spec(spec)
            parsed.n = parsed.n or tc.eval_task_items
            tasks.append(load_task(parsed))
        names = [t.task.name for t in tasks]
        if tc.best_metric != "val_loss" and tc.best_metric.split("/")[1] not in names:
            raise UserError(f"train.best_metric={tc.best_metric}: no task of that name in train.eval_tasks (names: "
                            f"{', '.join(names)}); name it as the table does, or add name=... to its spec")
        needs_engine = tc.degeneration_samples or any(t.task.kind == "gen" for t in tasks)
        if needs_engine and tc.parallel == "fsdp" and self.info.enabled:
            raise UserError("generative eval_tasks and train.degeneration_samples decode with the engine, which needs "
                            "whole weights; under train.parallel=fsdp use multiple-choice tasks only")
        return tasks, Tokenizer.load(self.tok_dir)

    def _task_scores(self) -> dict[str, float]:
        """train.eval_tasks and the degeneration samples, scored with the current weights (on every rank: under
        FSDP the forward is collective; each rank gets the same numbers)."""
        from nanolm.eval.runner import evaluate_tasks, task_metrics
        tc = self.cfg.train
        engine = None
        if tc.degeneration_samples or any(t.task.kind == "gen" for t in self.tasks):
            from nanolm.infer.engine import Engine
            engine = Engine(self.model, self.device)  # a copy of this step's weights, for decoding
        with self.compute():
            results = evaluate_tasks(self.model, self.task_tok, self.tasks, chat_default=self.data.is_chat,
                                     batch_size=tc.batch_size, device=self.device, engine=engine)
        out = task_metrics(results)
        if tc.degeneration_samples and self.val_sets:
            from nanolm.config import SamplingParams
            from nanolm.eval.degeneration import degeneration_scores, sample_completions
            val = self.val_sets[0][1]
            prompts = []
            for b in iter_eval_batches(val, tc.batch_size, min(32, tc.seq_len), None):
                prompts += [row.tolist() for row in b.x]
                if len(prompts) >= tc.degeneration_samples:
                    break
            params = SamplingParams(max_new_tokens=64, seed=tc.seed)
            scores = degeneration_scores(sample_completions(engine, prompts[:tc.degeneration_samples], params,
                                                            (self.task_tok.eot_id, self.task_tok.im_end_id)))
            out.update({f"degen/{k}": scores[k] for k in ("distinct_1", "distinct_2", "loop_fraction")})
        return out

    def _best_score(self, val: dict[str, float]) -> float | None:
        """The number train.best_metric minimises: the validation loss (for GRPO, minus the mean validation
        reward), or minus a task score."""
        metric = self.cfg.train.best_metric
        if metric == "val_loss":
            return -val["val_reward"] if "val_reward" in val else val.get("val_loss")
        return -val[metric] if metric in val else None

    def _frozen(self, model: torch.nn.Module, src: Path, what: str) -> torch.nn.Module:
        """`model` (a DPO reference, a distillation teacher, built from checkpoint `src`) frozen on this device."""
        self.say(f"{what}: {src} ({count_params(model)['total'] / 1e6:.2f}M parameters)")
        return model.to(self.device).eval().requires_grad_(False)

    def _objective(self) -> Objective:
        """The stage's batch -> loss function, checked against the kind of data it is given."""
        cfg, stage, kind = self.cfg, self.cfg.train.stage, self.data.kind
        where = cfg.data.path or ", ".join(s.path for s in cfg.data.sets)
        if not cfg.model.causal and stage != "blocks":
            raise UserError(f"model.causal is false: a non-causal model trains only with --stage blocks on "
                            f"`nanolm prepare --format blocks` data, not train.stage={stage}; drop "
                            "--model.causal false for this stage")
        if (stage == "blocks") != (kind == "blocks"):
            fix = ("prepare input/output records with `nanolm prepare --format blocks`" if stage == "blocks"
                   else "block data trains with --stage blocks")
            raise UserError(f"{where}: train.stage={stage} cannot train on {kind} data; {fix}")
        if stage == "blocks":
            T, causal = cfg.train.seq_len, cfg.model.causal
            need = 2 * T - 1 if causal else T  # a causal model reads both blocks as one sequence
            if need > cfg.model.max_seq_len:
                raise UserError(f"model.max_seq_len={cfg.model.max_seq_len} is shorter than the {need} positions a "
                                f"{'causal' if causal else 'non-causal'} model reads of blocks of train.seq_len {T}"
                                f"{' (input and output as one sequence)' if causal else ''}; set --model.max_seq_len "
                                f"{need} or lower --seq-len")
            return BlocksObjective(self.model, cfg.model.aux_loss_coef, causal)
        if (stage == "grpo") != (kind == "prompts"):
            fix = ("prepare RL prompts with `nanolm prepare --format prompts`" if stage == "grpo"
                   else "RL prompts train with --stage grpo")
            raise UserError(f"{where}: train.stage={stage} cannot train on {kind} data; {fix}")
        if stage == "grpo":
            return self._grpo_objective()
        if (stage == "dpo") != (kind == "dpo"):
            fix = ("prepare preference pairs with `nanolm prepare --format dpo`" if stage == "dpo"
                   else "preference data trains with --stage dpo")
            raise UserError(f"{where}: train.stage={stage} cannot train on {kind} data; {fix}")
        lm = LMObjective(self.model, cfg.model.aux_loss_coef)
        if stage == "dpo":
            if cfg.uses_lora:  # the reference is the same model with its adapters off: no second copy
                return DPOObjective(cfg.dpo.beta, None, lora.disable_adapters)
            # The frozen reference: dpo.ref_from, else the initial weights (train.init_from), as the policy is
            # built (its max_seq_len may have been raised for the pairs).
            src = ckpt.resolve_checkpoint(cfg.dpo.ref_from or cfg.train.init_from, "best")
            return DPOObjective(cfg.dpo.beta, self._frozen(ckpt.build_model(cfg.model, src), src, "DPO reference"))
        if stage == "distill":
            src = ckpt.resolve_checkpoint(cfg.distill.teacher, "best")
            theirs, ours = _tokenizer_of(src), self.data.manifest["tokenizer"]["fingerprint"]
            if theirs is None:
                raise UserError(f"{src}: the teacher checkpoint holds no tokenizer.json, so its tokenizer cannot be "
                                f"checked against the data's; use a checkpoint written by nanolm train")
            if theirs != ours:
                raise UserError(f"{src}: the teacher was trained with another tokenizer ({theirs[:12]}) than the "
                                f"data's ({ours[:12]}); distillation compares token distributions, so both must "
                                f"use the same tokenizer: prepare the data with the teacher's tokenizer")
            teacher = ckpt.load_model(src)[0]  # any size: its own model config
            return DistillObjective(self._frozen(teacher, src, "distillation teacher"), cfg.distill.temperature,
                                    cfg.distill.alpha, self.data.vocab_size, lm)
        return lm

    def _grpo_objective(self) -> GRPOObjective:
        """The GRPO stage's objective: the data's tokenizer, the rewards, and the reference (the initial weights
        frozen; for LoRA the model with its adapters off; none when grpo.beta is 0)."""
        from nanolm.tokenizer import Tokenizer
        from nanolm.train.rewards import Rewards
        cfg, g = self.cfg, self.cfg.grpo
        if cfg.train.parallel == "fsdp" and self.info.enabled:
            raise UserError("train.parallel=fsdp does not run --stage grpo (the rollout engine decodes from a full "
                            "copy of the weights); use --train.parallel ddp")
        if self.tok_dir is None:
            raise UserError(f"{cfg.data.path}: the prompts' tokenizer ({self.data.manifest['tokenizer'].get('path')}) "
                            "is not at hand, and sampling needs it; prepare the prompts again with a tokenizer "
                            "directory that stays in place")
        rewards = Rewards.from_spec(g.rewards, thinking=g.thinking, length_min=g.length_min,
                                    length_max=g.length_max, reward_model=g.reward_model, device=str(self.device))
        reference, switch = None, None
        if g.beta > 0:
            if cfg.uses_lora:  # the reference is the same model with its adapters off: no second copy
                switch = lora.disable_adapters
            else:
                src = ckpt.resolve_checkpoint(cfg.train.init_from, "best")
                reference = self._frozen(ckpt.build_model(cfg.model, src), src, "GRPO reference")
        return GRPOObjective(g, Tokenizer.load(self.tok_dir), rewards, reference=reference, disable_adapters=switch,
                             device=self.device, rank=self.info.rank, world_size=self.info.world_size,
                             compute=self.compute)

    def _restore(self, src: Path) -> None:
        """Continue checkpoint `src` of this run: optimizer state, then state.json into the data stream and RNG."""
        try:
            distributed.load_full_optimizer_state(self.model, self.optimizer, ckpt.read_optimizer(src))
        except (KeyError, ValueError, RuntimeError) as e:
            raise UserError(f"{src}/optimizer.pt: does not match this run's trainable parameters "
                            f"({type(e).__name__}: {e}); resume with the settings the run was saved with") from None
        state = ckpt.read_json(src / "state.json", "training state")
        try:  # a damaged state.json: a missing field, a wrong type, an RNG state of the wrong size
            step, tokens = int(state["step"]), int(state["tokens"])
            if step < 0 or tokens < 0:
                raise ValueError(f"step {step}, tokens {tokens}")
            best = state.get("best_val_loss")  # of train.best_metric, as minimised (a task score negated)
            self.best_val = float(best) if best is not None else float("inf")
            self.elapsed_before = float(state.get("elapsed_s", 0.0))
            if self.cfg.train.max_steps == 0 and state.get("budget_fit"):  # the fitted schedule, as decided
                self.max_steps, self.budget_fit = int(state["budget_fit"]["max_steps"]), dict(state["budget_fit"])
            self.data.load_state_dict(state["loader"])
            ckpt.set_rng_state(state["rng"])
        except UserError as e:  # the data position does not fit this data
            raise UserError(f"{src}/state.json: {e}") from None
        except (KeyError, TypeError, ValueError, AttributeError, RuntimeError) as e:
            raise UserError(f"{src}/state.json: damaged training state ({type(e).__name__}: {first_line(e)}); "
                            "resume from an earlier checkpoint (move this one away) or start a new run") from None
        self.step, self.tokens = step, tokens
        self.metrics.truncate_after(step)
        self.say(f"resumed from {src} at step {step} ({fmt_count(tokens)} tokens seen)")

    @property
    def tokens_per_step(self) -> int:
        """Input positions of one optimizer step as configured (DPO: batch_size counts (chosen, rejected) pairs)."""
        tc = self.cfg.train
        if self.data.kind == "prompts":  # GRPO: at most, every completion of the step at its longest
            return tc.batch_size * tc.grad_accum * self.cfg.grpo.group_size * self.cfg.grpo.max_new_tokens
        if self.data.kind == "blocks":  # a causal model reads the input and output blocks as one sequence
            return tc.batch_size * (2 * tc.seq_len - 1 if self.cfg.model.causal else tc.seq_len) * tc.grad_accum
        return tc.batch_size * (2 if self.data.kind == "dpo" else 1) * tc.seq_len * tc.grad_accum

    def report(self) -> None:
        """The derived settings, printed once at the start."""
        cfg, tc, info, data = self.cfg, self.cfg.train, self.info, self.data
        several = len(data.sets) > 1
        params = count_params(self.model)
        self.say(f"run dir: {self.run_dir.resolve()} (config saved as config.json)")
        for line in cfg.summary():
            self.say(f"  {line}")
        if cfg.note:
            self.say(cfg.note)
        if info.enabled:
            self.say(f"data parallel: {info.world_size} processes ({tc.parallel}) | {self.accum} micro-batch(es) per "
                     f"rank per step | global batch {self.tokens_per_step:,} tokens/step as configured")
        self.say(f"stage: {tc.stage} | device: {self.device} | compute dtype: {str(self.dtype).removeprefix('torch.')}"
                 f" ({self.dtype_why}) | compile: {tc.compile} | activation checkpointing: "
                 f"{tc.activation_checkpointing} | attention kernel: {tc.sdpa_backend}")
        active = f", {params['active'] / 1e6:.2f}M active per token" if params["active"] != params["total"] else ""
        self.say(f"model: {params['total'] / 1e6:.2f}M parameters ({params['trainable'] / 1e6:.2f}M trainable, "
                 f"{params['non_embedding'] / 1e6:.2f}M non-embedding{active}) | {self.fpt / 1e6:.1f} MFLOPs/token "
                 "(train)")
        val_tokens = sum(v.n_tokens for _, v in self.val_sets)
        self.say(f"data: {f'{len(data.sets)} sets as a {data.mode}, ' if several else ''}"
                 f"{fmt_count(data.n_tokens)} train tokens, {fmt_count(val_tokens)} val tokens | "
                 f"batch {tc.batch_size} x seq {tc.seq_len} x accum {tc.grad_accum} = {self.tokens_per_step:,} "
                 f"tokens/step" + ("" if several else
                                   f" | one epoch = {data.epoch_windows / (tc.batch_size * tc.grad_accum):.1f} steps"))
        for line in data.describe():
            self.say(f"data stream: {line}")
        if tc.stage == "grpo":
            g = cfg.grpo
            self.say(f"grpo: {tc.batch_size} prompts x {g.group_size} completions (at most {g.max_new_tokens} tokens)"
                     f" per micro-batch, {tc.grad_accum} micro-batch(es) per step, {g.inner_epochs} update(s) per "
                     f"rollout | loss {g.loss}, {g.average} average, beta {g.beta:g} | rewards {g.rewards} | "
                     f"validation: greedy on up to {tc.eval_batches * tc.batch_size} held-out prompts")
        for s in data.sets:  # which rule made each set's val split (the manifest's split_policy)
            rule = s.data.manifest.get("split_policy", {}).get("summary")
            if rule:
                self.say(f"val split{f' of {s.name}' if several else ''}: {rule}")
        for tracker in self.metrics.trackers:
            self.say(f"tracking: {tracker.describe()}")
        if tc.max_steps:
            steps = f"max_steps {self.max_steps}"
        elif self.budget_fit:
            steps = self._fit_text()
        else:
            steps = (f"max_steps fitted to the time budget at the step rate of the first "
                     f"{probe_steps(cfg.optim.warmup_steps)} steps")
        muon = (f" (AdamW; Muon matrices {cfg.optim.muon_lr:g} x the same factor)" if cfg.optim.name == "muon"
                else "")
        self.say(f"schedule: {cfg.optim.schedule}, lr {cfg.optim.lr:g} -> {cfg.optim.min_lr:g}{muon}, "
                 f"warmup {cfg.optim.warmup_steps}, {steps}"
                 + (f", max_tokens {tc.max_tokens:,}" if tc.max_tokens else "")
                 + (f", max_minutes {tc.max_minutes:g}" if tc.max_minutes else "")
                 + f" | MFU peak: {self.peak / 1e12:.2f} TFLOP/s ({self.peak_src})")
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
        lr = lr_at(self.step, cfg.optim, self.max_steps or cfg.optim.warmup_steps + 1)
        for group in self.optimizer.param_groups:  # Muon's groups scale the schedule (nanolm/train/optim.py)
            group["lr"] = lr * group.get("lr_scale", 1.0)
        if batches is None:
            batches = [self.data.next_batch() for _ in range(self.accum)]
        extra: dict[str, float] = {}
        if isinstance(self.objective, GRPOObjective):  # prompts -> scored completions of the current policy
            batches, extra = self._rollout(batches)
        units = [self.objective.units(b) for b in batches]  # counted on the host: no device sync
        batches = [b.to(device, non_blocking=True) for b in batches]
        step_units = distributed.sum_across_ranks(sum(units), info)
        t0 = time.perf_counter()
        # GRPO: grpo.inner_epochs updates over one rollout; every other stage: one.
        for _ in range(self.cfg.grpo.inner_epochs if extra else 1):
            sums, means, grad_norm, finite = self._update(batches, units, step_units)
            if not finite:
                break
        if extra:
            extra["update_s"] = time.perf_counter() - t0
            extra["generate_share"] = extra["generate_s"] / max(extra["generate_s"] + extra["update_s"]
                                                                + extra["score_s"], 1e-9)
        # the input positions the model read (an objective may read part of a batch); every rank takes as many
        positions = getattr(self.objective, "positions", lambda b: b.x.numel())
        tokens = sum(positions(b) for b in batches) * info.world_size
        self.step += 1
        self.tokens += tokens
        return StepResult(lr, step_units, len(batches) * info.world_size, tokens, grad_norm, finite, sums, means,
                          extra)

    def _rollout(self, prompts: list[Any]) -> tuple[list[Any], dict[str, float]]:
        """GRPO: this rank's prompt micro-batches -> rollout micro-batches, and the rollout's metrics over all
        ranks. The sampling seed of the step is drawn from the run's torch RNG (saved in checkpoints)."""
        objective = self.objective
        assert isinstance(objective, GRPOObjective)
        seed = int(torch.randint(0, 1 << 62, (1,)).item())
        rollouts = objective.rollout(self.model, prompts, seed)
        local = objective.last
        keys = sorted(local)
        totals = distributed.sum_across_ranks(torch.tensor([float(local[k]) for k in keys], dtype=torch.float64,
                                                           device=self.device), self.info).tolist()
        summed = dict(zip(keys, totals))
        extra = step_metrics(summed)
        # Times: this rank's (rank 0 logs); the score share is the rollout's time outside generation.
        extra.update(generate_s=local["generate_s"], score_s=local["rollout_s"] - local["generate_s"],
                     rollout_tok_s=summed["completion_tokens"] / self.info.world_size / max(local["generate_s"], 1e-9))
        return rollouts, extra

    def _update(self, batches: list[Any], units: list[int], step_units: int
                ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], torch.Tensor, bool]:
        """One optimizer update over the micro-batches (forward, backward, clip, step or skip)."""
        cfg, device = self.cfg, self.device
        rng = torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        with self._compiler_fallback():
            sums, means, _ = self._micro_batches(self.train_model, batches, units, step_units, sync=True)
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        max_norm = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else float("inf")
        grad_norm = distributed.local_value(torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm))
        # A NaN/inf loss or gradient skips the update (fp16: the scaler already skips inf gradients).
        finite = step_is_finite(sums["loss"], None if self.scaler else grad_norm)
        if finite:
            self.nonfinite_in_row = 0
            if self.scaler:
                self.scaler.step(self.optimizer)
                self.scaler.update()
            else:
                self.optimizer.step()
        else:
            if self.scaler:
                self.scaler.update()
            self._skipped(batches, units, step_units, rng, sums, grad_norm)
        self.optimizer.zero_grad(set_to_none=True)
        return sums, means, grad_norm, finite

    def _skipped(self, batches: list[Batch], units: list[int], step_units: int,
                 rng: tuple[torch.Tensor, torch.Tensor | None], sums: dict[str, torch.Tensor],
                 grad_norm: torch.Tensor) -> None:
        """Count and report a non-finite step; at the first of a streak, name where its first NaN/inf arose."""
        self.optimizer.zero_grad(set_to_none=True)
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
        """Validation on each set's val split (eval_batches each); with several sets, per-set metrics as
        `val_loss/<name>` and their (mixture: weighted) mean as `val_loss`, which picks the best checkpoint."""
        if not self.val_sets and not self.tasks:
            return {}
        tc = self.cfg.train
        t0 = time.perf_counter()
        self.model.eval()
        per_set = {}
        for name, val_data in self.val_sets:
            batches = (b.to(self.device) for b in iter_eval_batches(val_data, tc.batch_size, tc.seq_len,
                                                                    tc.eval_batches))
            per_set[name] = self.objective.evaluate(self.model, batches, self.compute, self.token_bytes)
        res = self.data.combine_eval(per_set) if per_set else {}
        if self.tasks or tc.degeneration_samples:  # benchmarks: task/<name>/acc, ... and degen/...
            res.update(self._task_scores())
        self.model.train()
        if not res:
            return {}
        res["eval_s"] = time.perf_counter() - t0
        self.metrics.write({"step": self.step, "tokens": self.tokens, **res})

        def shown(k: str) -> str:  # with several sets: the mean, then each set's value
            per = ", ".join(f"{name} {res[f'{k}/{name}']:.4f}" for name, _ in self.val_sets if f"{k}/{name}" in res)
            return f"{k.replace('_', ' ')} {res[k]:.4f}" + (f" ({per})" if per else "")
        line = " | ".join([shown(k) for k in res if k != "eval_s" and "/" not in k]
                          + [f"{k.removeprefix('task/').removeprefix('degen/').replace('/', ' ')} {v:.4f}"
                             for k, v in res.items() if k.startswith(("task/", "degen/"))])
        self.say(f"step {self.step:>6} | {line} | eval {res['eval_s']:.1f}s")
        return res

    def save(self, is_best: bool = False) -> Path:
        """A checkpoint of this step. Rank 0 writes (every rank holds the same weights and data position); the
        others wait for it."""
        path = self.run_dir / "checkpoints" / f"step-{self.step:08d}"
        if not weights_are_finite(self.model):
            raise UserError(f"step {self.step}: the weights hold NaN or inf values, so no checkpoint was written; "
                            f"the previous checkpoints are untouched: resume from them with a lower optim.lr "
                            f"(now {self.cfg.optim.lr:g})")
        # Gathered on every rank (a collective under FSDP); rank 0 gets the full tensors.
        weights = distributed.full_model_state(self.model) if distributed.is_sharded(self.model) else None
        optim_state = distributed.full_optimizer_state(self.model, self.optimizer)
        if self.info.is_main:
            state = {"tokens": self.tokens, "loader": self.data.state_dict(), "rng": ckpt.rng_state(),
                     "best_val_loss": self.best_val if math.isfinite(self.best_val) else None,
                     "elapsed_s": self.elapsed(), **({"budget_fit": self.budget_fit} if self.budget_fit else {})}
            path = ckpt.save_checkpoint(self.run_dir, self.step, self.model, optim_state, self.cfg, state,
                                        tokenizer_dir=self.tok_dir, keep_last=self.cfg.train.keep_last,
                                        is_best=is_best, adapter_base=self.adapter_base, weights=weights)
        distributed.barrier(self.info)
        return path

    def _best_shown(self) -> str:
        metric = self.cfg.train.best_metric
        if metric == "val_loss":
            return (f"val reward {-self.best_val:.4f}" if self.cfg.train.stage == "grpo"
                    else f"val loss {self.best_val:.4f}")
        return f"{metric} {-self.best_val:.4f}"

    def elapsed(self) -> float:
        """Seconds of training in this run so far, the runs it resumed included."""
        return self.elapsed_before + self.clock() - self.t_start

    def _fit(self, max_steps: int, how: dict[str, Any], announce: bool = True) -> None:
        """Fix the schedule's max_steps for a budget (train.max_steps 0), and say so (else report() does)."""
        tc = self.cfg.train
        if tc.max_tokens:  # a token budget caps a time budget's steps too
            max_steps = min(max_steps, steps_for_tokens(tc.max_tokens, self.tokens_per_step))
        self.max_steps = max(max_steps, self.step + 1)
        self.budget_fit = {"max_steps": self.max_steps, "at_step": self.step, **how}
        if announce:
            self.say(f"schedule: {self._fit_text()}")
            self._warn_repeats()

    def _fit_text(self) -> str:
        how = self.budget_fit or {}
        rate = (f" at {how['step_s']:.3f}s/step over steps {how['timed_steps']}" if "step_s" in how else "")
        return (f"max_steps {self.max_steps} fitted to {how.get('rule')}{rate}: warmup {self.cfg.optim.warmup_steps}, "
                f"then {self.cfg.optim.schedule} to step {self.max_steps}"
                + (" (note: no more steps than the warmup)" if self.max_steps <= self.cfg.optim.warmup_steps else ""))

    def _warn_repeats(self) -> None:
        """Warn when the planned steps see the training data more than SEEN_TIMES_WARNING times."""
        if self.max_steps is None or len(self.data.sets) > 1 or self.cfg.train.stage != "pretrain":
            return
        epochs = (self.max_steps - self.step) * self.tokens_per_step / max(1, self.data.n_tokens)
        if epochs > SEEN_TIMES_WARNING and len(self.data.sets) == 1:
            self.say(f"warning: the planned {self.max_steps} steps see the {fmt_count(self.data.n_tokens)} training "
                     f"tokens {epochs:.1f} times; past ~{SEEN_TIMES_WARNING} a model this size starts to memorise "
                     "them: use more data, or a smaller model or budget")

    def _fit_time(self, step_times: list[float]) -> None:
        """Fix max_steps for max_minutes from the timed steps (the first one, with its one-time costs, left out
        when there are others)."""
        tc = self.cfg.train
        timed = step_times[1:] or step_times
        step_s = sorted(timed)[len(timed) // 2]
        # A validation pass is a forward (about a third of a training step's work) of eval_batches micro-batches.
        eval_fraction = tc.eval_batches / (3 * self.accum)
        fitted = steps_for_time(tc.max_minutes * 60, self.elapsed(), self.step, step_s,
                                eval_interval=tc.eval_interval if self.val_sets else 0,
                                eval_step_fraction=eval_fraction if self.val_sets else 0.0)
        refit_at = self.step + max(1, (max(fitted, self.step + 1) - self.step) // 4)
        self._fit(fitted, {"rule": "max_minutes", "step_s": round(step_s, 6),
                           "timed_steps": f"{self.step - len(timed) + 1}-{self.step}", "refit_at": refit_at,
                           "elapsed_s": round(self.elapsed(), 6)})

    def _refit_time(self) -> None:
        """A quarter into the first fit's plan, fit max_steps again from the rate since that fit (all the loop's
        costs included: evaluations, saves, a machine that got busier or quieter), once; recorded as the first."""
        fit = self.budget_fit
        assert fit is not None
        tc = self.cfg.train
        rate = (self.elapsed() - fit["elapsed_s"]) / max(1, self.step - fit["at_step"])
        fitted = steps_for_time(tc.max_minutes * 60, self.elapsed(), self.step, rate,
                                eval_step_fraction=tc.eval_batches / (3 * self.accum) if self.val_sets else 0.0)
        first = fit["max_steps"]
        self._fit(fitted, {"rule": "max_minutes", "step_s": round(rate, 6),
                           "timed_steps": f"{fit['at_step'] + 1}-{self.step}", "first_fit": first}, announce=False)
        self.say(f"schedule: refit after step {self.step}: {self._fit_text()} (was {first})")

    # ------------------------------------------------------------------------------------------ the loop

    def _stop_reason(self, flag: _StopFlag) -> str | None:
        """Why the run stops before its next step, or None."""
        tc = self.cfg.train
        if self.max_steps is not None and self.step >= self.max_steps:
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

    def _log(self, res: StepResult, window: tuple[float, int]) -> None:
        """The step's line and metrics.jsonl record; window: (start time, tokens) of the log window."""
        tc, info = self.cfg.train, self.info
        logged = res.logged(info)
        logged.update(res.extra)
        loss = logged.pop("loss")
        if res.extra and res.extra["zero_var_groups"] > 0.5:
            self.say(f"step {self.step:>6} | warning: {res.extra['zero_var_groups']:.0%} of the groups have equal "
                     "rewards and teach nothing; raise grpo.group_size or grpo.temperature, or use prompts the "
                     "model solves sometimes (not always, not never)")
        self.losses[self.step] = loss
        shown = {k: v for k, v in logged.items() if not (k.endswith("_std") or k in ("generate_s", "score_s"))}
        extra = "".join(f" | {k.replace('_', ' ')} {v:.4f}" for k, v in shown.items())
        loads = [layer.expert_load.tolist() for layer in moe_layers(self.model) if layer.expert_load is not None]
        if loads:
            logged["expert_load"] = loads
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        tok_s = window[1] / (time.perf_counter() - window[0])
        mfu = tok_s * self.fpt / self.peak
        remaining = (self.max_steps - self.step) * self.tokens_per_step / tok_s if self.max_steps else math.inf
        if tc.max_tokens:
            remaining = min(remaining, max(0, tc.max_tokens - self.tokens) / tok_s)
        if tc.max_minutes:
            remaining = min(remaining, max(0.0, tc.max_minutes * 60 - self.elapsed()))
        several = len(self.data.sets) > 1
        # With several data sets: where the step's last micro-batch came from (DataStream.position).
        where = {"data": self.data.position()} if several else {}
        self.metrics.write({"step": self.step, "tokens": self.tokens, "loss": loss, **logged, "lr": res.lr,
                            "grad_norm": res.grad_norm.item(), "tokens_per_s": tok_s, "mfu": mfu,
                            "elapsed_s": self.elapsed(), **where})
        shown_set = f" [{where['data']['set']} epoch {where['data']['epoch']}]" if several else ""
        self.say(f"step {self.step:>6}/{self.max_steps or '?'}{shown_set} | loss {loss:.4f}{extra} | lr {res.lr:.2e} | "
                 f"grad {res.grad_norm.item():.3f} | {fmt_count(tok_s)} tok/s | MFU {mfu * 100:.1f}% | "
                 f"ETA {fmt_duration(remaining)}")

    def run(self) -> TrainResult:
        """Train until a stop condition, then evaluate and save once more; returns where it stopped."""
        tc = self.cfg.train
        self.report()
        self.losses: dict[int, float] = {}
        last_saved: Path | None = None
        evaluated_at, steps_done, stop_reason = -1, 0, "max_steps"
        self.t_start = self.clock()
        window = (time.perf_counter(), 0)
        step_times: list[float] = []  # of this run's first steps, while a time budget's fit waits for them
        self.say(f"setup took {self.t_start - self.t_setup:.1f}s; training from step {self.step}")
        with _StopFlag() as flag:
            while (reason := self._stop_reason(flag)) is None:
                t0 = self.clock()
                res = self.train_step()
                steps_done += 1
                if self.max_steps is None:
                    step_times.append(self.clock() - t0)
                    if len(step_times) >= probe_steps(self.cfg.optim.warmup_steps) or self.step > \
                            self.cfg.optim.warmup_steps:
                        self._fit_time(step_times)
                window = (window[0], window[1] + res.tokens)
                if self.nonfinite_in_row >= tc.max_nonfinite_steps:
                    reason = "nonfinite"
                    break
                if self.step % tc.log_interval == 0 or self.step == self.max_steps:
                    self._log(res, window)
                    window = (time.perf_counter(), 0)
                is_best = False
                if tc.eval_interval and self.step % tc.eval_interval == 0 and \
                        self.step < (self.max_steps or math.inf):
                    val = self.evaluate()
                    evaluated_at = self.step
                    score = self._best_score(val)
                    if score is not None and score < self.best_val:
                        self.best_val, is_best = score, True
                if self.budget_fit and self.step == self.budget_fit.get("refit_at"):  # after this step's eval
                    self._refit_time()
                if is_best or (tc.save_interval and self.step % tc.save_interval == 0):
                    last_saved = self.save(is_best=is_best)
            stop_reason = reason

        # Final evaluation and checkpoint, unless this exact step is already evaluated (a run stopped by
        # max_tokens, max_minutes or Ctrl-C right after an evaluation) or saved.
        if steps_done or not ckpt.step_dirs(self.run_dir):
            val = self.evaluate() if evaluated_at != self.step else {}
            score = self._best_score(val)
            is_best = score is not None and score < self.best_val
            if is_best:
                self.best_val = score
            if is_best or last_saved is None or last_saved.name != f"step-{self.step:08d}":
                last_saved = self.save(is_best=is_best)
        else:
            last_saved = ckpt.step_dirs(self.run_dir)[-1]
        self.metrics.write({"step": self.step, "tokens": self.tokens, "event": "stop", "reason": stop_reason})
        self.metrics.close()
        distributed.teardown(self.info)
        self.say(f"stopped at step {self.step} ({stop_reason}); {fmt_count(self.tokens)} tokens; checkpoint: "
                 f"{last_saved}" + (f"; best {self._best_shown()}" if math.isfinite(self.best_val) else ""))
        if stop_reason == "nonfinite":
            raise UserError(f"stopped: {self.nonfinite_in_row} steps in a row had a NaN/inf loss or gradient (first "
                            f"at {self.first_nonfinite}); their updates were skipped, so {last_saved} holds finite "
                            f"weights; lower optim.lr (now {self.cfg.optim.lr:g}) or raise optim.warmup_steps, check "
                            f"the data near that step, or raise train.max_nonfinite_steps, then --resume")
        return TrainResult(self.run_dir, self.step, self.tokens, last_saved, self.best_val, self.losses, stop_reason)


def train(cfg: Config, *, resume: bool = False, quiet: bool = False) -> TrainResult:
    """Run (or resume) training as configured. Returns where it stopped and what it saved."""
    return Trainer(cfg, resume=resume, quiet=quiet).run()
