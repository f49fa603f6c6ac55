"""`nanolm eval`: loss, perplexity and bits per byte of tiny trained models on files and prepared shards."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from nanolm.data.formats import iter_documents
from nanolm.data.prepare import prepare
from nanolm.errors import UserError
from nanolm.eval.loss import evaluate, format_result
from nanolm.tokenizer import Tokenizer, train_tokenizer
from nanolm.train.trainer import train
from test_train import read_metrics, tiny_cfg

STEPS = {"train.max_steps": 12, "train.eval_interval": 6}


@pytest.fixture(scope="module")
def run(tmp_path_factory, data_dir) -> Path:
    out = tmp_path_factory.mktemp("eval") / "run"
    train(tiny_cfg(data_dir, out, **STEPS), quiet=True)
    return out


@pytest.fixture(scope="module")
def other(tmp_path_factory, corpus) -> dict[str, Path]:
    """A second tokenizer (300 tokens) on the same corpus, its shards and a model trained on them."""
    root = tmp_path_factory.mktemp("other")
    train_tokenizer(iter_documents(corpus), root / "tok", vocab_size=300, quiet=True)
    prepare([corpus], root / "tok", root / "data", val_fraction=0.1, workers=0, quiet=True)
    train(tiny_cfg(root / "data", root / "run", **STEPS, **{"model.vocab_size": 300}), quiet=True)
    return {"tok": root / "tok", "data": root / "data", "run": root / "run"}


def corpus_counts(corpus: Path, tok: Tokenizer) -> tuple[int, int]:
    """(targets, bytes) a full pass over the corpus must score: every token but the first, and the
    UTF-8 bytes of every document less those of the first token (EOT tokens stand for no bytes)."""
    docs = list(iter_documents(corpus))
    n_tokens = sum(len(tok.encode(d)) + 1 for d in docs)
    n_bytes = sum(len(d.encode("utf-8")) for d in docs)
    return n_tokens - 1, n_bytes - int(tok.token_byte_lengths()[tok.encode(docs[0])[0]])


def test_files_and_prepared_shards_of_the_same_text_agree(run, corpus, tokenizer_dir, tmp_path):
    prepare([corpus], tokenizer_dir, tmp_path / "all", val_fraction=0, workers=0, quiet=True)  # train split only
    via_files = evaluate(run, [corpus], batch_size=64, quiet=True)
    via_shards = evaluate(run, [tmp_path / "all"], batch_size=64, quiet=True)
    assert via_shards["split"] == "train" and via_files["split"] is None
    assert (via_files["tokens"], via_files["bytes"]) == (via_shards["tokens"], via_shards["bytes"])
    assert (via_files["tokens"], via_files["bytes"]) == corpus_counts(corpus, Tokenizer.load(tokenizer_dir))
    assert via_files["bpb"] == pytest.approx(via_shards["bpb"], abs=1e-6)
    assert via_files["loss"] == pytest.approx(via_shards["loss"], abs=1e-6)
    r = via_files
    assert r["ppl"] == pytest.approx(math.exp(r["loss"]), rel=1e-12)
    assert r["bpb"] == pytest.approx(r["loss"] * r["tokens"] / (math.log(2) * r["bytes"]), rel=1e-9)
    assert 1.0 < r["loss"] < math.log(400)  # trained: better than uniform over the vocabulary
    assert r["seq_len"] == 32 and r["checkpoint"].endswith("step-00000012")
    line = format_result(r)
    assert line.startswith(f"loss {r['loss']:.4f} nats/token | ppl {r['ppl']:.2f} | bpb {r['bpb']:.4f} | ")


def test_the_val_split_scores_as_the_training_loop_did(run, data_dir):
    last_val = [r for r in read_metrics(run) if "val_loss" in r][-1]
    assert last_val["step"] == 12
    # The loop scored eval_batches=2 batches of 4 windows of 32 tokens.
    r = evaluate(run, [data_dir], which="last", batch_size=4, max_tokens=2 * 4 * 32, quiet=True)
    assert r["split"] == "val" and r["tokens"] == 256
    assert r["loss"] == pytest.approx(last_val["val_loss"], abs=1e-5)
    assert r["bpb"] == pytest.approx(last_val["val_bpb"], abs=1e-5)


def test_max_tokens_and_seq_len(run, corpus):
    r = evaluate(run, [corpus], max_tokens=100, seq_len=16, quiet=True)
    assert r["tokens"] == 100 and r["seq_len"] == 16
    # Batching does not change the result.
    a = evaluate(run, [corpus], max_tokens=300, batch_size=1, quiet=True)
    b = evaluate(run, [corpus], max_tokens=300, batch_size=7, quiet=True)
    assert a["loss"] == pytest.approx(b["loss"], abs=1e-6)


def test_models_with_different_tokenizers_are_compared_in_bits_per_byte(run, other, corpus, tokenizer_dir):
    ours = evaluate(run, [corpus], batch_size=64, quiet=True)
    theirs = evaluate(other["run"], [corpus], batch_size=64, quiet=True)
    assert (theirs["tokens"], theirs["bytes"]) == corpus_counts(corpus, Tokenizer.load(other["tok"]))
    assert theirs["tokens"] > ours["tokens"] * 1.1  # the smaller vocabulary spends more tokens on the text
    assert abs(theirs["bytes"] - ours["bytes"]) <= 8  # ... on the same bytes (all but each first token's)
    for r in (ours, theirs):
        assert 0.5 < r["bpb"] < 8.0 and r["bpb"] == pytest.approx(
            r["loss"] * r["tokens"] / (math.log(2) * r["bytes"]), rel=1e-9)


def test_shards_of_another_tokenizer_are_refused(run, other):
    with pytest.raises(UserError) as e:
        evaluate(run, [other["data"]], quiet=True)
    msg = str(e.value)
    assert f"{other['data'] / 'manifest.json'}: the data was tokenized with tokenizer " in msg
    assert "pass the raw .txt/.jsonl files instead" in msg and "\n" not in msg


def test_chat_shards_score_only_the_replies(run, tokenizer_dir, tmp_path):
    # Short enough (under 30 tokens) that every conversation fits a block of seq_len + 1 = 33 whole.
    convs = [{"messages": [{"role": "user", "content": f"{i}+1"},
                           {"role": "assistant", "content": f"{i + 1}"}]} for i in range(20)]
    src = tmp_path / "chat.jsonl"
    src.write_text("".join(json.dumps(c) + "\n" for c in convs))
    prepare([src], tokenizer_dir, tmp_path / "chat", format="chat", val_fraction=0, workers=0, quiet=True)
    r = evaluate(run, [tmp_path / "chat"], quiet=True)
    mask = np.fromfile(tmp_path / "chat" / "train-00000.mask", dtype=np.uint8)
    assert r["tokens"] == int((mask & 1).sum())  # each reply token and its <|im_end|>, nothing else


def test_argument_errors(run, corpus, data_dir, tmp_path):
    with pytest.raises(UserError, match="a prepared directory is evaluated alone"):
        evaluate(run, [data_dir, corpus], quiet=True)
    with pytest.raises(UserError, match=r"seq_len=64: the model was built for at most 32 tokens"):
        evaluate(run, [corpus], seq_len=64, quiet=True)
    with pytest.raises(UserError, match=r"which='first': use 'best'"):
        evaluate(run, [corpus], which="first", quiet=True)
    with pytest.raises(UserError, match=r"max_tokens=0: must be a positive integer"):
        evaluate(run, [corpus], max_tokens=0, quiet=True)
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(UserError, match="no text to score"):
        evaluate(run, [tmp_path / "empty.txt"], quiet=True)
