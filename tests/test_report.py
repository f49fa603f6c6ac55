"""The report card: its baselines' exact values, its benchmark numbers against `nanolm eval`, and its files."""

from __future__ import annotations

import json
import lzma
import math
import sys
from pathlib import Path

import numpy as np
import pytest

from nanolm.errors import UserError
from nanolm.eval.card import format_report, write_report
from nanolm.eval.report import (build_report, unigram_bits_per_byte, uniform_bits_per_byte, with_items,
                                xz_bits_per_byte)
from nanolm.train.trainer import train
from test_train import read_metrics, tiny_cfg

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
XZ_9E = 9 | lzma.PRESET_EXTREME
PRE = {"train.max_steps": 6, "train.eval_interval": 3, "train.save_interval": 0, "model.max_seq_len": 64,
       "model.dropout": 0.0}
CONVS = [
    [{"role": "user", "content": "To be, or not to be?"}, {"role": "assistant", "content": "That is the question."}],
    [{"role": "user", "content": "话说天下大势"}, {"role": "assistant", "content": "分久必合，合久必分。"}],
]
ITEMS = [{"question": "To be, or not to be?", "choices": ["that is the question.", "the state of our union."],
          "answer": 0},
         {"question": "话说天下大势", "choices": ["分久必合，合久必分。", "浪花淘尽英雄。"], "answer": 0},
         {"question": "滚滚长江东逝水", "choices": ["几度夕阳红。", "浪花淘尽英雄。", "惯看秋月春风。"], "answer": 1}]


# ------------------------------------------------------------------------------------------ the baselines

def test_xz_is_xz_9e_of_the_training_text_with_and_without_the_held_out_text():
    train_text = "To be, or not to be, that is the question. 话说天下大势，分久必合。\n".encode() * 30
    heldout = "To be, or not to be: 合久必分。\n".encode()
    both = lzma.compress(train_text + heldout, format=lzma.FORMAT_XZ, preset=XZ_9E)
    alone = lzma.compress(train_text, format=lzma.FORMAT_XZ, preset=XZ_9E)
    assert xz_bits_per_byte(train_text, heldout) == (len(both) - len(alone)) * 8 / len(heldout)
    # What xz has seen is cheap; bytes it has not seen cost more.
    assert xz_bits_per_byte(train_text, train_text[:60]) < xz_bits_per_byte(train_text, bytes(range(60)))
    with pytest.raises(ValueError):
        xz_bits_per_byte(train_text, b"")


def test_unigram_with_add_one_smoothing_by_hand():
    # counts [2, 1, 0] over a vocab of 3: p = (2+1)/6, (1+1)/6, (0+1)/6 = 1/2, 1/3, 1/6
    # held out [0, 1, 2, 0]: 1 + log2(3) + log2(6) + 1 = 3 + 2 log2(3) bits, over 5 bytes
    bits = unigram_bits_per_byte(np.array([0, 0, 1]), np.array([0, 1, 2, 0]), vocab_size=3, heldout_bytes=5)
    assert bits == pytest.approx((3 + 2 * math.log2(3)) / 5, rel=1e-12)
    assert uniform_bits_per_byte(4, 3, 5) == pytest.approx(4 * math.log2(3) / 5, rel=1e-12)
    with pytest.raises(ValueError):
        unigram_bits_per_byte(np.array([0, 3]), np.array([0]), vocab_size=3, heldout_bytes=1)
    with pytest.raises(ValueError):
        unigram_bits_per_byte(np.array([0]), np.array([0]), vocab_size=3, heldout_bytes=0)


def test_with_items():
    assert with_items("idioms", None) == "idioms"
    assert with_items("idioms", 5) == "idioms:n=5"
    assert with_items("t.jsonl:chat=false", 5) == "t.jsonl:chat=false,n=5"
    assert with_items("idioms:n=3", 5) == "idioms:n=3"


# ------------------------------------------------------------------------------------------ a tiny base and SFT run

