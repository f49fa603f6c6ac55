"""`prepare`: token shards that decode back to the input, the manifest, re-runs, atomicity."""

from __future__ import annotations

import hashlib
import json
import zlib
import os
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

import nanolm.data.formats as formats
import nanolm.data.kinds.text as text_kind
import nanolm.data.prepare as prep
import nanolm.data.shards as shards_module
from nanolm.data.prepare import prepare, val_every
from nanolm.data.shards import Manifest, token_dtype
from nanolm.errors import UserError

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
DOCS = [
    "The quick brown fox jumps over the lazy dog.",
    "第二个文档：你好，世界！",
    "  leading spaces, trailing newline\n",
    "emoji 🙂 and café",
    "x",
    "line one\nline two\n\nline four",
    "<|im_start|> is a special token string in plain text",
    "numbers 12345 67890",
    "tabs\tand\r\ncarriage returns",
    "the end",
]


def train_tokenizer(out_dir: Path, vocab_size: int = 300) -> Path:
    """A tiny byte-level BPE with nanolm's special tokens at ids 0, 1, 2, saved as out_dir/tokenizer.json."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(DOCS * 20, trainer=trainer)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    return out_dir / "tokenizer.json"


@pytest.fixture(scope="module")
def tok_path(tmp_path_factory) -> Path:
    return train_tokenizer(tmp_path_factory.mktemp("tok"))


def write_jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in texts), encoding="utf-8")
    return path


def read_split(out: Path, manifest: Manifest, split: str) -> list[np.ndarray]:
    """Each document's token ids (EOT included) of a split, in order, checking the .idx layout."""
    docs = []
    for s in manifest.splits[split]["shards"]:
        tokens = np.fromfile(out / s["bin"], dtype=manifest.dtype)
        offsets = np.fromfile(out / s["idx"], dtype=np.uint64)
        assert len(tokens) == s["n_tokens"] and len(offsets) == s["n_docs"] + 1
        assert offsets[0] == 0 and offsets[-1] == len(tokens)
        docs += [tokens[a:b] for a, b in zip(offsets[:-1], offsets[1:])]
    return docs


def decode_all(tok_path: Path, out: Path, manifest: Manifest) -> list[str]:
    """Train and val documents merged back into input order (val is every k-th document from 1)."""
    tok = HFTokenizer.from_file(str(tok_path))
    train, val = read_split(out, manifest, "train"), read_split(out, manifest, "val")
    k = manifest.split_policy["val_every"]
    merged = []
    for i in range(len(train) + len(val)):
        merged.append(val.pop(0) if k and i % k == 1 else train.pop(0))
    texts = []
    for d in merged:
        assert d[-1] == 0 and 0 not in d[:-1]  # exactly one EOT, at the end
        texts.append(tok.decode(d[:-1].tolist(), skip_special_tokens=False))
    return texts


def snapshot(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())}


def test_shards_decode_back_to_the_documents_in_order(tmp_path, tok_path):
    src = write_jsonl(tmp_path / "a.jsonl", DOCS[:6])
    txt = tmp_path / "b.txt"
    txt.write_bytes(b"A whole text file\r\nis one document.\r\n")
    src2 = write_jsonl(tmp_path / "c.jsonl", DOCS[6:])
    out = tmp_path / "out"
    m = prepare([src, txt, src2], tok_path, out, val_fraction=0.25, workers=0, quiet=True)
    expected = DOCS[:6] + ["A whole text file\nis one document.\n"] + DOCS[6:]
    assert decode_all(tok_path, out, m) == expected
    # k = 4: documents 1, 5 and 9 are validation.
    assert (m.splits["train"]["n_docs"], m.splits["val"]["n_docs"]) == (8, 3)
    val_texts = [HFTokenizer.from_file(str(tok_path)).decode(d[:-1].tolist(), skip_special_tokens=False)
                 for d in read_split(out, m, "val")]
    assert val_texts == [expected[1], expected[5], expected[9]]
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "train-00000.bin", "train-00000.idx",
                                                     "val-00000.bin", "val-00000.idx"]


def test_val_policy():
    assert [val_every(f) for f in (0, 0.01, 0.1, 0.25, 0.3, 0.5)] == [0, 100, 10, 4, 3, 2]
    for bad in (-0.1, 0.6, 1, "0.1", True):
        with pytest.raises(UserError, match="must be a number from 0 .no validation split. to 0.5"):
            val_every(bad)


