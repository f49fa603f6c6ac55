"""Preference (DPO) data from file to batches: the reader and its messages, final-reply masks, pairs kept
together through truncation, the val split and shards, paired batch rows, the idioms preference set, and a
few DPO steps of a tiny model on prepared pairs."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch

import nanolm.data.kinds.pairs as pairs_kind
import nanolm.data.prepare as prep
from nanolm.chat import fit_pair, render_chat
from nanolm.config import ModelConfig
from nanolm.corpora import fetch
from nanolm.data.formats import iter_conversations, iter_preferences
from nanolm.data.jsonl import ReadStats
from nanolm.data.kinds import iter_texts
from nanolm.data.loader import Loader, iter_eval_batches, unit_kind
from nanolm.data.builtin.preferences import build_idiom_preferences
from nanolm.data.prepare import prepare
from nanolm.data.shards import Manifest, PackedData
from nanolm.errors import UserError
from nanolm.model.transformer import Transformer
from nanolm.tokenizer import Tokenizer
from nanolm.train.losses import dpo_loss, split_pairs
from nanolm.train.objectives import token_logps

from chat_helpers import (END, HINT, a, assert_two_ranks_continue, read_masked_docs, s, u, write_jsonl,
                          write_masked_data)


# (chosen, rejected): one turn, with a system prompt, several turns (the earlier reply is context).
PAIRS = [
    ([u("你好，请介绍一下长江。"), a("长江是中国最长的河流，滚滚长江东逝水。")],
     [u("你好，请介绍一下长江。"), a("不知道。")]),
    ([s("You are a helpful assistant."), u("To be, or not to be?"), a("That is the question.")],
     [s("You are a helpful assistant."), u("To be, or not to be?"), a("Whatever you like, really.")]),
    ([u("写一句诗。"), a("白发渔樵江渚上，惯看秋月春风。"), u("再来一句"), a("一壶浊酒喜相逢。")],
     [u("写一句诗。"), a("白发渔樵江渚上，惯看秋月春风。"), u("再来一句"), a("不写了。")]),
    ([u("Who wrote Hamlet?"), a("Shakespeare, around 1600.")],
     [u("Who wrote Hamlet?"), a("All the world's a stage.")]),
]


# --- reader -----------------------------------------------------------------------------------------


def test_both_formats_read_as_the_same_pairs(tmp_path):
    p = write_jsonl(tmp_path / "p.jsonl", [
        {"chosen": PAIRS[0][0], "rejected": PAIRS[0][1], "id": 7},  # MiniMind: two whole conversations
        {"prompt": [s("You are a helpful assistant."), u("To be, or not to be?")],  # TRL, prompt as messages
         "chosen": [a("That is the question.")], "rejected": "Whatever you like, really."},
        {"prompt": PAIRS[2][0][:3], "chosen": "一壶浊酒喜相逢。", "rejected": "不写了。"},
        {"prompt": "Who wrote Hamlet?", "chosen": "Shakespeare, around 1600.",  # TRL, prompt as a string
         "rejected": [{"role": "assistant", "content": "All the world's a stage.", "extra": 1}]},
    ])
    assert list(iter_preferences(p)) == PAIRS
    # Tokenizer training reads every message once: the chosen conversation, then the rejected reply.
    texts = list(iter_texts([p], format="pairs"))
    assert texts[:3] == ["你好，请介绍一下长江。", "长江是中国最长的河流，滚滚长江东逝水。", "不知道。"]
    assert len(texts) == sum(len(c) + 1 for c, _ in PAIRS)


GOOD = {"chosen": [u("q"), a("yes")], "rejected": [u("q"), a("no")]}
BAD_PAIRS = [
    (["x"], 'expected a JSON object like {"chosen": [messages], "rejected": [messages]} or {"prompt": "..." or '
            '[messages], "chosen": "...", "rejected": "..."}, got an array'),
    ({"chosen": [u("q"), a("y")]}, 'no "rejected" field (keys: chosen); expected {"chosen": [messages], '
                                   '"rejected": [messages]} or {"prompt": "..." or [messages], "chosen": "...", '
                                   '"rejected": "..."}'),
    ({"conversations": [u("q"), a("y")]}, 'no "chosen" field (keys: conversations); expected {"chosen": '
                                          '[messages], "rejected": [messages]} or {"prompt": "..." or [messages], '
                                          '"chosen": "...", "rejected": "..."}'),
    ({"chosen": "yes", "rejected": "no"}, '"chosen" is a string but there is no "prompt"; give a "prompt", or make '
                                          '"chosen" and "rejected" whole conversations (arrays of messages)'),
    ({"chosen": {"role": "user"}, "rejected": [u("q"), a("n")]},
     '"chosen" must be an array of {"role": ..., "content": ...} objects, got an object'),
    ({"chosen": [u("q"), a("y")], "rejected": []},
     '"rejected" is empty; a conversation needs a user turn and an assistant reply'),
    ({"chosen": [u("q"), a("")], "rejected": [u("q"), a("n")]}, '"chosen"[1].content is empty'),
    ({"chosen": [u("q"), a("y")], "rejected": [u("q"), {"role": "bot", "content": "n"}]},
     '"rejected"[1] has unknown role "bot"; allowed roles: system, user, assistant, tool'),
    ({"chosen": [u("q"), a("y"), u("more?")], "rejected": [u("q"), a("n")]},
     '"chosen" ends with a user turn; a conversation must end with an assistant reply (drop the unanswered turn)'),
    ({"chosen": [u("q")], "rejected": [u("q"), a("n")]}, '"chosen" has no assistant turn, so nothing to train on'),
    ({"chosen": [u("q"), a("y<|im_end|>")], "rejected": [u("q"), a("n")]},
     '"chosen"[1].content contains the control token <|im_end|>, which would change the conversation\'s turns'),
    ({"chosen": [u("q"), a("y")], "rejected": [u("other q"), a("n")]},
     '"chosen" and "rejected" differ at message 0, before their final reply; a pair must share every turn but '
     'the last assistant reply (the prompt)'),
    ({"chosen": [u("q"), a("y"), u("q2"), a("y2")], "rejected": [u("q"), a("n")]},
     '"chosen" and "rejected" differ at message 1, before their final reply; a pair must share every turn but '
     'the last assistant reply (the prompt)'),
    ({"chosen": [u("q"), a("same")], "rejected": [u("q"), a("same")]},
     '"chosen" and "rejected" have the same final reply, so there is nothing to prefer'),
    ({"prompt": "q", "chosen": "same", "rejected": "same"},
     '"chosen" and "rejected" have the same final reply, so there is nothing to prefer'),
    ({"prompt": 3, "chosen": "y", "rejected": "n"}, '"prompt" must be a string or an array of messages, got a number'),
    ({"prompt": [], "chosen": "y", "rejected": "n"}, '"prompt" must be a string or an array of messages, got empty'),
    ({"prompt": "  ", "chosen": "y", "rejected": "n"}, '"prompt" is empty (only whitespace)'),
    ({"prompt": "q", "chosen": "", "rejected": "n"}, '"chosen" is empty'),
    ({"prompt": "q", "chosen": "y", "rejected": None}, '"rejected" must be the reply: a string or an array of '
                                                       'messages, got null'),
    ({"prompt": [u("q"), a("earlier")], "chosen": "y", "rejected": "n"},
     '"chosen" is assistant after assistant; user and assistant turns must alternate'),
    ({"prompt": [a("hi"), u("q")], "chosen": "y", "rejected": "n"},
     '"prompt"[0] is assistant, but the first turn (after an optional system message) must be user'),
    ({"prompt": "q", "chosen": [a("y"), s("late")], "rejected": "n"},
     '"chosen"[1] is a system message, but a system message may only come first'),
    ('{"chosen": [', "invalid JSON (Expecting value at column 13)"),
]


@pytest.mark.parametrize("record, problem", BAD_PAIRS, ids=[str(i) for i in range(len(BAD_PAIRS))])
def test_malformed_pair_names_file_line_and_fix(tmp_path, record, problem):
    bad = record if isinstance(record, str) else json.dumps(record)
    p = tmp_path / "bad.jsonl"
    p.write_text(f"{json.dumps(GOOD)}\n\n{bad}\n{json.dumps(GOOD)}\n", encoding="utf-8")  # the bad one: line 3
    with pytest.raises(UserError) as e:
        list(iter_preferences(p))
    assert str(e.value) == f"{p}:3: {problem}{HINT}"
    stats = ReadStats()
    assert list(iter_preferences(p, skip_bad=True, stats=stats)) == [(GOOD["chosen"], GOOD["rejected"])] * 2
    assert (stats.bad_lines, stats.examples) == (1, [f"{p}:3: {problem}"])


def test_preference_data_must_be_jsonl(tmp_path, tokenizer_dir):
    p = tmp_path / "pairs.txt"
    p.write_text("chosen: yes\n")
    with pytest.raises(UserError, match=r"pairs\.txt: preference data must be a \.jsonl file .*not '\.txt'"):
        list(iter_preferences(p))
    with pytest.raises(UserError, match=r"pairs\.txt: preference data must be \.jsonl \(one pair per line\); leave "
                                        r"this file out, or prepare it with --format text"):
        prepare([p], tokenizer_dir, tmp_path / "o", format="pairs")


# --- prepare: final-reply masks, pairs kept together -----------------------------------------------------


@pytest.fixture(scope="module")
def tok(tokenizer_dir) -> Tokenizer:
    return Tokenizer.load(tokenizer_dir)


def runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) of each run of ones."""
    edges = np.diff(np.r_[0, mask.astype(np.int8), 0])
    return list(zip(np.flatnonzero(edges == 1).tolist(), np.flatnonzero(edges == -1).tolist()))


