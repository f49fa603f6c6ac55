r"""Reward functions for RL from rewards (`--stage grpo`, `--stage ppo`), chosen and weighted by name.

`grpo.rewards` (or `ppo.rewards`) is a spec such as "answer:1.0,format:0.2,length:0.1": each
item a reward and its weight (1 when left out); a completion's reward is the
weighted sum, and each reward's own value is logged. Every reward is a
function (prompt, completion, record) -> float: prompt the text of the
prompt's last user message, completion the text the model wrote after the
generation prompt (its closing `<|im_end|>` not included), record the prompt's
JSON record as the user gave it (reference fields such as "answer" included).

Built-ins:

- `answer`: 1.0 when the completion's final answer matches the record's
  reference ("answer", else "solution", else "gt"), else 0.0. The final
  answer is the last `\boxed{...}`, else what follows the last `####`, else
  the last number of the reply (its content after any think block); a
  reference that is a worked solution is read the same way. Both are
  normalised (`normalise_answer`: spaces, `$`, thousands commas, a trailing
  period, trailing units such as "42 apples" or "42元" dropped) and compared as
  numbers (to 1e-6, relative) when both are, else as case-folded text.
- `format`: 1.0 when the reply holds exactly one `<think>` block, closed,
  with an answer after it (the generation prompt's own opening counts when
  thinking is on), else 0.0.
- `length`: 1.0 when the reply has grpo.length_min to grpo.length_max
  characters, falling linearly to 0 at 0 characters and at twice length_max.
- `repetition`: minus the share of the reply's word 3-grams (a CJK character
  is a word) that repeat an earlier one: 0 for a reply that never repeats.
- `tool_call`: 1.0 when the reply holds at least one `<tool_call>` and each is
  a valid call (`chat.parse_tool_call`) of a tool the record lists (any name
  when it lists none), else 0.0. With grpo.tools, every reply of the
  trajectory is read (its calls).
- `finished`: 1.0 when the last reply made no call and ended by itself (not
  cut at max_new_tokens, not out of grpo.max_rounds), else 0.0.

With grpo.tools (nanolm/train/rl/agent.py) the completion is the trajectory's
final reply, a `Completion` that also carries the text of every reply and
whether the trajectory finished; a plain completion is a Completion too.
- `model`: the score of a local `transformers` sequence-classification
  model (grpo.reward_model, a directory with its tokenizer) on the prompt's
  conversation with the reply (its chat template when the tokenizer has one,
  else prompt and reply on two lines); logit 0 of its output.

A user's own function is named by its file: "my_rewards.py:score:0.5" loads
`score` from my_rewards.py (imported from that path with importlib).
"""

from __future__ import annotations

import importlib.util
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from nanolm.chat import ChatError, parse_tool_call
from nanolm.errors import UserError
from nanolm.special_tokens import THINK, THINK_END

RewardFn = Callable[[str, str, Mapping[str, Any]], float]
REFERENCE_FIELDS = ("answer", "solution", "gt")
BUILTINS = ("answer", "format", "length", "repetition", "tool_call", "finished", "model")

_BOXED = "\\boxed{"
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")
_NUMERIC = re.compile(r"^-?(?:\d+(?:\.\d*)?|\.\d+)(?:/\d+)?$")
_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
_WORD = re.compile(r"[A-Za-z0-9_]+|[^\sA-Za-z0-9_]")


class Completion(str):
    """A completion's text (the final reply of a trajectory), with the text of all its replies (`replies`, the
    calls among them) and whether it finished (`finished`: no call in the last reply, which ended by itself)."""

    replies: str
    finished: bool

    def __new__(cls, text: str, replies: str | None = None, finished: bool = True) -> "Completion":
        self = super().__new__(cls, text)
        self.replies = text if replies is None else replies
        self.finished = finished
        return self


# ----------------------------------------------------------------------------- the answer


