"""The training stages, one registry entry each: `--stage NAME` looks it up here.

A stage says what the one training loop (nanolm/train/trainer.py) does differently for it, and nothing else:

- `name`, and `kinds`: the kinds of prepared data it trains on (`nanolm prepare --format KIND`);
- `fine_tunes`: whether it starts from trained weights (`train.init_from` is required);
- `defaults(base)`: what it changes in a preset before the user's file and overrides apply;
- `check(cfg)`: settings it needs, checked when the configuration is loaded and when a run starts;
- `objective(trainer)`: the batch -> loss function it trains (nanolm/train/objectives.py), built from the
  trainer's model, data and configuration;
- `tokens_per_step(cfg)`, `val_seq_len(cfg)`, `describe(cfg)`: how its steps are counted, how its validation
  split is cut, and a line for the start-of-run report.

A new stage is one `Stage` subclass passed to `register` (tests/test_registries.py trains one step of a toy
stage that way). The trainer, prepare and the configuration name no stage.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Protocol

import torch

from nanolm import checkpoint as ckpt
from nanolm.config import Config, GRPOConfig, PPOConfig
from nanolm.data.stream import DataStream
from nanolm.errors import UserError
from nanolm.model import lora
from nanolm.train.distributed import DistInfo
from nanolm.train.rl.grpo import GRPOObjective
from nanolm.train.objectives import BlocksObjective, DistillObjective, DPOObjective, LMObjective, Objective
from nanolm.train.rl.ppo import PPOObjective, value_model
from nanolm.train.rl.rewards import Rewards


class Trainer(Protocol):
    """What a stage's objective is built from: the run's trainer (nanolm/train/trainer.py)."""

    cfg: Config
    model: torch.nn.Module
    data: DataStream
    info: DistInfo
    device: torch.device
    tok_dir: Path | None

    def frozen(self, model: torch.nn.Module, src: Path, what: str) -> torch.nn.Module: ...

    def check_tokenizer(self, src: Path, what: str, why: str) -> None: ...

    def compute(self) -> AbstractContextManager: ...


class Stage:
    """One way of training: the defaults suit plain next-token training on text or chat data."""

    name = ""
    kinds: tuple[str, ...] = ("text", "chat")
    fine_tunes = False  # starts from trained weights: train.init_from is required
    trains_non_causal = False  # a non-causal model (model.causal false) trains with it
    prepare_hint = ""  # how to prepare the data it needs, where it needs its own kind
    data_hint = ""  # what the data only it trains on is called and how it trains, for the other stages' errors
    pretrains = False  # trains from scratch on one data set: warn when the plan repeats the data many times

    def defaults(self, base: Config) -> dict[str, Any]:
        """What the stage changes in preset `base` before the user's file and overrides apply."""
        return {}

    def check(self, cfg: Config) -> None:
        """Settings the stage needs; a one-line UserError naming the fix."""

    def objective(self, trainer: Trainer) -> Objective:
        return LMObjective(trainer.model, trainer.cfg.model.aux_loss_coef)

    def tokens_per_step(self, cfg: Config) -> int:
        """Input positions of one optimizer step as configured."""
        tc = cfg.train
        return tc.batch_size * tc.seq_len * tc.grad_accum

    def val_seq_len(self, cfg: Config) -> int:
        """The window length a validation split is cut into (a set whose split is shorter has none)."""
        return cfg.train.seq_len

    def describe(self, cfg: Config) -> str | None:
        """An extra line of the start-of-run report, or None."""
        return None


_REGISTRY: dict[str, Stage] = {}


def register(cls: type[Stage]) -> type[Stage]:
    """Add a stage (a class decorator); its `name` is what `--stage` takes."""
    if not cls.name or cls.name in _REGISTRY:
        raise ValueError(f"stage {cls.name!r}: a stage needs a name of its own")
    _REGISTRY[cls.name] = cls()
    return cls


def names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def get(name: str) -> Stage:
    if name not in _REGISTRY:
        raise UserError(f"train.stage must be one of {', '.join(_REGISTRY)}, got {name!r}")
    return _REGISTRY[name]


def check_data(stage: Stage, kind: str, where: str) -> None:
    """A stage given data of a kind it does not train on: one line naming the fix."""
    if kind in stage.kinds:
        return
    owners = [s for s in _REGISTRY.values() if kind in s.kinds and s.data_hint]
    fix = stage.prepare_hint or (owners[0].data_hint if owners else
                                 f"prepare {' or '.join(stage.kinds)} data with `nanolm prepare`")
    raise UserError(f"{where}: train.stage={stage.name} cannot train on {kind} data; {fix}")


