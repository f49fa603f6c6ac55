"""RL over tool calls: `--stage grpo` with `grpo.tools`, each sampled trajectory a multi-turn exchange with tools.

A trajectory starts as a plain GRPO completion (nanolm/train/rl/rollout.py), its
calls guided by the offered tools' schemas (the ToolCallGuide, as chat and
serve guide them). When a reply stops with calls, they are run (`AgentTools`:
built-in tools for real, a user's function with the parsed arguments, an error
as the result text), the results enter as tool turns rendered by the chat
template, and the model continues, up to grpo.max_rounds replies. All the
trajectories of a micro-batch decode in one DecodeBatch (`run_trajectories`):
a reply that ends with a call leaves the batch and its continuation joins as a
new row (prompt + everything so far + the tool turn), so the rows of a group
finish at different times and none waits for another's tool.

A trajectory's training row is prompt + each model-written segment (its
`<|im_end|>` too when it stopped) + the tool turns between them, the targets on
the model's own tokens only (`Trajectory.row`). The rewards see the final reply
(`answer`, ...), the text of every reply (`tool_call`: the trajectory's calls)
and whether it finished (`finished`: the last reply made no call and ended by
itself), through `rewards.Completion`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn

from nanolm.chat import Message, ToolCall, message_from_dict, read_reply
from nanolm.chat.templates import TURN_SEP
from nanolm.config.sampling import SamplingParams
from nanolm.data.kinds.prompts import PromptBatch, last_user_text
from nanolm.data.shards import IGNORE_INDEX
from nanolm.errors import UserError
from nanolm.infer.tools import Toolbox, tool_name
from nanolm.train.rl.rewards import Completion, load_user_function
from nanolm.train.rl.rollout import Sampled, Sampler

ROUND_SEED = 1_000_003  # a continuation of round k draws from its trajectory's seed + k x this


# ----------------------------------------------------------------------------- the tools


@dataclass
class AgentTools:
    """The tools grpo.tools offers (OpenAI tool objects) and how each call is answered.

    Spec: comma-separated items, as chat's `--tools` takes them: `builtin` (the built-in tools, run for real),
    a tools.json path (declared tools), and `file.py:function` (a user's function that answers the declared
    tool of its name, called with the parsed arguments as a dict, returning the result text).
    """

    box: Toolbox = field(default_factory=Toolbox)
    functions: dict[str, Callable[[dict[str, Any]], Any]] = field(default_factory=dict)

    @classmethod
    def from_spec(cls, spec: str) -> "AgentTools":
        items = [s.strip() for s in spec.split(",") if s.strip()]
        fns = {}
        for item in items:
            if ".py:" in item:
                fn = load_user_function(item, "grpo.tools")
                fns[item.rpartition(":")[2]] = fn
        box = Toolbox.from_specs([i for i in items if ".py:" not in i])
        declared = set(box.names())
        for name in fns:
            if name not in declared:
                raise UserError(f"grpo.tools: the function {name!r} has no schema; declare a tool named {name!r} in a "
                                "tools.json given to grpo.tools too (a JSON array of OpenAI tool objects)")
        return cls(box, fns)

    @property
    def tools(self) -> tuple[dict[str, Any], ...]:
        return self.box.tools

    def run(self, call: ToolCall) -> str:
        """The result text of a call; an error, the user's function's included, becomes the text."""
        if call.name in self.functions:
            try:
                arguments = json.loads(call.arguments)
                return str(self.functions[call.name](arguments))
            except Exception as e:  # the user's code or the model's JSON: the model reads what went wrong
                return f"error: {type(e).__name__}: {e}"
        if self.box.can_run(call):
            return self.box.run(call)
        return f"error: there is no tool named {call.name!r}"


def offered(tools: Sequence[dict[str, Any]], record_tools: Sequence[str]) -> tuple[list[dict[str, Any]], list[str]]:
    """The tools offered to one prompt: the record's (JSON text each) then grpo.tools' not among them, as
    objects (for the guide) and as texts (for the template)."""
    objects = [json.loads(t) for t in record_tools]
    names = {tool_name(t) for t in objects}
    objects += [t for t in tools if tool_name(t) not in names]
    return objects, [json.dumps(t, ensure_ascii=False) for t in objects]


# ----------------------------------------------------------------------------- trajectories


@dataclass
class Trajectory:
    """One sampled exchange: its prompt (generation prompt included), segments (ids, written by the model?),
    each reply's text, and how the last reply ended."""

    prompt: int  # index of its prompt in the micro-batch
    sample: int  # its place in the prompt's group
    prompt_ids: list[int]
    segments: list[tuple[list[int], bool]] = field(default_factory=list)
    replies: list[str] = field(default_factory=list)
    calls: list[list[ToolCall]] = field(default_factory=list)
    finish: str = ""
    finished: bool = False
    generated: int = 0  # tokens the model drew (its stop ids not counted), against max_new_tokens

    def ids(self) -> list[int]:
        """The whole row: prompt, then every segment."""
        return self.prompt_ids + [t for ids, _ in self.segments for t in ids]

    def row(self) -> tuple[list[int], list[bool]]:
        """The row's ids, and per id whether it is a target (the model wrote it)."""
        ids = list(self.prompt_ids)
        mine = [False] * len(ids)
        for seg, m in self.segments:
            ids += seg
            mine += [m] * len(seg)
        return ids, mine