@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_dir, tokenizer_dir) -> dict[str, Path]:
    from nanolm.data.prepare import prepare
    root = tmp_path_factory.mktemp("report")
    sources = [root / "chat.jsonl", root / "more.jsonl"]  # two sources: the card splits the SFT row by them
    for k, path in enumerate(sources):
        with open(path, "w", encoding="utf-8") as f:
            for i in range(20 * k, 20 * k + 20):
                f.write(json.dumps({"conversations": CONVS[i % 2]}, ensure_ascii=False) + "\n")
    prepare(sources, tokenizer_dir, root / "chat", format="chat", val_fraction=0.1, workers=0, quiet=True)
    train(tiny_cfg(data_dir, root / "base", **PRE), quiet=True)
    train(tiny_cfg(root / "chat", root / "sft", **{**PRE, "train.stage": "sft", "train.init_from": str(root / "base"),
                                                   "train.seq_len": 64, "train.batch_size": 2}), quiet=True)
    task = root / "mine.jsonl"
    task.write_text("".join(json.dumps(it, ensure_ascii=False) + "\n" for it in ITEMS), encoding="utf-8")
    return {"base": root / "base", "sft": root / "sft", "task": task, "root": root}


@pytest.fixture(scope="module")
def report(runs) -> dict:
    return build_report([runs["base"], runs["sft"]], tasks=[str(runs["task"])])


def test_benchmark_numbers_equal_a_fresh_nanolm_eval(runs, report, tmp_path):
    from nanolm.cli import main
    (task,) = report["tasks"]
    assert task["task"] == "mine" and [r["label"] for r in task["results"]] == ["pretrain", "sft"]
    for run, card in zip((runs["base"], runs["sft"]), task["results"]):
        main(["eval", str(run), "--task", str(runs["task"]), "--out", str(tmp_path / "e.json")])
        (fresh,) = json.loads((tmp_path / "e.json").read_text())["tasks"]
        for key in ("n", "acc", "acc_norm", "stderr", "chance", "centred", "chat"):
            assert card[key] == fresh[key], key
    assert [r["chat"] for r in task["results"]] == [False, True]  # base on plain text, SFT through the template
    assert task["results"][0]["chance"] == pytest.approx((1 / 2 + 1 / 2 + 1 / 3) / 3)


def test_baselines_are_computed_on_the_tokens_val_bpb_scored(runs, report, data_dir, tokenizer_dir):
    from nanolm.data.shards import PackedData
    from nanolm.eval.loss import evaluate
    from nanolm.tokenizer import Tokenizer
    base = report["runs"][0]
    b = base["baseline"]
    # Independently: the loop scored eval_batches=2 batches of 4 windows of 32 tokens at stride 32 from the
    # start of the one val shard, so its targets are val[1:257]; the training text is the whole train split.
    tok = Tokenizer.load(tokenizer_dir)
    val = np.asarray(PackedData(data_dir, "val").shards[0], dtype=np.int64)[1:2 * 4 * 32 + 1]
    train_ids = np.concatenate([np.asarray(s, dtype=np.int64) for s in PackedData(data_dir, "train").shards])
    lengths = tok.token_byte_lengths()
    n_bytes = int(lengths[val].sum())
    text = lambda ids: b"".join(tok.token_bytes()[i] for i in ids if lengths[i])  # noqa: E731
    assert (b["heldout"]["tokens"], b["heldout"]["bytes"]) == (256, n_bytes)
    assert b["unigram_bpb"] == pytest.approx(unigram_bits_per_byte(train_ids, val, 400, n_bytes), rel=1e-12)
    assert b["xz_bpb"] == xz_bits_per_byte(text(train_ids), text(val))
    assert b["uniform_bpb"] == pytest.approx(256 * math.log2(400) / n_bytes, rel=1e-12)
    assert b["train"]["tokens"] == len(train_ids) and b["train"]["bytes"] == b["train"]["xz_bytes"]
    # ...which are the tokens and bytes `nanolm eval` counts on the same windows, and the model's val_bpb.
    again = evaluate(runs["base"], [data_dir], which="last", batch_size=4, max_tokens=256, quiet=True)
    assert (again["tokens"], again["bytes"]) == (256, n_bytes)
    assert again["bpb"] == pytest.approx(base["validation"]["last"]["value"], abs=1e-5)


