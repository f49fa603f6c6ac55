"""The training stages, one registry entry each: `--stage NAME` looks it up here.

A stage says what the one training loop (nanolm/train/trainer.py) does differently for it, and nothing else:

- `name`, and `kinds`: the kinds of prepared data it trains on (`nanolm prepare --format KIND`);
- `fine_tunes`: whether it starts from trained weights (`train.init_from` is required);
- `defaults(base)`: what it changes in a preset before the user's file and overrides apply;
- `check(cfg)`: settings it needs, checked when the configuration is loaded and when a run starts;
- `objective(trainer)`: the batch -> loss function it trains (nanolm/train/objectives.py), built from the
  trainer's model, data and configuration;
- `tokens_per_step(cfg)`, `val_seq_len(cfg)`, `describe(cfg)`: how its steps are counted, how its validation
  split is cut, and a line for the start-of-run report;
- `section`: its own settings, a dataclass the configuration builds, validates, saves and prints under the
  stage's name (`--grpo.group_size`, `cfg.grpo`), and `shows_section(cfg)`: where the summary prints it;
- `activation_tokens(cfg)`, `copies(cfg, device, params)`: what it needs in memory beside the trained weights
  (nanolm/train/memory.py): the positions a micro-batch saves activations for, and the frozen references,
  teacher, rollout engine and critic it keeps;
- `card_measures`, `card_baseline`: its row of the report card (nanolm/eval/report.py); `block_model`: whether
  it trains input/output blocks (`nanolm generate` then writes the output block).

A new stage is one `Stage` subclass passed to `register` (tests/test_registries.py trains one step of a toy
stage, with a settings section of its own, that way). `register` adds it to nanolm/config/registry.py, where the
configuration and evaluation, below the trainer, look stages up; no module outside this one and the stages' own
(nanolm/train/rl/) names a stage (tests/test_stage_names.py).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from nanolm import checkpoint as ckpt
from nanolm.config import Config, registry
from nanolm.config.fields import check as _check
from nanolm.data.kinds import BlocksKind, ChatKind, PairsKind, PromptsKind, TextKind
from nanolm.data.stream import DataStream
from nanolm.errors import UserError
from nanolm.model import lora
from nanolm.train.distributed import DistInfo
from nanolm.train.rl.grpo import GRPOConfig, GRPOObjective
from nanolm.train.objectives import BlocksObjective, DistillObjective, DPOObjective, LMObjective, Objective
from nanolm.train.rl.ppo import PPOConfig, PPOObjective, value_model
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
    kinds: tuple[str, ...] = (TextKind.name, ChatKind.name)
    fine_tunes = False  # starts from trained weights: train.init_from is required
    trains_non_causal = False  # a non-causal model (model.causal false) trains with it
    prepare_hint = ""  # how to prepare the data it needs, where it needs its own kind
    data_hint = ""  # what the data only it trains on is called and how it trains, for the other stages' errors
    pretrains = False  # trains from scratch on one data set: warn when the plan repeats the data many times
    default = False  # the stage a configuration trains when none is named
    section: type | None = None  # its own settings: a dataclass, the config section named after the stage
    adapters = False  # trains LoRA adapters on a frozen base (Config.uses_lora)
    block_model = False  # trains input/output blocks: `nanolm generate` writes a run's output block
    # Its report-card row (nanolm/eval/report.py): what its held-out bits per byte are measured on, and the
    # baseline beside it: "text" (unigram, xz and uniform bits per byte of its text set), "initial" (the initial
    # model's, and the replies by source), or "" (none).
    card_measures = "text"
    card_baseline = ""

    def shows_section(self, cfg: Config) -> bool:
        """Whether the start-of-run summary prints the stage's section (where the run trains this stage)."""
        return cfg.train.stage == self.name

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

    def activation_tokens(self, cfg: Config) -> int:
        """The positions one micro-batch saves activations for in backward (nanolm/train/memory.py's floor)."""
        return cfg.train.batch_size * cfg.train.seq_len

    def copies(self, cfg: Config, device: torch.device, params: int) -> int:
        """Bytes of the models it keeps beside the trained one (frozen references, a teacher, the rollout engine,
        a critic), per process; `params`: the trained model's parameter count."""
        return 0