def test_tiny_corpus_gets_a_val_document_and_train_is_never_empty(tmp_path, tok_path):
    m = prepare([write_jsonl(tmp_path / "a.jsonl", ["one", "two"])], tok_path, tmp_path / "o2", quiet=True)
    assert (m.splits["train"]["n_docs"], m.splits["val"]["n_docs"]) == (1, 1)
    m = prepare([write_jsonl(tmp_path / "b.jsonl", ["only"])], tok_path, tmp_path / "o1", quiet=True)
    assert (m.splits["train"]["n_docs"], m.splits["val"]["n_docs"]) == (1, 0)


def test_val_fraction_zero_means_no_val_split(tmp_path, tok_path):
    out = tmp_path / "out"
    m = prepare([write_jsonl(tmp_path / "a.jsonl", DOCS)], tok_path, out, val_fraction=0, workers=0, quiet=True)
    assert m.splits["val"] == {"shards": [], "n_tokens": 0, "n_docs": 0}
    assert m.splits["train"]["n_docs"] == len(DOCS)
    assert not list(out.glob("val-*"))


def test_manifest_content(tmp_path, tok_path):
    from nanolm.tokenizer import Tokenizer
    src = write_jsonl(tmp_path / "a.jsonl", DOCS)
    out = tmp_path / "out"
    m = prepare([src], tok_path, out, val_fraction=0.5, workers=0, quiet=True, shard_tokens=1000)
    assert json.loads((out / "manifest.json").read_text()) == m.to_dict() and Manifest.read(out) == m
    assert m.to_dict()["format"] == "nanolm-tokens" and m.version == shards_module.FORMAT_VERSION
    assert m.kind == "text" and m.section is None
    tok = Tokenizer.load(tok_path)
    assert m.tokenizer.to_dict() == {"path": str(tok_path.resolve()), "fingerprint": tok.fingerprint,
                              "vocab_size": tok.vocab_size, "eot_id": 0}
    assert m.dtype == "uint16"
    st = src.stat()
    assert m.sources == [{"path": str(src.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
                             "sha256": hashlib.sha256(src.read_bytes()).hexdigest()}]
    assert m.options == {"val_fraction": 0.5, "skip_bad": False, "shard_tokens": 1000,
                            "long_doc_chars": text_kind.LONG_DOC_CHARS}
    assert m.split_policy["val_every"] == 2
    assert m.split_policy["by_position"] == 0 and m.split_policy["summary"] == "by document: 1 in 2 " \
        "(document i when i % 2 == 1)"
    assert m.skipped == {"bad_lines": 0, "examples": [], "empty_docs": 0}
    n = sum(len(HFTokenizer.from_file(str(tok_path)).encode(d, add_special_tokens=False).ids) + 1 for d in DOCS)
    assert m.totals == {"n_tokens": n, "n_docs": len(DOCS), "bytes": st.st_size}
    assert m.splits["train"]["n_tokens"] + m.splits["val"]["n_tokens"] == n
    crc = {k: f"{zlib.crc32((out / f'train-00000.{k}').read_bytes()):08x}" for k in ("bin", "idx")}
    assert m.splits["train"]["shards"][0] == {"bin": "train-00000.bin", "idx": "train-00000.idx",
                                                 "n_tokens": m.splits["train"]["n_tokens"], "n_docs": 5,
                                                 "crc32": crc}  # each file's bytes, as written
    assert set(m.throughput) == {"seconds", "workers", "mb_per_s", "tokens_per_s"}
    assert m.throughput["workers"] == 0


def test_dtype_choice(tmp_path):
    assert token_dtype(300) == np.uint16 and token_dtype(65536) == np.uint16 and token_dtype(65537) == np.uint32
    tok = HFTokenizer.from_file(str(train_tokenizer(tmp_path / "tok")))
    tok.add_tokens([f"<w{i}>" for i in range(65536)])  # vocab past 65536: ids need 32 bits
    tok.save(str(tmp_path / "tok" / "tokenizer.json"))
    text = "big <w65500> id"
    out = tmp_path / "out"
    m = prepare([write_jsonl(tmp_path / "a.jsonl", [text])], tmp_path / "tok", out, workers=0, quiet=True)
    assert m.dtype == "uint32"
    ids = np.fromfile(out / "train-00000.bin", dtype=np.uint32)
    assert ids.max() > 65535 and (out / "train-00000.bin").stat().st_size == 4 * len(ids)
    assert tok.decode(ids[:-1].tolist()) == text


def test_shards_roll_over_at_document_ends(tmp_path, tok_path):
    out = tmp_path / "out"
    docs = [f"document number {i} " * (i % 5 + 1) for i in range(40)]
    m = prepare([write_jsonl(tmp_path / "a.jsonl", docs)], tok_path, out, val_fraction=0, shard_tokens=50,
                workers=0, quiet=True)
    shards = m.splits["train"]["shards"]
    assert len(shards) > 3
    for s in shards[:-1]:
        assert s["n_tokens"] >= 50  # closed at the first document end at or past shard_tokens
    assert decode_all(tok_path, out, m) == docs
    # A later run with bigger shards removes the now-stale shard files.
    m2 = prepare([tmp_path / "a.jsonl"], tok_path, out, val_fraction=0, workers=0, quiet=True)
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "train-00000.bin", "train-00000.idx"]
    assert decode_all(tok_path, out, m2) == docs