def _last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} (braces balanced), or None."""
    at = text.rfind(_BOXED)
    if at < 0:
        return None
    depth, i = 1, at + len(_BOXED)
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def reply_content(completion: str) -> str:
    """The reply without its think block: what follows the last `</think>` (all of it when there is none)."""
    return completion.rsplit(THINK_END, 1)[-1]


def final_answer(text: str) -> str | None:
    """The final answer a text states: the last \\boxed{}, else after the last ####, else its last number."""
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed
    if "####" in text:
        return text.rsplit("####", 1)[1].strip().split("\n")[0]
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def normalise_answer(answer: str) -> str:
    """An answer as compared: spaces, `$`, thousands commas, a trailing period and trailing units dropped."""
    a = answer.strip().replace("$", "").replace("\\,", "").strip()
    a = re.sub(r"\\(?:text|mathrm)\{([^}]*)\}", r"\1", a)
    a = a.rstrip(".。").strip()
    m = re.match(r"^(-?[\d,]*\.?\d+(?:/\d+)?)\s*[^\d\s,./].*$", a)  # a number then units: "42 apples", "42元"
    if m:
        a = m.group(1)
    if re.fullmatch(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?", a):
        a = a.replace(",", "")
    return " ".join(a.split()).casefold()


def _number(a: str) -> float | None:
    if not _NUMERIC.match(a):
        return None
    if "/" in a:
        num, den = a.split("/")
        return float(num) / float(den) if float(den) else None
    return float(a)


def answers_match(given: str, reference: str) -> bool:
    """Whether two normalised answers agree: as numbers to 1e-6 (relative) when both are, else as text."""
    g, r = normalise_answer(given), normalise_answer(reference)
    gn, rn = _number(g), _number(r)
    if gn is not None and rn is not None:
        return math.isclose(gn, rn, rel_tol=1e-6, abs_tol=1e-9)
    return g == r


def reference_of(record: Mapping[str, Any]) -> str | None:
    """The record's reference answer as text: its "answer", "solution" or "gt" field, read as final_answer
    reads a worked solution; None when it has none."""
    for key in REFERENCE_FIELDS:
        value = record.get(key)
        if value is None or value == "":
            continue
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            return str(value)
        text = str(value)
        return final_answer(text) if ("####" in text or _BOXED in text) else text
    return None


def answer_reward(prompt: str, completion: str, record: Mapping[str, Any]) -> float:
    ref = reference_of(record)
    if ref is None:
        raise UserError(f"the answer reward needs a reference field ({', '.join(REFERENCE_FIELDS)}) "
                        f"in every prompt record; this one has {', '.join(map(str, record)) or 'no fields'}")
    given = final_answer(reply_content(completion))
    return float(given is not None and answers_match(given, ref))


# ----------------------------------------------------------------------------- form


def format_reward(thinking: bool) -> RewardFn:
    """One closed think block then an answer; with thinking on, the prompt has opened the block already."""
    def reward(prompt: str, completion: str, record: Mapping[str, Any]) -> float:
        text = (THINK if thinking else "") + completion
        if text.count(THINK) != 1 or text.count(THINK_END) != 1:
            return 0.0
        head, _, tail = text.partition(THINK_END)
        return float(head.lstrip().startswith(THINK) and bool(tail.strip()))
    return reward


def length_reward(lo: int, hi: int) -> RewardFn:
    def reward(prompt: str, completion: str, record: Mapping[str, Any]) -> float:
        n = len(reply_content(completion).strip())
        if n < lo:
            return n / lo if lo else 1.0
        if n > hi:
            return max(0.0, 1.0 - (n - hi) / hi)
        return 1.0
    return reward


def repetition_reward(prompt: str, completion: str, record: Mapping[str, Any]) -> float:
    words = _WORD.findall(completion)
    grams = [tuple(words[i:i + 3]) for i in range(len(words) - 2)]
    if not grams:
        return 0.0
    return -(1.0 - len(set(grams)) / len(grams))


def _tool_names(record: Mapping[str, Any]) -> set[str]:
    names = set()
    for tool in record.get("tools") or ():
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            names.add(fn["name"])
    return names


def tool_call_reward(prompt: str, completion: str, record: Mapping[str, Any]) -> float:
    bodies = _CALL.findall(getattr(completion, "replies", completion))
    if not bodies:
        return 0.0
    allowed = _tool_names(record)
    for body in bodies:
        try:
            call = parse_tool_call(body)
        except ChatError:
            return 0.0
        if allowed and call.name not in allowed:
            return 0.0
    return 1.0


def finished_reward(prompt: str, completion: str, record: Mapping[str, Any]) -> float:
    """1.0 when the trajectory's last reply made no call and ended by itself; a plain str, when it has no call."""
    return float(getattr(completion, "finished", True) and not _CALL.search(completion))


# ----------------------------------------------------------------------------- a reward model


class RewardModel:
    """A local transformers sequence-classification model as a reward (see the module doc)."""

    def __init__(self, path: str, device: str = "cpu", section: str = "grpo") -> None:
        try:
            import torch
            from transformers import AutoModelForSequenceClassification, AutoTokenizer
        except ImportError:
            raise UserError(f"{section}.reward_model needs transformers: pip install 'nanolm[hf]'") from None
        d = Path(path)
        if not (d / "config.json").is_file():
            raise UserError(f"{d}: {section}.reward_model must be a transformers model directory (config.json, weights "
                            "and tokenizer), saved with save_pretrained")
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(d)
            self.model = AutoModelForSequenceClassification.from_pretrained(d).to(device).eval()
        except (OSError, ValueError) as e:
            raise UserError(f"{d}: cannot load it as a sequence-classification model ({e}); {section}.reward_model "
                            "takes a directory saved with save_pretrained") from None
        self.torch, self.device = torch, device

    def _text(self, prompt: str, completion: str) -> str:
        if getattr(self.tokenizer, "chat_template", None):
            return self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}], tokenize=False)
        return f"{prompt}\n{completion}"

    def __call__(self, prompt: str, completion: str, record: Mapping[str, Any]) -> float:
        enc = self.tokenizer(self._text(prompt, reply_content(completion)), return_tensors="pt", truncation=True)
        with self.torch.no_grad():
            logits = self.model(**{k: v.to(self.device) for k, v in enc.items()}).logits  # (1, num_labels)
        return float(logits[0, 0])


