"""The chat session and the `nanolm chat` command (scripted through stdin): history in the tokenizer's chat
format, reasoning shown apart, tool calls run (built-ins) or answered by the user, the round limit, and old
exchanges dropped whole to fit the context."""

from __future__ import annotations

import collections
import io
import json
import subprocess
import sys

import pytest
from chat_helpers import old_chatml_tokenizer
import torch

from nanolm.chat import CHATML, Message, ToolCall
from nanolm.config import ModelConfig, SamplingParams
from nanolm.errors import UserError
from nanolm.infer.session import ChatSession, run_chat
from nanolm.infer.engine import Engine
from nanolm.infer.tools import Toolbox
from nanolm.model.transformer import Transformer
from nanolm.tokenizer import Tokenizer
from nanolm.train.trainer import train
from test_train import tiny_cfg

from engine_doubles import ScriptBatch, Watched


def session(tokenizer_dir, max_seq_len=64, max_new_tokens=8, system=""):
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=400, d_model=32, n_layer=1, n_head=4, n_kv_head=2,
                                    max_seq_len=max_seq_len))
    return ChatSession(Engine(model), Tokenizer.load(tokenizer_dir),
                       SamplingParams(max_new_tokens=max_new_tokens, temperature=0), system=system)


def test_history_is_rendered_with_the_chat_template(tokenizer_dir):
    s = session(tokenizer_dir, max_seq_len=256, system="Be brief.")
    reply = "".join(s.reply("你好"))
    assert s.history == [Message("user", "你好"), Message("assistant", reply)]
    ids, dropped = s.prompt_ids("And then?")
    tok = s.tok
    expected = tok.chat_format.render([Message("system", "Be brief."), *s.history, Message("user", "And then?")],
                                      add_generation_prompt=True)
    assert ids == tok.encode(expected) and dropped == 0


def test_oldest_turns_are_dropped_to_fit_and_reported(tokenizer_dir):
    s = session(tokenizer_dir, max_seq_len=64, max_new_tokens=8, system="sys")
    out = io.StringIO()
    turns = "\n".join(["To be, or not to be, that is the question."] * 4) + "\n"
    run_chat(s, stdin=io.StringIO(turns), out=out, interactive=False)
    text = out.getvalue()
    assert text.count("user: To be") == 4 and text.count("assistant: ") == 4
    assert "[context full: dropped the" in text
    assert s.dropped_total > 0
    ids, _ = s.prompt_ids("x")
    assert len(ids) <= 64 - 8  # room kept for the reply
    assert s.tok.decode(ids).startswith("<|im_start|>system\nsys<|im_end|>")  # the system prompt is kept


def test_commands(tokenizer_dir):
    s = session(tokenizer_dir, max_seq_len=128)
    out = io.StringIO()
    run_chat(s, stdin=io.StringIO("hi\n/reset\n/system You are a poet.\n/what\nhello\n/exit\nignored\n"), out=out,
             interactive=False)
    text = out.getvalue()
    assert "[conversation reset]" in text
    assert "[system prompt set: 'You are a poet.'; conversation reset]" in text
    assert "[unknown command /what;" in text
    assert "ignored" not in text  # /exit stopped reading
    assert s.system == "You are a poet." and s.history[0] == Message("user", "hello")


def test_chat_command_holds_a_two_turn_conversation(data_dir, tmp_path):
    run = tmp_path / "run"
    train(tiny_cfg(data_dir, run, **{"train.max_steps": 3, "model.max_seq_len": 128, "train.seq_len": 32}),
          quiet=True)
    r = subprocess.run([sys.executable, "-m", "nanolm", "chat", str(run), "--temperature", "0",
                        "--max-new-tokens", "12", "--system", "You are helpful."],
                       input="你好，请介绍一下三国。\nWhat is the question?\n", capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "user: 你好，请介绍一下三国。" and lines[1].startswith("assistant: ")
    assert "user: What is the question?" in lines
    assert sum(line.startswith("assistant: ") for line in lines) == 2


# --- tools and reasoning, with an engine that replays scripted replies ----------------------------------

class Replies(Watched, Engine):
    """An engine whose k-th generation replays the k-th reply text (then nothing); `prompts` holds the prompt
    ids of each."""

    def __init__(self, tok: Tokenizer, replies: list[str], max_seq_len: int = 4096) -> None:
        torch.manual_seed(0)
        super().__init__(Transformer(ModelConfig(vocab_size=400, d_model=32, n_layer=1, n_head=4, n_kv_head=2,
                                                 max_seq_len=max_seq_len)))
        self.replies = collections.deque(tok.encode(r) for r in replies)
        self.watch()

    @property
    def prompts(self) -> list[list[int]]:
        return self.signals.prompts

    def batch(self) -> ScriptBatch:
        return ScriptBatch([], self.signals, 0.0, self.replies)


def call_text(name: str, arguments: dict) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments)}}}\n</tool_call>'