def test_stages_their_validation_and_cost_come_from_metrics(runs, report):
    for entry, run in zip(report["runs"], (runs["base"], runs["sft"])):
        records = read_metrics(run)
        vals = [r for r in records if "val_bpb" in r]
        trained = [r for r in records if "elapsed_s" in r]
        v = entry["validation"]
        assert v["metric"] == "val_bpb" and [v["first"]["step"], v["last"]["step"]] == [3, 6]
        assert (v["first"]["value"], v["last"]["value"]) == (vals[0]["val_bpb"], vals[-1]["val_bpb"])
        assert v["best"]["value"] == min(r["val_bpb"] for r in vals)
        assert (entry["steps"], entry["tokens"], entry["wall_s"]) == (6, records[-1]["tokens"],
                                                                     trained[-1]["elapsed_s"])
    assert [e["stage"] for e in report["runs"]] == ["pretrain", "sft"]
    sft = report["runs"][1]["baseline"]
    assert sft["init_bpb"] > 0 and Path(sft["checkpoint"]).parent.parent == runs["base"]
    text = format_report(report)
    assert [c.strip() for c in text.splitlines()[2].split("|")[1:-1]] == ["stage", "measure", "value", "baseline"]
    assert "xz -9e" in text and "chance 44.4%" in text and "initial model" in text


def test_text_files_instead_of_the_shards(runs, corpus, tmp_path):
    from nanolm.data.formats import iter_documents
    from nanolm.eval.loss import evaluate
    held = tmp_path / "held.jsonl"
    held.write_text("".join(corpus.read_text(encoding="utf-8").splitlines(keepends=True)[:4]), encoding="utf-8")
    r = build_report([runs["base"]], tasks=[], text_train=corpus, text_heldout=[held])
    b = r["runs"][0]["baseline"]
    fresh = evaluate(runs["base"], [held], quiet=True)
    assert b["model_bpb"] == fresh["bpb"] and b["heldout"]["tokens"] == fresh["tokens"]
    assert b["heldout"]["bytes"] == fresh["bytes"] and r["tasks"] == []
    assert b["train"]["bytes"] == sum(len(d.encode("utf-8")) for d in iter_documents(corpus))  # lossless BPE
    assert f"held-out bits per byte on {held}" in format_report(r)


def test_a_mixture_is_measured_on_its_first_set(runs, report, data_dir, tokenizer_dir):
    """A pretraining run on text mixed with a drill (as the quickstart's): the card reads the text set's own
    validation (val_bpb/text) and computes the baselines on that set alone, equal to the one-set run's."""
    from nanolm.data.prepare import prepare
    from nanolm.data.builtin.tooluse import build_tool_drill
    from nanolm.infer.tools import BUILTIN_TOOLS, calculator
    root = runs["root"]
    drill = build_tool_drill(root / "drill.jsonl", 60, calculator=calculator, tools=BUILTIN_TOOLS)
    prepare([drill], tokenizer_dir, root / "drill", val_fraction=0.1, workers=0, quiet=True)
    sets = [{"path": str(data_dir), "name": "text"}, {"path": str(root / "drill"), "name": "drill"}]
    train(tiny_cfg(data_dir, root / "mixed", **{**PRE, "data.path": "", "data.sets": sets, "data.mode": "mixture"}),
          quiet=True)
    entry = build_report([root / "mixed"], tasks=[])["runs"][0]
    vals = [r for r in read_metrics(root / "mixed") if "val_bpb/text" in r]
    v = entry["validation"]
    assert entry["data_set"] == "text" and v["metric"] == "val_bpb" and v["key"] == "val_bpb/text"
    assert (v["first"]["value"], v["last"]["value"]) == (vals[0]["val_bpb/text"], vals[-1]["val_bpb/text"])
    assert vals[-1]["val_bpb/text"] != vals[-1]["val_bpb"]  # the mean over both sets is not what is read
    one = report["runs"][0]["baseline"]
    for key in ("heldout", "unigram_bpb", "xz_bpb", "uniform_bpb"):
        assert entry["baseline"][key] == one[key], key
    assert "held-out bits per byte (text, set text)" in format_report({**report, "runs": [entry], "tasks": []})


# ------------------------------------------------------------------------------------------ files and errors

