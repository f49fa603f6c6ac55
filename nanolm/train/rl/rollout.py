"""Completions of RL prompts for the RL stages (GRPO, PPO): sampled, scored, laid out as training rows.

`Sampler` is what `--stage grpo` (nanolm/train/rl/grpo.py) and `--stage ppo`
(nanolm/train/rl/ppo.py) share. It samples `n` completions of each prompt of a
micro-batch with the one generation engine (nanolm/infer/engine.py: a prompt
is prefilled once for its `n` rows) from a copy of the current weights, in the
dtype decoding is fastest in on the device (`runtime.decode_dtype`). Each
row's generator is seeded from the step's seed, drawn from the run's torch RNG
(saved in checkpoints, so a resume samples what the uninterrupted run would
have), and the row's place in the step's global stream of prompts (micro-batch
m of rank r is slot m * world_size + r, which is where the loader took its
prompts from): every row of a step draws with its own seed, a step samples the
same completions however its prompts are cut into micro-batches, and 2
processes sample what 1 process with twice the accumulation samples.

A completion is scored by the `Rewards` of the stage's spec
(nanolm/train/rl/rewards.py), and laid out as a training row (`rows`): prompt,
generation prompt, completion and, when it stopped, its `<|im_end|>`, the
targets on the completion's tokens only (a completion cut at max_new_tokens
has no `<|im_end|>` to learn). `RolloutSums` adds up a step's rollout metrics
(rewards, lengths, truncation) on a rank, `over_ranks` sums them over the
ranks and `step_metrics` turns the sums into what is logged; `evaluate` decodes held-out prompts greedily and reports
their mean reward.
"""

from __future__ import annotations

import json
import math
import sys
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Protocol

import torch
import torch.nn as nn

from nanolm.config.sampling import SamplingParams
from nanolm.data.kinds.prompts import PromptBatch, last_user_text
from nanolm.data.shards import IGNORE_INDEX
from nanolm.infer.bans import ReplyGuides
from nanolm.infer.engine import Engine
from nanolm.runtime import decode_dtype
from nanolm.train import distributed
from nanolm.train.objectives import token_logps
from nanolm.train.rl.rewards import Completion, Rewards