def test_each_pair_is_two_documents_masked_on_the_final_reply_only(tmp_path, tok, tokenizer_dir):
    src = write_jsonl(tmp_path / "p.jsonl", [{"chosen": c, "rejected": r} for c, r in PAIRS])
    out = tmp_path / "out"
    m = prepare([src], tokenizer_dir, out, format="pairs", val_fraction=0, workers=0, quiet=True)
    (docs,) = read_masked_docs(out, m)
    assert len(docs) == 2 * len(PAIRS)
    for i, (chosen, rejected) in enumerate(PAIRS):
        for conv, (ids, mask) in ((chosen, docs[2 * i]), (rejected, docs[2 * i + 1])):
            assert ids.tolist() == tok.encode(render_chat(conv)) + [tok.eot_id]
            # One run of ones: the final reply and its <|im_end|>; earlier replies (pair 2) are context.
            assert [tok.decode(ids[x:y]) for x, y in runs(mask)] == [conv[-1]["content"] + END]
            assert mask[-2:].tolist() == [0, 0]
    n_trainable = sum(int(mk.sum()) for _, mk in docs)
    assert m.options == {"format": "pairs", "max_tokens": 1024, "val_fraction": 0, "skip_bad": False,
                         "shard_tokens": 100_000_000}
    assert m.kind == "pairs" and m.section == {"template": "qwen3", "mask": "final reply", "max_tokens": 1024,
                                               "n_pairs": 4, "n_trainable": n_trainable, "truncated": 0,
                                               "skipped_too_long": 0}
    assert m.splits["train"]["n_pairs"] == 4 and m.totals["n_docs"] == 8
    on_disk = json.loads((out / "manifest.json").read_text())
    assert on_disk["options"]["format"] == "pairs" and on_disk["pairs"] == m.section and "dpo" not in on_disk
    assert PackedData(out).kind == "pairs"


