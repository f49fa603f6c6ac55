"""`--task toolcall:FILE`: tool use scored on its calls and final answers, for a checkpoint or any endpoint.

A task file is JSON Lines, one item per line, in either of two layouts:

- plain: `{"question": ..., "tools": [...], "call": {"name": ..., "arguments": {...}}, "answer": ...,
  "results": {...}}`;
- MiniMind's (`scripts/eval_toolcall.py`'s cases): `{"prompt": ..., "tools": [...]}`, with the same optional
  `call`, `answer` and `results`.

`tools` lists the tools offered: OpenAI tool objects (`{"type": "function", "function": {...}}`) or bare
functions, or the names of nanolm's built-in tools (`calculator`, ...: `nanolm chat --tools builtin`), which
are run for real. A call to any other tool gets the item's `results[name]` (text, or JSON written as JSON),
as MiniMind's evaluation mocks its tools. `call` is the call expected (any call of the conversation with that
name and those arguments counts; strings compared without whitespace, numbers as numbers), `answer` what the
final reply must state (a number among its numbers, else the text, case-insensitive). An item is right when
every expectation it gives holds; one that gives neither is right when the model called an offered tool.

Each item is a conversation of up to `max_rounds` rounds: the reply is read, its calls run, their results
entered as tool turns, and the model replies again, until a reply makes no call. Replies are greedy. A
backend answers a round for every conversation still going:

- `LocalBackend`: a checkpoint's engine, the prompts rendered and the calls guided as `nanolm serve` renders
  and guides them (rows decoded together);
- `EndpointBackend`: any OpenAI-compatible `/v1/chat/completions` (`nanolm serve`, ollama, vLLM, ...), one
  request per conversation and round, `temperature` 0.

Both read the same OpenAI messages, so a checkpoint scores the same directly and through `nanolm serve`
(tested). The result adds, beside the accuracy, how often the model called a tool at all (`called`), the share
of right calls among items that expect one (`call_acc`) and of right answers among items that give one
(`answer_acc`); each item's conversation is kept in the results JSON.
"""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, Sequence

from nanolm.chat import ToolCall, message_from_dict, read_reply, tools_from_value
from nanolm.data.jsonl import read_jsonl
from nanolm.errors import UserError
from nanolm.eval.scoring import NUMBER, answers_match, summary

PREFIX = "toolcall:"
MAX_ROUNDS = 3
MAX_NEW_TOKENS = 128


@dataclass
class ToolItem:
    """One tool-use question: the tools offered (OpenAI tool objects), what is expected, the mocked results."""

    question: str
    tools: list[dict[str, Any]]
    call: dict[str, Any] | None = None  # {"name", "arguments": {...}}
    answer: str | None = None
    results: dict[str, Any] = field(default_factory=dict)
    where: str = ""


def _function(tool: dict[str, Any]) -> dict[str, Any]:
    return tool.get("function", tool) if tool.get("type") == "function" else tool


def read_toolcall_file(path: str | Path) -> list[ToolItem]:
    """The items of a toolcall task file (either layout); one line naming file:line and the fix on bad input."""
    from nanolm.infer.tools import BUILTIN_TOOLS
    builtin = {_function(t)["name"]: t for t in BUILTIN_TOOLS}
    p = Path(path)
    if not p.is_file():
        raise UserError(f"--task toolcall:{path}: no such file; give a .jsonl file of tool-use items")
    items = []
    for rec, n, _ in read_jsonl(p, fix="write one item per line"):
        where = f"{p}:{n}"
        if not isinstance(rec, dict):
            raise UserError(f"{where}: an item must be an object with \"question\" (or \"prompt\") and \"tools\"")
        question = rec.get("question", rec.get("prompt"))
        if not isinstance(question, str) or not question.strip():
            raise UserError(f"{where}: no \"question\" (or MiniMind's \"prompt\") text")
        tools = rec.get("tools")
        if not isinstance(tools, list) or not tools:
            raise UserError(f"{where}: \"tools\" must be a non-empty list of tool objects or built-in tool names")
        offered = []
        for i, t in enumerate(tools):
            if isinstance(t, str):
                if t not in builtin:
                    raise UserError(f"{where}: tools[{i}] {t!r} is not a built-in tool ({', '.join(builtin)}); "
                                    "give the tool's object instead")
                offered.append(builtin[t])
            elif isinstance(t, dict) and isinstance(_function(t).get("name"), str):
                offered.append(t)
            else:
                raise UserError(f"{where}: tools[{i}] must be a tool object with a function name, or a "
                                "built-in tool's name")
        call = rec.get("call", rec.get("expected_call"))
        if call is not None:
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                raise UserError(f"{where}: \"call\" must be {{\"name\": ..., \"arguments\": {{...}}}}")
            args = call.get("arguments", {})
            if isinstance(args, str):
                try:
                    args = json.loads(args)
                except json.JSONDecodeError:
                    raise UserError(f"{where}: call.arguments is not a JSON object") from None
            if not isinstance(args, dict):
                raise UserError(f"{where}: call.arguments must be an object")
            call = {"name": call["name"], "arguments": args}
        answer = rec.get("answer")
        if answer is not None and not isinstance(answer, (str, int, float)):
            raise UserError(f"{where}: \"answer\" must be a string or a number")
        results = rec.get("results", {})
        if not isinstance(results, dict):
            raise UserError(f"{where}: \"results\" must be an object of tool name -> result")
        items.append(ToolItem(question, offered, call, None if answer is None else str(answer), results, where))
    if not items:
        raise UserError(f"{p}: holds no items; write one JSON object per line")
    return items