def test_write_report_writes_markdown_json_and_png(report, tmp_path):
    md = write_report(report, tmp_path / "card")
    assert md == tmp_path / "card" / "report.md"
    assert sorted(p.name for p in md.parent.iterdir()) == ["curves.png", "report.json", "report.md"]
    assert (md.parent / "curves.png").read_bytes()[:8] == PNG_MAGIC
    text = md.read_text(encoding="utf-8")
    assert text.startswith("# nanolm report card\n\n| stage") and "](curves.png)" in text
    assert json.loads((md.parent / "report.json").read_text(encoding="utf-8")) == report


def test_without_matplotlib_the_report_says_so(report, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import raises ImportError
    md = write_report(report, tmp_path)
    assert not (tmp_path / "curves.png").exists()
    assert md.read_text(encoding="utf-8").splitlines()[-1] == \
        "Curves: not drawn, matplotlib is not installed (pip install 'nanolm[track]')."


def test_a_path_that_is_not_a_run_is_named(runs, tmp_path):
    with pytest.raises(UserError, match=r"nope: no such run directory; pass run directories written by"):
        build_report([runs["base"], tmp_path / "nope"], tasks=[])
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match=r"empty: not a training run \(it holds no config.json, metrics.jsonl, "
                                        r"checkpoints/step-\*\)"):
        build_report([tmp_path / "empty"], tasks=[])
    step = next((runs["base"] / "checkpoints").glob("step-*"))
    with pytest.raises(UserError, match=rf"{step.name}: a checkpoint, not a run; pass its run directory "
                                        rf".*{runs['base'].name}$"):
        build_report([step], tasks=[])
    with pytest.raises(UserError, match="no runs given"):
        build_report([], tasks=[])


def test_calc_misses_are_listed_under_the_benchmark_line(report):
    calc = {"task": "calc", "kind": "calc", "path": "built-in", "results": [
        {"label": label, "n": 200, "acc": acc, "centred": acc, "stderr": 0.03, "chance": 0.0, "chat": True,
         "metric": "acc", "misses": misses} for label, acc, misses in (
            ("pretrain", 0.155, {"no call": 90, "misstated": 20, "operation": 30, "numbers": 29}),
            ("sft", 0.7, {"no call": 1, "misstated": 6, "operation": 31, "numbers": 22}))]}
    lines = format_report({**report, "tasks": [calc]}).splitlines()
    i = lines.index("- calc (calc, 200 items, acc, higher is better): pretrain 15.5% ± 3.0%, sft 70.0% ± 3.0%; "
                    "chance 0.0%")
    assert lines[i + 1:i + 3] == ["  - pretrain missed: no call 90, misstated 20, operation 30, numbers 29",
                                  "  - sft missed: no call 1, misstated 6, operation 31, numbers 22"]


# ------------------------------------------------------------------------------------------ what fine-tuning cost

def test_sft_replies_by_source_are_its_val_split_scored(runs, report):
    """The SFT run's held-out replies by source (its data has two): the val split's conversations read again
    from the sources; together, the same reply tokens and bytes `nanolm eval` scores on the val split, and the
    same bits per byte."""
    from nanolm.eval.loss import evaluate
    got = report["runs"][1]["by_source"]
    assert list(got) == ["chat", "more"] and [g["files"] for g in got.values()] == [["chat.jsonl"], ["more.jsonl"]]
    assert [g["conversations"] for g in got.values()] == [2, 2]  # records 1, 11 of the first, 21, 31 of the second
    fresh = evaluate(runs["sft"], [runs["root"] / "chat"], batch_size=2, seq_len=64, quiet=True)
    n_bytes = sum(g["bytes"] for g in got.values())
    assert (sum(g["tokens"] for g in got.values()), n_bytes) == (fresh["tokens"], fresh["bytes"])
    assert sum(g["bpb"] * g["bytes"] for g in got.values()) / n_bytes == pytest.approx(fresh["bpb"], rel=1e-5)
    init = evaluate(runs["base"], [runs["root"] / "chat"], batch_size=2, seq_len=64, quiet=True)
    assert sum(g["init_bpb"] * g["bytes"] for g in got.values()) / n_bytes == pytest.approx(init["bpb"], rel=1e-5)
    row = next(line for line in format_report(report).splitlines() if "by source" in line)
    for name, g in got.items():
        assert f"{name} {g['bpb']:.4f}" in row and f"{name} {g['init_bpb']:.4f}" in row
    assert "initial model chat" in row and "lower is better" in row