def test_data_prepared_as_dpo_loads_as_pairs(tmp_path, tokenizer_dir, capsys):
    """`--format dpo` is the old name of pairs; a directory prepared before the rename (options.format and its
    section "dpo") reads as pairs, and a re-run on it with either name finds it up to date."""
    src = write_jsonl(tmp_path / "p.jsonl", [{"chosen": c, "rejected": r} for c, r in PAIRS])
    out = tmp_path / "out"
    m = prepare([src], tokenizer_dir, out, format="dpo", val_fraction=0, workers=0, quiet=True)
    assert m.kind == "pairs" and m.options["format"] == "pairs"
    old = json.loads((out / "manifest.json").read_text())  # rewritten as nanolm wrote it before the rename
    old["options"]["format"] = "dpo"
    old["dpo"] = old.pop("pairs")
    (out / "manifest.json").write_text(json.dumps(old, indent=2))
    read = Manifest.read(out)
    assert read.kind == "pairs" and read.options == m.options and read.section == m.section
    assert read.splits == m.splits and read.to_dict()["pairs"] == old["dpo"]
    data = PackedData(out)
    assert data.kind == "pairs" and data.manifest.section["n_pairs"] == len(PAIRS)
    batch = Loader(data, batch_size=2, seq_len=127).next_batch()
    assert batch.pairs and batch.x.shape[0] == 4
    capsys.readouterr()
    for name in ("dpo", "pairs"):
        again = prepare([src], tokenizer_dir, out, format=name, val_fraction=0, workers=0)
        assert "nothing to do" in capsys.readouterr().err and again == read