class Backend(Protocol):
    name: str

    def replies(self, talks: Sequence[list[dict[str, Any]]], tools: Sequence[list[dict[str, Any]]]
                ) -> list[dict[str, Any]]:
        """The assistant message (OpenAI's form) that answers each conversation, greedily."""


class LocalBackend:
    """A checkpoint's engine, its prompts rendered and its calls guided as `nanolm serve` renders and guides."""

    def __init__(self, engine: Any, tok: Any, *, rows: int = 16, max_new_tokens: int = MAX_NEW_TOKENS) -> None:
        if not tok.chat_format.tools:
            raise UserError(f"--task toolcall: the tokenizer {tok.path} carries the plain ChatML template, which "
                            "has no tools; score a model whose tokenizer has them (`nanolm tokenizer train`)")
        self.engine, self.tok, self.rows, self.max_new_tokens = engine, tok, rows, max_new_tokens
        self.name = str(getattr(tok, "path", "checkpoint"))

    def replies(self, talks: Sequence[list[dict[str, Any]]], tools: Sequence[list[dict[str, Any]]]
                ) -> list[dict[str, Any]]:
        from nanolm.config.sampling import SamplingParams
        from nanolm.eval.scoring import generate_texts
        from nanolm.infer.bans import ReplyGuides
        from nanolm.infer.server.choices import assistant_message, call_id

        fmt, tok = self.tok.chat_format, self.tok
        guides = ReplyGuides(tok, self.engine.model.config.vocab_size, self.engine.device)
        prompts, per_talk = [], []
        for talk, offered in zip(talks, tools):
            messages = [message_from_dict(f"messages[{i}]", m) for i, m in enumerate(talk)]
            text = fmt.render(messages, tools_from_value("tools", offered), add_generation_prompt=True,
                              thinking=False)
            prompts.append(tok.encode(text))
            per_talk.append(guides.reply(offered, thinking=False))  # no tools offered: no call tag
        params = SamplingParams(max_new_tokens=self.max_new_tokens, temperature=0.0)
        texts = generate_texts(self.engine, tok, prompts, params, stop_ids=(tok.im_end_id, tok.eot_id),
                               rows=self.rows, guide=per_talk)
        out = []
        for text in texts:
            msg = read_reply(text, bare_calls=fmt.bare_calls)
            out.append(assistant_message(msg, [call_id() for _ in msg.tool_calls], thinking=False))
        return out


