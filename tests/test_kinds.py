"""A data kind is one registered class: a new one, defined here, is prepared by `prepare` (and `nanolm prepare
--format`), written with its own manifest section, read back by PackedData and the loader, trains a tokenizer
(`nanolm tokenizer train --format`) and mixes with text; no module outside nanolm/data/kinds/ names a kind."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import pytest
from tokenizers import Tokenizer as HFTokenizer

import nanolm
from nanolm.cli import main
from nanolm.config import DataConfig, DataSetConfig
from nanolm.data import kinds
from nanolm.data.formats import iter_pieces
from nanolm.data.kinds import base as kinds_base
from nanolm.data.kinds.base import Chunk, DataKind, Record
from nanolm.data.kinds.text import Windows, encode_pieces
from nanolm.data.loader import Loader, iter_eval_batches, unit_kind
from nanolm.data.prepare import PrepareConfig, prepare
from nanolm.data.shards import Manifest, PackedData, SplitWriter, write_splits
from nanolm.data.stream import DataStream
from nanolm.errors import UserError
from nanolm.tokenizer import Tokenizer

ROOT = Path(nanolm.__file__).parent


class UpperKind(DataKind):
    """A toy kind: {"text": ...} lines, each document's text upper-cased, read by the loader as text windows."""

    name = "upper"
    about = "upper-cased documents (a test's toy kind)"
    help = '{"text": ...} lines, upper-cased'

    @classmethod
    def units(cls, data: PackedData, seq_len: int) -> Windows:
        return Windows(data, seq_len)

    @classmethod
    def texts(cls, files: list[Path], *, skip_bad: bool = False, stats: Any = None) -> Iterator[str]:
        documents = super().texts(files, skip_bad=skip_bad, stats=stats)  # a tokenizer for it reads them upper-cased
        return (t.upper() for t in documents)

    def options(self) -> dict[str, Any]:
        return {"format": self.name, "val_fraction": self.cfg.val_fraction, "skip_bad": self.cfg.skip_bad,
                "shard_tokens": self.cfg.shard_tokens}

    def records(self, path: Path) -> Iterator[Record]:
        for piece in iter_pieces(path, skip_bad=self.cfg.skip_bad, stats=self.stats):
            yield piece.text.upper(), piece.last, len(piece.text), piece.nbytes, None

    def job(self, chunk: Chunk) -> tuple[Callable[..., Any], tuple]:
        return encode_pieces, (chunk.items, chunk.lasts)  # a module function: it runs in the worker processes

    def consume(self, writers: dict[str, SplitWriter], chunk: Chunk, tokens: np.ndarray, lens: np.ndarray) -> None:
        write_splits(writers, np.array(chunk.is_val, dtype=bool), tokens, lens, np.array(chunk.lasts, dtype=bool))

    def section(self, splits: dict[str, dict[str, Any]], n_docs: int) -> dict[str, Any] | None:
        return {"n_upper": n_docs}


@pytest.fixture
def upper(monkeypatch):
    monkeypatch.setattr(kinds_base, "_KINDS", dict(kinds_base._KINDS))  # registered for this test only
    kinds.register(UpperKind)
    return UpperKind


DOCS = ["the quick brown fox", "jumps over", "the lazy dog", "and runs away", "far, far away"] * 4


def write_docs(path: Path) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in DOCS), encoding="utf-8")
    return path