def test_val_split_and_shards_keep_pairs_together(tmp_path, tok, tokenizer_dir, capsys):
    pairs = PAIRS * 3  # 12 pairs: with val_fraction 0.25 (every 4th), pairs 1, 5 and 9 are validation
    src = write_jsonl(tmp_path / "p.jsonl", [{"chosen": c, "rejected": r} for c, r in pairs])
    out = tmp_path / "out"
    # shard_tokens=1: every shard closes at the first point it may, which is after a pair's rejected conversation.
    m = prepare([src], tokenizer_dir, out, format="pairs", val_fraction=0.25, shard_tokens=1, workers=0)
    err = capsys.readouterr().err
    assert "prepared 12 preference pairs" in err and "trainable (final reply) tokens" in err
    assert m.split_policy["rule"] == "pair i goes to val when val_every > 0 and i % val_every == 1"
    for split, want in (("train", [0, 2, 3, 4, 6, 7, 8, 10, 11]), ("val", [1, 5, 9])):
        shards = read_masked_docs(out, m, split)
        assert [len(docs) for docs in shards] == [2] * len(want)  # one pair per shard, never split
        assert m.splits[split]["n_pairs"] == len(want)
        for docs, i in zip(shards, want):
            assert [tok.decode(ids[:-1]) for ids, _ in docs] == [render_chat(conv) for conv in pairs[i]]
    data = PackedData(out, "val")
    assert data.n_docs == 6 and len(data.shards) == 3


def test_prepare_truncates_both_conversations_alike_and_counts(tmp_path, tok, tokenizer_dir):
    history = [u("To be, or not to be?"), a("That is the question."), u("And then?"), a("Whether tis nobler.")]
    long_reply = "话说天下大势，分久必合，合久必分。" * 4
    pairs = [
        ([u("hi"), a("hello")], [u("hi"), a("go")]),  # fits
        ([s("sys"), *history, u("last one"), a("the end")], [s("sys"), *history, u("last one"), a(long_reply)]),
        ([u("q"), a(long_reply)], [u("q"), a("short")]),  # the chosen reply is cut, the rejected one is whole
        ([u(long_reply), a("x")], [u(long_reply), a("y")]),  # the prompt alone is too long: skipped
    ]
    kept_prompt = [s("sys"), u("last one")]
    max_tokens = len(tok.encode(render_chat([*kept_prompt, a("the end")]))) + 2
    assert len(tok.encode(render_chat(pairs[0][0]))) <= max_tokens
    src = write_jsonl(tmp_path / "p.jsonl", [{"chosen": c, "rejected": r} for c, r in pairs])
    m = prepare([src], tokenizer_dir, tmp_path / "out", format="pairs", max_tokens=max_tokens, val_fraction=0,
                workers=0, quiet=True)
    assert (m.section["truncated"], m.section["skipped_too_long"], m.section["n_pairs"]) == (2, 1, 3)
    (docs,) = read_masked_docs(tmp_path / "out", m)
    assert len(docs) == 6 and all(len(ids) - 1 <= max_tokens for ids, _ in docs)
    # Pair 1: the rejected reply is long, so both drop all the history (the chosen one would have fit with
    # part of it) and keep one prompt; the long reply is cut at the end, without <|im_end|>.
    assert docs[2][0].tolist() == tok.encode(render_chat([*kept_prompt, a("the end")])) + [0]
    ids, mask = docs[3]
    prompt_text = render_chat(kept_prompt, add_generation_prompt=True)
    assert tok.decode(ids[:-1]).startswith(prompt_text + "话说天下") and len(ids) == max_tokens + 1
    assert ids[-2] != tok.im_end_id and mask[-2] == 1
    assert docs[5][0].tolist() == tok.encode(render_chat(pairs[2][1])) + [0]
    with pytest.raises(UserError, match=r"no preference pairs in .*p\.jsonl \(0 bad line\(s\) skipped, 4 with a "
                                        r"conversation longer than max_tokens=5\); check the files, or raise "
                                        r"--max-tokens"):
        prepare([src], tokenizer_dir, tmp_path / "o2", format="pairs", max_tokens=5, quiet=True)


@pytest.mark.slow
def test_pair_worker_processes_write_the_same_bytes(tmp_path, tokenizer_dir, monkeypatch):
    src = write_jsonl(tmp_path / "p.jsonl", [{"chosen": c, "rejected": r} for c, r in PAIRS * 15])
    monkeypatch.setattr(prep, "BATCH_PIECES", 7)  # many batches in flight
    got = {}
    for workers in (0, 2):
        out = tmp_path / f"o{workers}"
        prepare([src], tokenizer_dir, out, format="pairs", max_tokens=40, workers=workers, val_fraction=0.2,
                shard_tokens=300, quiet=True)
        got[workers] = {p.name: p.read_bytes() for p in out.iterdir() if p.name != "manifest.json"}
    assert len(got[0]) > 6 and got[0] == got[2]


# Synthetic ChatML ids: <|im_start|> 1, <|im_end|> 2, "\n" 3, roles system 10 / user 11 / assistant 12.
ROLE = {"system": 10, "user": 11, "assistant": 12}


