"""`nanolm quickstart --model`: the real model's quickstart, end to end, on a tiny random model of SmolLM2's family
(a Llama with tied embeddings, SmolLM2's chat template, which has no place for tools, and its special tokens).

The card must hold the base model's row (benchmarks only) and the LoRA run's, each benchmark saying which way is
better, and the table of gains and costs; the fine-tuned model must be merged into a GGUF file that the gguf
package reads back; and a name that is neither a built-in model nor a directory is refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from test_families import hf_model
from test_family_templates import NANOLM, SMOLLM2, family_tokenizer

from nanolm.errors import UserError
from nanolm.export.hf import import_hf
from nanolm.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def tiny_smol(tmp_path_factory) -> Path:
    """A random SmolLM2-shaped model imported as `nanolm import hf` imports the real one."""
    root = tmp_path_factory.mktemp("smol")
    tok_dir = family_tokenizer(root / "tok", SMOLLM2, NANOLM, {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"})
    tok = Tokenizer.load(tok_dir)
    src = root / "hf"
    hf_model("Llama", vocab_size=tok.vocab_size, tie_word_embeddings=True,
             max_position_embeddings=2048).save_pretrained(src)
    tok.save(src)
    return import_hf(src, root / "base")


@pytest.mark.slow
def test_real_model_quickstart_end_to_end(tiny_smol, tmp_path, capsys, monkeypatch):
    from nanolm.quickstart_model import quickstart_model
    monkeypatch.setenv("NANOLM_CACHE", str(tmp_path / "cache"))  # the base's scores kept here, not in ~/.cache

    out = tmp_path / "qs"
    artefacts = quickstart_model(out, str(tiny_smol), minutes=1.0, bench_items=4, tool_conversations=40,
                                 seq_len=2048, quiet_train=True)
    printed = capsys.readouterr().out

    # the tool-use conversations went through the model's own template: tools in a system turn, as text
    manifest = json.loads((out / "sft-data" / "manifest.json").read_text(encoding="utf-8"))
    assert manifest["chat"]["template"] == "template" and manifest["totals"]["n_docs"] == 40
    assert manifest["chat"]["skipped_too_long"] == 0

    card = json.loads((artefacts["report"].parent / "report.json").read_text(encoding="utf-8"))
    assert [r["stage"] for r in card["runs"]] == ["base", "lora"]
    assert card["runs"][0]["validation"] is None and card["runs"][1]["steps"] >= 1
    tasks = {t["task"]: t for t in card["tasks"]}
    assert set(tasks) == {"calc", "everyday"}
    for t in tasks.values():
        assert [r["label"] for r in t["results"]] == ["base", "lora"]
        assert all(r["n"] == 4 for r in t["results"])
    # the base's scores were measured once, before fine-tuning, and are the ones on the card
    base_eval = json.loads((out / "eval" / "base.json").read_text(encoding="utf-8"))
    assert {t["task"]: t["acc"] for t in base_eval["tasks"] if "acc" in t} == \
        {name: t["results"][0]["acc"] for name, t in tasks.items() if "acc" in t["results"][0]}

    report_md = (artefacts["report"].parent / "report.md").read_text(encoding="utf-8")
    assert "calc acc (chat template, 4 items; higher is better)" in report_md
    assert "everyday reply bits per byte (lower better)" in report_md  # the table of gains and costs
    assert "| lora " in report_md and "| base " in report_md
    assert "== [7/7] report card" in printed

    reader = gguf.GGUFReader(str(artefacts["gguf"]))
    assert reader.fields["general.architecture"].contents() == "llama"
    assert any(t.name == "blk.0.attn_q.weight" for t in reader.tensors)


def test_an_unknown_model_is_refused_in_one_line(tmp_path):
    from nanolm.quickstart_model import quickstart_model
    with pytest.raises(UserError, match=r"--model no-such-model: not a built-in model and no such directory; "
                                        r"built-in models: smollm2-135m-instruct"):
        quickstart_model(tmp_path / "qs", "no-such-model", minutes=1.0)


def test_the_base_models_scores_are_measured_once_and_kept(tiny_smol, tmp_path, monkeypatch):
    """A second quickstart of the same model takes the base's scores kept by the first (the same weights, items
    and greedy decoding give the same result) and spends that time fine-tuning; other tasks, or other weights,
    are measured anew, and a damaged kept file is measured again."""
    import nanolm.eval.runner as runner
    from nanolm.quickstart_model import base_scores

    monkeypatch.setenv("NANOLM_CACHE", str(tmp_path / "cache"))
    calls = []

    def fake_run_eval(checkpoint, specs, out):
        calls.append(list(specs))
        result = {"checkpoint": str(checkpoint), "tasks": [{"task": s, "acc": 0.25} for s in specs]}
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(result), encoding="utf-8")
        return result

    monkeypatch.setattr(runner, "run_eval", fake_run_eval)
    first, seconds, kept = base_scores(tiny_smol, ["calc:n=4"], tmp_path / "a" / "base.json")
    assert kept is None and calls == [["calc:n=4"]] and seconds >= 0
    again, seconds2, kept = base_scores(tiny_smol, ["calc:n=4"], tmp_path / "b" / "base.json")
    assert again == first and seconds2 == seconds and calls == [["calc:n=4"]]
    assert kept.parent == tmp_path / "cache" / "scores"
    assert json.loads((tmp_path / "b" / "base.json").read_text(encoding="utf-8")) == first  # the run has its copy
    base_scores(tiny_smol, ["calc:n=5"], tmp_path / "c" / "base.json")  # other items: measured
    assert calls[-1] == ["calc:n=5"]
    kept.write_text("{not json", encoding="utf-8")  # damaged: measured again
    base_scores(tiny_smol, ["calc:n=4"], tmp_path / "d" / "base.json")
    assert calls[-1] == ["calc:n=4"] and len(calls) == 3