# ----------------------------------------------------------------------------- the spec


def load_user_function(spec: str, section: str = "grpo") -> RewardFn:
    """`path/to/module.py:function`, imported from the file."""
    file, _, name = spec.rpartition(":")
    path = Path(file)
    if not path.is_file():
        raise UserError(f"{section}.rewards: {path} (from {spec!r}) is not a file; name a user reward as "
                        "path/to/module.py:function")
    module_name = f"nanolm_user_reward_{abs(hash(str(path.resolve())))}"
    loader_spec = importlib.util.spec_from_file_location(module_name, path)
    if loader_spec is None or loader_spec.loader is None:
        raise UserError(f"{section}.rewards: {path} cannot be imported as a Python module")
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[module_name] = module
    try:
        loader_spec.loader.exec_module(module)
    except Exception as e:  # the user's code: any error it raises
        raise UserError(f"{path}: importing it failed ({type(e).__name__}: {e})") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise UserError(f"{path}: has no function {name!r} ({section}.rewards names {spec!r}); define "
                        f"def {name}(prompt, completion, record) -> float")
    return fn


def parse_spec(spec: str, section: str = "grpo") -> list[tuple[str, float]]:
    """"answer:1.0,format:0.2,my.py:fn:0.5" -> [("answer", 1.0), ("format", 0.2), ("my.py:fn", 0.5)]."""
    out = []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        name, weight = item, 1.0
        head, sep, tail = item.rpartition(":")
        if sep:
            try:
                name, weight = head, float(tail)
            except ValueError:
                name, weight = item, 1.0
        if not math.isfinite(weight):
            raise UserError(f"{section}.rewards: the weight of {name!r} must be a finite number, got {tail!r}")
        if name not in BUILTINS and ".py:" not in name:
            raise UserError(f"{section}.rewards: unknown reward {name!r}; choose from {', '.join(BUILTINS)}, or name "
                            "your own as path/to/module.py:function")
        out.append((name, weight))
    if not out:
        raise UserError(f"{section}.rewards is empty; give at least one reward, e.g. answer:1.0")
    return out


@dataclass
class Rewards:
    """The weighted rewards of a spec: `score` gives each completion's total and each reward's value."""

    names: list[str]
    weights: list[float]
    fns: list[RewardFn]
    section: str = "grpo"  # the config section whose spec it is (grpo, ppo), for the messages

    @classmethod
    def from_spec(cls, spec: str, *, thinking: bool = False, length_min: int = 1, length_max: int = 512,
                  reward_model: str = "", device: str = "cpu", section: str = "grpo") -> "Rewards":
        names, weights, fns = [], [], []
        for name, weight in parse_spec(spec, section):
            if name == "model":
                if not reward_model:
                    raise UserError(f"{section}.rewards names the model reward; pass --{section}.reward_model "
                                    "<directory>")
                fn: RewardFn = RewardModel(reward_model, device, section)
            elif name == "answer":
                fn = answer_reward
            elif name == "format":
                fn = format_reward(thinking)
            elif name == "length":
                fn = length_reward(length_min, length_max)
            elif name == "repetition":
                fn = repetition_reward
            elif name == "tool_call":
                fn = tool_call_reward
            elif name == "finished":
                fn = finished_reward
            else:
                fn = load_user_function(name, section)
            names.append(Path(name.split(":")[0]).stem if ".py:" in name else name)
            weights.append(weight)
            fns.append(fn)
        return cls(names, weights, fns, section)

    def score(self, prompts: Sequence[str], completions: Sequence[str],
              records: Sequence[Mapping[str, Any]]) -> tuple[list[float], dict[str, list[float]]]:
        """(total per completion, {reward name: its value per completion})."""
        values: dict[str, list[float]] = {}
        for name, fn in zip(self.names, self.fns):
            got = []
            for p, c, r in zip(prompts, completions, records):
                try:
                    v = fn(p, c, r)
                except UserError as e:  # a reward that cannot score this record (the answer reward, no reference)
                    raise UserError(f"{self.section}.rewards: {e}") from None
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                    raise UserError(f"{self.section}.rewards: reward {name!r} returned {v!r}; a reward must return "
                                    "a finite float")
                got.append(float(v))
            values[name] = got
        totals = [sum(w * values[n][i] for n, w in zip(self.names, self.weights)) for i in range(len(completions))]
        return totals, values