def test_a_registered_kind_is_prepared_and_read_back_by_the_loader(upper, tokenizer_dir, tmp_path, capsys):
    src, out = write_docs(tmp_path / "docs.jsonl"), tmp_path / "out"
    m = prepare([src], tokenizer_dir, out, format="upper", val_fraction=0.2, workers=0)
    assert "prepared 20 documents" in capsys.readouterr().err
    assert (m.kind, m.options["format"], m.section) == ("upper", "upper", {"n_upper": 20})
    on_disk = json.loads((out / "manifest.json").read_text())
    assert on_disk["options"]["format"] == "upper" and on_disk["upper"] == {"n_upper": 20}
    assert Manifest.read(out) == m
    # The documents, upper-cased, in the shards: k = 5, so documents 1, 6, 11 and 16 are validation.
    tok = HFTokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    data = PackedData(out, "train")
    assert data.kind == "upper" and data.masks is None
    shard, start, length = data.documents()
    texts = [tok.decode(data.doc_ids(int(s), int(a), int(n)).tolist()) for s, a, n in zip(shard, start, length)]
    assert texts == [t.upper() for i, t in enumerate(DOCS) if i % 5 != 1]
    # The loader reads it through the kind's units: windows of text.
    assert isinstance(unit_kind(data, 8), Windows)
    batch = Loader(data, batch_size=2, seq_len=8, seed=0).next_batch()
    assert batch.x.shape == (2, 8) and batch.pos is None
    assert all(tok.decode(row.tolist()) == tok.decode(row.tolist()).upper() for row in batch.x)
    assert sum(b.x.shape[0] for b in iter_eval_batches(PackedData(out, "val"), 2, 8)) > 0
    # Up to date: the same options again do nothing; the worker pool writes the same bytes.
    assert prepare([src], tokenizer_dir, out, format="upper", val_fraction=0.2, workers=0) == m
    assert "nothing to do" in capsys.readouterr().err
    pooled = tmp_path / "pooled"
    prepare([src], tokenizer_dir, pooled, format="upper", val_fraction=0.2, workers=1, quiet=True)
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.name != "manifest.json"} == \
        {p.name: p.read_bytes() for p in pooled.iterdir() if p.name != "manifest.json"}


def test_the_command_line_offers_a_registered_kind(upper, tokenizer_dir, tmp_path, capsys):
    src, out = write_docs(tmp_path / "docs.jsonl"), tmp_path / "out"
    assert main(["prepare", str(src), "--tokenizer", str(tokenizer_dir), "--out", str(out), "--format", "upper",
                 "--workers", "0", "--quiet"]) == 0
    assert PackedData(out).kind == "upper"
    with pytest.raises(SystemExit):
        main(["prepare", "--help"])
    assert "blocks,upper" in capsys.readouterr().out.replace("\n", "")  # --format {text,...,blocks,upper,dpo}


def test_data_of_an_unregistered_kind_is_named_where_it_is_read(upper, tokenizer_dir, tmp_path, monkeypatch):
    out = tmp_path / "out"
    prepare([write_docs(tmp_path / "docs.jsonl")], tokenizer_dir, out, format="upper", workers=0, quiet=True)
    monkeypatch.setattr(kinds_base, "_KINDS", {k: v for k, v in kinds_base._KINDS.items() if k != "upper"})
    with pytest.raises(UserError, match=rf"{re.escape(str(out / 'manifest.json'))}: unknown data kind 'upper' \(this "
                                        r"nanolm reads text, chat, pairs, prompts, blocks\); run `nanolm prepare`"):
        Loader(PackedData(out), batch_size=1, seq_len=8)
    with pytest.raises(UserError, match=r"format='upper': must be one of text, chat, pairs, prompts, blocks \(text: "
                                        r"documents for pretraining; chat: conversations for fine-tuning; pairs: "):
        PrepareConfig([tmp_path / "docs.jsonl"], tokenizer_dir, out, format="upper")


def test_the_built_in_kinds_and_the_old_name_of_pairs():
    assert kinds.names() == ["text", "chat", "pairs", "prompts", "blocks"]
    assert kinds.get("dpo") is kinds.get("pairs") is kinds.PairsKind
    cfg = PrepareConfig(["a.jsonl"], "tok", "out", format="dpo")
    assert cfg.format == "pairs" and cfg.sources == [Path("a.jsonl")]
    with pytest.raises(ValueError, match="needs a name of its own"):
        kinds.register(type("Dpo", (UpperKind,), {"name": "dpo"}))


def test_prepare_names_no_data_kind():
    """The driver asks the kind for everything: no kind's name (nor the old "dpo") is written in prepare.py."""
    source = (ROOT / "data" / "prepare.py").read_text(encoding="utf-8")
    assert kinds.choices() == ["text", "chat", "pairs", "prompts", "blocks", "dpo"]
    found = re.findall(r"""["'](text|chat|dpo|pairs|prompts|blocks)["']""", source)
    assert found == [], f"prepare.py names the kinds {sorted(set(found))}"