def register(cls: type[Stage]) -> type[Stage]:
    """Add a stage (a class decorator) to the registry (nanolm/config/registry.py); its `name` is what `--stage`
    takes, its `section` the settings the configuration then takes under that name."""
    registry.add(cls())
    return cls


def names() -> tuple[str, ...]:
    return registry.names()


def get(name: str) -> Stage:
    stage = registry.get(name)
    assert isinstance(stage, Stage), f"stage {name!r} was registered without nanolm.train.stages.register"
    return stage


def check_data(stage: Stage, kind: str, where: str) -> None:
    """A stage given data of a kind it does not train on: one line naming the fix."""
    if kind in stage.kinds:
        return
    owners = [s for s in map(get, names()) if kind in s.kinds and s.data_hint]
    fix = stage.prepare_hint or (owners[0].data_hint if owners else
                                 f"prepare {' or '.join(stage.kinds)} data with `nanolm prepare`")
    raise UserError(f"{where}: train.stage={stage.name} cannot train on {kind} data; {fix}")


@dataclass
class LoRAConfig:
    """Low-rank adapters for `train.stage = "lora"`: W x + (alpha / rank) * B A x on the target projections."""

    enabled: bool = False  # train adapters in any fine-tuning stage (dpo, distill); stage "lora" implies it
    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.05
    targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    # The dtype the frozen base's matrices (projections, embedding, head) are kept in: auto = bfloat16 when training
    # computes in bf16 (autocast casts every weight to it anyway: the same products, half the memory), else float32.
    base_dtype: str = "auto"

    def __post_init__(self) -> None:
        _check(self.base_dtype in ("auto", "float32", "bfloat16"),
               f"lora.base_dtype must be auto, float32 or bfloat16, got {self.base_dtype!r}")
        _check(self.rank > 0, f"lora.rank must be a positive integer, got {self.rank}")
        _check(self.alpha > 0, f"lora.alpha must be > 0, got {self.alpha}")
        _check(0.0 <= self.dropout < 1.0, f"lora.dropout must be in [0, 1), got {self.dropout}")
        self.targets = tuple(self.targets)
        _check(len(self.targets) > 0, "lora.targets must name at least one module (e.g. q_proj,v_proj)")


@dataclass
class DPOConfig:
    """Direct preference optimisation (`train.stage = "dpo"`)."""

    beta: float = 0.1  # how far the policy may move from the reference
    ref_from: str = ""  # the frozen reference checkpoint; "" = the initial weights (train.init_from)

    def __post_init__(self) -> None:
        _check(self.beta > 0, f"dpo.beta must be > 0, got {self.beta}")


@dataclass
class DistillConfig:
    """Knowledge distillation (`train.stage = "distill"`): loss = alpha * T^2 * KL(teacher_T || student_T)
    + (1 - alpha) * cross-entropy."""

    teacher: str = ""  # the teacher's run or checkpoint (same tokenizer as the data)
    temperature: float = 2.0
    alpha: float = 0.5

    def __post_init__(self) -> None:
        _check(self.temperature > 0, f"distill.temperature must be > 0, got {self.temperature}")
        _check(0.0 <= self.alpha <= 1.0, f"distill.alpha must be in [0, 1], got {self.alpha}")


def _float32_bytes(model_config: Any) -> int:
    """Bytes of a model's weights in float32 (as a checkpoint loads), counted on the meta device."""
    from nanolm.model.transformer import Transformer, count_params
    with torch.device("meta"):
        return 4 * count_params(Transformer(model_config))["total"]


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
    default = True
    card_baseline = "text"


