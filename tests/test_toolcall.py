"""`--task toolcall:FILE`: tool-use items in the plain and MiniMind layouts, scored on their calls and answers
through a checkpoint's engine or an OpenAI-compatible endpoint, with the same result both ways."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from server_helpers import ScriptedEngine, running, tiny_model

from nanolm.config import ServeConfig
from nanolm.errors import UserError
from nanolm.eval.runner import format_table, load_task
from nanolm.eval.toolcall import EndpointBackend, LocalBackend, read_toolcall_file, score_toolcall
from nanolm.infer.engine import Engine

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}}, "required": ["city"]}}}


def call(name: str, args: dict) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>'


def write_items(path, items) -> str:
    path.write_text("".join(json.dumps(it, ensure_ascii=False) + "\n" for it in items), encoding="utf-8")
    return str(path)


ITEMS = [
    # plain layout: a built-in tool, its call and the answer expected
    {"question": "What is 12 times 11?", "tools": ["calculator"],
     "call": {"name": "calculator", "arguments": {"expression": "12*11"}}, "answer": 132},
    # MiniMind's layout: prompt and tool objects; a mocked result and an expected answer
    {"prompt": "北京天气怎么样？", "tools": [WEATHER], "results": {"get_weather": {"temp": "22C"}}, "answer": "22C"},
    # nothing expected: right when an offered tool is called
    {"question": "What's the weather in Paris?", "tools": [WEATHER, "calculator"],
     "results": {"get_weather": "sunny"}},
    # a call of the wrong arguments
    {"question": "Add 2 and 3.", "tools": ["calculator"],
     "call": {"name": "calculator", "arguments": {"expression": "2 + 3"}}},
]


def test_both_layouts_are_read_and_bad_items_name_their_line(tmp_path):
    items = read_toolcall_file(write_items(tmp_path / "t.jsonl", ITEMS))
    assert [it.question for it in items] == ["What is 12 times 11?", "北京天气怎么样？", "What's the weather in Paris?",
                                             "Add 2 and 3."]
    assert items[0].tools[0]["function"]["name"] == "calculator" and items[0].answer == "132"
    assert items[1].tools == [WEATHER] and items[1].results == {"get_weather": {"temp": "22C"}}
    assert items[0].where.endswith("t.jsonl:1")
    for bad, message in [({"tools": ["calculator"]}, r"t\.jsonl:2: no \"question\""),
                         ({"question": "q", "tools": ["nope"]}, r"t\.jsonl:2: tools\[0\] 'nope' is not a built-in"),
                         ({"question": "q", "tools": []}, r"t\.jsonl:2: \"tools\" must be a non-empty list"),
                         ({"question": "q", "tools": ["calculator"], "call": {"arguments": {}}},
                          r"t\.jsonl:2: \"call\" must be")]:
        with pytest.raises(UserError, match=message):
            read_toolcall_file(write_items(tmp_path / "t.jsonl", [ITEMS[0], bad]))


def test_calls_are_run_fed_back_and_scored(tok, tmp_path):
    items = read_toolcall_file(write_items(tmp_path / "t.jsonl", ITEMS))
    replies = [call("calculator", {"expression": "12 * 11"}),  # round 1, item by item
               call("get_weather", {"city": "北京"}),
               call("get_weather", {"city": "Paris"}),
               call("calculator", {"expression": "2 + 4"}),
               "12 times 11 is 132.",  # round 2: each item had called
               "北京现在 22C。",
               "It is sunny in Paris.",
               "It is 6."]
    eng = ScriptedEngine(tok.encode("(no reply scripted)"), replies=[tok.encode(r) for r in replies],
                         max_seq_len=2048)
    res = score_toolcall(LocalBackend(eng, tok, rows=2), items)
    per = res["items"]
    assert [p["correct"] for p in per] == [True, True, True, False]
    assert [p["call_ok"] for p in per] == [True, None, None, False]
    assert [p["answer_ok"] for p in per] == [True, True, None, None]
    assert (res["acc"], res["called"], res["call_acc"], res["answer_acc"], res["n"]) == (0.75, 1.0, 0.5, 1.0, 4)
    # the results entered as tool turns: the calculator run, the mocked results (JSON as JSON)
    tools = [[m["content"] for m in p["conversation"] if m["role"] == "tool"] for p in per]
    assert tools == [["132"], ['{"temp": "22C"}'], ["sunny"], ["6"]]
    second = [tok.decode(p) for p in eng.prompts[4:]]
    assert "What is 12 times 11?" in second[0] and "<tool_response>\n132\n</tool_response>" in second[0]
    assert '"name": "get_weather"' in second[1] and '<tool_response>\n{"temp": "22C"}\n</tool_response>' in second[1]


def test_a_checkpoint_scores_the_same_directly_and_through_nanolm_serve(tok, tmp_path):
    """Same model, same items: the engine's replies and the server's (at --endpoint) are the same, item by item."""
    engine = Engine(tiny_model(max_seq_len=2048))
    items = read_toolcall_file(write_items(tmp_path / "t.jsonl", ITEMS * 2))
    direct = score_toolcall(LocalBackend(engine, tok, max_new_tokens=24), items)
    from nanolm.infer.server import create_app
    with running(create_app(engine, tok, ServeConfig(model_name="tiny"))) as url:
        served = score_toolcall(EndpointBackend(url + "/v1", "tiny", max_new_tokens=24), items)
    assert [p["reply"] for p in served["items"]] == [p["reply"] for p in direct["items"]]
    strip = lambda conv: [{k: v for k, v in m.items() if k != "tool_call_id" and k != "tool_calls"}  # noqa: E731
                          for m in conv]
    assert [strip(p["conversation"]) for p in served["items"]] == [strip(p["conversation"]) for p in direct["items"]]
    assert {k: served[k] for k in ("acc", "called", "call_acc", "answer_acc")} == \
           {k: direct[k] for k in ("acc", "called", "call_acc", "answer_acc")}
    # and with replies that call tools, over two rounds (a scripted engine replays them in the order rows come)
    replies = [call("calculator", {"expression": "12 * 11"}), call("get_weather", {"city": "北京"}), "Not sure.",
               call("calculator", {"expression": "2 + 3"}), "It is 132.", "22C in Beijing.", "It is 5."]
    scripted = [ScriptedEngine(tok.encode("(none)"), replies=[tok.encode(r) for r in replies], max_seq_len=2048)
                for _ in range(2)]
    direct = score_toolcall(LocalBackend(scripted[0], tok), items[:4])
    with running(create_app(scripted[1], tok, ServeConfig(model_name="tiny"))) as url:
        served = score_toolcall(EndpointBackend(url + "/v1", "tiny"), items[:4])
    assert [p["correct"] for p in direct["items"]] == [True, True, False, True]
    assert [strip(p["conversation"]) for p in served["items"]] == [strip(p["conversation"]) for p in direct["items"]]
    assert served["acc"] == direct["acc"] == 0.75
    assert [tok.decode(x) for x in scripted[1].prompts] == [tok.decode(x) for x in scripted[0].prompts]


def test_nanolm_eval_endpoint_writes_the_results(tok, tmp_path):
    engine = Engine(tiny_model(max_seq_len=2048))
    path = write_items(tmp_path / "t.jsonl", ITEMS)
    from nanolm.infer.server import create_app
    with running(create_app(engine, tok, ServeConfig(model_name="tiny"))) as url:
        out = subprocess.run([sys.executable, "-m", "nanolm", "eval", "--endpoint", url + "/v1", "--model", "tiny",
                              "--task", f"toolcall:{path}:n=2", "--max-new-tokens", "16",
                              "--out", str(tmp_path / "r.json")], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["model"] == "tiny" and report["tasks"][0]["n"] == 2 and report["tasks"][0]["task"] == "toolcall:t"
    assert "toolcall:t (chat)" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "nanolm", "eval", "--endpoint", url + "/v1", "--model", "tiny",
                          "--task", "idioms"], capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "--endpoint scores tool-use tasks (--task toolcall:FILE) only" in bad.stderr


def test_the_task_spec_and_its_table_row(tmp_path):
    lt = load_task(f"toolcall:{write_items(tmp_path / 'calls.jsonl', ITEMS)}:n=3")
    assert lt.task.kind == "toolcall" and len(lt.task.items) == 3 and lt.task.name == "toolcall:calls"
    row = {"task": lt.task.name, "chat": True, "n": 3, "shots": 0, "acc": 0.5, "chance": 0.0, "centred": 0.5,
           "stderr": 0.1}
    assert "toolcall:calls (chat)" in format_table([row])
    with pytest.raises(UserError, match="cannot reach it"):
        EndpointBackend("http://127.0.0.1:9/v1", "x", timeout=5).replies([[{"role": "user", "content": "hi"}]],
                                                                         [[WEATHER]])