@torch.no_grad()
def reference_logps(model: nn.Module, reference: nn.Module | None,
                    disable_adapters: Callable[[nn.Module], AbstractContextManager] | None,
                    x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The reference's log-probs of y (R, T): a frozen model, or `model` with its LoRA adapters off."""
    if reference is not None:
        return token_logps(reference, x, y)
    with disable_adapters(model):  # type: ignore[misc]
        return token_logps(model, x, y)


@dataclass
class Sampled:
    """What the engine made of a micro-batch's prompts: per row its prompt index, tokens and how it ended."""

    prompt: list[int]
    tokens: list[list[int]]
    finish: list[str]


class SamplingSettings(Protocol):
    """How an RL stage samples its completions: fields of its config section (GRPOConfig, PPOConfig)."""

    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int


class Sampler:
    """Samples, scores and lays out completions of RL prompts (see the module doc)."""

    def __init__(self, tokenizer: Any, rewards: Rewards, device: torch.device, *, thinking: bool = False,
                 compile: bool = False) -> None:
        self.tok, self.rewards, self.device = tokenizer, rewards, device
        self.generation_prompt = tokenizer.encode(tokenizer.chat_format.generation_prompt(thinking))
        self.stop_ids = (tokenizer.im_end_id,)
        self.compile = compile  # grpo/ppo.compile_rollouts: the engine's decode step under torch.compile
        self.thinking = thinking
        self.engine: Engine | None = None
        self.guides: ReplyGuides | None = None  # built with the engine, for its model's vocabulary

    def _engine(self, model: nn.Module) -> Engine:
        """The engine, its weights those of `model` now (one copy, refreshed in place each time)."""
        if self.engine is None:
            # bf16 on GPUs, and on CPUs with native bf16 for models 256+ wide (runtime.decode_dtype), untimed: every
            # rank, and a resumed run, must decode in the same dtype. Rollouts decode many rows, which every
            # native-bf16 CPU measured decodes faster in bf16 (a Xeon with AMX, 16 rows at width 512: 196 against
            # 967 us a product). The update still scores the tokens with the policy.
            dtype = decode_dtype("auto", self.device, model.config, timer=None)[0]
            self.engine = Engine(model, self.device, dtype)
            self.guides = ReplyGuides(self.tok, model.config.vocab_size, self.device)
            if self.compile:
                # Untimed (keep_faster false): every rank, and a resumed run, decode through the same step. The
                # compiled step reads the copy's weights, which load_weights refreshes in place.
                print(f"[rollouts: {self.engine.compile_decode(keep_faster=False)}]", file=sys.stderr, flush=True)
        else:
            self.engine.load_weights(model)
        return self.engine

    def sample(self, model: nn.Module, prompts: list[list[int]], n: int, params: list[SamplingParams],
               tools: list[list[Any]] | None = None) -> Sampled:
        """n completions of each prompt (generation prompt appended), decoded together by the engine. tools: per
        prompt, the tools its conversation offers (None: none); where none are offered a completion cannot open a
        call, and with thinking off it cannot open a think block (`infer/bans.py`)."""
        engine = self._engine(model)
        assert self.guides is not None
        offered = tools if tools is not None else [[]] * len(prompts)
        # Calls are not guided here (the agentic sampler guides them); only what a reply may not write is banned.
        guides = [self.guides.reply(t, thinking=self.thinking, guide_calls=False) for t in offered]
        replies = engine.replies([p + self.generation_prompt for p in prompts], params, self.stop_ids, n=n,
                                 guide=guides)
        return Sampled([i for i in range(len(prompts)) for _ in range(n)], [r.tokens for r in replies],
                       [r.finish for r in replies])

    def sample_batch(self, model: nn.Module, pb: PromptBatch, n: int, params: list[SamplingParams]) -> Sampled:
        """n completions of each prompt of a micro-batch (an agent's sampler runs its tools here too)."""
        return self.sample(model, pb.prompts, n, params,
                           [[json.loads(t) for t in r.get("tools") or ()] for r in pb.records])

    @staticmethod
    def seeded(how: SamplingSettings, step_seed: int, slot: int, n_prompts: int, n: int) -> list[SamplingParams]:
        """The sampling of each prompt of the micro-batch in `slot` of the step: prompt i's n rows draw from the
        seed of its place in the step's stream of prompts (the engine gives row j of a prompt seed + j)."""
        return [SamplingParams(max_new_tokens=how.max_new_tokens, temperature=how.temperature, top_k=how.top_k,
                               top_p=how.top_p, seed=(step_seed + (slot * n_prompts + i) * n) % (1 << 63))
                for i in range(n_prompts)]

    def texts(self, sampled: Sampled) -> list[str]:
        # A model's vocabulary may be padded past the tokenizer's: such ids (which training makes unlikely) are
        # no text, and the rewards see the rest.
        v = self.tok.vocab_size
        return [Completion(self.tok.decode([i for i in t if i < v]), finished=f == "stop")
                for t, f in zip(sampled.tokens, sampled.finish)]

    def score(self, pb: PromptBatch, sampled: Sampled) -> tuple[list[float], dict[str, list[float]]]:
        """Each completion's total reward, and each reward's value per completion."""
        prompts = [last_user_text(pb.records[i]["messages"]) for i in sampled.prompt]
        records = [pb.records[i]["record"] for i in sampled.prompt]
        return self.rewards.score(prompts, self.texts(sampled), records)

    def rows(self, pb: PromptBatch, sampled: Sampled) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) (R, T): rows of prompt + completion (+ <|im_end|> where it stopped), right-padded, the
        targets y IGNORE_INDEX but at the completion's tokens."""
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
        return x, y

    def cut(self, sampled: Sampled) -> int:
        """How many of the completions were cut before they ended by themselves (at max_new_tokens)."""
        return sum(f == "length" for f in sampled.finish)

    @torch.no_grad()
    def evaluate(self, model: nn.Module, batches: Iterable[PromptBatch], max_new_tokens: int) -> dict[str, float]:
        """Greedy completions of the held-out prompts: mean reward (and each reward's), mean completion length,
        fraction cut at max_new_tokens."""
        greedy = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
        totals: list[float] = []
        per: dict[str, list[float]] = {}
        lengths, cut = 0, 0
        for pb in batches:
            sampled = self.sample_batch(model, pb, 1, [greedy] * len(pb.prompts))
            t, p = self.score(pb, sampled)
            totals += t
            for k, v in p.items():
                per.setdefault(k, []).extend(v)
            lengths += sum(len(x) for x in sampled.tokens)
            cut += self.cut(sampled)
        if not totals:
            return {}
        n = len(totals)
        out = {"val_reward": sum(totals) / n}
        if len(per) > 1:
            out.update({f"val_reward_{k}": sum(v) / n for k, v in per.items()})
        out.update({"val_completion_len": lengths / n, "val_truncated": cut / n})
        return out