def test_large_txt_in_pieces_tokenizes_as_a_whole(tmp_path, tok_path, monkeypatch):
    text = "".join(f"{DOCS[i % len(DOCS)]}\nline {i}: words, more words.\n  indented\n\n" for i in range(200))
    text = text.replace("\r\n", "\n")  # .txt line ends are normalised to LF
    (tmp_path / "big.txt").write_text(text, encoding="utf-8")
    monkeypatch.setattr(formats, "TXT_PIECE_CHARS", 200)
    assert len(list(formats.iter_pieces(tmp_path / "big.txt"))) > 20
    out = tmp_path / "out"
    prepare([tmp_path / "big.txt"], tok_path, out, val_fraction=0, workers=0, quiet=True)
    whole = HFTokenizer.from_file(str(tok_path)).encode(text, add_special_tokens=False).ids
    assert np.fromfile(out / "train-00000.bin", dtype=np.uint16).tolist() == whole + [0]


def _decode(tok_path: Path, doc: np.ndarray) -> str:
    assert doc[-1] == 0 and 0 not in doc[:-1]  # exactly one EOT, at the end
    return HFTokenizer.from_file(str(tok_path)).decode(doc[:-1].tolist(), skip_special_tokens=False)


def test_one_long_txt_gives_its_last_val_fraction_by_position(tmp_path, tok_path, monkeypatch, capsys):
    # One file is one document: its first int(n * 0.9) characters train, the rest validate, as nanoGPT splits.
    # In pieces of 300 characters, so the cut falls inside a piece and the length is counted ahead.
    text = "".join(f"line {i}: {DOCS[i % len(DOCS)].strip()}\n" for i in range(120)).replace("\r\n", "\n")
    (tmp_path / "novel.txt").write_text(text, encoding="utf-8")
    monkeypatch.setattr(formats, "TXT_PIECE_CHARS", 300)
    monkeypatch.setattr(text_kind, "LONG_DOC_CHARS", 1000)
    assert len(text) > 1000 and len(list(formats.iter_pieces(tmp_path / "novel.txt"))) > 10
    out = tmp_path / "out"
    m = prepare([tmp_path / "novel.txt"], tok_path, out, val_fraction=0.1, workers=0)
    cut = int(len(text) * 0.9)
    train, val = read_split(out, m, "train"), read_split(out, m, "val")
    assert [_decode(tok_path, d) for d in train] == [text[:cut]]
    assert [_decode(tok_path, d) for d in val] == [text[cut:]]
    assert m.split_policy["by_position"] == 1
    summary = "by position: the last 10% of each of 1 long document(s) (>= 1,000 characters)"
    assert m.split_policy["summary"] == summary
    assert f"validation split: {summary}" in capsys.readouterr().err
    # The same file with val_fraction 0 stays whole; under the threshold it is one document, so no val split.
    m0 = prepare([tmp_path / "novel.txt"], tok_path, tmp_path / "o0", val_fraction=0, workers=0, quiet=True)
    assert m0.splits["val"]["n_docs"] == 0 and m0.split_policy["by_position"] == 0
    monkeypatch.setattr(text_kind, "LONG_DOC_CHARS", len(text) + 1)
    m1 = prepare([tmp_path / "novel.txt"], tok_path, tmp_path / "o1", val_fraction=0.1, workers=0, quiet=True)
    assert (m1.splits["train"]["n_docs"], m1.splits["val"]["n_docs"]) == (1, 0)


