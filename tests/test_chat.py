"""The chat session and the `nanolm chat` command (scripted through stdin)."""

from __future__ import annotations

import io
import subprocess
import sys

import torch

from nanolm.config import ModelConfig, SamplingParams
from nanolm.data.chatml import render_chat
from nanolm.infer.chat import ChatSession, run_chat
from nanolm.infer.engine import Engine
from nanolm.model.transformer import Transformer
from nanolm.tokenizer import Tokenizer
from nanolm.train.trainer import train
from test_train import tiny_cfg


def session(tokenizer_dir, max_seq_len=64, max_new_tokens=8, system=""):
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=400, d_model=32, n_layer=1, n_head=4, n_kv_head=2,
                                    max_seq_len=max_seq_len))
    return ChatSession(Engine(model), Tokenizer.load(tokenizer_dir),
                       SamplingParams(max_new_tokens=max_new_tokens, temperature=0), system=system)


def test_history_is_rendered_with_the_chat_template(tokenizer_dir):
    s = session(tokenizer_dir, max_seq_len=256, system="Be brief.")
    reply = "".join(s.reply("你好"))
    assert s.turns == [{"role": "user", "content": "你好"}, {"role": "assistant", "content": reply}]
    ids, dropped = s.prompt_ids("And then?")
    tok = s.tok
    expected = render_chat([{"role": "system", "content": "Be brief."}, *s.turns,
                                {"role": "user", "content": "And then?"}], add_generation_prompt=True)
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
    assert s.system == "You are a poet." and [t["content"] for t in s.turns][0] == "hello"


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