class RolloutSums:
    """A rank's sums of a step's rollout metrics, as `step_metrics` reads them once summed over the ranks."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {"completions": 0, "completion_tokens": 0, "truncated": 0, "reward": 0.0,
                                       "reward_sq": 0.0}

    def add(self, sampled: Sampled, totals: list[float], per_name: dict[str, list[float]]) -> None:
        s = self.sums
        s["completions"] += len(totals)
        s["completion_tokens"] += sum(len(t) for t in sampled.tokens)
        s["truncated"] += sum(f == "length" for f in sampled.finish)
        # float64: a float32 sum of the rewards rounds differently as a step's prompts are cut into micro-batches
        rewards = torch.tensor(totals, dtype=torch.float32).double()
        s["reward"] += float(rewards.sum())
        s["reward_sq"] += float((rewards ** 2).sum())
        for name, values in per_name.items():
            s[f"reward/{name}"] = s.get(f"reward/{name}", 0.0) + sum(values)
            s[f"reward_sq/{name}"] = s.get(f"reward_sq/{name}", 0.0) + sum(v * v for v in values)


def over_ranks(sums: dict[str, float], info: distributed.DistInfo, device: torch.device) -> dict[str, float]:
    """A rank's sums of a step's metrics summed over all ranks (every rank holds the same keys)."""
    keys = sorted(sums)
    totals = distributed.sum_across_ranks(torch.tensor([float(sums[k]) for k in keys], dtype=torch.float64,
                                                       device=device), info).tolist()
    return dict(zip(keys, totals))


def step_metrics(sums: dict[str, float]) -> dict[str, float]:
    """A step's logged rollout metrics from its sums over all ranks: each reward's mean and std over the
    step's completions, the fraction of zero-variance groups (GRPO's sums count groups), mean completion
    length, fraction truncated."""
    n = max(sums.get("completions", 0), 1)

    def std(total: float, sq: float) -> float:
        return math.sqrt(max(sq / n - (total / n) ** 2, 0.0))
    out = {"reward": sums["reward"] / n, "reward_std": std(sums["reward"], sums["reward_sq"])}
    for key in sorted(k for k in sums if k.startswith("reward/")):
        name = key.split("/", 1)[1]
        out[f"reward_{name}"] = sums[key] / n
        out[f"reward_{name}_std"] = std(sums[key], sums[f"reward_sq/{name}"])
    if "groups" in sums:
        out["zero_var_groups"] = sums["zero_var_groups"] / max(sums["groups"], 1)
    out["completion_len"] = sums["completion_tokens"] / n
    out["truncated"] = sums["truncated"] / n
    return out
