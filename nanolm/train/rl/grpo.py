"""The GRPO stage's objective: rollouts from the current policy, their rewards, and the policy loss.

A step of `--stage grpo` (Trainer.train_step) takes this rank's micro-batches
of prompts (`PromptBatch`, batch_size prompts each), and `rollout` turns each
into a `Rollouts` micro-batch: grpo.group_size completions per prompt,
sampled, scored and laid out by the RL stages' `Sampler`
(nanolm/train/rl/rollout.py: the engine, each row's seed from the run's RNG and
its place in the step's stream of prompts, so a resume, micro-batches and
ranks sample what one uninterrupted process would). Advantages are
group-relative (nanolm/train/rl/formulas.py), and, where they are needed, the
behaviour policy's log-probabilities (grpo.inner_epochs > 1) and the
reference's (grpo.beta > 0) are computed once, without gradient.

The loss of a micro-batch (`__call__`) is the clipped surrogate or CISPO per
completion token plus beta x the k3 KL to the reference, summed over the
tokens (grpo.average = token: the step's units are its completion tokens, so
every token of the step weighs alike over micro-batches and ranks, DAPO's
token average) or as each completion's mean summed over completions
(sequence: the units are completions). A completion holds the tokens the
policy wrote and, when it stopped, its `<|im_end|>`; a completion cut at
max_new_tokens has no `<|im_end|>` to learn.

With grpo.tools, each completion is a trajectory of replies and tool turns
(nanolm/train/rl/agent.py): the row holds them all, the targets and the loss's
units only the model's own tokens.

`evaluate` decodes the held-out prompts greedily and reports their mean
reward (each reward's too), the completions' mean length and the fraction
cut at the limit.
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
import torch.nn as nn

from nanolm.config.fields import check as _check
from nanolm.data.kinds.prompts import PromptBatch
from nanolm.data.shards import IGNORE_INDEX
from nanolm.train import distributed
from nanolm.train.objectives import Loss, Objective, target_tokens, token_logps
from nanolm.train.rl.rewards import Rewards
from nanolm.train.rl.formulas import cispo, clipped_surrogate, group_advantages, k3_kl, token_sums, zero_variance_groups
from nanolm.train.rl.agent import sampler_for
from nanolm.train.rl.rollout import RolloutSums, Sampler, over_ranks, reference_logps, step_metrics


@dataclass
class GRPOConfig:
    """RL from rewards (`train.stage = "grpo"`): group_size sampled completions per prompt, group-relative
    advantages, a clipped (or CISPO) policy loss and a k3 KL penalty to the frozen initial model."""

    group_size: int = 8  # completions sampled per prompt (a group; its rewards are compared with each other)
    temperature: float = 1.0  # sampling of the completions
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_new_tokens: int = 256  # completion budget; a completion cut here counts in the `truncated` metric
    thinking: bool = False  # open a <think> block in the generation prompt (the chat template's thinking switch)
    scale_rewards: bool = True  # divide by the group's std (off: Dr. GRPO)
    loss: str = "grpo"  # grpo (PPO's clipped ratio) or cispo (clipped importance weight, stop-gradient)
    epsilon: float = 0.2  # clip ratios below 1 - epsilon
    epsilon_high: float = 0.2  # clip ratios above 1 + epsilon_high (DAPO's clip-higher: > epsilon)
    cispo_clip: float = 5.0  # cispo: the importance weight is clipped at this
    average: str = "token"  # token: every completion token of the step weighs alike (DAPO); sequence: each one
    beta: float = 0.04  # weight of the k3 KL to the reference; 0 drops the reference (no copy is kept)
    inner_epochs: int = 1  # optimizer updates per rollout batch (the behaviour log-probs are kept)
    rewards: str = "answer:1.0"  # weighted rewards by name (nanolm/train/rl/rewards.py), e.g. answer:1,format:0.2
    reward_model: str = ""  # a transformers sequence-classification directory, for the `model` reward
    length_min: int = 1  # the `length` reward's window, in characters of the reply
    length_max: int = 512
    tools: str = ""  # RL over tool calls: "" none, builtin, tools.json, file.py:function (comma-separated)
    max_rounds: int = 3  # with tools: the most replies of a trajectory (each but the last may call tools)
    compile_rollouts: bool = False  # torch.compile the rollouts' decode step at the first step (30-90 s on a CPU)

    def __post_init__(self) -> None:
        _check(self.max_rounds >= 1, f"grpo.max_rounds must be >= 1, got {self.max_rounds}")
        _check(self.group_size >= 2, f"grpo.group_size must be >= 2 (a group compares completions), got "
                                     f"{self.group_size}")
        _check(self.temperature > 0, f"grpo.temperature must be > 0 (the completions of a group must differ), "
                                     f"got {self.temperature}")
        _check(0 < self.top_p <= 1, f"grpo.top_p must be in (0, 1], got {self.top_p}")
        _check(self.top_k >= 0, f"grpo.top_k must be >= 0 (0 = off), got {self.top_k}")
        _check(self.max_new_tokens > 0, f"grpo.max_new_tokens must be > 0, got {self.max_new_tokens}")
        _check(self.loss in ("grpo", "cispo"), f"grpo.loss must be grpo or cispo, got {self.loss!r}")
        _check(0 < self.epsilon < 1, f"grpo.epsilon must be in (0, 1), got {self.epsilon}")
        _check(self.epsilon_high > 0, f"grpo.epsilon_high must be > 0, got {self.epsilon_high}")
        _check(self.cispo_clip > 0, f"grpo.cispo_clip must be > 0, got {self.cispo_clip}")
        _check(self.average in ("token", "sequence"), f"grpo.average must be token or sequence, got "
                                                      f"{self.average!r}")
        _check(self.beta >= 0, f"grpo.beta must be >= 0 (0 disables the KL penalty), got {self.beta}")
        _check(self.inner_epochs >= 1, f"grpo.inner_epochs must be >= 1, got {self.inner_epochs}")
        _check(self.length_min >= 0, f"grpo.length_min must be >= 0, got {self.length_min}")
        _check(self.length_max > 0 and self.length_max >= self.length_min,
               f"grpo.length_max must be > 0 and >= grpo.length_min ({self.length_min}), got {self.length_max}")


@dataclass
class Rollouts:
    """One micro-batch of completions: R = prompts x group_size rows, prompt then completion, right-padded.

    x, y (R, T): inputs and next-token targets, y = IGNORE_INDEX but at the completion's tokens;
    advantages (R,); old_logp, ref_logp (R, T) or None (behaviour and reference log-probs of y).
    """

    x: torch.Tensor
    y: torch.Tensor
    advantages: torch.Tensor
    old_logp: torch.Tensor | None = None
    ref_logp: torch.Tensor | None = None
    pos: None = None  # plain causal rows (the trainer's batches have these)
    seg: None = None

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "Rollouts":
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=non_blocking)
        return Rollouts(move(self.x), move(self.y), move(self.advantages), move(self.old_logp),  # type: ignore
                        move(self.ref_logp))

    @property
    def mask(self) -> torch.Tensor:
        return self.y != IGNORE_INDEX


class GRPOObjective(Objective):
    """The GRPO stage (see the module doc). The reference is a frozen model, the model with its LoRA adapters
    off (`disable_adapters`), or none at all when grpo.beta is 0."""

    def __init__(self, cfg: GRPOConfig, tokenizer: Any, rewards: Rewards, *, reference: nn.Module | None = None,
                 disable_adapters: Callable[[nn.Module], AbstractContextManager] | None = None,
                 device: torch.device, rank: int = 0, world_size: int = 1,
                 compute: Callable[[], AbstractContextManager]) -> None:
        if cfg.beta > 0 and (reference is None) == (disable_adapters is None):
            raise ValueError("grpo.beta > 0 needs exactly one of a reference model or an adapter switch")
        self.cfg = cfg
        self.sampler = sampler_for(cfg, tokenizer, rewards, device)
        self.reference, self.disable_adapters = reference, disable_adapters
        self.device, self.rank, self.world_size, self.compute = device, rank, world_size, compute
        self.last: dict[str, float] = {}  # this rank's sums of the last rollout (rewards, lengths, times)
        self.updates = cfg.inner_epochs  # optimizer updates per rollout
        self.best = ("val_reward", True)  # the held-out prompts' mean reward picks the best checkpoint

    # -------------------------------------------------------------------------------------- rollouts

    def rollout(self, model: nn.Module, batches: list[PromptBatch], step_seed: int) -> list[Rollouts]:
        """This rank's micro-batches of prompts -> micro-batches of scored completions (see the module doc);
        `self.last` gets this rank's sums of the rollout's metrics."""
        cfg, g = self.cfg, self.cfg.group_size
        t0 = time.perf_counter()
        out: list[Rollouts] = []
        sums = RolloutSums()
        sums.sums.update(groups=0, zero_var_groups=0)
        gen_s = 0.0
        model_was_training = model.training
        for m, pb in enumerate(batches):
            slot = m * self.world_size + self.rank  # where in the step's stream of prompts this batch is
            params = Sampler.seeded(cfg, step_seed, slot, len(pb.prompts), g)
            tg = time.perf_counter()
            sampled = self.sampler.sample_batch(model, pb, g, params)
            gen_s += time.perf_counter() - tg
            totals, per_name = self.sampler.score(pb, sampled)
            rewards = torch.tensor(totals, dtype=torch.float32)
            adv = group_advantages(rewards, g, scale=cfg.scale_rewards)
            out.append(Rollouts(*self.sampler.rows(pb, sampled), adv))
            sums.add(sampled, totals, per_name)
            sums.sums["groups"] += len(totals) // g
            sums.sums["zero_var_groups"] += int(zero_variance_groups(rewards, g).sum())
        out = [self._with_logps(model, b) for b in out]
        model.train(model_was_training)
        self.last = {**sums.sums, "generate_s": gen_s, "rollout_s": time.perf_counter() - t0}
        return out

    @torch.no_grad()
    def _with_logps(self, model: nn.Module, b: Rollouts) -> Rollouts:
        """b with the behaviour log-probs (inner_epochs > 1) and the reference's (beta > 0), on the device."""
        b = b.to(self.device)
        model.eval()  # no dropout in the log-probs the ratios compare with
        if self.cfg.inner_epochs > 1:
            with self.compute():
                b.old_logp = token_logps(model, b.x, b.y)
        if self.cfg.beta > 0:
            with self.compute():
                b.ref_logp = reference_logps(model, self.reference, self.disable_adapters, b.x, b.y)
        return b

    # -------------------------------------------------------------------------------------- the step's hooks

    def before_step(self, model: nn.Module, batches: list[PromptBatch], info: distributed.DistInfo
                    ) -> tuple[list[Rollouts], dict[str, float]]:
        """This rank's prompt micro-batches -> rollout micro-batches, and the rollout's metrics over all ranks.
        The sampling seed of the step is drawn from the run's torch RNG (saved in checkpoints)."""
        seed = int(torch.randint(0, 1 << 62, (1,)).item())
        rollouts = self.rollout(model, batches, seed)
        local = self.last
        summed = over_ranks({k: v for k, v in local.items() if not k.endswith("_s")}, info, self.device)
        extra = step_metrics(summed)
        # Times: this rank's (rank 0 logs); the score share is the rollout's time outside generation.
        extra.update(generate_s=local["generate_s"], score_s=local["rollout_s"] - local["generate_s"],
                     rollout_tok_s=summed["completion_tokens"] / info.world_size / max(local["generate_s"], 1e-9))
        return rollouts, extra

    def after_step(self, extra: dict[str, float], update_s: float) -> dict[str, float]:
        """The step's share of time spent generating, once its updates are timed."""
        extra["update_s"] = update_s
        extra["generate_share"] = extra["generate_s"] / max(extra["generate_s"] + update_s + extra["score_s"], 1e-9)
        return extra

    def warning(self, logged: dict[str, float]) -> str | None:
        if logged.get("zero_var_groups", 0.0) > 0.5:
            return (f"warning: {logged['zero_var_groups']:.0%} of the groups have equal rewards and teach nothing; "
                    "raise grpo.group_size or grpo.temperature, or use prompts the model solves sometimes (not "
                    "always, not never)")
        return None

    # -------------------------------------------------------------------------------------- the loss

    @staticmethod
    def projected(batch: Rollouts) -> int:
        """The completions' tokens (token_logps projects those alone)."""
        return target_tokens(batch)

    def units(self, batch: Rollouts) -> int:
        """Completion tokens (average = token) or completions with at least one token (sequence)."""
        mask = batch.mask
        return int(mask.sum()) if self.cfg.average == "token" else int(mask.any(dim=1).sum())

    def __call__(self, model: nn.Module, batch: Rollouts) -> Loss:
        cfg = self.cfg
        logp = token_logps(model, batch.x, batch.y)  # (R, T)
        mask = batch.mask
        old = batch.old_logp if batch.old_logp is not None else logp.detach()
        if cfg.loss == "grpo":
            per_token, clipped = clipped_surrogate(logp, old, batch.advantages, cfg.epsilon, cfg.epsilon_high)
        else:
            per_token, clipped = cispo(logp, old, batch.advantages, cfg.cispo_clip)
        sums = {}
        if cfg.beta > 0:
            kl = k3_kl(logp, batch.ref_logp)  # type: ignore[arg-type]
            per_token = per_token + cfg.beta * kl
            sums["kl"] = token_sums(kl.detach(), mask, cfg.average)
        total = token_sums(per_token, mask, cfg.average)
        sums["clipped"] = token_sums(clipped.float(), mask, cfg.average)
        return Loss(total, {"loss": total.detach(), **sums})

    # -------------------------------------------------------------------------------------- validation

    def evaluate(self, model: nn.Module, batches: Iterable[PromptBatch],
                 autocast: Callable[[], AbstractContextManager], token_bytes: torch.Tensor | None) -> dict[str, float]:
        """Greedy completions of the held-out prompts: mean reward (and each reward's), mean completion length,
        fraction cut at max_new_tokens."""
        return self.sampler.evaluate(model, batches, self.cfg.max_new_tokens)