def _finetune_lr(base: Config, lr_div: float, min_div: float, warmup: int) -> dict[str, Any]:
    lr = base.optim.lr
    return {"optim": {"lr": lr / lr_div, "min_lr": lr / min_div, "muon_lr": base.optim.muon_lr / lr_div,
                      "warmup_steps": warmup, "weight_decay": 0.0}}


# Fine-tuning starts from trained weights, so it takes smaller steps than pretraining, with short warmups as
# fine-tuning runs are short: SFT at a tenth of the preset's pretraining lr, decaying to a hundredth; LoRA
# trains only small fresh adapters, which tolerate half the pretraining lr; DPO, which must stay near its
# reference, a fiftieth, and GRPO and PPO too, at a constant lr. Distillation trains like pretraining.
# A Muon preset's matrix rate (optim.muon_lr) is divided alike: at the pretraining 0.02, 62 s of the
# quickstart's GRPO took its fine-tuned model's held-out calc from 56.5% to 0 (docs/rl.md).

@register
class Pretrain(Stage):
    """Next-token prediction from scratch (or from train.init_from)."""

    name = "pretrain"
    pretrains = True


@register
class SFT(Stage):
    """Supervised fine-tuning: next-token prediction on the targets chat data marks (the assistant's turns)."""

    name = "sft"
    fine_tunes = True

    def defaults(self, base: Config) -> dict[str, Any]:
        return _finetune_lr(base, 10, 100, 20)


@register
class LoRA(SFT):
    """SFT of low-rank adapters on a frozen base (`Config.uses_lora`)."""

    name = "lora"

    def defaults(self, base: Config) -> dict[str, Any]:
        return _finetune_lr(base, 2, 20, 20)


@register
class DPO(Stage):
    """Direct preference optimisation on preference pairs, against a frozen reference."""

    name = "dpo"
    kinds = ("pairs",)
    fine_tunes = True
    prepare_hint = "prepare preference pairs with `nanolm prepare --format pairs`"
    data_hint = "preference data trains with --stage dpo"

    def defaults(self, base: Config) -> dict[str, Any]:
        return _finetune_lr(base, 50, 500, 10)

    def objective(self, trainer: Trainer) -> Objective:
        cfg = trainer.cfg
        if cfg.uses_lora:  # the reference is the same model with its adapters off: no second copy
            return DPOObjective(cfg.dpo.beta, None, lora.disable_adapters)
        # The frozen reference: dpo.ref_from, else the initial weights (train.init_from), as the policy is built
        # (its max_seq_len may have been raised for the pairs).
        src = ckpt.resolve_checkpoint(cfg.dpo.ref_from or cfg.train.init_from, "best")
        return DPOObjective(cfg.dpo.beta, trainer.frozen(ckpt.build_model(cfg.model, src), src, "DPO reference"))

    def tokens_per_step(self, cfg: Config) -> int:  # batch_size counts (chosen, rejected) pairs
        return 2 * super().tokens_per_step(cfg)


@register
class Distill(Stage):
    """Knowledge distillation: a frozen teacher's token distributions, mixed with cross-entropy."""

    name = "distill"

    def check(self, cfg: Config) -> None:
        if not cfg.distill.teacher:
            raise UserError("train.stage=distill needs a teacher: pass --distill.teacher <run or checkpoint>")

    def objective(self, trainer: Trainer) -> Objective:
        cfg = trainer.cfg
        src = ckpt.resolve_checkpoint(cfg.distill.teacher, "best")
        if ckpt.tokenizer_fingerprint(src) is None:
            raise UserError(f"{src}: the teacher checkpoint holds no tokenizer.json, so its tokenizer cannot be "
                            f"checked against the data's; use a checkpoint written by nanolm train")
        trainer.check_tokenizer(src, "the teacher", "distillation compares token distributions, so both must use "
                                "the same tokenizer: prepare the data with the teacher's tokenizer")
        teacher = ckpt.load_model(src)[0]  # any size: its own model config
        lm = LMObjective(trainer.model, cfg.model.aux_loss_coef)
        return DistillObjective(trainer.frozen(teacher, src, "distillation teacher"), cfg.distill.temperature,
                                cfg.distill.alpha, trainer.data.vocab_size, lm)


