"""The GRPO stage's objective: rollouts from the current policy, their rewards, and the policy loss.

A step of `--stage grpo` (Trainer.train_step) takes this rank's micro-batches
of prompts (`PromptBatch`, batch_size prompts each), and `rollout` turns each
into a `Rollouts` micro-batch: grpo.group_size completions per prompt,
sampled by the one generation engine (nanolm/infer/engine.py: a prompt is
prefilled once for its group) from a copy of the current weights, each row's
generator seeded from the run's torch RNG (saved in checkpoints, so a resume
samples what the uninterrupted run would have) and the micro-batch's slot in
the step's global stream of prompts (micro-batch m of rank r is slot
m * world_size + r, which is where the loader took its prompts from): every
row of a step draws with its own seed, and 2 processes sample what 1 process
with twice the accumulation samples. Each completion is scored (nanolm/train/rewards.py),
advantages are group-relative (nanolm/train/rl.py), and, where they are
needed, the behaviour policy's log-probabilities (grpo.inner_epochs > 1)
and the reference's (grpo.beta > 0) are computed once, without gradient.

The loss of a micro-batch (`__call__`) is the clipped surrogate or CISPO per
completion token plus beta x the k3 KL to the reference, summed over the
tokens (grpo.average = token: the step's units are its completion tokens, so
every token of the step weighs alike over micro-batches and ranks, DAPO's
token average) or as each completion's mean summed over completions
(sequence: the units are completions). A completion holds the tokens the
policy wrote and, when it stopped, its `<|im_end|>`; a completion cut at
max_new_tokens has no `<|im_end|>` to learn.

`evaluate` decodes the held-out prompts greedily and reports their mean
reward (each reward's too), the completions' mean length and the fraction
cut at the limit.
"""

from __future__ import annotations

import math
import time
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
import torch.nn as nn
import torch.nn.functional as F

from nanolm.config.methods import GRPOConfig
from nanolm.config.sampling import SamplingParams
from nanolm.data.prompts import PromptBatch, last_user_text
from nanolm.data.shards import IGNORE_INDEX
from nanolm.infer.engine import Engine
from nanolm.runtime import decode_dtype
from nanolm.train import distributed
from nanolm.train.objectives import Loss, Objective
from nanolm.train.rewards import Rewards
from nanolm.train.rl import cispo, clipped_surrogate, group_advantages, k3_kl, token_sums, zero_variance_groups


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


def token_logps(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """log p(y) per position (R, T) in float32, 0 where y is IGNORE_INDEX."""
    nll = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=IGNORE_INDEX, reduction="none")
    return -nll.view(y.shape)


@dataclass
class Sampled:
    """What the engine made of a micro-batch's prompts: per row its prompt index, tokens and how it ended."""

    prompt: list[int]
    tokens: list[list[int]]
    finish: list[str]