def test_short_documents_keep_the_every_kth_rule_beside_a_long_one(tmp_path, tok_path, monkeypatch):
    monkeypatch.setattr(text_kind, "LONG_DOC_CHARS", 500)
    long_doc = " ".join(f"word{i}" for i in range(150))  # 1,039 characters: one jsonl line, one piece
    docs = DOCS[:3] + [long_doc] + DOCS[3:9]
    out = tmp_path / "out"
    m = prepare([write_jsonl(tmp_path / "a.jsonl", docs)], tok_path, out, val_fraction=0.25, workers=0, quiet=True)
    cut = int(len(long_doc) * 0.75)
    # k = 4 over the documents in input order (the long one is document 3, split by position): 1, 5, 9 go to val.
    train = [_decode(tok_path, d) for d in read_split(out, m, "train")]
    val = [_decode(tok_path, d) for d in read_split(out, m, "val")]
    assert train == [docs[0], docs[2], long_doc[:cut], docs[4], docs[6], docs[7], docs[8]]
    assert val == [docs[1], long_doc[cut:], docs[5], docs[9]]
    assert m.split_policy["by_position"] == 1
    assert m.split_policy["summary"] == ("by document: 1 in 4 (document i when i % 4 == 1); by position: the last "
                                            "25% of each of 1 long document(s) (>= 500 characters)")


def test_rerun_on_unchanged_inputs_is_a_no_op(tmp_path, tok_path, capsys):
    src = write_jsonl(tmp_path / "a.jsonl", DOCS)
    out = tmp_path / "out"
    m1 = prepare([src], tok_path, out, workers=0)
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    capsys.readouterr()
    m2 = prepare([src], tok_path, out, workers=0)
    assert m2 == m1
    assert "up to date (same sources, tokenizer and options); nothing to do" in capsys.readouterr().err
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before
    # Other options, or the same size and mtime with other content, mean work to do.
    m3 = prepare([src], tok_path, out, workers=0, quiet=True, val_fraction=0.5)
    assert m3.options["val_fraction"] == 0.5 and m3.created >= m1.created
    st = src.stat()
    src.write_text(src.read_text().replace("quick", "QUICK"), encoding="utf-8")
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns))
    m4 = prepare([src], tok_path, out, workers=0, quiet=True, val_fraction=0.5)
    assert m4.sources[0]["sha256"] != m3.sources[0]["sha256"]
    assert decode_all(tok_path, out, m4)[0].startswith("The QUICK")
    # A shard deleted by hand is noticed.
    (out / "val-00000.bin").unlink()
    capsys.readouterr()
    prepare([src], tok_path, out, workers=0, val_fraction=0.5)
    assert "nothing to do" not in capsys.readouterr().err
    assert (out / "val-00000.bin").is_file()


def _fail_on_second_append(monkeypatch):
    calls = {"n": 0}
    real = shards_module.SplitWriter.append

    def append(self, *args):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt  # as if the user pressed Ctrl-C mid-way
        return real(self, *args)

    monkeypatch.setattr(shards_module.SplitWriter, "append", append)
    monkeypatch.setattr(prep, "BATCH_PIECES", 2)  # several batches, so the run stops part-way


