"""The PPO stage's objective: rollouts from the current policy, a learned critic, GAE, and the clipped losses.

A step of `--stage ppo` (Trainer.train_step) takes this rank's micro-batches of
prompts (`PromptBatch`, batch_size prompts each), and `before_step` turns
them into `PPORollouts` micro-batches, as GRPO does with the RL stages'
`Sampler` (nanolm/train/rl/rollout.py: the engine, each row's seed from the
run's RNG and its place in the step's stream of prompts):
ppo.samples_per_prompt completions per prompt, each scored by the rewards of
ppo.rewards. Then, once and without gradient:

- the behaviour policy's log-probabilities of the completion tokens, the
  reference's (the frozen initial weights; for LoRA the model with its
  adapters off) and the critic's value of each token's state;
- each token's reward (rl.token_rewards): -ppo.kl_coef x its KL to the
  reference (k1, the log-ratio, as TRL's PPO; or k3), plus the completion's
  reward at its last token;
- GAE (rl.gae: ppo.gamma, ppo.lam) gives each token's advantage, and
  returns = advantages + values are the critic's targets; the advantages are
  whitened over every completion token of the step (their moments summed over
  micro-batches and ranks, so the step's advantages are the same however it is
  cut).

The critic is a copy of the policy (ppo.critic_from, default the initial
weights) whose output projection is a scalar head (`value_model`), trained in
the same steps: it is the objective's `Companion`, so the loop gives it an
optimizer of its own (lr x ppo.value_lr_scale), clips its gradients with the
policy's and saves it as critic.safetensors and critic.optimizer.pt in every
checkpoint.

The loss of a micro-batch (`__call__`) is, per completion token, PPO's clipped
policy loss (rl.clipped_surrogate, ppo.epsilon) plus ppo.vf_coef x the
clipped value loss (rl.clipped_value_loss, ppo.value_clip), summed over the
tokens: the step's units are its completion tokens, so every token weighs
alike over micro-batches and ranks. A step runs ppo.inner_epochs updates over
its rollouts, and with ppo.target_kl > 0 stops them early once an update's
mean approximate KL to the behaviour policy (k3, measured in that update's
forward) passes it.

`evaluate` decodes the held-out prompts greedily and reports their mean
reward, as GRPO does.
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
from nanolm.train.objectives import Companion, Loss, Metrics, Objective, target_tokens, token_logps
from nanolm.train.rl.rewards import Rewards
from nanolm.train.rl.formulas import (clipped_surrogate, clipped_value_loss, explained_variance, gae, k3_kl, masked_moments,
                             token_rewards, token_sums, whiten)
from nanolm.train.rl.agent import sampler_for
from nanolm.train.rl.rollout import RolloutSums, Sampler, over_ranks, reference_logps, step_metrics


KL_ESTIMATORS = ("k1", "k3")


@dataclass
class PPOConfig:
    """RL from rewards with a learned critic (`train.stage = "ppo"`): sampled completions, a per-token KL
    penalty to the frozen initial model in the reward, GAE advantages from a value model, the clipped policy
    and value losses over inner_epochs updates per rollout."""

    samples_per_prompt: int = 1  # completions sampled per prompt
    temperature: float = 1.0  # sampling of the completions
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_new_tokens: int = 256  # completion budget; a completion cut here counts in the `truncated` metric
    thinking: bool = False  # open a <think> block in the generation prompt (the chat template's thinking switch)
    epsilon: float = 0.2  # the policy ratio is clipped to [1 - epsilon, 1 + epsilon]
    kl_coef: float = 0.05  # each token's reward is -kl_coef x its KL to the reference; 0 drops the reference
    kl_estimator: str = "k1"  # k1: logp - ref_logp (TRL's default); k3: exp(q) - q - 1, q = ref_logp - logp
    gamma: float = 1.0  # discount of GAE
    lam: float = 0.95  # GAE's lambda: 1 = Monte Carlo returns, 0 = one-step TD
    whiten_advantages: bool = True  # advantages to mean 0, variance 1 over the step's completion tokens
    vf_coef: float = 0.1  # weight of the value loss beside the policy loss
    value_clip: float = 0.2  # a value may move this far from the rollout's before its loss stops pulling
    value_lr_scale: float = 1.0  # the critic's learning rate, times the policy's (optim.lr and its schedule)
    inner_epochs: int = 4  # optimizer updates per rollout (the behaviour log-probs and values are kept)
    target_kl: float = 0.0  # stop a step's updates once the approximate KL to the behaviour policy passes this
    critic_from: str = ""  # the checkpoint the critic starts from; "" = the initial weights (train.init_from)
    rewards: str = "answer:1.0"  # weighted rewards by name (nanolm/train/rl/rewards.py), e.g. answer:1,format:0.2
    reward_model: str = ""  # a transformers sequence-classification directory, for the `model` reward
    length_min: int = 1  # the `length` reward's window, in characters of the reply
    length_max: int = 512
    tools: str = ""  # RL over tool calls, as grpo.tools: "" none, builtin, tools.json, file.py:function
    max_rounds: int = 3  # with tools: the most replies of a trajectory (each but the last may call tools)
    compile_rollouts: bool = False  # as grpo.compile_rollouts

    def __post_init__(self) -> None:
        _check(self.max_rounds >= 1, f"ppo.max_rounds must be >= 1, got {self.max_rounds}")
        _check(self.samples_per_prompt >= 1, f"ppo.samples_per_prompt must be >= 1, got {self.samples_per_prompt}")
        _check(self.temperature > 0, f"ppo.temperature must be > 0 (PPO learns from sampled completions), got "
                                     f"{self.temperature}")
        _check(0 < self.top_p <= 1, f"ppo.top_p must be in (0, 1], got {self.top_p}")
        _check(self.top_k >= 0, f"ppo.top_k must be >= 0 (0 = off), got {self.top_k}")
        _check(self.max_new_tokens > 0, f"ppo.max_new_tokens must be > 0, got {self.max_new_tokens}")
        _check(0 < self.epsilon < 1, f"ppo.epsilon must be in (0, 1), got {self.epsilon}")
        _check(self.kl_coef >= 0, f"ppo.kl_coef must be >= 0 (0 disables the KL penalty), got {self.kl_coef}")
        _check(self.kl_estimator in KL_ESTIMATORS,
               f"ppo.kl_estimator must be one of {', '.join(KL_ESTIMATORS)}, got {self.kl_estimator!r}")
        _check(0 < self.gamma <= 1, f"ppo.gamma must be in (0, 1], got {self.gamma}")
        _check(0 <= self.lam <= 1, f"ppo.lam must be in [0, 1], got {self.lam}")
        _check(self.vf_coef > 0, f"ppo.vf_coef must be > 0 (the critic learns from the value loss), got "
                                 f"{self.vf_coef}")
        _check(self.value_clip > 0, f"ppo.value_clip must be > 0, got {self.value_clip}")
        _check(self.value_lr_scale > 0, f"ppo.value_lr_scale must be > 0, got {self.value_lr_scale}")
        _check(self.inner_epochs >= 1, f"ppo.inner_epochs must be >= 1, got {self.inner_epochs}")
        _check(self.target_kl >= 0, f"ppo.target_kl must be >= 0 (0 = no early stop), got {self.target_kl}")
        _check(self.length_min >= 0, f"ppo.length_min must be >= 0, got {self.length_min}")
        _check(self.length_max > 0 and self.length_max >= self.length_min,
               f"ppo.length_max must be > 0 and >= ppo.length_min ({self.length_min}), got {self.length_max}")


@dataclass
class PPORollouts:
    """One micro-batch of completions: R = prompts x samples_per_prompt rows, prompt then completion, right-padded.

    x, y (R, T): inputs and next-token targets, y = IGNORE_INDEX but at the completion's tokens;
    advantages, returns, old_logp, old_values (R, T): per completion token (0 elsewhere).
    """

    x: torch.Tensor
    y: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor
    old_logp: torch.Tensor
    old_values: torch.Tensor
    pos: None = None  # plain causal rows (the trainer's batches have these)
    seg: None = None

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "PPORollouts":
        return PPORollouts(*(t.to(device, non_blocking=non_blocking) for t in (
            self.x, self.y, self.advantages, self.returns, self.old_logp, self.old_values)))

    @property
    def mask(self) -> torch.Tensor:
        return self.y != IGNORE_INDEX


def value_model(model: nn.Module) -> nn.Module:
    """A Transformer as a critic: its output projection replaced by a scalar head (a tied projection is untied),
    zero-initialised so that every value starts at 0. (B, T) token ids -> (B, T, 1) values."""
    head = nn.Linear(model.config.d_model, 1, bias=True).to(next(model.parameters()).device)
    nn.init.zeros_(head.weight)
    nn.init.zeros_(head.bias)
    model.lm_head = head
    return model


def values_of(critic: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The critic's value of each position's state (R, T), float32."""
    return critic(x)[..., 0].float()