class GRPOObjective(Objective):
    """The GRPO stage (see the module doc). The reference is a frozen model, the model with its LoRA adapters
    off (`disable_adapters`), or none at all when grpo.beta is 0."""

    def __init__(self, cfg: GRPOConfig, tokenizer: Any, rewards: Rewards, *, reference: nn.Module | None = None,
                 disable_adapters: Callable[[nn.Module], AbstractContextManager] | None = None,
                 device: torch.device, rank: int = 0, world_size: int = 1, compute: Callable[[], AbstractContextManager]) -> None:
        if cfg.beta > 0 and (reference is None) == (disable_adapters is None):
            raise ValueError("grpo.beta > 0 needs exactly one of a reference model or an adapter switch")
        self.cfg, self.tok, self.rewards = cfg, tokenizer, rewards
        self.reference, self.disable_adapters = reference, disable_adapters
        self.device, self.rank, self.world_size, self.compute = device, rank, world_size, compute
        self.generation_prompt = tokenizer.encode(tokenizer.chat_format.generation_prompt(cfg.thinking))
        self.stop_ids = (tokenizer.im_end_id,)
        self.engine: Engine | None = None
        self.last: dict[str, float] = {}  # this rank's sums of the last rollout (rewards, lengths, times)
        self.updates = cfg.inner_epochs  # optimizer updates per rollout
        self.best = ("val_reward", True)  # the held-out prompts' mean reward picks the best checkpoint

    # -------------------------------------------------------------------------------------- sampling

    def _engine(self, model: nn.Module) -> Engine:
        """The engine, its weights those of `model` now (one copy, refreshed in place each time)."""
        if self.engine is None:
            # The dtype decoding is fastest in on this device for this width (runtime.decode_dtype: bf16 on GPUs and
            # on CPUs with native bf16 for models 256+ wide); the update still scores the tokens with the policy.
            self.engine = Engine(model, self.device, decode_dtype("auto", self.device, model.config.d_model)[0])
        else:
            self.engine.load_weights(model)
        return self.engine

    def sample(self, model: nn.Module, prompts: list[list[int]], n: int, params: list[SamplingParams]) -> Sampled:
        """n completions of each prompt (generation prompt appended), decoded together by the engine."""
        replies = self._engine(model).replies([p + self.generation_prompt for p in prompts], params, self.stop_ids,
                                              n=n)
        return Sampled([i for i in range(len(prompts)) for _ in range(n)], [r.tokens for r in replies],
                       [r.finish for r in replies])

    def _texts(self, sampled: Sampled) -> list[str]:
        # A model's vocabulary may be padded past the tokenizer's: such ids (which training makes unlikely) are
        # no text, and the rewards see the rest.
        v = self.tok.vocab_size
        return [self.tok.decode([i for i in t if i < v]) for t in sampled.tokens]

    def _score(self, pb: PromptBatch, sampled: Sampled) -> tuple[list[float], dict[str, list[float]]]:
        prompts = [last_user_text(pb.records[i]["messages"]) for i in sampled.prompt]
        records = [pb.records[i]["record"] for i in sampled.prompt]
        return self.rewards.score(prompts, self._texts(sampled), records)

    # -------------------------------------------------------------------------------------- rollouts

    def rollout(self, model: nn.Module, batches: list[PromptBatch], step_seed: int) -> list[Rollouts]:
        """This rank's micro-batches of prompts -> micro-batches of scored completions (see the module doc);
        `self.last` gets this rank's sums of the rollout's metrics."""
        cfg, g = self.cfg, self.cfg.group_size
        t0 = time.perf_counter()
        out: list[Rollouts] = []
        sums: dict[str, float] = {"completions": 0, "groups": 0, "zero_var_groups": 0, "completion_tokens": 0,
                                  "truncated": 0, "reward": 0.0, "reward_sq": 0.0}
        gen_s = 0.0
        model_was_training = model.training
        for m, pb in enumerate(batches):
            slot = m * self.world_size + self.rank  # where in the step's stream of prompts this batch is
            params = [SamplingParams(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_k=cfg.top_k,
                                     top_p=cfg.top_p, seed=(step_seed + (slot * len(pb.prompts) + i) * g) % (1 << 63))
                      for i in range(len(pb.prompts))]
            tg = time.perf_counter()
            sampled = self.sample(model, pb.prompts, g, params)
            gen_s += time.perf_counter() - tg
            totals, per_name = self._score(pb, sampled)
            rewards = torch.tensor(totals, dtype=torch.float32)
            adv = group_advantages(rewards, g, scale=cfg.scale_rewards)
            out.append(self._rows(pb, sampled, adv))
            sums["completions"] += len(totals)
            sums["groups"] += len(totals) // g
            sums["zero_var_groups"] += int(zero_variance_groups(rewards, g).sum())
            sums["completion_tokens"] += sum(len(t) for t in sampled.tokens)
            sums["truncated"] += sum(f == "length" for f in sampled.finish)
            sums["reward"] += float(rewards.sum())
            sums["reward_sq"] += float((rewards.double() ** 2).sum())
            for name, values in per_name.items():
                sums[f"reward/{name}"] = sums.get(f"reward/{name}", 0.0) + sum(values)
                sums[f"reward_sq/{name}"] = sums.get(f"reward_sq/{name}", 0.0) + sum(v * v for v in values)
        out = [self._with_logps(model, b) for b in out]
        model.train(model_was_training)
        sums["generate_s"] = gen_s
        sums["rollout_s"] = time.perf_counter() - t0
        self.last = sums
        return out

    def _rows(self, pb: PromptBatch, sampled: Sampled, adv: torch.Tensor) -> Rollouts:
        """Rows of prompt + completion (+ <|im_end|> where it stopped), targets on the completion only."""
        seqs, starts = [], []
        for i, toks, fin in zip(sampled.prompt, sampled.tokens, sampled.finish):
            prompt = pb.prompts[i] + self.generation_prompt
            seqs.append(prompt + toks + ([self.stop_ids[0]] if fin == "stop" else []))
            starts.append(len(prompt))
        width = max(len(s) for s in seqs) - 1
        x = torch.zeros(len(seqs), width, dtype=torch.long)
        y = torch.full((len(seqs), width), IGNORE_INDEX, dtype=torch.long)
        for r, (s, start) in enumerate(zip(seqs, starts)):
            t = torch.tensor(s, dtype=torch.long)
            x[r, :len(s) - 1] = t[:-1]
            y[r, start - 1:len(s) - 1] = t[start:]  # the targets of the completion's tokens
        return Rollouts(x, y, adv)

    @torch.no_grad()
    def _with_logps(self, model: nn.Module, b: Rollouts) -> Rollouts:
        """b with the behaviour log-probs (inner_epochs > 1) and the reference's (beta > 0), on the device."""
        b = b.to(self.device)
        model.eval()  # no dropout in the log-probs the ratios compare with
        if self.cfg.inner_epochs > 1:
            with self.compute():
                b.old_logp = token_logps(model(b.x), b.y)
        if self.cfg.beta > 0:
            with self.compute():
                if self.reference is not None:
                    b.ref_logp = token_logps(self.reference(b.x), b.y)
                else:
                    with self.disable_adapters(model):  # type: ignore[misc]
                        b.ref_logp = token_logps(model(b.x), b.y)
        return b

    # -------------------------------------------------------------------------------------- the step's hooks

    def before_step(self, model: nn.Module, batches: list[PromptBatch], info: distributed.DistInfo
                    ) -> tuple[list[Rollouts], dict[str, float]]:
        """This rank's prompt micro-batches -> rollout micro-batches, and the rollout's metrics over all ranks.
        The sampling seed of the step is drawn from the run's torch RNG (saved in checkpoints)."""
        seed = int(torch.randint(0, 1 << 62, (1,)).item())
        rollouts = self.rollout(model, batches, seed)
        local = self.last
        keys = sorted(local)
        totals = distributed.sum_across_ranks(torch.tensor([float(local[k]) for k in keys], dtype=torch.float64,
                                                           device=self.device), info).tolist()
        summed = dict(zip(keys, totals))
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

    def units(self, batch: Rollouts) -> int:
        """Completion tokens (average = token) or completions with at least one token (sequence)."""
        mask = batch.mask
        return int(mask.sum()) if self.cfg.average == "token" else int(mask.any(dim=1).sum())

    def __call__(self, model: nn.Module, batch: Rollouts) -> Loss:
        cfg = self.cfg
        logp = token_logps(model(batch.x), batch.y)  # (R, T)
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

    @torch.no_grad()
    def evaluate(self, model: nn.Module, batches: Iterable[PromptBatch],
                 autocast: Callable[[], AbstractContextManager], token_bytes: torch.Tensor | None) -> dict[str, float]:
        """Greedy completions of the held-out prompts: mean reward (and each reward's), mean completion length,
        fraction cut at max_new_tokens."""
        greedy = SamplingParams(max_new_tokens=self.cfg.max_new_tokens, temperature=0.0)
        totals: list[float] = []
        per: dict[str, list[float]] = {}
        lengths, cut = 0, 0
        for pb in batches:
            sampled = self.sample(model, pb.prompts, 1, [greedy] * len(pb.prompts))
            t, p = self._score(pb, sampled)
            totals += t
            for k, v in p.items():
                per.setdefault(k, []).extend(v)
            lengths += sum(len(x) for x in sampled.tokens)
            cut += sum(f == "length" for f in sampled.finish)
        if not totals:
            return {}
        n = len(totals)
        out = {"val_reward": sum(totals) / n}
        if len(per) > 1:
            out.update({f"val_reward_{k}": sum(v) / n for k, v in per.items()})
        out.update({"val_completion_len": lengths / n, "val_truncated": cut / n})
        return out


def step_metrics(sums: dict[str, float]) -> dict[str, float]:
    """A step's logged rollout metrics from its sums over all ranks: each reward's mean and std over the
    step's completions, the fraction of zero-variance groups, mean completion length, fraction truncated."""
    n = max(sums.get("completions", 0), 1)

    def std(total: float, sq: float) -> float:
        return math.sqrt(max(sq / n - (total / n) ** 2, 0.0))
    out = {"reward": sums["reward"] / n, "reward_std": std(sums["reward"], sums["reward_sq"])}
    for key in sorted(k for k in sums if k.startswith("reward/")):
        name = key.split("/", 1)[1]
        out[f"reward_{name}"] = sums[key] / n
        out[f"reward_{name}_std"] = std(sums[key], sums[f"reward_sq/{name}"])
    out["zero_var_groups"] = sums["zero_var_groups"] / max(sums["groups"], 1)
    out["completion_len"] = sums["completion_tokens"] / n
    out["truncated"] = sums["truncated"] / n
    return out