class ToolTurns:
    """Turns a reply's calls into the tokens the model continues from: the tool turns as the template renders
    them, then the generation prompt."""

    def __init__(self, tokenizer: Any, tools: AgentTools, thinking: bool) -> None:
        self.tok, self.tools, self.thinking = tokenizer, tools, thinking
        self.fmt = tokenizer.chat_format

    def parse(self, text: str) -> Message:
        return read_reply(text, thinking=self.thinking, bare_calls=self.fmt.bare_calls)

    def results(self, calls: Sequence[ToolCall]) -> list[str]:
        return [self.tools.run(c) for c in calls]

    def tokens(self, results: Sequence[str]) -> list[int]:
        """After the reply's `<|im_end|>`: the turn separator, the tool turns, the generation prompt."""
        text = self.fmt.render([Message("tool", r) for r in results], add_generation_prompt=True,
                               thinking=self.thinking)
        return self.tok.encode(TURN_SEP + text)  # the separator the template writes after each <|im_end|>


def run_trajectories(batch: Any, prompts: Sequence[list[int]], n: int, params: Sequence[SamplingParams],
                     stop_id: int, turns: ToolTurns, max_rounds: int, guides: Sequence[Any] | None = None,
                     decode: Callable[[list[int]], str] | None = None) -> list[Trajectory]:
    """n trajectories of each prompt (generation prompt included), decoded in `batch` (DecodeBatch's add and
    step): a reply that stops with calls leaves, and its continuation (tool turns appended) joins as a new row
    at once; rows never wait for each other. max_new_tokens bounds the model's tokens of a whole trajectory."""
    decode = decode or turns.tok.decode
    trajs: list[Trajectory] = []
    live: dict[int, tuple[Trajectory, int, list[int]]] = {}  # row id -> (trajectory, round, tokens so far)
    for i, p in enumerate(prompts):
        guide = guides[i] if guides is not None else None
        ids = batch.add(p, params[i], (stop_id,), n=n, guide=guide)
        for j, row in enumerate(ids):
            t = Trajectory(i, j, list(p))
            trajs.append(t)
            live[row] = (t, 0, [])
    while live:
        for out in batch.step():
            if out.row not in live:
                continue
            t, rnd, toks = live[out.row]
            if out.token is not None:
                toks.append(out.token)
            if out.finish is None:
                continue
            del live[out.row]
            reply = turns.parse(decode(toks))
            t.segments.append((toks + ([stop_id] if out.finish == "stop" else []), True))
            t.replies.append(decode(toks))
            t.calls.append(list(reply.tool_calls))
            t.finish = out.finish
            i = t.prompt
            t.generated += len(toks)
            left = params[i].max_new_tokens - t.generated
            if out.finish != "stop" or not reply.tool_calls or rnd + 1 >= max_rounds or left <= 0:
                t.finished = out.finish == "stop" and not reply.tool_calls
                continue
            tool = turns.tokens(turns.results(reply.tool_calls))
            t.segments.append((tool, False))
            seed = None if params[i].seed is None else (params[i].seed + (rnd + 1) * ROUND_SEED) % (1 << 63)
            again = replace(params[i], max_new_tokens=left, seed=seed)
            guide = guides[i] if guides is not None else None
            try:
                (row,) = batch.add(t.ids(), again, (stop_id,), n=1, guide=guide, first=t.sample)
            except ValueError:  # the tool turn fills the model's context: the trajectory ends unfinished
                t.segments.pop()  # before it, so that its row fits the model (the turn trains nothing)
                t.finish = "length"
                continue
            live[row] = (t, rnd + 1, [])
    return trajs


@dataclass
class AgentSampled(Sampled):
    """Sampled, with each row's trajectory (tokens: the model's tokens of the whole trajectory)."""

    trajectories: list[Trajectory] = field(default_factory=list)