def _rl_setup(trainer: Trainer, section: str) -> None:
    """What an RL stage needs of the run before it samples: a layout the engine decodes from, the tokenizer."""
    cfg = trainer.cfg
    if cfg.train.parallel == "fsdp" and trainer.info.enabled:
        raise UserError(f"train.parallel=fsdp does not run --stage {section} (the rollout engine decodes from a "
                        "full copy of the weights); use --train.parallel ddp")
    if trainer.tok_dir is None:
        raise UserError(f"{cfg.data.path}: the prompts' tokenizer ({trainer.data.manifest.tokenizer.path})"
                        " is not at hand, and sampling needs it; prepare the prompts again with a tokenizer "
                        "directory that stays in place")


def _rewards(trainer: Trainer, section: GRPOConfig | PPOConfig) -> Rewards:
    """The rewards of an RL stage's section (grpo, ppo: rewards, thinking, length window, reward model)."""
    return Rewards.from_spec(section.rewards, thinking=section.thinking, length_min=section.length_min,
                             length_max=section.length_max, reward_model=section.reward_model,
                             device=str(trainer.device), section=trainer.cfg.train.stage)


def _reference(trainer: Trainer, what: str) -> tuple[torch.nn.Module | None, Any]:
    """(frozen reference, adapter switch) of an RL stage's KL penalty: the initial weights frozen, or for LoRA
    the model with its adapters off (no second copy)."""
    cfg = trainer.cfg
    if cfg.uses_lora:
        return None, lora.disable_adapters
    src = ckpt.resolve_checkpoint(cfg.train.init_from, "best")
    return trainer.frozen(ckpt.build_model(cfg.model, src), src, what), None


def _tool_rounds(section: GRPOConfig | PPOConfig) -> str:
    """What describe() says of a trajectory with tools: the model's tokens over all its replies (the tool turns
    between them are neither counted nor trained)."""
    return (f" over up to {section.max_rounds} replies, calling tools {section.tools}; tool results not trained"
            if section.tools else "")


class RLStage(Stage):
    """What the RL stages share: RL prompts, trained weights to start from, small constant steps, validation by
    decoding held-out prompts."""

    kinds = ("prompts",)
    fine_tunes = True
    prepare_hint = "prepare RL prompts with `nanolm prepare --format prompts`"
    data_hint = "RL prompts train with --stage grpo or --stage ppo"

    def defaults(self, base: Config) -> dict[str, Any]:  # on-policy RL: small steps near the SFT model
        return _finetune_lr(base, 50, 50, 0)

    def val_seq_len(self, cfg: Config) -> int:  # any held-out prompt is one to decode
        return 1


@register
class GRPO(RLStage):
    """RL from rewards: sampled completions of RL prompts, scored and weighed group-relatively."""

    name = "grpo"

    def objective(self, trainer: Trainer) -> Objective:
        """The data's tokenizer, the rewards, and the reference (the initial weights frozen; for LoRA the model
        with its adapters off; none when grpo.beta is 0)."""
        from nanolm.tokenizer import Tokenizer
        g = trainer.cfg.grpo
        _rl_setup(trainer, self.name)
        rewards = _rewards(trainer, g)
        reference, switch = _reference(trainer, "GRPO reference") if g.beta > 0 else (None, None)
        return GRPOObjective(g, Tokenizer.load(trainer.tok_dir), rewards, reference=reference,
                             disable_adapters=switch, device=trainer.device, rank=trainer.info.rank,
                             world_size=trainer.info.world_size, compute=trainer.compute)

    def tokens_per_step(self, cfg: Config) -> int:  # at most: every completion of the step at its longest
        tc = cfg.train
        return tc.batch_size * tc.grad_accum * cfg.grpo.group_size * cfg.grpo.max_new_tokens

    def describe(self, cfg: Config) -> str | None:
        tc, g = cfg.train, cfg.grpo
        return (f"grpo: {tc.batch_size} prompts x {g.group_size} completions (at most {g.max_new_tokens} tokens"
                f"{_tool_rounds(g)}) per micro-batch, {tc.grad_accum} micro-batch(es) per step, {g.inner_epochs} "
                f"update(s) per rollout | loss {g.loss}, {g.average} average, beta {g.beta:g} | rewards {g.rewards} | "
                f"validation: greedy on up to {tc.eval_batches * tc.batch_size} held-out prompts")