def test_interrupted_run_keeps_the_previous_good_data(tmp_path, tok_path, monkeypatch):
    src = write_jsonl(tmp_path / "a.jsonl", DOCS)
    out = tmp_path / "out"
    prepare([src], tok_path, out, workers=0, quiet=True, shard_tokens=40)
    good = snapshot(out)
    write_jsonl(src, DOCS[::-1])
    _fail_on_second_append(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        prepare([src], tok_path, out, workers=0, quiet=True, shard_tokens=40)
    assert snapshot(out) == good  # same files, same bytes, no temp directory left behind


def test_interrupted_first_run_leaves_nothing(tmp_path, tok_path, monkeypatch):
    out = tmp_path / "out"
    _fail_on_second_append(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        prepare([write_jsonl(tmp_path / "a.jsonl", DOCS)], tok_path, out, workers=0, quiet=True)
    assert not out.exists() and [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_bad_line_fails_without_output_or_is_skipped_and_recorded(tmp_path, tok_path, capsys):
    src = tmp_path / "a.jsonl"
    src.write_text('{"text": "good one"}\n{"text": 5}\n{"text": "good two"}\n{"txt": "x"}\n', encoding="utf-8")
    out = tmp_path / "out"
    with pytest.raises(UserError, match=r'a\.jsonl:2: "text" must be a string, got a number; fix the line or pass '
                                        r"--skip-bad to skip such lines"):
        prepare([src], tok_path, out, workers=0, quiet=True)
    assert not out.exists() and [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    m = prepare([src], tok_path, out, workers=0, skip_bad=True, val_fraction=0)
    assert decode_all(tok_path, out, m) == ["good one", "good two"]
    assert m.skipped == {"bad_lines": 2, "empty_docs": 0, "examples": [
        f'{src}:2: "text" must be a string, got a number', f'{src}:4: no "text" field (keys: txt)']}
    assert f"skipped 2 bad line(s) (--skip-bad), first: {src}:2:" in capsys.readouterr().err


def test_argument_errors(tmp_path, tok_path):
    src = write_jsonl(tmp_path / "a.jsonl", DOCS)
    with pytest.raises(UserError, match="workers=-1: must be an integer >= 0"):
        prepare([src], tok_path, tmp_path / "o", workers=-1)
    with pytest.raises(UserError, match="shard_tokens=0: must be a positive integer"):
        prepare([src], tok_path, tmp_path / "o", shard_tokens=0)
    with pytest.raises(UserError, match="no tokenizer file here"):
        prepare([src], tmp_path / "nope", tmp_path / "o")
    (tmp_path / "file").write_text("x")
    with pytest.raises(UserError, match="file: exists and is not a directory"):
        prepare([src], tok_path, tmp_path / "file")
    empty = write_jsonl(tmp_path / "e.jsonl", ["", ""])
    with pytest.raises(UserError, match=r"no documents in .*e\.jsonl \(all empty or skipped\)"):
        prepare([empty], tok_path, tmp_path / "o", quiet=True)


@pytest.mark.slow
def test_worker_processes_write_the_same_bytes(tmp_path, tok_path, monkeypatch):
    docs = [f"{DOCS[i % len(DOCS)]} #{i}" for i in range(300)]
    src = write_jsonl(tmp_path / "a.jsonl", docs)
    monkeypatch.setattr(prep, "BATCH_PIECES", 16)  # many batches in flight
    results = {}
    for workers in (0, 1, 2):
        out = tmp_path / f"out{workers}"
        m = prepare([src], tok_path, out, workers=workers, quiet=True, shard_tokens=500)
        assert m.throughput["workers"] == workers
        results[workers] = {k: v for k, v in snapshot(out).items() if k != "manifest.json"}
    assert len(results[0]) > 4
    assert results[0] == results[1] == results[2]
    assert decode_all(tok_path, tmp_path / "out2", m) == docs


def test_out_is_written_whole_and_may_hold_nothing_else(corpus, tokenizer_dir, tmp_path):
    """prepare replaces its output directory whole (a new one beside it, renamed into place), so a file it did
    not write in there is refused, named, before any work, and stays as it was."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "raw.txt").write_text("my only copy")
    with pytest.raises(UserError) as e:
        prepare([corpus], tokenizer_dir, out, workers=0, quiet=True)
    assert str(e.value) == (f"{out}: holds raw.txt, which nanolm prepare did not write, and prepared data replaces "
                            f"the whole directory; move it out of {out}, or choose another --out")
    assert [p.name for p in out.iterdir()] == ["raw.txt"] and (out / "raw.txt").read_text() == "my only copy"
    (out / "raw.txt").unlink()
    prepare([corpus], tokenizer_dir, out, workers=0, quiet=True)
    first = {p.name for p in out.iterdir()}
    assert "manifest.json" in first and [p.name for p in tmp_path.iterdir()] == ["out"]
    prepare([corpus], tokenizer_dir, out, workers=0, quiet=True, val_fraction=0.2)  # prepared data: replaced
    assert {p.name for p in out.iterdir()} == first and [p.name for p in tmp_path.iterdir()] == ["out"]