def conv_ids(*turns: tuple[str, int, int]) -> tuple[np.ndarray, np.ndarray]:
    """(role, content length, content token) -> ids and final-reply mask of the rendered conversation."""
    ids, mask = [], []
    for k, (role, n, tokv) in enumerate(turns):
        ids += [1, ROLE[role], 3] + [tokv] * n + [2, 3]
        mask += [0, 0, 0] + [int(k == len(turns) - 1)] * (n + 1) + [0]
    return np.array(ids), np.array(mask, dtype=np.uint8)


def test_fit_pair_drops_the_same_turns_from_both():
    prompt = [("system", 2, 100), ("user", 3, 101), ("assistant", 4, 102), ("user", 3, 103)]
    chosen = conv_ids(*prompt, ("assistant", 2, 104))  # 7 + 8 + 9 + 8 + 7 = 39 tokens
    rejected = conv_ids(*prompt, ("assistant", 12, 105))  # 49 tokens
    assert fit_pair(chosen, rejected, 49)[0][0] is chosen[0]  # both fit: unchanged
    # At 40 the chosen one fits whole, but the rejected one must drop the first pair, so both do.
    (c_ids, c_mask), (r_ids, r_mask) = fit_pair(chosen, rejected, 40)
    assert c_ids.tolist() == conv_ids(("system", 2, 100), ("user", 3, 103), ("assistant", 2, 104))[0].tolist()
    assert r_ids.tolist() == conv_ids(("system", 2, 100), ("user", 3, 103), ("assistant", 12, 105))[0].tolist()
    assert c_mask.tolist() == [0] * 18 + [1] * 3 + [0] and int(r_mask.sum()) == 13
    # At 20 the rejected reply is cut to 2 tokens, no <|im_end|>; at 18 no reply token is left: None.
    (c_ids, _), (r_ids, r_mask) = fit_pair(chosen, rejected, 20)
    assert len(c_ids) == 20 and r_ids.tolist()[-3:] == [3, 105, 105] and r_mask.tolist() == [0] * 18 + [1, 1]
    assert fit_pair(chosen, rejected, 18) is None


# --- loader ---------------------------------------------------------------------------------------------


def make_dpo_data(root: Path, splits: dict[str, list[tuple[tuple, tuple]]]) -> Path:
    """A preference data directory from ((ids, mask), (ids, mask)) per pair; one shard per split."""
    return write_masked_data(root, {split: [c for pair in pairs for c in pair] for split, pairs in splits.items()},
                             "pairs", {split: {"n_pairs": len(pairs)} for split, pairs in splits.items()})


def synthetic_pairs(n: int, seed: int = 0) -> list[tuple[tuple, tuple]]:
    """Pairs of 11 to 56 tokens a conversation; pair p's prompt tokens are 1000 + p, its chosen reply's
    2000 + p and its rejected reply's 3000 + p, so a row says which pair and side it holds."""
    rng = np.random.default_rng(seed)
    out = []
    for p in range(n):
        prompt = [("system", int(rng.integers(1, 5)), 1000 + p)] if p % 3 == 0 else []
        for _ in range(int(rng.integers(0, 2))):
            prompt += [("user", int(rng.integers(1, 6)), 1000 + p), ("assistant", int(rng.integers(1, 6)), 1000 + p)]
        prompt.append(("user", int(rng.integers(1, 6)), 1000 + p))
        out.append((conv_ids(*prompt, ("assistant", int(rng.integers(1, 15)), 2000 + p)),
                    conv_ids(*prompt, ("assistant", int(rng.integers(1, 15)), 3000 + p))))
    return out


PAIRS_SYN = synthetic_pairs(40)
SEQ = 63


@pytest.fixture
def dpo(tmp_path) -> PackedData:
    return PackedData(make_dpo_data(tmp_path / "dpo", {"train": PAIRS_SYN, "val": PAIRS_SYN[:7]}))