def test_prompts_and_blocks_go_through_the_same_driver(tokenizer_dir, tmp_path, capsys):
    """The in-process kinds share the driver's up-to-date check (the prompts' records files included)."""
    src = tmp_path / "prompts.jsonl"
    src.write_text("".join(json.dumps({"prompt": f"what is {i} + {i}?", "answer": str(2 * i)}) + "\n"
                           for i in range(8)), encoding="utf-8")
    out = tmp_path / "prompts"
    m = prepare([src], tokenizer_dir, out, format="prompts", val_fraction=0.25, workers=0)
    assert m.kind == "prompts" and m.throughput is None and (m.section["train"], m.section["val"]) == (6, 2)
    assert "prepared 8 prompts (train 6, val 2)" in capsys.readouterr().err
    assert prepare([src], tokenizer_dir, out, format="prompts", val_fraction=0.25, workers=0) == m
    assert "nothing to do" in capsys.readouterr().err
    (out / "val.records.jsonl").unlink()
    prepare([src], tokenizer_dir, out, format="prompts", val_fraction=0.25, workers=0)
    assert "nothing to do" not in capsys.readouterr().err and (out / "val.records.jsonl").is_file()
    blocks = tmp_path / "blocks.jsonl"
    blocks.write_text("".join(json.dumps({"input": str(i), "output": str(i)[::-1]}) + "\n" for i in range(10, 20)),
                      encoding="utf-8")
    b = prepare([blocks], tokenizer_dir, tmp_path / "b", format="blocks", val_fraction=0, workers=0, quiet=True)
    assert b.kind == "blocks" and b.section["n_records"] == 10 and b.splits["train"]["n_records"] == 10
    assert prepare([blocks], tokenizer_dir, tmp_path / "b", format="blocks", val_fraction=0, quiet=True) == b


def test_a_registered_kind_trains_a_tokenizer_and_mixes_with_text(upper, tokenizer_dir, tmp_path):
    """What the toy kind needs to train a tokenizer and to mix is in its class: its texts, and (by default) batches
    of token rows like text's."""
    src = write_docs(tmp_path / "docs.jsonl")
    assert list(kinds.iter_texts([src], format="upper")) == [t.upper() for t in DOCS]
    tok_dir = tmp_path / "tok"
    assert main(["tokenizer", "train", str(src), "--out", str(tok_dir), "--vocab-size", "300", "--format",
                 "upper"]) == 0
    tok = Tokenizer.load(tok_dir)  # trained on the upper-cased documents only: no lower-case word is merged
    assert len(tok.encode("THE QUICK BROWN FOX")) < len(tok.encode("the quick brown fox")) == 19
    for name in ("upper", "text"):
        prepare([src], tokenizer_dir, tmp_path / name, format=name, val_fraction=0, workers=0, quiet=True)
    sets = (DataSetConfig(path=str(tmp_path / "upper")), DataSetConfig(path=str(tmp_path / "text")))
    s = DataStream(DataConfig(sets=sets, mode="mixture"), 2, 8, pin_memory=False)
    assert (s.kind, s.segments) == ("upper", False)
    taken = []
    for _ in range(4):
        s.next_batch()
        taken.append(s.position()["set"])
    assert taken == ["upper", "text", "upper", "text"]
    assert kinds.mix_refusal(UpperKind, kinds.PairsKind) == kinds.PairsKind.mix_fix == (
        "preference pairs cannot be combined with text or chat data: train them in a run of their own")
    assert kinds.mix_refusal(kinds.PairsKind, kinds.BlocksKind) == kinds.BlocksKind.mix_fix  # alone speaks first
    assert kinds.mix_refusal(kinds.BlocksKind, kinds.BlocksKind) == ("block data trains alone: give it as the one "
                                                                     "data set of its run")
    assert kinds.mix_refusal(kinds.PromptsKind, kinds.PromptsKind) == ""
    assert kinds.stream_kind([kinds.TextKind, kinds.ChatKind, UpperKind]) is kinds.ChatKind  # it has segments


# A string equal to a kind's name stands for that kind where it is compared with, or tested against, an
# expression that names a kind or a format; where it is the value of a keyword argument, a parameter's default or
# an assignment whose name says kind or format; or where it is an argument of a call that defines a --format or
# --kind option. Elsewhere "text" or "chat" are other things (a message's content type, a command's name).
KIND_WORDS = re.compile(r"kind|format", re.IGNORECASE)
# Files that may name kinds, and why.
ALLOWED = {
    "data/shards.py": "the manifest format's history: a manifest without options.format holds text, and a 'dpo' "
                      "one pairs (data/kinds/ imports shards.py, so the kinds cannot be imported there)",
    "corpora/registry.py": "a built-in corpus says which kind of records its file holds; corpora/ sits below data/ "
                           "and cannot import the kinds",
}