@register
class PPO(RLStage):
    """RL from rewards with a learned critic: sampled completions of RL prompts, a per-token KL penalty, GAE."""

    name = "ppo"

    def objective(self, trainer: Trainer) -> Objective:
        """The data's tokenizer, the rewards, the reference (as GRPO's; none when ppo.kl_coef is 0) and the
        critic: ppo.critic_from, else the initial weights, its output projection a scalar head
        (nanolm/train/rl/ppo.py's `value_model`)."""
        from nanolm.tokenizer import Tokenizer
        cfg, p = trainer.cfg, trainer.cfg.ppo
        _rl_setup(trainer, self.name)
        rewards = _rewards(trainer, p)
        reference, switch = _reference(trainer, "PPO reference") if p.kl_coef > 0 else (None, None)
        if p.critic_from:
            src = ckpt.resolve_checkpoint(p.critic_from, "best")
            if ckpt.is_adapter(src):
                raise UserError(f"{src}: ppo.critic_from needs a full checkpoint, not a LoRA adapter; merge it first "
                                "with `nanolm lora merge`")
            trainer.check_tokenizer(src, "ppo.critic_from", "the critic reads the policy's token ids: start it "
                                    "from a checkpoint trained with the data's tokenizer")
            body = ckpt.load_model(src)[0]
            if body.config.max_seq_len < cfg.model.max_seq_len:
                raise UserError(f"{src}: ppo.critic_from reads at most {body.config.max_seq_len} positions, fewer "
                                f"than the policy's model.max_seq_len {cfg.model.max_seq_len}; start the critic "
                                "from a checkpoint with a window as long, or leave ppo.critic_from empty")
        else:
            body = ckpt.build_model(cfg.model, ckpt.resolve_checkpoint(cfg.train.init_from, "best"))
        critic = value_model(body).to(trainer.device).train()
        return PPOObjective(p, Tokenizer.load(trainer.tok_dir), rewards, critic, reference=reference,
                            disable_adapters=switch, device=trainer.device, rank=trainer.info.rank,
                            world_size=trainer.info.world_size, compute=trainer.compute)

    def tokens_per_step(self, cfg: Config) -> int:  # at most: every completion of the step at its longest
        tc, p = cfg.train, cfg.ppo
        return tc.batch_size * tc.grad_accum * p.samples_per_prompt * p.max_new_tokens

    def describe(self, cfg: Config) -> str | None:
        tc, p = cfg.train, cfg.ppo
        stop = f", stopped past approx KL {p.target_kl:g}" if p.target_kl > 0 else ""
        return (f"ppo: {tc.batch_size} prompts x {p.samples_per_prompt} completion(s) (at most {p.max_new_tokens} "
                f"tokens{_tool_rounds(p)}) per micro-batch, {tc.grad_accum} micro-batch(es) per step, "
                f"{p.inner_epochs} update(s) per rollout{stop} | epsilon {p.epsilon:g}, kl_coef {p.kl_coef:g} "
                f"({p.kl_estimator}), GAE gamma {p.gamma:g} lam {p.lam:g}, vf_coef {p.vf_coef:g}, value_clip "
                f"{p.value_clip:g} | rewards {p.rewards} | validation: greedy on up to "
                f"{tc.eval_batches * tc.batch_size} held-out prompts")


@register
class Blocks(Stage):
    """Input and output blocks (Nano's non-causal mode, or a causal model reading both as one sequence)."""

    name = "blocks"
    kinds = ("blocks",)
    trains_non_causal = True
    prepare_hint = "prepare input/output records with `nanolm prepare --format blocks`"
    data_hint = "block data trains with --stage blocks"

    def check(self, cfg: Config) -> None:
        T, causal = cfg.train.seq_len, cfg.model.causal
        need = 2 * T - 1 if causal else T  # a causal model reads both blocks as one sequence
        if need > cfg.model.max_seq_len:
            raise UserError(f"model.max_seq_len={cfg.model.max_seq_len} is shorter than the {need} positions a "
                            f"{'causal' if causal else 'non-causal'} model reads of blocks of train.seq_len {T}"
                            f"{' (input and output as one sequence)' if causal else ''}; set --model.max_seq_len "
                            f"{need} or lower --seq-len")

    def objective(self, trainer: Trainer) -> Objective:
        return BlocksObjective(trainer.model, trainer.cfg.model.aux_loss_coef, trainer.cfg.model.causal)

    def tokens_per_step(self, cfg: Config) -> int:  # a causal model reads the input and output as one sequence
        tc = cfg.train
        return tc.batch_size * (2 * tc.seq_len - 1 if cfg.model.causal else tc.seq_len) * tc.grad_accum