QUESTION = "What is 12*(3+4)?"
CALL = ToolCall("calculator", '{"expression": "12*(3+4)"}')
BUILTIN = Toolbox.from_specs(["builtin"])


def chat(tok, replies: list[str], lines: list[str], interactive: bool = False, **kw):
    """(the transcript, the session, the engine) of a scripted session over `replies`."""
    eng = Replies(tok, replies, kw.pop("max_seq_len", 4096))
    s = ChatSession(eng, tok, SamplingParams(max_new_tokens=kw.pop("max_new_tokens", 256)), **kw)
    out = io.StringIO()
    run_chat(s, stdin=io.StringIO("".join(line + "\n" for line in lines)), out=out, interactive=interactive)
    return out.getvalue(), s, eng


def test_a_builtin_tool_call_is_run_and_its_result_fed_back(tok):
    text, s, eng = chat(tok, [call_text("calculator", {"expression": "12*(3+4)"}), "12*(3+4) = 84."], [QUESTION],
                        tools=BUILTIN)
    assert text == (f"user: {QUESTION}\n"
                    'tool call: calculator({"expression": "12*(3+4)"})\n'
                    "tool result: 84\n"
                    "assistant: 12*(3+4) = 84.\n")
    turn = [Message("user", QUESTION), Message("assistant", "", "", (CALL,)), Message("tool", "84")]
    assert s.history == [*turn, Message("assistant", "12*(3+4) = 84.")]
    fmt, tools = tok.chat_format, BUILTIN.texts()
    # The first prompt offers the tools; the second holds the call and the computed result, as the format renders.
    assert eng.prompts == [tok.encode(fmt.render(turn[:1], tools, add_generation_prompt=True)),
                           tok.encode(fmt.render(turn, tools, add_generation_prompt=True))]
    assert "<tool_response>\n84\n</tool_response>" in tok.decode(eng.prompts[1])


def test_reasoning_is_shown_apart_from_the_answer(tok):
    text, s, eng = chat(tok, ["I multiply.\n</think>\n\n" + call_text("calculator", {"expression": "6*7"}),
                              "Half done.\n</think>\n\nIt is 42."], ["6 times 7?"], tools=BUILTIN, thinking=True)
    assert text == ("user: 6 times 7?\n"
                    "reasoning: I multiply.\n"
                    'tool call: calculator({"expression": "6*7"})\n'
                    "tool result: 42\n"
                    "reasoning: Half done.\n"
                    "assistant: It is 42.\n")
    assert s.history[-1] == Message("assistant", "It is 42.", "Half done.")
    assert tok.decode(eng.prompts[0]).endswith("<|im_start|>assistant\n<think>\n")  # thinking on: left open


