"""The lm-evaluation-harness model `nanolm`, offline: a task YAML over a local JSONL file, run through the
command line docs/evaluation.md gives, scores what `nanolm eval --task` scores on the same items."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lm_eval", reason="lm-evaluation-harness is not installed (pip install 'nanolm[eval]')")

ROOT = Path(__file__).resolve().parents[1]
ITEMS = [{"question": "To be, or not to be?", "choices": ["that is the question.", "the state of our union is strong.",
                                                      "all men"], "answer": 0},
         {"question": "All the world's a stage?", "choices": ["and all the men and women merely players.",
                                                             "the gentle rain"], "answer": 0},
         {"question": "The quality of mercy is not strained?", "choices": ["it is strong.",
                                                                          "it droppeth as the gentle rain from heaven."],
          "answer": 1},
         {"question": "My fellow citizens,", "choices": ["the state of our union is strong.", "to be"], "answer": 0},
         {"question": "We hold these truths?", "choices": ["merely players", "to be self-evident."], "answer": 1}]


@pytest.fixture(scope="module")
def run(tmp_path_factory, data_dir) -> Path:
    from nanolm.train.trainer import train
    from test_train import tiny_cfg
    out = tmp_path_factory.mktemp("lmeval") / "run"
    train(tiny_cfg(data_dir, out, **{"train.max_steps": 8, "train.eval_interval": 0}), quiet=True)
    return out


def test_lm_eval_scores_equal_nanolm_eval(run, tmp_path):
    from nanolm.eval.runner import run_eval
    from nanolm.eval.tasks import read_task_file

    task_file = tmp_path / "mine.jsonl"
    task_file.write_text("".join(json.dumps(r) + "\n" for r in ITEMS), encoding="utf-8")
    # The same items for lm-eval: its multiple_choice output type puts target_delimiter (" ") between the
    # prompt and each choice, as nanolm's English cloze form does.
    items = read_task_file(task_file).items
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"prompt": i.prompt, "choices": list(i.choices), "label": i.answer}) + "\n"
                            for i in items), encoding="utf-8")
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "mine.yaml").write_text(
        "task: nanolm_mine\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {docs}\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: prompt\ndoc_to_choice: choices\n"
        "doc_to_target: label\ntarget_delimiter: \" \"\n"
        "metric_list:\n  - metric: acc\n  - metric: acc_norm\n", encoding="utf-8")
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = tmp_path / "results"
    proc = subprocess.run([sys.executable, "-m", "nanolm.eval.harness", "--model", "nanolm", "--model_args",
                           f"path={run}", "--tasks", "nanolm_mine", "--include_path", str(tasks), "--batch_size", "4",
                           "--output_path", str(out), "--log_samples"], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (result_file,) = out.rglob("results_*.json")
    theirs = json.loads(result_file.read_text())["results"]["nanolm_mine"]

    ours = run_eval(run, [str(task_file)], out=tmp_path / "ours.json")["tasks"][0]
    assert theirs["acc,none"] == ours["acc"] and theirs["acc_norm,none"] == ours["acc_norm"]
    assert theirs["acc_stderr,none"] == pytest.approx(ours["stderr"])
    # Item by item, the log-likelihoods lm-eval was given are the ones nanolm eval scores with.
    (samples,) = out.rglob("samples_nanolm_mine_*.jsonl")
    logged = {s["doc_id"]: [float(r[0]) for r in s["filtered_resps"]]
              for s in map(json.loads, samples.read_text().splitlines())}
    assert [logged[i] for i in range(len(ITEMS))] == [pytest.approx(it["logprobs"], abs=1e-5) for it in ours["items"]]


def test_loglikelihood_rolling_and_generate_until(run):
    import torch
    from lm_eval.api.instance import Instance

    import nanolm.eval.harness as harness
    from nanolm.config import SamplingParams
    from nanolm.infer.engine import Engine

    lm = harness.NanoLM(path=str(run), batch_size="2")
    short = "To be, or not to be."
    ids = lm.tok.encode(short)
    assert len(ids) < lm.model.config.max_seq_len
    (total,) = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (short,), 0)])
    with torch.no_grad():  # one forward from <|endoftext|>: every token of the text predicted once
        logp = torch.log_softmax(lm.model(torch.tensor([[lm.tok.eot_id, *ids[:-1]]])).double(), -1)[0]
    assert total == pytest.approx(float(logp[torch.arange(len(ids)), torch.tensor(ids)].sum()), abs=1e-4)
    long = short * 12  # longer than the 32-token window: windows, each token once
    (total_long,) = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (long,), 0)])
    assert total_long < total < 0
    (gen,) = lm.generate_until([Instance("generate_until", {}, ("To be,", {"until": ["\n"], "max_gen_toks": 6}), 0)])
    stop = (lm.tok.eot_id, lm.tok.im_end_id)
    greedy = Engine(lm.model).generate_all(lm.tok.encode("To be,"), SamplingParams(max_new_tokens=6, temperature=0.0),
                                           stop)
    assert gen == lm.tok.decode(greedy).split("\n")[0]
    # --apply_chat_template: the tokenizer's own chat layout, the generation prompt after the last turn.
    from nanolm.chat import Message
    assert lm.apply_chat_template([{"role": "user", "content": "hi"}]) == lm.tok.chat_format.render(
        [Message("user", "hi")], add_generation_prompt=True)
    from nanolm.errors import UserError
    with pytest.raises(UserError, match=r"--model_args: unknown key\(s\) pretrained for the nanolm model"):
        harness.NanoLM(path=str(run), pretrained="x")