class EndpointBackend:
    """Any OpenAI-compatible chat completions endpoint: `url` is its base (`http://127.0.0.1:8000/v1`)."""

    def __init__(self, url: str, model: str, *, api_key: str | None = None,
                 max_new_tokens: int = MAX_NEW_TOKENS, timeout: float = 600.0) -> None:
        if not url.startswith(("http://", "https://")):
            raise UserError(f"--endpoint {url}: give the API's base URL, such as http://127.0.0.1:8000/v1")
        self.url = url.rstrip("/") + "/chat/completions"
        self.name, self.api_key, self.max_new_tokens, self.timeout = model, api_key, max_new_tokens, timeout

    def _post(self, body: dict[str, Any]) -> dict[str, Any]:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(self.url, json.dumps(body).encode("utf-8"), headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            detail = e.read().decode("utf-8", "replace")[:300]
            raise UserError(f"--endpoint {self.url}: HTTP {e.code}: {detail}") from None
        except (urllib.error.URLError, TimeoutError, OSError) as e:
            raise UserError(f"--endpoint {self.url}: cannot reach it ({getattr(e, 'reason', e)}); is the server "
                            "running at that address?") from None

    def replies(self, talks: Sequence[list[dict[str, Any]]], tools: Sequence[list[dict[str, Any]]]
                ) -> list[dict[str, Any]]:
        out = []
        for talk, offered in zip(talks, tools):
            res = self._post({"model": self.name, "messages": talk, "tools": offered, "temperature": 0,
                              "max_tokens": self.max_new_tokens, "stream": False})
            try:
                msg = res["choices"][0]["message"]
            except (KeyError, IndexError, TypeError):
                raise UserError(f"--endpoint {self.url}: the answer holds no choices[0].message") from None
            out.append({k: v for k, v in msg.items() if k in ("role", "content", "reasoning_content", "tool_calls")})
        return out


def _same(a: Any, b: Any) -> bool:
    """Arguments equal as a user means them: strings without whitespace, numbers as numbers."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=1e-12)
    if isinstance(a, str) and isinstance(b, str):
        return "".join(a.split()) == "".join(b.split())
    return a == b


def states(reply: str, answer: str) -> bool:
    """Whether a reply states the answer: as one of its numbers when the answer is a number, else as text."""
    if NUMBER.fullmatch(answer.strip()):
        return any(answers_match(x.replace("$", ""), answer) for x in NUMBER.findall(reply))
    return answer.strip().lower() in reply.lower()


def _run(call: dict[str, Any], item: ToolItem) -> str:
    """A call's result: a built-in tool runs; another gets the item's mocked result."""
    from nanolm.infer.tools import BUILTINS, run_builtin
    fn = call.get("function", {})
    name, args = fn.get("name", ""), fn.get("arguments", "{}")
    offered = [_function(t)["name"] for t in item.tools]
    if name not in offered:
        return f"error: there is no tool named {name!r}"
    if name in item.results:
        r = item.results[name]
        return r if isinstance(r, str) else json.dumps(r, ensure_ascii=False)
    if name in BUILTINS:
        return run_builtin(ToolCall(name, args if isinstance(args, str) else json.dumps(args)))
    return f"error: no result for the tool {name!r} in this item"


def _arguments(call: dict[str, Any]) -> Any:
    args = call.get("function", {}).get("arguments", "{}")
    try:
        return json.loads(args) if isinstance(args, str) else args
    except json.JSONDecodeError:
        return None


def score_toolcall(backend: Backend, items: Sequence[ToolItem], *, max_rounds: int = MAX_ROUNDS) -> dict[str, Any]:
    """Score the items through `backend` (see the module doc). Returns {"kind": "toolcall", "n", "acc",
    "chance": 0, "centred", "stderr", "called", "call_acc", "answer_acc", "endpoint", "items"}."""
    talks: list[list[dict[str, Any]]] = [[{"role": "user", "content": it.question}] for it in items]
    calls: list[list[dict[str, Any]]] = [[] for _ in items]
    finals: list[str] = [""] * len(items)
    going = list(range(len(items)))
    for _ in range(max_rounds):
        if not going:
            break
        answers = backend.replies([talks[i] for i in going], [items[i].tools for i in going])
        still = []
        for i, msg in zip(going, answers):
            made = msg.get("tool_calls") or []
            finals[i] = msg.get("content") or ""
            talks[i].append({"role": "assistant", "content": msg.get("content"),
                             **({"tool_calls": made} if made else {})})
            if not made:
                continue
            calls[i] += made
            for c in made:
                talks[i].append({"role": "tool", "tool_call_id": c.get("id", ""), "content": _run(c, items[i])})
            still.append(i)
        going = still
    per_item, correct = [], []
    for i, it in enumerate(items):
        offered = {_function(t)["name"] for t in it.tools}
        names = [c.get("function", {}).get("name") for c in calls[i]]
        call_ok = None if it.call is None else any(
            n == it.call["name"] and _same(_arguments(c), it.call["arguments"]) for n, c in zip(names, calls[i]))
        answer_ok = None if it.answer is None else states(finals[i], it.answer)
        if call_ok is None and answer_ok is None:
            ok = any(n in offered for n in names)
        else:
            ok = call_ok is not False and answer_ok is not False
        correct.append(float(ok))
        per_item.append({"where": it.where, "question": it.question, "call": it.call, "answer": it.answer,
                         "call_ok": call_ok, "answer_ok": answer_ok, "correct": ok, "reply": finals[i],
                         "conversation": talks[i]})
    s = summary(correct, 0.0)
    n = len(items)
    with_call = [p["call_ok"] for p in per_item if p["call_ok"] is not None]
    with_answer = [p["answer_ok"] for p in per_item if p["answer_ok"] is not None]
    return {"kind": "toolcall", "n": n, "acc": s["acc"], "chance": 0.0, "centred": s["centred"],
            "stderr": s["stderr"], "called": sum(bool(c) for c in calls) / n,
            "call_acc": sum(with_call) / len(with_call) if with_call else None,
            "answer_acc": sum(with_answer) / len(with_answer) if with_answer else None,
            "endpoint": backend.name, "items": per_item}