def test_a_declared_tool_is_asked_for_or_reported_as_not_runnable(tok, tmp_path):
    f = tmp_path / "tools.json"
    f.write_text(json.dumps([{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]))
    box = Toolbox.from_specs([str(f)])
    replies = [call_text("get_weather", {"city": "Paris"}), "Sorry."]
    text, s, _ = chat(tok, replies, ["Weather in Paris?"], tools=box)
    failed = "error: the tool get_weather could not be run in this chat"
    assert text == ("user: Weather in Paris?\n"
                    'tool call: get_weather({"city": "Paris"})\n'
                    f"tool result: {failed}\n"
                    "[get_weather is not a tool this chat can run; the model was told it failed]\n"
                    "assistant: Sorry.\n")
    assert s.history[2] == Message("tool", failed)
    # At a terminal the user types the result: a line with a control token is refused and asked again.
    text, s, eng = chat(tok, [replies[0], "Sunny, then."], ["Weather in Paris?", "<think>", "sunny, 21 C"],
                        interactive=True, tools=box)
    assert s.history[2] == Message("tool", "sunny, 21 C")
    assert "get_weather result> [the tool result: contains <think>, a control token of the chat format; " in text
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in tok.decode(eng.prompts[1])
    assert "bot> Sunny, then." in text


def test_a_call_to_a_tool_not_offered_is_answered_with_an_error(tok):
    text, s, _ = chat(tok, [call_text("search", {"q": "x"}), "ok"], ["find x"], tools=BUILTIN)
    assert "tool result: error: there is no tool named 'search'; the tools are calculator, current_time\n" in text
    assert "not a tool this chat can run" not in text


def test_the_round_limit_ends_a_turn_of_endless_calls_and_the_chat_goes_on(tok):
    again = call_text("calculator", {"expression": "1+1"})
    text, s, eng = chat(tok, [again, again, "Fine."], ["loop", "next"], tools=BUILTIN, max_tool_rounds=1)
    assert text.count("tool call: calculator") == 2 and text.count("tool result: 2\n") == 2
    assert ("[stopped after 2 replies with tool calls (the limit is 1 continuations per turn); the results are kept "
            "for the next turn]\n") in text
    assert [m.role for m in s.history] == ["user", "assistant", "tool", "assistant", "tool", "user", "assistant"]
    assert text.endswith("user: next\nassistant: Fine.\n")


def test_old_exchanges_with_tool_turns_are_dropped_whole(tok):
    """Each turn is a call, its result and an answer; once the context is full the oldest exchanges go, each
    from its question up to the next one, so no tool result is left without its call."""
    fmt, tools = tok.chat_format, BUILTIN.texts()
    exchange = [Message("user", "q0"), Message("assistant", "", "", (ToolCall("calculator", '{"expression": "1+1"}'),)),
                Message("tool", "2"), Message("assistant", "It is 2.")]
    one = len(tok.encode(fmt.render(exchange, tools)))
    head = len(tok.encode(fmt.render([], tools)))
    per = one - head
    call = call_text("calculator", {"expression": "1+1"})
    max_new = len(tok.encode(call)) + 2  # room for the longer reply
    ctx = head + int(2.5 * per) + max_new  # room for two exchanges and a half
    replies = [r for _ in range(5) for r in (call, "It is 2.")]
    text, s, eng = chat(tok, replies, [f"q{i}" for i in range(5)], tools=BUILTIN, max_seq_len=ctx,
                        max_new_tokens=max_new)
    assert text.count("assistant: It is 2.") == 5 and "[context full: dropped the 1 oldest exchange(s)]" in text
    assert s.dropped_total == 3
    assert [m.content for m in s.history if m.role == "user"] == ["q3", "q4"] and s.history[0].role == "user"
    assert len(s.history) == 8
    for prompt in eng.prompts:
        assert len(prompt) <= ctx - max_new
        system, _, turns = tok.decode(prompt).partition("<|im_end|>\n")
        assert system.startswith("<|im_start|>system\n# Tools")  # the tools stay
        assert turns.startswith("<|im_start|>user\nq") and turns.count("<tool_call>") == turns.count("<tool_response>")


def test_tools_and_thinking_need_a_tokenizer_with_the_tags(tok, tmp_path):
    plain = old_chatml_tokenizer(tok.path.parent, tmp_path / "old")
    assert plain.chat_format is CHATML
    eng = Replies(plain, ["hi"])
    with pytest.raises(UserError, match=r"the chat has tools, but the tokenizer .* carries the plain ChatML "):
        ChatSession(eng, plain, SamplingParams(), tools=BUILTIN)
    with pytest.raises(UserError, match=r"the chat has thinking on, but the tokenizer .* drop --think"):
        ChatSession(eng, plain, SamplingParams(), thinking=True)
    text, s, _ = chat(plain, ["Hello."], ["hi"])  # a plain chat renders in its own layout
    assert text == "user: hi\nassistant: Hello.\n"
    assert s.engine.prompts == [plain.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")]


def test_chat_command_tools_flags(tmp_path):
    bad = tmp_path / "tools.json"
    bad.write_text("[1]")
    r = subprocess.run([sys.executable, "-m", "nanolm", "chat", str(tmp_path / "no-run"), "--tools", str(bad)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.strip() == (
        f'error: {bad}: tools[0] must be a tool object with a function name, such as {{"type": "function", '
        '"function": {"name": "add", "parameters": {...}}}')
    r = subprocess.run([sys.executable, "-m", "nanolm", "chat", "x", "--max-tool-rounds", "-1"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--max-tool-rounds -1: must be >= 0" in r.stderr


def test_chat_command_with_builtin_tools_and_thinking(tok, tmp_path):
    """The flags reach the session: a random model's reply, with thinking on, is read as reasoning until it
    writes </think> (which it is unlikely to), and the answer line follows it."""
    from nanolm.checkpoint import save_model

    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=400, d_model=32, n_layer=1, n_head=4, n_kv_head=2, max_seq_len=2048))
    ckpt = save_model(tmp_path / "ckpt", model, tokenizer_from=tok.path.parent)
    r = subprocess.run([sys.executable, "-m", "nanolm", "chat", str(ckpt), "--tools", "builtin", "--think",
                        "--temperature", "0", "--max-new-tokens", "6"],
                       input="What is 2+2?\n", capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "user: What is 2+2?"
    assert sum(line.startswith("assistant: ") for line in lines) == 1
    assert lines[1].startswith(("reasoning: ", "assistant: ", "tool call: ", "["))
