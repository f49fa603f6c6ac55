"""A run's checkpoints from the trainer's side (nanolm/train/trainer.py): which checkpoint a resume continues
from (the newest that verifies, checked against this run's config), restoring its optimizer state, companions,
data position, budget and RNG into the trainer, and saving a step. The on-disk layout is nanolm/checkpoint/'s.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nanolm import checkpoint as ckpt
from nanolm.config import Config
from nanolm.errors import UserError
from nanolm.io import first_line
from nanolm.progress import fmt_count
from nanolm.train import distributed, stages
from nanolm.train.numerics import weights_are_finite

Trainer = Any  # nanolm/train/trainer.py's, which imports this module


def newest_that_verifies(steps: list[Path]) -> tuple[Path, list[str]]:
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


def resume_source(cfg: Config, run_dir: Path, resume: bool) -> tuple[Path | None, list[str]]:
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
        resume_src, skipped = newest_that_verifies(steps)
        saved_cfg = ckpt.read_run_config(resume_src)
        if saved_cfg.model != cfg.model:
            raise UserError(f"{resume_src}/config.json: the checkpoint's model config differs from this run's; "
                            f"resume with the same model settings (saved: {saved_cfg.model})")
    elif ckpt.step_dirs(run_dir):
        raise UserError(f"{run_dir}: already holds checkpoints of a run; pass --resume to continue it, or choose "
                        f"another --out for a new run")
    if stages.get(tc.stage).fine_tunes and not tc.init_from:
        raise UserError(f"train.stage={tc.stage} fine-tunes a trained model; pass --init-from <pretrained run or "
                        f"checkpoint>")
    return resume_src, skipped


def restore(t: Trainer, src: Path) -> None:
    """Continue checkpoint `src` of this run: optimizer state (and each companion's weights and optimizer
    state), then state.json into the data stream and RNG."""
    parts = [(t.model, t.optimizer, ckpt.OPTIMIZER)]
    for name, c in t.companions.items():
        ckpt.load_companion(src, name, c.module)
        parts.append((c.module, t.companion_optimizers[name], ckpt.companion_files(name)[1]))
    for module, optimizer, file in parts:
        try:
            distributed.load_full_optimizer_state(module, optimizer, ckpt.read_optimizer(src, file))
        except (KeyError, ValueError, RuntimeError) as e:
            raise UserError(f"{src}/{file}: does not match this run's trainable parameters "
                            f"({type(e).__name__}: {e}); resume with the settings the run was saved with") \
                from None
    state = ckpt.read_json(src / "state.json", "training state")
    try:  # a damaged state.json: a missing field, a wrong type, an RNG state of the wrong size
        step, tokens = int(state["step"]), int(state["tokens"])
        if step < 0 or tokens < 0:
            raise ValueError(f"step {step}, tokens {tokens}")
        t.best.restore(state)
        t.elapsed_before = float(state.get("elapsed_s", 0.0))
        t.budget.restore(state)
        t.data.load_state_dict(state["loader"])
        ckpt.set_rng_state(state["rng"])
    except UserError as e:  # the data position does not fit this data
        raise UserError(f"{src}/state.json: {e}") from None
    except (KeyError, TypeError, ValueError, AttributeError, RuntimeError) as e:
        raise UserError(f"{src}/state.json: damaged training state ({type(e).__name__}: {first_line(e)}); "
                        "resume from an earlier checkpoint (move this one away) or start a new run") from None
    t.step, t.tokens = step, tokens
    t.metrics.truncate_after(step)
    t.say(f"resumed from {src} at step {step} ({fmt_count(tokens)} tokens seen)")


def save_step(t: Trainer, is_best: bool = False) -> Path:
    """A checkpoint of this step. Rank 0 writes (every rank holds the same weights and data position); the
    others wait for it."""
    path = t.run_dir / "checkpoints" / f"step-{t.step:08d}"
    if not weights_are_finite(t.model):
        raise UserError(f"step {t.step}: the weights hold NaN or inf values, so no checkpoint was written; "
                        f"the previous checkpoints are untouched: resume from them with a lower optim.lr "
                        f"(now {t.cfg.optim.lr:g})")
    # Gathered on every rank (a collective under FSDP); rank 0 gets the full tensors.
    weights = distributed.full_model_state(t.model) if distributed.is_sharded(t.model) else None
    optim_state = distributed.full_optimizer_state(t.model, t.optimizer)
    companions = {name: (ckpt.model_state(c.module),
                         distributed.full_optimizer_state(c.module, t.companion_optimizers[name]))
                  for name, c in t.companions.items()}
    if t.info.is_main:
        state = {"tokens": t.tokens, "loader": t.data.state_dict(), "rng": ckpt.rng_state(),
                 **t.best.state(),
                 "elapsed_s": t.elapsed(), **t.budget.state()}
        path = ckpt.save_checkpoint(t.run_dir, t.step, t.model, optim_state, t.cfg, state,
                                    tokenizer_dir=t.tok_dir, keep_last=t.cfg.train.keep_last,
                                    is_best=is_best, adapter_base=t.adapter_base, weights=weights,
                                    companions=companions)
    distributed.barrier(t.info)
    return path