class PPOObjective(Objective):
    """The PPO stage (see the module doc). The reference is a frozen model, the model with its LoRA adapters off
    (`disable_adapters`), or none at all when ppo.kl_coef is 0."""

    def __init__(self, cfg: PPOConfig, tokenizer: Any, rewards: Rewards, critic: nn.Module, *,
                 reference: nn.Module | None = None,
                 disable_adapters: Callable[[nn.Module], AbstractContextManager] | None = None,
                 device: torch.device, rank: int = 0, world_size: int = 1,
                 compute: Callable[[], AbstractContextManager]) -> None:
        if cfg.kl_coef > 0 and (reference is None) == (disable_adapters is None):
            raise ValueError("ppo.kl_coef > 0 needs exactly one of a reference model or an adapter switch")
        self.cfg = cfg
        self.sampler = sampler_for(cfg, tokenizer, rewards, device)
        self.critic = critic
        self.reference, self.disable_adapters = reference, disable_adapters
        self.device, self.rank, self.world_size, self.compute = device, rank, world_size, compute
        self.updates = cfg.inner_epochs  # optimizer updates per rollout (fewer when target_kl stops them)
        self.best = ("val_reward", True)  # the held-out prompts' mean reward picks the best checkpoint
        self.updates_run, self.kl_stopped = 0, False  # of the current step

    def companions(self) -> dict[str, Companion]:
        return {"critic": Companion(self.critic, self.cfg.value_lr_scale)}

    # -------------------------------------------------------------------------------------- rollouts

    def rollout(self, model: nn.Module, batches: list[PromptBatch], step_seed: int
                ) -> tuple[list[PPORollouts], dict[str, float]]:
        """This rank's micro-batches of prompts -> micro-batches of scored completions with their advantages
        (not yet whitened) and returns, and this rank's sums of the rollout's metrics."""
        cfg, n = self.cfg, self.cfg.samples_per_prompt
        t0 = time.perf_counter()
        out: list[PPORollouts] = []
        sums = RolloutSums()
        extra = {"kl": 0.0, "non_score_reward": 0.0}
        gen_s = 0.0
        model_was_training, critic_was_training = model.training, self.critic.training
        for m, pb in enumerate(batches):
            slot = m * self.world_size + self.rank  # where in the step's stream of prompts this batch is
            params = Sampler.seeded(cfg, step_seed, slot, len(pb.prompts), n)
            tg = time.perf_counter()
            sampled = self.sampler.sample_batch(model, pb, n, params)
            gen_s += time.perf_counter() - tg
            totals, per_name = self.sampler.score(pb, sampled)
            sums.add(sampled, totals, per_name)
            b, kl = self._scored(model, *self.sampler.rows(pb, sampled), torch.tensor(totals))
            extra["kl"] += float(kl.sum())
            extra["non_score_reward"] -= cfg.kl_coef * float(kl.sum())
            out.append(b)
        model.train(model_was_training)
        self.critic.train(critic_was_training)
        return out, {**sums.sums, **extra, "generate_s": gen_s, "rollout_s": time.perf_counter() - t0}

    @torch.no_grad()
    def _scored(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, scores: torch.Tensor
                ) -> tuple[PPORollouts, torch.Tensor]:
        """Rows on the device with the behaviour log-probs, the critic's values, and GAE's advantages and returns
        of the per-token rewards; and each completion token's KL to the reference (R, T)."""
        cfg = self.cfg
        x, y = x.to(self.device), y.to(self.device)
        mask = y != IGNORE_INDEX
        model.eval()  # no dropout in the log-probs and values the update compares with
        self.critic.eval()
        with self.compute():
            old_logp = token_logps(model, x, y)
            values = values_of(self.critic, x) * mask
            kl = torch.zeros_like(old_logp)
            if cfg.kl_coef > 0:
                ref_logp = reference_logps(model, self.reference, self.disable_adapters, x, y)
                kl = old_logp - ref_logp if cfg.kl_estimator == "k1" else k3_kl(old_logp, ref_logp)
        kl = kl * mask
        rewards = token_rewards(scores.to(self.device), kl, mask, cfg.kl_coef)
        advantages, returns = gae(rewards, values, mask, cfg.gamma, cfg.lam)
        return PPORollouts(x, y, advantages, returns, old_logp, values), kl

    # -------------------------------------------------------------------------------------- the step's hooks

    def before_step(self, model: nn.Module, batches: list[PromptBatch], info: distributed.DistInfo
                    ) -> tuple[list[PPORollouts], dict[str, float]]:
        """This rank's prompt micro-batches -> rollout micro-batches with advantages whitened over the whole step,
        and the rollout's metrics over all ranks. The sampling seed of the step is drawn from the run's torch RNG
        (saved in checkpoints)."""
        seed = int(torch.randint(0, 1 << 62, (1,)).item())
        rollouts, local = self.rollout(model, batches, seed)
        # Moments over the step's completion tokens, summed over micro-batches and ranks: advantages, returns,
        # and the critic's residuals (returns - values).
        moments = torch.zeros(3, 3, dtype=torch.float64, device=self.device)
        for b in rollouts:
            moments += torch.stack([masked_moments(t, b.mask) for t in (b.advantages, b.returns,
                                                                        b.returns - b.old_values)])
        moments = distributed.sum_across_ranks(moments, info)
        if self.cfg.whiten_advantages:
            for b in rollouts:
                b.advantages = whiten(b.advantages, b.mask, moments[0])
        summed = over_ranks({k: v for k, v in local.items() if not k.endswith("_s")}, info, self.device)
        extra = step_metrics(summed)
        tokens = max(float(moments[1, 0]), 1.0)
        extra.update(kl=summed["kl"] / tokens, non_score_reward=summed["non_score_reward"] / max(
            summed["completions"], 1), value=float(moments[1, 1] - moments[2, 1]) / tokens,
            explained_variance=explained_variance(moments[1], moments[2]))
        # Times: this rank's (rank 0 logs); the score share is the rollout's time outside generation.
        extra.update(generate_s=local["generate_s"], score_s=local["rollout_s"] - local["generate_s"],
                     rollout_tok_s=summed["completion_tokens"] / info.world_size / max(local["generate_s"], 1e-9))
        self.updates_run, self.kl_stopped = 0, False
        return rollouts, extra

    def stop_updates(self, sums: Metrics, step_units: int, info: distributed.DistInfo) -> bool:
        """Whether the update just run measured a mean approximate KL to the behaviour policy above
        ppo.target_kl (over all ranks, so every rank stops alike); never when target_kl is 0."""
        self.updates_run += 1
        if self.cfg.target_kl <= 0 or self.updates_run >= self.updates:
            return False
        kl = distributed.sum_across_ranks(sums["approx_kl"].detach().double(), info).item() / max(step_units, 1)
        self.kl_stopped = kl > self.cfg.target_kl
        return self.kl_stopped

    def after_step(self, extra: dict[str, float], update_s: float) -> dict[str, float]:
        """The updates the step ran (fewer than ppo.inner_epochs when target_kl stopped them), and its share of
        time spent generating, once its updates are timed."""
        extra["updates"] = float(max(self.updates_run, 1))
        if self.cfg.target_kl > 0:
            extra["kl_stop"] = float(self.kl_stopped)
        extra["update_s"] = update_s
        extra["generate_share"] = extra["generate_s"] / max(extra["generate_s"] + update_s + extra["score_s"], 1e-9)
        return extra

    # -------------------------------------------------------------------------------------- the loss

    @staticmethod
    def projected(batch: PPORollouts) -> int:
        """The completions' tokens (token_logps projects those alone)."""
        return target_tokens(batch)

    @staticmethod
    def units(batch: PPORollouts) -> int:
        """Completion tokens: every one weighs alike in the step."""
        return int(batch.mask.sum())

    def __call__(self, model: nn.Module, batch: PPORollouts) -> Loss:
        cfg, mask = self.cfg, batch.mask
        logp = token_logps(model, batch.x, batch.y)  # (R, T)
        values = values_of(self.critic, batch.x)  # (R, T)
        policy, clipped = clipped_surrogate(logp, batch.old_logp, batch.advantages, cfg.epsilon, cfg.epsilon)
        value, value_clipped = clipped_value_loss(values, batch.old_values, batch.returns, cfg.value_clip)
        total = token_sums(policy + cfg.vf_coef * value, mask, "token")
        with torch.no_grad():
            sums = {"loss": total.detach(), "policy_loss": token_sums(policy, mask, "token"),
                    "value_loss": token_sums(value, mask, "token"),
                    # KL(behaviour || policy), k3 on the behaviour's samples: (r - 1) - log r, r = p / p_old
                    "approx_kl": token_sums(k3_kl(batch.old_logp, logp), mask, "token"),
                    "clipped": token_sums(clipped.float(), mask, "token"),
                    "value_clipped": token_sums(value_clipped.float(), mask, "token")}
        return Loss(total, sums)

    # -------------------------------------------------------------------------------------- validation

    def evaluate(self, model: nn.Module, batches: Iterable[PromptBatch],
                 autocast: Callable[[], AbstractContextManager], token_bytes: torch.Tensor | None) -> dict[str, float]:
        """Greedy completions of the held-out prompts: mean reward (and each reward's), mean completion length,
        fraction cut at max_new_tokens."""
        return self.sampler.evaluate(model, batches, self.cfg.max_new_tokens)