def _names_a_kind(node: ast.AST) -> bool:
    return any(KIND_WORDS.search(n.id if isinstance(n, ast.Name) else n.attr)
               for n in ast.walk(node) if isinstance(n, (ast.Name, ast.Attribute)))


def kind_name_uses(source: str, names: set[str]) -> list[tuple[int, str]]:
    """(line, name) of each string constant of `source` equal to one of `names` where it stands for a data kind."""
    def constants(node: ast.AST | None) -> list[ast.Constant]:
        return [] if node is None else [c for c in ast.walk(node) if isinstance(c, ast.Constant)
                                        and isinstance(c.value, str) and c.value in names]
    hits: list[ast.Constant] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            for i, side in enumerate(sides):
                if isinstance(side, (ast.Constant, ast.Tuple, ast.List, ast.Set)) and \
                        any(_names_a_kind(other) for j, other in enumerate(sides) if j != i):
                    hits += constants(side)
        elif isinstance(node, ast.keyword) and node.arg and KIND_WORDS.search(node.arg):
            hits += constants(node.value)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(_names_a_kind(t) for t in targets):
                hits += constants(node.value)
        elif isinstance(node, ast.arguments):
            args = [*node.posonlyargs, *node.args]
            defaults = [*zip(args[len(args) - len(node.defaults):], node.defaults),
                        *zip(node.kwonlyargs, node.kw_defaults)]
            hits += [c for a, d in defaults if KIND_WORDS.search(a.arg) for c in constants(d)]
        elif isinstance(node, ast.Call) and any(isinstance(a, ast.Constant) and isinstance(a.value, str)
                                                and a.value.startswith("--") and KIND_WORDS.search(a.value)
                                                for a in node.args):
            hits += [c for k in node.keywords for c in constants(k.value)]
    return sorted({(c.lineno, c.value) for c in hits})


def test_the_scan_finds_a_kind_named_and_passes_other_meanings():
    names = set(kinds.choices())
    named = """
if data.kind == "chat": pass
if args.format in ("text", "blocks"): pass
prepare(files, tok, out, format="prompts")
kinds = ("pairs",)
def read(files, format="dpo"): pass
tt.add_argument("--format", choices=["text", "chat"], default="text")
"""
    assert kind_name_uses(named, names) == [(2, "chat"), (3, "blocks"), (3, "text"), (4, "prompts"), (5, "pairs"),
                                            (6, "dpo"), (7, "chat"), (7, "text")]
    other = """
if message.role == "chat" or part.get("type") == "text" or args.cmd == "blocks": pass
sub.add_parser("chat", help="multi-turn chat")
record = {"text": "a document", "object": "chat.completion"}
if stage.name == "dpo": pass
"""
    assert kind_name_uses(other, names) == []


def test_no_module_outside_the_kinds_names_a_kind():
    """Every .py under nanolm/ but data/kinds/: a kind is named by its class (`ChatKind.name`), asked for what it
    is (`kinds.get(name).segments`), or not at all."""
    names = set(kinds.choices())
    found, allowed_hit = [], set()
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("data/kinds/"):
            continue
        uses = kind_name_uses(path.read_text(encoding="utf-8"), names)
        if rel in ALLOWED:
            allowed_hit.add(rel) if uses else None
            continue
        found += [f"{rel}:{line}: {name!r}" for line, name in uses]
    assert found == [], "kind names outside nanolm/data/kinds/:\n" + "\n".join(found)
    assert allowed_hit == set(ALLOWED), f"no longer names a kind, drop it from ALLOWED: {set(ALLOWED) - allowed_hit}"


def test_each_built_in_kind_gives_a_tokenizer_its_texts(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"messages": [{"role": "system", "content": "be brief"},
                                                {"role": "user", "content": "what is 2 + 2?"}], "answer": "4"})
                       + "\n" + json.dumps({"prompt": "hi"}) + "\n", encoding="utf-8")
    assert list(kinds.iter_texts([prompts], format="prompts")) == ["be brief", "what is 2 + 2?", "hi"]
    blocks = tmp_path / "blocks.jsonl"
    blocks.write_text(json.dumps({"input": "123", "output": "321"}) + "\n" + json.dumps({"text": "4567"}) + "\n",
                      encoding="utf-8")
    assert list(kinds.iter_texts([blocks], format="blocks")) == ["123", "321", "4567"]
    with pytest.raises(UserError, match=r"prompts\.jsonl:1: no \"chosen\" field"):  # "dpo" reads as pairs
        list(kinds.iter_texts([prompts], format="dpo"))
