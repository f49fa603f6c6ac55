"""Shared fixtures: a small real corpus, a tokenizer trained on it and prepared shards; for the server
tests, the tiny model's engine and a server of it (their helpers are in server_helpers.py).

Built once per test session in a temp dir, through the same library calls a
user's commands make.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

ZH = ["话说天下大势，分久必合，合久必分。", "滚滚长江东逝水，浪花淘尽英雄。", "是非成败转头空，青山依旧在，几度夕阳红。",
      "白发渔樵江渚上，惯看秋月春风。", "一壶浊酒喜相逢，古今多少事，都付笑谈中。"]
EN = ["To be, or not to be, that is the question.", "All the world's a stage, and all the men and women merely players.",
      "We hold these truths to be self-evident, that all men are created equal.",
      "The quality of mercy is not strained; it droppeth as the gentle rain from heaven.",
      "My fellow citizens, the state of our union is strong."]


def make_corpus(dir: Path, n_docs: int = 120, seed: int = 0) -> Path:
    """A JSONL corpus of short mixed Chinese/English documents."""
    rng = random.Random(seed)
    path = dir / "corpus.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n_docs):
            pool = ZH if i % 2 else EN
            text = " ".join(rng.choice(pool) for _ in range(rng.randint(3, 12)))
            f.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
    return path


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    return make_corpus(tmp_path_factory.mktemp("corpus"))


def train_corpus_tokenizer(out: Path, corpus: Path, vocab_size: int, **kw) -> Path:
    """A tokenizer trained on `corpus` into `out`, as `nanolm tokenizer train` makes one; returns `out`."""
    from nanolm.data.formats import iter_documents
    from nanolm.tokenizer import train_tokenizer
    train_tokenizer(iter_documents(corpus), out, vocab_size=vocab_size, quiet=True, **kw)
    return out


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory, corpus) -> Path:
    return train_corpus_tokenizer(tmp_path_factory.mktemp("tokenizer"), corpus, 400)


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory, corpus, tokenizer_dir) -> Path:
    from nanolm.data.prepare import prepare
    out = tmp_path_factory.mktemp("data")
    prepare([corpus], tokenizer_dir, out, val_fraction=0.1, workers=1, quiet=True)
    return out


@pytest.fixture(scope="module")
def tok(tokenizer_dir):
    from nanolm.tokenizer import Tokenizer
    return Tokenizer.load(tokenizer_dir)


@pytest.fixture(scope="module")
def engine():
    from server_helpers import tiny_model

    from nanolm.infer.engine import Engine
    return Engine(tiny_model())


@pytest.fixture(scope="module")
def base(engine, tok):
    """The URL of a server of `engine` named "tiny", with ServeConfig's defaults otherwise."""
    from server_helpers import running

    from nanolm.config import ServeConfig
    from nanolm.infer.server import create_app
    with running(create_app(engine, tok, ServeConfig(model_name="tiny"))) as url:
        yield url