@register
class SFT(Stage):
    """Supervised fine-tuning: next-token prediction on the targets chat data marks (the assistant's turns)."""

    name = "sft"
    fine_tunes = True
    card_measures = "assistant replies"
    card_baseline = "initial"

    def defaults(self, base: Config) -> dict[str, Any]:
        return _finetune_lr(base, 10, 100, 20)


@register
class LoRA(SFT):
    """SFT of low-rank adapters on a frozen base (`Config.uses_lora`)."""

    name = "lora"
    section = LoRAConfig  # any fine-tuning stage trains adapters with lora.enabled
    adapters = True

    def shows_section(self, cfg: Config) -> bool:
        return cfg.uses_lora

    def defaults(self, base: Config) -> dict[str, Any]:
        return _finetune_lr(base, 2, 20, 20)


@register
class DPO(Stage):
    """Direct preference optimisation on preference pairs, against a frozen reference."""

    name = "dpo"
    kinds = (PairsKind.name,)
    fine_tunes = True
    prepare_hint = "prepare preference pairs with `nanolm prepare --format pairs`"
    data_hint = "preference data trains with --stage dpo"
    section = DPOConfig
    card_measures = "assistant replies"

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

    def activation_tokens(self, cfg: Config) -> int:  # chosen and rejected
        return 2 * super().activation_tokens(cfg)

    def copies(self, cfg: Config, device: torch.device, params: int) -> int:
        return 0 if cfg.uses_lora else 4 * params  # the frozen reference (with LoRA: the base, adapters off)


@register
class Distill(Stage):
    """Knowledge distillation: a frozen teacher's token distributions, mixed with cross-entropy."""

    name = "distill"
    section = DistillConfig

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

    def copies(self, cfg: Config, device: torch.device, params: int) -> int:
        """The frozen teacher, of any size: its own model config, loaded in float32 as `objective` loads it."""
        return _float32_bytes(ckpt.read_model_config(ckpt.resolve_checkpoint(cfg.distill.teacher, "best")))


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

    kinds = (PromptsKind.name,)
    fine_tunes = True
    prepare_hint = "prepare RL prompts with `nanolm prepare --format prompts`"
    data_hint = "RL prompts train with --stage grpo or --stage ppo"

    def defaults(self, base: Config) -> dict[str, Any]:  # on-policy RL: small steps near the SFT model
        return _finetune_lr(base, 50, 50, 0)

    def val_seq_len(self, cfg: Config) -> int:  # any held-out prompt is one to decode
        return 1

    def kl_weight(self, cfg: Config) -> float:
        """The weight of the KL penalty to the frozen reference (0: no reference is kept)."""
        raise NotImplementedError

    def activation_tokens(self, cfg: Config) -> int:  # its micro-batches are rollouts, of lengths not configured
        return 0

    def copies(self, cfg: Config, device: torch.device, params: int) -> int:
        """The frozen reference (none with LoRA: the base with its adapters off) and the rollout engine's copy,
        in the dtype it decodes in (nanolm/train/rl/rollout.py)."""
        from nanolm.runtime import decode_dtype
        reference = 4 * params if self.kl_weight(cfg) > 0 and not cfg.uses_lora else 0
        engine = decode_dtype("auto", device, cfg.model, timer=None)[0]
        return reference + params * torch.finfo(engine).bits // 8


@register
class GRPO(RLStage):
    """RL from rewards: sampled completions of RL prompts, scored and weighed group-relatively."""

    name = "grpo"
    section = GRPOConfig

    def kl_weight(self, cfg: Config) -> float:
        return cfg.grpo.beta

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
    section = PPOConfig

    def kl_weight(self, cfg: Config) -> float:
        return cfg.ppo.kl_coef

    def copies(self, cfg: Config, device: torch.device, params: int) -> int:
        # and the critic: a copy of the policy, trained (float32 weights, gradients, two moments)
        return super().copies(cfg, device, params) + 16 * params

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
    kinds = (BlocksKind.name,)
    trains_non_causal = True
    block_model = True
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