class AgentSampler(Sampler):
    """The RL stages' Sampler over multi-turn tool use (see the module doc)."""

    def __init__(self, tokenizer: Any, rewards: Any, device: torch.device, *, thinking: bool = False,
                 tools: AgentTools, max_rounds: int = 3, compile: bool = False) -> None:
        super().__init__(tokenizer, rewards, device, thinking=thinking, compile=compile)
        if not tokenizer.chat_format.tools:
            raise UserError(f"grpo.tools: the tokenizer {tokenizer.path} carries the plain ChatML template, which "
                            "has no tools; use a tokenizer trained by this nanolm (`nanolm tokenizer train`)")
        self.tools, self.max_rounds, self.thinking = tools, max_rounds, thinking
        self.turns = ToolTurns(tokenizer, tools, thinking)

    def prompt_ids(self, pb: PromptBatch) -> tuple[list[list[int]], list[list[dict[str, Any]]]]:
        """Each prompt rendered with its offered tools (generation prompt appended), and those tools."""
        fmt = self.tok.chat_format
        ids, objects = [], []
        for rec in pb.records:
            objs, texts = offered(self.tools.tools, rec.get("tools") or ())
            msgs = [message_from_dict("prompt", m) for m in rec["messages"]]
            ids.append(self.tok.encode(fmt.render(msgs, texts, add_generation_prompt=True, thinking=self.thinking)))
            objects.append(objs)
        return ids, objects

    def _guides(self, objects: list[list[dict[str, Any]]]) -> list[Any]:
        """Each prompt's guide: its calls held to its tools, or, offered none, no call tag (`infer/bans.py`)."""
        assert self.guides is not None  # built with the engine
        return [self.guides.reply(objs, thinking=self.thinking) for objs in objects]

    def sample_batch(self, model: nn.Module, pb: PromptBatch, n: int, params: list[SamplingParams]) -> AgentSampled:
        prompts, objects = self.prompt_ids(pb)
        engine = self._engine(model)
        v = self.tok.vocab_size
        trajs = run_trajectories(engine.batch(), prompts, n, params, self.stop_ids[0], self.turns, self.max_rounds,
                                 self._guides(objects), lambda t: self.tok.decode([i for i in t if i < v]))
        return self.sampled(trajs)

    @staticmethod
    def sampled(trajs: list[Trajectory]) -> AgentSampled:
        tokens = [[i for ids, mine in t.segments if mine for i in ids] for t in trajs]
        return AgentSampled([t.prompt for t in trajs], tokens, [t.finish for t in trajs], trajs)

    def texts(self, sampled: Sampled) -> list[str]:
        if not isinstance(sampled, AgentSampled):
            return super().texts(sampled)
        return [Completion(t.replies[-1] if t.replies else "", "".join(t.replies), t.finished)
                for t in sampled.trajectories]

    def score(self, pb: PromptBatch, sampled: Sampled) -> tuple[list[float], dict[str, list[float]]]:
        prompts = [last_user_text(pb.records[i]["messages"]) for i in sampled.prompt]
        records = [pb.records[i]["record"] for i in sampled.prompt]
        return self.rewards.score(prompts, self.texts(sampled), records)

    def rows(self, pb: PromptBatch, sampled: Sampled) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) (R, T) of the trajectories, y IGNORE_INDEX but at the model's own tokens."""
        assert isinstance(sampled, AgentSampled)
        return trajectory_rows(sampled.trajectories)

    def cut(self, sampled: Sampled) -> int:
        """The trajectories that did not finish (out of tokens, rounds or context)."""
        assert isinstance(sampled, AgentSampled)
        return sum(not tr.finished for tr in sampled.trajectories)


def trajectory_rows(trajs: Sequence[Trajectory]) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y) (R, T): each trajectory's row right-padded, the targets y IGNORE_INDEX but where the model wrote
    the token (y[r, k] is the target of x[r, k]: the row's token k + 1)."""
    rows = [t.row() for t in trajs]
    width = max(len(ids) for ids, _ in rows) - 1
    x = torch.zeros(len(rows), width, dtype=torch.long)
    y = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    for r, (ids, mine) in enumerate(rows):
        t = torch.tensor(ids, dtype=torch.long)
        x[r, :len(ids) - 1] = t[:-1]
        targets = torch.tensor(mine[1:], dtype=torch.bool)
        y[r, :len(ids) - 1] = torch.where(targets, t[1:], torch.full_like(t[1:], IGNORE_INDEX))
    return x, y


def sampler_for(cfg: Any, tokenizer: Any, rewards: Any, device: torch.device) -> Sampler:
    """The sampler of an RL stage's config (grpo.* or ppo.*): plain completions, or with `tools` the trajectories
    of this module, calling them."""
    if cfg.tools:
        return AgentSampler(tokenizer, rewards, device, thinking=cfg.thinking, tools=AgentTools.from_spec(cfg.tools),
                            max_rounds=cfg.max_rounds, compile=cfg.compile_rollouts)
    return Sampler(tokenizer, rewards, device, thinking=cfg.thinking, compile=cfg.compile_rollouts)
