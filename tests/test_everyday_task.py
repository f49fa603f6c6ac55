"""The built-in `everyday` benchmark: held-out conversations of the built-in chat corpora, absent from every
training path (the corpora by name, prepared shards, the preference builder, the tool-use set), and its two
scores (replies that compute or call unasked; the corpus replies' bits per byte) equal to hand-computed values."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import pytest
import torch
from test_builtin_bench import fake_idioms, words
from test_calc_task import Replies

from nanolm import corpora
from nanolm.chat import Message
from nanolm.corpora.holdout import chatterbot_held_out, question_held_out, training_view
from nanolm.eval.everyday import (ASKS_COMPUTATION, DEFAULT_ITEMS, EverydayItem, everyday_task, off_topic,
                                  score_everyday)


def fake_chatterbot(path: Path, n: int = 500) -> Path:
    """A chatterbot-shaped corpus: English and Chinese questions, some asked twice in another case, some with
    two exchanges, some asking for a computation."""
    lines = []
    for i in range(n):
        q = f"What is thing {i}?" if i % 2 else f"什么是东西{i}"
        if i % 50 == 7:
            q = f"What is {i} + 3?"  # asks for a computation: never an everyday item
        conv = [{"role": "user", "content": q}, {"role": "assistant", "content": f"Thing {i} is a thing."}]
        if i % 5 == 0:
            conv += [{"role": "user", "content": "Why?"}, {"role": "assistant", "content": f"Because of {i}."}]
        lines.append(json.dumps({"conversations": conv}, ensure_ascii=False) + "\n")
        if i % 10 == 1:  # the same question in other case: the same side of the split
            conv = [{"role": "user", "content": q.upper()}, {"role": "assistant", "content": "Again."}]
            lines.append(json.dumps({"conversations": conv}, ensure_ascii=False) + "\n")
    path.write_text("".join(lines), encoding="utf-8")
    return path


def questions(path: Path) -> list[str]:
    return [json.loads(line)["conversations"][0]["content"] for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.fixture
def chat_corpora(tmp_path, monkeypatch) -> dict[str, Path]:
    """Fake idioms and chatterbot corpora served as the built-in ones (fetch patched), in a cache of their own."""
    monkeypatch.setenv("NANOLM_CACHE", str(tmp_path / "cache"))
    files = {"idioms": fake_idioms(tmp_path / "idioms.jsonl"), "chatterbot": fake_chatterbot(tmp_path / "cb.jsonl")}
    monkeypatch.setattr(corpora, "fetch", lambda name, quiet=False: files[name])
    return files


def test_chatterbot_is_held_out_by_a_fixed_hash_of_its_first_question():
    h = int.from_bytes(hashlib.sha256("nanolm held-out v1:chatterbot:what is ai?".encode()).digest()[:8], "big")
    assert question_held_out("What is AI? ") == question_held_out("what is ai?") == (h % 1000 < 100)
    share = sum(question_held_out(f"question {i}") for i in range(20000)) / 20000
    assert share == pytest.approx(0.1, rel=0.1)
    line = json.dumps({"conversations": [{"role": "user", "content": "What is AI?"},
                                         {"role": "assistant", "content": "x"}]})
    assert chatterbot_held_out(line) == question_held_out("What is AI?")


def test_items_are_held_out_conversations_in_turn_asking_for_no_computation(chat_corpora):
    task = everyday_task()
    assert task.name == task.kind == "everyday" and task.metric == "arith_or_call"
    assert len(task.items) == DEFAULT_ITEMS
    assert [it.source for it in task.items[:4]] == ["chatterbot", "idioms", "chatterbot", "idioms"]
    for it in task.items:
        assert it.messages[0] == Message("user", it.prompt) and not ASKS_COMPUTATION.search(it.prompt)
        file, n = it.where.rsplit(":", 1)
        line = Path(file).read_text(encoding="utf-8").splitlines()[int(n) - 1]
        assert [m.content for m in it.messages] == [t["content"] for t in json.loads(line)["conversations"]]
    held = [q for q in questions(chat_corpora["chatterbot"]) if question_held_out(q)]
    assert any(ASKS_COMPUTATION.search(q) for q in held)  # the fake corpus has such a held-out question, left out
    assert everyday_task(6).items == task.items[:6] and everyday_task().items == task.items
    assert any(len(it.messages) == 4 for it in everyday_task(200).items)  # two exchanges kept whole


def test_items_are_disjoint_from_every_training_path(chat_corpora, tmp_path, tokenizer_dir):
    from nanolm.cli import main
    from nanolm.data.formats import iter_preferences
    from nanolm.data.prepare import prepare
    from nanolm.data.shards import PackedData
    from nanolm.data.builtin.tooluse import _DIRECT
    from nanolm.tokenizer import Tokenizer

    items = everyday_task(400).items
    prompts = {it.prompt for it in items}
    assert {it.source for it in items} == {"chatterbot", "idioms"} and len(prompts) == len(items)
    # The corpora by name, as prepare, tokenizer training and the quickstart read them: their training views.
    views = corpora.resolve_sources(["idioms", "chatterbot"])
    assert views == [training_view(n, chat_corpora[n]) for n in ("idioms", "chatterbot")]
    trained = [q for v in views for q in questions(v)]
    assert not {q.strip().lower() for q in trained} & {p.strip().lower() for p in prompts}
    whole = questions(chat_corpora["chatterbot"])
    assert len(questions(views[1])) + sum(map(question_held_out, whole)) == len(whole)
    assert set(words(views[0])) | {w for w in words(chat_corpora["idioms"]) if w} == set(words(chat_corpora["idioms"]))
    # Prepared chat shards of them hold none of the items' questions.
    prepare(views, tokenizer_dir, tmp_path / "sft", format="chat", val_fraction=0.1, workers=1, quiet=True)
    tok = Tokenizer.load(tokenizer_dir)
    text = "".join(tok.decode(PackedData(tmp_path / "sft", s).shards[0][:].tolist()) for s in ("train", "val"))
    assert text.count("<|im_start|>user") == sum(len(json.loads(line)["conversations"]) // 2 for v in views
                                                  for line in v.read_text(encoding="utf-8").splitlines())
    assert not any(f"user\n{p}<|im_end|>" in text for p in prompts)
    # The preference builder of `nanolm data preferences`, and the tool-use set's prompts answered directly.
    assert main(["data", "preferences", "--out", str(tmp_path / "prefs.jsonl"), "--n", "100"]) == 0
    assert not {chosen[0]["content"] for chosen, _ in iter_preferences(tmp_path / "prefs.jsonl")} & prompts
    assert not {q for q, _ in _DIRECT} & prompts


def test_off_topic_reads_arithmetic_and_calls():
    assert off_topic("12 + 7 = 19.") == (True, False) and off_topic("1888 / 19 = 17.") == (True, False)
    assert off_topic("3 × 4 = 12") == (True, False) and off_topic("So: #### 21") == (True, False)
    assert off_topic('<tool_call>\n{"name": "calculator"}') == (False, True)
    assert off_topic("I was born in 1990 - 2000 is when I grew up.") == (False, False)
    assert off_topic("It is a proverb about 3 friends.") == (False, False)


def test_both_scores_equal_hand_computed_values(tok):
    def item(*turns: str) -> EverydayItem:
        return EverydayItem(turns[0], tuple(Message(("user", "assistant")[i % 2], t) for i, t in enumerate(turns)),
                            "chatterbot")

    items = [item("What is AI?", "A program."), item("你好", "你好！", "Who are you?", "Nobody."),
             item("Hello", "Hi there."), item("Tell me a joke", "No.")]
    replies = ["2 + 10 = 33, 21 - 1 = 12. #### 21", "Hello to you.", '<tool_call>\n{"name": "calculator"}',
               "Why did the chicken cross the road?"]
    eng = Replies(tok, replies)
    with torch.no_grad():  # every weight 0: the logits are 0, each target costs log2(vocab size) bits
        for p in eng.model.parameters():
            p.zero_()
    res = score_everyday(eng, tok, items, rows=2, batch_size=3)
    assert (res["n"], res["arith_or_call"], res["arithmetic"], res["calls"]) == (4, 0.5, 0.25, 0.25)
    assert res["arith_or_call_stderr"] == pytest.approx(math.sqrt((4 * 0.25 / 3) / 4))
    assert [(p["arithmetic"], p["call"]) for p in res["items"]] == [(True, False), (False, False), (False, True),
                                                                    (False, False)]
    assert [p["reply"] for p in res["items"]] == replies
    # The replies scored: every assistant turn's text and its closing <|im_end|>.
    answers = ["A program.", "你好！", "Nobody.", "Hi there.", "No."]
    targets = sum(len(tok.encode(a)) + 1 for a in answers)
    n_bytes = sum(len(a.encode("utf-8")) for a in answers)
    assert (res["reply_tokens"], res["reply_bytes"]) == (targets, n_bytes)
    assert res["reply_bpb"] == pytest.approx(targets * math.log2(400) / n_bytes, rel=1e-6)
    # Each prompt is the user's first turn through the chat template, no tools offered.
    prompts = [tok.decode(p) for p in eng.signals.prompts]
    assert prompts == [tok.chat_format.render([Message("user", it.prompt)], add_generation_prompt=True)
                       for it in items]
    assert not any("<tools>" in p for p in prompts)


def test_nanolm_eval_scores_the_task(chat_corpora, tok):
    from nanolm.config import ModelConfig
    from nanolm.eval.runner import evaluate_tasks, format_table, load_task, task_metrics
    from nanolm.model.transformer import Transformer
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=400, d_model=32, n_layer=1, n_head=4, n_kv_head=2, max_seq_len=256))
    (res,) = evaluate_tasks(model, tok, [load_task("everyday:n=4")])
    assert (res["task"], res["kind"], res["n"], res["chat"], res["metric"]) == ("everyday", "everyday", 4, True,
                                                                                "arith_or_call")
    assert 0 <= res["arith_or_call"] <= 1 and res["reply_bpb"] > 0 and res["higher_is_better"] is False
    metrics = task_metrics([res])
    assert set(metrics) == {"task/everyday/arith_or_call", "task/everyday/reply_bpb"}
    assert "everyday (chat)" in format_table([res])