def row_pairs(batch) -> list[int]:
    """The pair id of each (chosen, rejected) row pair, checking the rows against the pair's tokens."""
    B, T = batch.x.shape
    assert batch.pairs and B % 2 == 0 and batch.pos is None and batch.seg is None
    assert batch.y.shape == (B, T) and batch.x.dtype == batch.y.dtype == torch.int64
    assert T % pairs_kind.PAD_MULTIPLE == 0 or T == SEQ
    out = []
    for i in range(B // 2):
        p = int(batch.x[2 * i][batch.x[2 * i] >= 1000][0]) % 1000
        for side in range(2):
            ids, mask = PAIRS_SYN[p][side]
            row_x, row_y = batch.x[2 * i + side].tolist(), batch.y[2 * i + side].tolist()
            n = len(ids)
            assert row_x == (ids.tolist() + [0] * (T + 1 - n))[:T]  # from position 0, padded with 0 at the end
            assert row_y == np.where(mask[1:] == 1, ids[1:], -1).tolist() + [-1] * (T - n + 1)
            assert {t // 1000 for t in row_y if t >= 1000} == {2 + side}  # targets: that side's reply
        out.append(p)
    return out


def pair_stream(loader: Loader, steps: int) -> list[int]:
    return [p for _ in range(steps) for p in row_pairs(loader.next_batch())]


def test_rows_come_in_chosen_rejected_pairs_padded_to_the_longest(dpo):
    loader = Loader(dpo, batch_size=4, seq_len=SEQ, seed=0)
    assert loader.epoch_windows == 40
    for _ in range(3):
        batch = loader.next_batch()
        assert batch.x.shape[0] == 8
        pairs = row_pairs(batch)
        longest = max(len(PAIRS_SYN[p][side][0]) for p in pairs for side in range(2)) - 1
        assert batch.x.shape[1] == min(SEQ, -(-longest // pairs_kind.PAD_MULTIPLE) * pairs_kind.PAD_MULTIPLE)
    moved = batch.to("cpu")
    assert moved.pairs and torch.equal(moved.x, batch.x) and torch.equal(moved.y, batch.y)


def test_an_epoch_holds_every_pair_once_seeded_and_by_length(dpo):
    loader = Loader(dpo, batch_size=1, seq_len=SEQ, seed=3)
    epoch0 = pair_stream(loader, 40)
    assert loader.state_dict() == {"epoch": 1, "cursor": 0, "seed": 3, "seq_len": SEQ, "n_pairs": 40}
    epoch1 = pair_stream(loader, 40)
    assert sorted(epoch0) == sorted(epoch1) == list(range(40)) and epoch0 != epoch1
    # The order is the seeded shuffle, sorted by the longer conversation (40 < LENGTH_CHUNK: one run).
    longest = [max(len(c[0]) for c in PAIRS_SYN[p]) for p in epoch0]
    assert longest == sorted(longest)
    perm = np.random.default_rng([3, 0]).permutation(40)
    assert epoch0 == sorted(perm.tolist(), key=lambda p: max(len(c[0]) for c in PAIRS_SYN[p]))
    assert pair_stream(Loader(dpo, batch_size=1, seq_len=SEQ, seed=3), 40) == epoch0
    assert pair_stream(Loader(dpo, batch_size=1, seq_len=SEQ, seed=4), 40) != epoch0
    # The batch size does not change the stream; a batch straddles epochs without repeats.
    assert pair_stream(Loader(dpo, batch_size=30, seq_len=SEQ, seed=3), 2) == epoch0 + epoch1[:20]


def test_ranks_split_the_pair_stream_and_resume_exactly(dpo):
    ref, state = assert_two_ranks_continue(dpo, pair_stream, SEQ)
    with pytest.raises(UserError, match=r"saved data position is for 39 preference pairs at seq_len 63, but .* has "
                                        r"40 pairs at seq_len 63; resume with the same prepared data"):
        ref.load_state_dict({**state, "n_pairs": 39})
    with pytest.raises(UserError, match=r"40 preference pairs, but a step takes batch_size x world_size = 42 pairs"):
        Loader(dpo, batch_size=21, seq_len=SEQ, world_size=2)


def test_padding_fraction_is_reported_and_true(dpo):
    loader = Loader(dpo, batch_size=4, seq_len=SEQ, seed=1)
    real = total = 0
    for _ in range(10):  # one epoch
        batch = loader.next_batch()
        total += batch.x.numel()
        real += sum(len(PAIRS_SYN[p][side][0]) - 1 for p in row_pairs(batch) for side in range(2))
    n_real = sum(len(c[0]) - 1 for pair in PAIRS_SYN for c in pair)
    assert real == n_real == loader.tokens_per_epoch
    assert loader.describe() == (f"40 preference pairs ({n_real:,} tokens to predict), 4 a batch as 8 rows padded "
                                 "to the "
                                 f"longest (a multiple of {pairs_kind.PAD_MULTIPLE}, at most seq_len {SEQ}): "
                                 f"{100 * (1 - real / total):.1f}% of positions are padding")


def test_long_pairs_are_cut_to_the_block_or_left_out(tmp_path):
    prompt = [("user", 5, 1040)]
    long_reply = (conv_ids(*prompt, ("assistant", 70, 2040)), conv_ids(*prompt, ("assistant", 3, 3040)))
    long_prompt = (conv_ids(("user", 70, 1041), ("assistant", 2, 2041)),
                   conv_ids(("user", 70, 1041), ("assistant", 3, 3041)))
    data = PackedData(make_dpo_data(tmp_path / "d", {"train": PAIRS_SYN[:10] + [long_reply, long_prompt]}))
    loader = Loader(data, batch_size=11, seq_len=SEQ)
    assert loader.describe().endswith("; 1 with a conversation longer than 64 tokens cut to fit, 1 left out (no "
                                      "reply token would fit)")
    batch = loader.next_batch()
    assert batch.x.shape == (22, SEQ)  # the cut conversation fills seq_len + 1
    i = [int(batch.x[2 * k][batch.x[2 * k] >= 1000][0]) for k in range(11)].index(1040)
    cut = fit_pair(*long_reply, 64)[0]
    assert batch.x[2 * i].tolist() == cut[0][:-1].tolist() and batch.y[2 * i, -1] == 2040
    with pytest.raises(UserError, match=r"none of its 1 preference pairs fits in seq_len\+1 = 64 tokens"):
        Loader(PackedData(make_dpo_data(tmp_path / "e", {"train": [long_prompt]})), batch_size=1, seq_len=SEQ)


def test_eval_batches_are_the_pairs_in_file_order(dpo):
    val = PackedData(dpo.data_dir, "val")
    batches = list(iter_eval_batches(val, batch_size=3, seq_len=SEQ))
    assert [row_pairs(b) for b in batches] == [[0, 1, 2], [3, 4, 5], [6]]
    again = list(iter_eval_batches(val, batch_size=3, seq_len=SEQ, max_batches=1))
    assert len(again) == 1 and torch.equal(again[0].x, batches[0].x)


def test_damaged_preference_data_is_named(tmp_path):
    root = make_dpo_data(tmp_path / "d", {"train": PAIRS_SYN[:3]})
    # Pair 2's chosen and rejected conversations merged into one document: 5 documents, not 3 pairs.
    m = json.loads((root / "manifest.json").read_text())
    m["splits"]["train"]["shards"][0]["n_docs"] = 5
    (root / "manifest.json").write_text(json.dumps(m))
    offsets = np.fromfile(root / "train-00000.idx", dtype=np.uint64)
    np.r_[offsets[:5], offsets[-1]].astype(np.uint64).tofile(root / "train-00000.idx")
    with pytest.raises(UserError, match=r"preference shard train-00000\.bin holds 5 conversations, not whole pairs"):
        unit_kind(PackedData(root), SEQ)  # the pairs kind's check, as the loader opens the split


def test_prepared_pairs_batch_into_their_final_replies(tmp_path, tok, tokenizer_dir):
    src = write_jsonl(tmp_path / "p.jsonl", [{"chosen": c, "rejected": r} for c, r in PAIRS])
    prepare([src], tokenizer_dir, tmp_path / "out", format="pairs", val_fraction=0, workers=0, quiet=True)
    batch = Loader(PackedData(tmp_path / "out"), batch_size=4, seq_len=127).next_batch()
    got = set()
    for r in range(0, 8, 2):
        texts = [tok.decode(batch.y[r + j][batch.y[r + j] >= 0].tolist()) for j in range(2)]
        got.add(tuple(texts))
        # The two rows share the prompt: the same inputs up to the final reply.
        prompt = tok.decode(batch.x[r].tolist()).split("<|im_start|>assistant\n")[:-1]
        assert tok.decode(batch.x[r + 1].tolist()).split("<|im_start|>assistant\n")[:-1] == prompt
    assert got == {(c[-1]["content"] + END, r[-1]["content"] + END) for c, r in PAIRS}


# --- the idioms preference set --------------------------------------------------------------------------

FAKE_IDIOMS = [
    [u("「一帆风顺」是什么意思？"), a("「一帆风顺」：船挂着满帆顺风行驶。")],
    [u("「守株待兔」是什么意思？"), a("「守株待兔」：死守狭隘经验。")],
    [u("「画蛇添足」是什么意思？"), a("「画蛇添足」：做了多余的事。")],
    [u("成语「卧薪尝胆」的出处是什么？"), a("出处：《史记》。")],
    [u("成语「破釜沉舟」的出处是什么？"), a("出处：《史记·项羽本纪》。")],
    [u("用「胸有成竹」造个句子。"), a("例句：他胸有成竹。")],  # the only one of its kind
]


def test_idiom_preferences_pair_each_question_with_another_idioms_answer(tmp_path):
    src = write_jsonl(tmp_path / "idioms.jsonl", [{"conversations": c} for c in FAKE_IDIOMS])
    out = build_idiom_preferences(src, tmp_path / "prefs" / "idiom_prefs.jsonl", n=6, seed=0)
    assert out == tmp_path / "prefs" / "idiom_prefs.jsonl"
    pairs = list(iter_preferences(out))
    assert [c for c, _ in pairs] == FAKE_IDIOMS  # every question once, in file order, with its own answer
    answers = [c[-1]["content"] for c in FAKE_IDIOMS]
    for k, (chosen, rejected) in enumerate(pairs):
        assert rejected[:-1] == chosen[:-1] and rejected[-1]["content"] in answers
        j = answers.index(rejected[-1]["content"])
        assert j != k
        if k < 3:
            assert j < 3  # a meaning question gets another idiom's meaning
        elif k < 5:
            assert j in (3, 4)  # a source question another source
    assert out.read_bytes() == build_idiom_preferences(src, tmp_path / "again.jsonl", n=6, seed=0).read_bytes()
    some = list(iter_preferences(build_idiom_preferences(src, tmp_path / "two.jsonl", n=2, seed=5)))
    assert len(some) == 2 and all(c in FAKE_IDIOMS for c, _ in some)
    with pytest.raises(UserError, match=r"n=7: must be an integer from 1 to 6, the conversations in .*idioms\.jsonl"):
        build_idiom_preferences(src, tmp_path / "x.jsonl", n=7, seed=0)


@pytest.mark.slow
def test_idiom_preferences_from_the_real_corpus(tmp_path, monkeypatch, tokenizer_dir):
    monkeypatch.setenv("NANOLM_CACHE", str(tmp_path / "cache"))
    idioms = fetch("idioms", quiet=True)
    out = build_idiom_preferences(idioms, tmp_path / "prefs.jsonl", n=300, seed=0)
    convs = list(iter_conversations(idioms))
    real = {json.dumps(c, ensure_ascii=False) for c in convs}
    asked: dict[str, list[str]] = {}  # answer -> the questions it answers (a few idioms share one)
    for question, answer in convs:
        asked.setdefault(answer["content"], []).append(question["content"])
    word = lambda question: question.split("「")[1].split("」")[0]  # noqa: E731
    pairs = list(iter_preferences(out))
    assert len(pairs) == 300
    for chosen, rejected in pairs:
        assert json.dumps(chosen, ensure_ascii=False) in real  # a real question and its real answer
        question, reply = chosen[0]["content"], rejected[1]["content"]
        assert reply != chosen[1]["content"]
        # The rejected reply is the real answer to the same question about another idiom.
        assert any(word(q) != word(question) and q.replace(word(q), word(question)) == question
                   for q in asked[reply])
    # All three kinds of question are there, answered from the dictionary.
    assert {c[1]["content"][:3] for c, _ in pairs} >= {"出处：", "例句："}
    assert any(c[1]["content"].startswith(f"「{word(c[0]['content'])}」（") for c, _ in pairs)
    m = prepare([out], tokenizer_dir, tmp_path / "data", format="pairs", workers=0, quiet=True)
    assert m.section["n_pairs"] == 300 and m.splits["val"]["n_pairs"] == 3


def test_dpo_on_prepared_pairs_padding_changes_nothing_and_the_margin_grows(tmp_path, tokenizer_dir):
    src = write_jsonl(tmp_path / "p.jsonl", [{"chosen": c, "rejected": r} for c, r in PAIRS])
    prepare([src], tokenizer_dir, tmp_path / "out", format="pairs", val_fraction=0, workers=0, quiet=True)
    batch = next(iter_eval_batches(PackedData(tmp_path / "out"), batch_size=4, seq_len=127))
    torch.manual_seed(0)
    policy = Transformer(ModelConfig(vocab_size=400, d_model=32, n_layer=2, n_head=4, n_kv_head=2, max_seq_len=128))
    ref = copy.deepcopy(policy).requires_grad_(False)
    with torch.no_grad():
        ref_logps = token_logps(ref, batch.x, batch.y).sum(dim=1)
        # A row's log-probability is the same alone, without the padding after it.
        for r in range(8):
            n = int((batch.y[r] >= 0).nonzero().max()) + 1
            alone = token_logps(ref, batch.x[r:r + 1, :n], batch.y[r:r + 1, :n]).sum(dim=1)
            torch.testing.assert_close(alone, ref_logps[r:r + 1], rtol=1e-5, atol=1e-5)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=3e-3)
    history = []
    for _ in range(15):
        loss, m = dpo_loss(*split_pairs(token_logps(policy, batch.x, batch.y).sum(dim=1)), *split_pairs(ref_logps),
                           beta=0.1)
        history.append((loss.item(), m["reward_margin"].item(), m["reward_accuracy"].item()))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert history[0][:2] == (pytest.approx(np.log(2), abs=1e-6), 0.0)  # the policy starts as the reference
    assert history[-1][0] < 0.5 * history[0][0] and history[-1][1] > 1.0 and history[-1][2] == 1.0