def test_val_conversations_by_source_follow_the_split_rule(tmp_path, tokenizer_dir):
    from nanolm.data.prepare import prepare
    from nanolm.eval.report import val_by_source
    from nanolm.tokenizer import Tokenizer
    files = []
    for name, n in (("a.jsonl", 5), ("b.jsonl", 7)):
        files.append(tmp_path / name)
        files[-1].write_text("".join(json.dumps({"conversations": [{"role": "user", "content": f"{name} {i}"},
                                                                   {"role": "assistant", "content": "ok"}]}) + "\n"
                                     for i in range(n)), encoding="utf-8")
    prepare(files, tokenizer_dir, tmp_path / "d", format="chat", val_fraction=0.25, workers=0, quiet=True)
    got = val_by_source(tmp_path / "d", Tokenizer.load(tokenizer_dir))
    # records 0..11 over both files, val when i % 4 == 1: a's 1, b's 0 (record 5) and 4 (record 9)
    assert {f: [c.messages[0].content for c in convs] for f, convs in got.items()} == {
        "a.jsonl": ["a.jsonl 1"], "b.jsonl": ["b.jsonl 0", "b.jsonl 4"]}
    files[0].write_text("changed\n", encoding="utf-8")
    with pytest.raises(UserError, match=r"a.jsonl: gone or changed since .* keep the sources as prepared"):
        val_by_source(tmp_path / "d", Tokenizer.load(tokenizer_dir))


def test_benchmark_rows_say_which_way_is_better_and_everyday_has_both_scores(report):
    everyday = {"task": "everyday", "kind": "everyday", "path": "built-in", "results": [
        {"label": label, "n": 48, "metric": "arith_or_call", "arith_or_call": share, "arith_or_call_stderr": 0.05,
         "arithmetic": share, "calls": 0.0625, "reply_bpb": bpb, "chance": 0.0, "chat": True,
         "higher_is_better": False} for label, share, bpb in (("pretrain", 0.125, 3.5), ("sft", 0.875, 2.25))]}
    text = format_report({**report, "tasks": [*report["tasks"], everyday]})
    lines = text.splitlines()
    card, stages = text.split("\nEach stage against the model before it")
    cells = [[c.strip() for c in line.split("|")[1:-1]] for line in card.splitlines() if line.startswith("| ")]
    # the second table: a row per model, each score's change from the model before, a gain or a cost
    table = [[c.strip() for c in line.split("|")[1:-1]] for line in stages.splitlines() if line.startswith("| ")]
    assert table[0][-3:] == ["everyday arith_or_call (lower better)", "everyday reply bits per byte (lower better)",
                             "training time"]
    assert table[2][0] == "pretrain" and table[2][-3:-1] == ["12.5%", "3.5000"]
    assert table[3][0] == "sft" and table[3][-3:-1] == ["87.5% (+75.0 pts, cost)", "2.2500 (−35.7%, gain)"]
    assert ["sft", "mine acc (chat template, 3 items; higher is better)"] == cells[-5][:2]
    assert cells[-4][:3] == ["pretrain", "everyday arith_or_call (chat template, 48 items; lower is better)",
                             "12.5% ± 5.0%"]
    assert cells[-3][:3] == ["pretrain", "everyday bits per byte of the held-out replies (48 conversations; lower "
                                         "is better)", "3.5000"]
    assert cells[-1][:3] == ["sft", "everyday bits per byte of the held-out replies (48 conversations; lower is "
                                    "better)", "2.2500"]
    i = lines.index("- everyday (everyday, 48 items, arith_or_call, lower is better): pretrain 12.5% ± 5.0%, "
                    "sft 87.5% ± 5.0%; chance 0.0%")
    assert lines[i + 2] == "  - sft: arithmetic 87.5%, tool calls 6.2%; held-out replies 2.2500 bits per byte"
