"""Chat data from file to batches: readers and their messages, ChatML ids with a loss mask, truncation,
packing conversations into blocks that do not see each other."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import nanolm.data.prepare as prep
from nanolm.chat import QWEN3, Message, encode_chat, fit_conversation, render_chat
from nanolm.data.formats import iter_conversations
from nanolm.data.jsonl import ReadStats
from nanolm.progress import fmt_count
from nanolm.data.kinds.chat import pack_blocks
from nanolm.data.loader import Loader, iter_eval_batches
from nanolm.data.prepare import prepare
from nanolm.data.shards import Manifest, PackedData
from nanolm.errors import UserError
from nanolm.tokenizer import Tokenizer

from chat_helpers import (END, HINT, a, assert_two_ranks_continue, read_masked_docs, s, u, write_jsonl,
                          write_masked_data)


CONVS = [
    [u("你好，请介绍一下长江。"), a("长江是中国最长的河流，滚滚长江东逝水。")],
    [s("You are a helpful assistant."), u("To be, or not to be?"), a("That is the question.")],
    [s("你是一个诗人。"), u("写一句诗。"), a("白发渔樵江渚上，惯看秋月春风。"), u("再来一句"), a("一壶浊酒喜相逢。")],
    [u("Who wrote it?"), a("Shakespeare."), u("When?"), a("Around 1600, in Hamlet."), u("Thanks!"),
     a("You are welcome.")],
    [u("code please"), a("    indented = True\n\n  and more")],  # a reply that starts with whitespace
    [u("blank"), a("\n\nstarts with blank lines")],
]


# --- readers ---------------------------------------------------------------------------


def test_the_three_formats_read_as_the_same_messages(tmp_path):
    p = write_jsonl(tmp_path / "c.jsonl", [
        {"conversations": [u("hi"), {"role": "assistant", "content": "yo", "reasoning_content": "x"}], "id": 1},
        {"messages": [s("sys"), u("hi"), a("yo")]},
        {"instruction": "Translate", "input": "猫", "output": "cat"},
        {"instruction": "Say hi", "input": "", "output": "hi", "system": "be kind"},
        {"instruction": "Say hi", "output": "hi", "system": "", "input": None},
    ])
    assert list(iter_conversations(p)) == [
        [u("hi"), {**a("yo"), "reasoning_content": "x"}],
        [s("sys"), u("hi"), a("yo")],
        [u("Translate\n\n猫"), a("cat")],
        [s("be kind"), u("Say hi"), a("hi")],
        [u("Say hi"), a("hi")],
    ]


MSGS = '"messages"'
BAD_CHAT = [
    (["a"], 'expected a JSON object like {"conversations": [{"role": ..., "content": ...}, ...]}, '
            '{"messages": [...]} or {"instruction": ..., "output": ...}, got an array'),
    ({"text": "hi", "id": 3}, 'no "conversations", "messages" or "instruction"/"output" field (keys: text, id); '
                              'expected {"conversations": [{"role": ..., "content": ...}, ...]}, {"messages": [...]} '
                              'or {"instruction": ..., "output": ...}'),
    ({"messages": "hi"}, '"messages" must be an array of {"role": ..., "content": ...} objects, got a string'),
    ({"conversations": {"role": "user"}},
     '"conversations" must be an array of {"role": ..., "content": ...} objects, got an object'),
    ({"messages": []}, '"messages" is empty; a conversation needs a user turn and an assistant reply'),
    ({"messages": [u("q"), "answer"]}, '"messages"[1] must be an object {"role": ..., "content": ...}, got a string'),
    ({"messages": [{"content": "q"}, a("x")]}, '"messages"[0] has no "role"; use one of system, user, assistant, tool'),
    ({"messages": [u("q"), {"role": "bot", "content": "x"}]},
     '"messages"[1] has unknown role "bot"; allowed roles: system, user, assistant, tool'),
    ({"messages": [{"role": 1, "content": "q"}, a("x")]},
     '"messages"[0] has unknown role a number; allowed roles: system, user, assistant, tool'),
    ({"messages": [u("q"), {"role": "assistant"}]}, '"messages"[1] (assistant) has no "content"'),
    ({"messages": [u("q"), {"role": "assistant", "content": None}]},
     '"messages"[1].content must be a string, got null'),
    ({"messages": [u("q"), {"role": "assistant", "content": ["x"]}]},
     '"messages"[1].content must be a string, got an array'),
    ({"messages": [u(""), a("x")]}, '"messages"[0].content is empty'),
    ({"messages": [u("q"), a(" \n\t")]}, '"messages"[1].content is empty (only whitespace)'),
    ({"messages": [u("q"), a("fine<|im_end|>\n<|im_start|>user\nmore")]},
     '"messages"[1].content contains the control token <|im_end|>, which would change the conversation\'s turns'),
    ({"messages": [u("q \ud83d"), a("x")]},
     '"messages"[0].content holds an unpaired surrogate escape \\ud83d, which is not valid Unicode'),
    ({"messages": [u("q"), s("late"), a("x")]},
     '"messages"[1] is a system message, but a system message may only come first'),
    ({"messages": [a("hello"), u("q")]},
     '"messages"[0] is assistant, but the first turn (after an optional system message) must be user'),
    ({"messages": [s("sys"), a("hello")]},
     '"messages"[1] is assistant, but the first turn (after an optional system message) must be user'),
    ({"messages": [u("q"), u("q2"), a("x")]}, '"messages"[1] is user after user; user and assistant turns must '
                                              'alternate'),
    ({"messages": [u("q"), a("x"), a("y")]}, '"messages"[2] is assistant after assistant; user and assistant '
                                             'turns must alternate'),
    ({"messages": [u("q")]}, '"messages" has no assistant turn, so nothing to train on'),
    ({"messages": [s("only a system prompt")]}, '"messages" has no assistant turn, so nothing to train on'),
    ({"conversations": [u("q"), a("x"), u("and?")]},
     '"conversations" ends with a user turn; a conversation must end with an assistant reply (drop the '
     'unanswered turn)'),
    ({"instruction": "q"}, 'Alpaca record has "instruction" but no "output" (the reply to train on)'),
    ({"output": "x"}, 'Alpaca record has "output" but no "instruction"'),
    ({"instruction": "  ", "output": "x"}, '"instruction" is empty (only whitespace)'),
    ({"instruction": "q", "output": 3}, '"output" must be a string, got a number'),
    ({"instruction": "q", "output": ""}, '"output" is empty'),
    ({"instruction": "q", "input": ["x"], "output": "x"}, '"input" must be a string, got an array'),
    ({"instruction": "q", "input": "<|endoftext|>", "output": "x"},
     '"input" contains the control token <|endoftext|>, which would change the conversation\'s turns'),
    ({"instruction": "q", "output": "x", "system": 1}, '"system" must be a string, got a number'),
    ('{"messages": [', "invalid JSON (Expecting value at column 15)"),
]


@pytest.mark.parametrize("record, problem", BAD_CHAT, ids=[str(i) for i in range(len(BAD_CHAT))])
def test_malformed_conversation_names_file_line_and_fix(tmp_path, record, problem):
    good = json.dumps({"messages": [u("q"), a("x")]})
    bad = record if isinstance(record, str) else json.dumps(record)
    p = tmp_path / "bad.jsonl"
    p.write_text(f"{good}\n\n{bad}\n{good}\n", encoding="utf-8")  # blank line 2: the bad one is line 3
    with pytest.raises(UserError) as e:
        list(iter_conversations(p))
    assert str(e.value) == f"{p}:3: {problem}{HINT}"
    stats = ReadStats()
    assert list(iter_conversations(p, skip_bad=True, stats=stats)) == [[u("q"), a("x")]] * 2
    assert (stats.bad_lines, stats.examples) == (1, [f"{p}:3: {problem}"])


def test_chat_data_must_be_jsonl(tmp_path):
    p = tmp_path / "chat.txt"
    p.write_text("user: hi\n")
    with pytest.raises(UserError, match=r"chat\.txt: chat data must be a \.jsonl file .*not '\.txt'; convert it, "
                                        r"or prepare it with --format text"):
        list(iter_conversations(p))


# --- ChatML ids and loss mask --------------------------------------------------------------


@pytest.fixture(scope="module")
def tok(tokenizer_dir) -> Tokenizer:
    return Tokenizer.load(tokenizer_dir)


def read_docs(out: Path, m: Manifest, split: str = "train") -> list[tuple[np.ndarray, np.ndarray]]:
    """(ids, mask) of each conversation of a split, checking the file layout."""
    return [doc for shard in read_masked_docs(out, m, split) for doc in shard]


def runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) of each run of ones."""
    edges = np.diff(np.r_[0, mask.astype(np.int8), 0])
    return list(zip(np.flatnonzero(edges == 1).tolist(), np.flatnonzero(edges == -1).tolist()))


def test_ids_are_the_rendered_conversation_and_mask_is_exactly_the_replies(tmp_path, tok, tokenizer_dir):
    src = write_jsonl(tmp_path / "chat.jsonl", [{"conversations": c} for c in CONVS])
    out = tmp_path / "out"
    m = prepare([src], tokenizer_dir, out, format="chat", val_fraction=0, workers=0, quiet=True)
    docs = read_docs(out, m)
    assert len(docs) == len(CONVS)
    for conv, (ids, mask) in zip(CONVS, docs):
        assert ids.tolist() == tok.encode(render_chat(conv)) + [tok.eot_id]
        # The runs of ones are exactly the replies with their <|im_end|>: every other token (system and user
        # turns, "<|im_start|>assistant\n<think>\n\n</think>\n\n", the "\n" after <|im_end|>, EOT) is 0. The
        # template drops the newlines a reply starts with.
        replies = [msg["content"].lstrip("\n") + END for msg in conv if msg["role"] == "assistant"]
        texts = [tok.decode(ids[x:y]) for x, y in runs(mask)]
        if conv in CONVS[:4]:
            assert texts == replies
        else:  # a reply opening with whitespace may share a token with the "\n\n" before it
            assert texts in (replies, ["\n" + r for r in replies], ["\n\n" + r for r in replies])
        assert mask[-2:].tolist() == [0, 0]  # the "\n" after the last <|im_end|>, and EOT


def test_reply_token_that_starts_in_the_template_is_a_target(tmp_path):
    from nanolm.tokenizer import train_tokenizer
    code = ["</think>\n\n    return x\n\n\n    pass\n"] * 50  # "\n\n   " becomes a token
    tok = train_tokenizer(code, tmp_path / "tok", vocab_size=300, quiet=True)
    conv = [u("fix it"), a("    return x\n"), u("more"), a("ok")]
    m = prepare([write_jsonl(tmp_path / "c.jsonl", [{"messages": conv}])], tmp_path / "tok", tmp_path / "out",
                format="chat", val_fraction=0, workers=0, quiet=True)
    (ids, mask), = read_docs(tmp_path / "out", m)
    assert ids.tolist() == tok.encode(render_chat(conv)) + [0]
    texts = [tok.decode(ids[x:y]) for x, y in runs(mask)]
    # The reply's first token holds the think block's closing newlines too.
    assert texts[0].endswith("    return x\n" + END) and texts[0].startswith("\n")
    assert texts[1] == "ok" + END


def test_encode_chat_exact_values():
    # Ids: <|im_start|> 1, <|im_end|> 2, <think> 7, </think> 8, "\n" 3, "user" 20, "hi" 21, "assistant" 22,
    # "yo" 23, "\n\n" 24, "\n\n " 25 (3 bytes, from the scaffolding into the reply), " x" 26.
    lengths = np.zeros(30, dtype=np.int64)
    lengths[[1, 2, 7, 8]] = [12, 10, 7, 8]
    lengths[[3, 20, 21, 22, 23, 24, 25, 26]] = [1, 4, 2, 9, 2, 2, 3, 2]
    msgs = [Message("user", "hi"), Message("assistant", "yo")]
    spans = QWEN3.spans(msgs)
    ids = [1, 20, 3, 21, 2, 3, 1, 22, 3, 7, 24, 8, 24, 23, 2, 3]
    assert "".join(s.text for s in spans) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n" \
                                            "\n</think>\n\nyo<|im_end|>\n"
    got_ids, mask = encode_chat(spans, ids, lengths, "tok.json")
    assert got_ids.tolist() == ids
    assert mask.tolist() == [2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 0]  # EXCHANGE on the user turn
    # A token that runs from the scaffolding into the reply is part of the reply.
    spans = QWEN3.spans([Message("user", "hi"), Message("assistant", " x")])
    ids = [1, 20, 3, 21, 2, 3, 1, 22, 3, 7, 24, 8, 25, 23, 2, 3]
    lengths[23] = 1  # "x"
    assert encode_chat(spans, ids, lengths, "t")[1].tolist() == [2] + [0] * 11 + [1, 1, 1, 0]
    with pytest.raises(UserError, match=r"^t: the tokens of a conversation do not spell its text byte for byte"):
        encode_chat(spans, ids[:-1], lengths, "t")


def test_manifest_records_chat_format_mask_and_counts(tmp_path, tokenizer_dir, capsys):
    src = write_jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in CONVS * 2])
    out = tmp_path / "out"
    m = prepare([src], tokenizer_dir, out, format="chat", max_tokens=512, val_fraction=0.25, workers=0)
    err = capsys.readouterr().err
    assert m.options == {"format": "chat", "max_tokens": 512, "val_fraction": 0.25, "skip_bad": False,
                         "shard_tokens": 100_000_000}
    train, val = read_docs(out, m, "train"), read_docs(out, m, "val")
    assert (len(train), len(val)) == (9, 3)  # conversations 1, 5 and 9 are validation
    n_trainable = sum(int(mk.sum()) for _, mk in train + val)
    assert m.kind == "chat" and m.section == {"template": "qwen3", "mask": True, "max_tokens": 512,
                                              "n_trainable": n_trainable, "truncated": 0, "skipped_too_long": 0}
    assert m.splits["train"]["n_trainable"] + m.splits["val"]["n_trainable"] == n_trainable
    assert m.splits["val"]["shards"][0]["mask"] == "val-00000.mask"
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "train-00000.bin", "train-00000.idx",
                                                     "train-00000.mask", "val-00000.bin", "val-00000.idx",
                                                     "val-00000.mask"]
    assert f"prepared 12 conversations, {fmt_count(m.totals['n_tokens'])} tokens" in err
    assert f"trainable (assistant) tokens: {n_trainable} = " in err
    assert PackedData(out).kind == "chat" and not PackedData(out).masks[0].flags.writeable
    # Unchanged inputs: nothing to do. A deleted mask file is noticed. Other max_tokens: work to do.
    assert prepare([src], tokenizer_dir, out, format="chat", max_tokens=512, val_fraction=0.25, workers=0) == m
    assert "nothing to do" in capsys.readouterr().err
    (out / "val-00000.mask").unlink()
    prepare([src], tokenizer_dir, out, format="chat", max_tokens=512, val_fraction=0.25, workers=0, quiet=True)
    assert (out / "val-00000.mask").is_file()
    m2 = prepare([src], tokenizer_dir, out, format="chat", max_tokens=60, val_fraction=0.25, workers=0, quiet=True)
    assert m2.options["max_tokens"] == 60 and m2.section["truncated"] > 0
    # Text data written over it drops the masks and reads as text.
    prepare([write_jsonl(tmp_path / "t.jsonl", [{"text": "hi"}] * 3)], tokenizer_dir, out, workers=0, quiet=True)
    assert not list(out.glob("*.mask")) and PackedData(out).kind == "text"


@pytest.mark.slow
def test_chat_worker_processes_write_the_same_bytes(tmp_path, tokenizer_dir, monkeypatch):
    src = write_jsonl(tmp_path / "chat.jsonl", [{"conversations": c} for c in CONVS * 20])
    monkeypatch.setattr(prep, "BATCH_PIECES", 7)  # many batches in flight
    got = {}
    for workers in (0, 2):
        out = tmp_path / f"o{workers}"
        prepare([src], tokenizer_dir, out, format="chat", max_tokens=40, workers=workers, quiet=True,
                shard_tokens=300)
        got[workers] = {p.name: p.read_bytes() for p in out.iterdir() if p.name != "manifest.json"}
    assert len(got[0]) > 6 and got[0] == got[2]


def test_prepare_chat_argument_errors(tmp_path, tokenizer_dir):
    src = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVS[0]}])
    with pytest.raises(UserError, match=r"format='sft': must be one of text, chat"):
        prepare([src], tokenizer_dir, tmp_path / "o", format="sft")
    with pytest.raises(UserError, match=r"max_tokens=0: must be a positive integer"):
        prepare([src], tokenizer_dir, tmp_path / "o", format="chat", max_tokens=0)
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(UserError, match=r"notes\.txt: chat data must be \.jsonl .*or prepare it with --format text"):
        prepare([src, tmp_path / "notes.txt"], tokenizer_dir, tmp_path / "o", format="chat")
    with pytest.raises(UserError, match=r"no conversations in .*chat\.jsonl \(0 bad line\(s\) skipped, 1 longer "
                                        r"than max_tokens=5\); check the files, or raise --max-tokens"):
        prepare([src], tokenizer_dir, tmp_path / "o", format="chat", max_tokens=5, quiet=True)
    assert not (tmp_path / "o" / "manifest.json").exists()


# --- truncation ------------------------------------------------------------------------------

# Synthetic ChatML ids: <|im_start|> 1, <|im_end|> 2, "\n" 3, roles system 10 / user 11 / assistant 12.
ROLE = {"system": 10, "user": 11, "assistant": 12}


def conv_ids(*turns: tuple[str, int, int]) -> tuple[np.ndarray, np.ndarray]:
    """(role, content length, content token) -> ids and mask of the rendered conversation."""
    ids, mask = [], []
    for role, n, tokv in turns:
        reply = role == "assistant"
        ids += [1, ROLE[role], 3] + [tokv] * n + [2, 3]
        mask += [0, 0, 0] + [int(reply)] * (n + 1) + [0]
    return np.array(ids), np.array(mask, dtype=np.uint8)


def test_fit_conversation_keeps_system_and_drops_oldest_pairs():
    ids, mask = conv_ids(("system", 2, 100), ("user", 3, 101), ("assistant", 4, 102), ("user", 3, 103),
                         ("assistant", 4, 104))  # lengths 7 + 8 + 9 + 8 + 9 = 41
    assert fit_conversation(ids, mask, 41)[0] is ids  # fits: unchanged
    want = conv_ids(("system", 2, 100), ("user", 3, 103), ("assistant", 4, 104))
    for budget in (24, 40):
        got = fit_conversation(ids, mask, budget)
        assert got[0].tolist() == want[0].tolist() and got[1].tolist() == want[1].tolist()
    no_sys = conv_ids(("user", 3, 101), ("assistant", 4, 102), ("user", 3, 103), ("assistant", 4, 104))
    got = fit_conversation(*no_sys, 20)
    assert got[0].tolist() == conv_ids(("user", 3, 103), ("assistant", 4, 104))[0].tolist()


def test_fit_conversation_cuts_the_last_reply_and_never_leaves_it_without_a_target():
    ids, mask = conv_ids(("system", 2, 100), ("user", 3, 101), ("assistant", 4, 102), ("user", 3, 103),
                         ("assistant", 4, 104))
    # system (7) + last user (8) + "<|im_start|>assistant\n" (3) + 2 reply tokens = 20: cut, no <|im_end|>.
    got_ids, got_mask = fit_conversation(ids, mask, 20)
    assert got_ids.tolist() == [1, 10, 3, 100, 100, 2, 3, 1, 11, 3, 103, 103, 103, 2, 3, 1, 12, 3, 104, 104]
    assert got_mask.tolist() == [0] * 18 + [1, 1]
    assert fit_conversation(ids, mask, 19)[1].tolist() == [0] * 18 + [1]  # one target is enough
    assert fit_conversation(ids, mask, 18) is None  # no target would be left: skipped
    # Losing only the final "\n" keeps the reply whole, <|im_end|> included.
    got_ids, got_mask = fit_conversation(ids, mask, 23)
    assert got_ids[-1] == 2 and got_mask[-5:].tolist() == [1] * 5
    assert fit_conversation(*conv_ids(("user", 30, 101), ("assistant", 4, 102)), 35) is None  # the prompt alone


def test_prepare_counts_truncated_and_skipped_conversations(tmp_path, tok, tokenizer_dir):
    long_history = [u("To be, or not to be?"), a("That is the question."), u("And then?"),
                    a("Whether tis nobler in the mind to suffer.")]
    convs = [
        [u("hi"), a("hello")],  # fits
        [s("sys"), *long_history, u("last one"), a("the end")],  # drops the two oldest pairs
        [u("q"), a("话说天下大势，分久必合，合久必分。" * 4)],  # the reply is cut
        [u("话说天下大势，分久必合，合久必分。" * 4), a("x")],  # the prompt alone is too long: skipped
    ]
    kept = [s("sys"), u("last one"), a("the end")]
    max_tokens = len(tok.encode(render_chat(kept))) + 2
    n_tokens = [len(tok.encode(render_chat(c))) for c in convs]
    assert n_tokens[0] <= max_tokens < min(n_tokens[1:])
    assert len(tok.encode(render_chat([s("sys"), *long_history[2:], *kept[1:]]))) > max_tokens
    src = write_jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in convs])
    out = tmp_path / "out"
    m = prepare([src], tokenizer_dir, out, format="chat", max_tokens=max_tokens, val_fraction=0, workers=0,
                quiet=True)
    assert (m.section["truncated"], m.section["skipped_too_long"]) == (2, 1)
    docs = read_docs(out, m)
    assert len(docs) == 3 and all(len(ids) - 1 <= max_tokens for ids, _ in docs)
    assert docs[0][0].tolist() == tok.encode(render_chat(convs[0])) + [0]
    assert docs[1][0].tolist() == tok.encode(render_chat(kept)) + [0]
    ids, mask = docs[2]
    assert len(ids) == max_tokens + 1 and ids[-2] != tok.im_end_id and mask[-2] == 1
    assert tok.decode(ids[:-1]).startswith(render_chat([u("q")]) + "<|im_start|>assistant\n<think>\n\n</think>\n\n话说天下")


# --- packing ---------------------------------------------------------------------------------


def test_pack_blocks_exact():
    order, starts = pack_blocks(np.array([5, 9, 3, 6, 2, 4]), capacity=10)
    blocks = [order[x:y].tolist() for x, y in zip(starts[:-1], starts[1:])]
    # Longest first: 9 | 6 -> new | 5 -> new | 4 -> the 6 (room 4) | 3 -> the 5 | 2 -> the 5 (room 2).
    assert blocks == [[1], [3, 5], [0, 2, 4]]
    order, starts = pack_blocks(np.array([5, 9, 3, 6, 2, 4]), capacity=10, chunk=3)  # chunks 5 9 3 | 6 2 4
    assert [order[x:y].tolist() for x, y in zip(starts[:-1], starts[1:])] == [[1], [0, 2], [3, 5], [4]]
    # Best-fit needs 3 blocks here ([4 4] [3 3 3] [3]); filling each block exactly needs 2, and packs chunk 2 too.
    order, starts = pack_blocks(np.array([4, 3, 3, 3, 3, 4] * 2), capacity=10, chunk=6)
    assert [order[x:y].tolist() for x, y in zip(starts[:-1], starts[1:])] == [[0, 1, 2], [5, 3, 4], [6, 7, 8],
                                                                              [11, 9, 10]]
    with pytest.raises(ValueError, match=r"lengths must be in \[1, 10\]"):
        pack_blocks(np.array([3, 11]), 10)


@pytest.mark.parametrize("capacity, median, sigma", [(513, 128, 0.9), (1025, 256, 0.9), (257, 70, 0.3)])
def test_pack_blocks_fill_on_sft_like_lengths(capacity, median, sigma):
    # Lengths like an SFT set prepared with max_tokens = capacity: most short, a long tail cut at the max;
    # or all alike, 3 or 4 to a block (as the idioms corpus at seq_len 256), where best-fit alone gets 96%.
    lengths = np.clip(np.random.default_rng(0).lognormal(np.log(median), sigma, 10_000).astype(np.int64), 12,
                      capacity)
    order, starts = pack_blocks(lengths, capacity)
    assert sorted(order.tolist()) == list(range(len(lengths)))  # every item exactly once
    assert np.add.reduceat(lengths[order], starts[:-1]).max() <= capacity
    fill = lengths.sum() / ((len(starts) - 1) * capacity)
    print(f"capacity {capacity}: {100 * fill:.2f}% of positions hold a real token")
    assert fill >= 0.98


def make_chat_data(root: Path, splits: dict[str, list[tuple[np.ndarray, np.ndarray]]]) -> Path:
    """A chat data directory from (ids, mask) per conversation; one shard per split, EOT after each."""
    return write_masked_data(root, splits, "chat")


def synthetic_convs(n: int, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """Conversations of 10 to 59 tokens; conversation c's content tokens are all 1000 + c,
    so a row says which conversations it holds."""
    rng = np.random.default_rng(seed)
    out = []
    for c in range(n):
        turns = [("system", int(rng.integers(1, 5)), 1000 + c)] if c % 3 == 0 else []
        for _ in range(int(rng.integers(1, 3))):
            turns += [("user", int(rng.integers(1, 6)), 1000 + c), ("assistant", int(rng.integers(1, 11)), 1000 + c)]
        out.append(conv_ids(*turns))
    return out


CONV = synthetic_convs(60)
SEQ = 63  # blocks of 64 tokens: every conversation of CONV fits


@pytest.fixture
def chat(tmp_path) -> PackedData:
    return PackedData(make_chat_data(tmp_path / "chat", {"train": CONV, "val": CONV[:9]}))


def row_conversations(batch, r: int) -> list[int]:
    """Conversation ids of row r, in order (the padding segment holds none)."""
    x, seg = batch.x[r], batch.seg[r]
    out = []
    for sid in seg.unique().tolist():
        content = x[(seg == sid) & (x >= 1000)]
        if len(content):
            assert (content == content[0]).all()  # a segment is one conversation
            out.append(int(content[0]) - 1000)
    return out


def check_rows(batch, convs=CONV) -> None:
    """x, y, pos, seg against the conversations the rows hold."""
    B, T = batch.x.shape
    assert batch.y.shape == batch.pos.shape == batch.seg.shape == (B, T)
    assert all(t.dtype == torch.int64 for t in (batch.x, batch.y, batch.pos, batch.seg))
    for r in range(B):
        block_ids, block_mask, block_seg = [], [], []
        for s_id, c in enumerate(row_conversations(batch, r)):
            ids, mask = fit_conversation(*convs[c], T + 1)
            block_ids += ids.tolist()
            block_mask += mask.tolist()
            block_seg += [s_id] * len(ids)
        pad = T + 1 - len(block_ids)
        n_segs = len(set(block_seg))
        block_ids += [0] * pad
        block_mask += [0] * pad
        block_seg += [n_segs] * pad
        assert batch.x[r].tolist() == block_ids[:-1]
        assert batch.seg[r].tolist() == block_seg[:-1]
        want_pos = []
        for s_id in range(n_segs + 1):
            want_pos += list(range(block_seg.count(s_id)))
        assert batch.pos[r].tolist() == want_pos[:-1]
        want_y = [block_ids[i + 1] if block_mask[i + 1] and block_seg[i + 1] == block_seg[i] else -1
                  for i in range(T)]
        assert batch.y[r].tolist() == want_y


def test_chat_batches_have_segments_positions_and_masked_targets(chat):
    loader = Loader(chat, batch_size=4, seq_len=SEQ, seed=0)
    for _ in range(3):
        batch = loader.next_batch()
        check_rows(batch)
        assert batch.seg.max() >= 1  # rows do hold several conversations
        assert (batch.y == -1).any() and (batch.y > 0).any()
    moved = batch.to("cpu")
    assert all(torch.equal(getattr(moved, k), getattr(batch, k)) for k in ("x", "y", "pos", "seg"))


def stream(loader: Loader, steps: int) -> list[list[int]]:
    """The conversations of each block (row) the loader yields in `steps` steps."""
    out = []
    for _ in range(steps):
        batch = loader.next_batch()
        out += [row_conversations(batch, r) for r in range(batch.x.shape[0])]
    return out


def test_an_epoch_holds_every_conversation_once_and_the_order_is_seeded(chat):
    loader = Loader(chat, batch_size=1, seq_len=SEQ, seed=3)
    n_blocks = loader.epoch_windows
    total = sum(len(c) for c, _ in CONV)
    fill = total / (n_blocks * 64)
    assert 0.9 < fill < 0.97  # 10 to 59 tokens each: rarely more than two to a block
    assert loader.describe() == (f"60 conversations ({total:,} tokens) packed into {n_blocks} blocks of seq_len+1 = "
                                 f"64: {100 * fill:.1f}% of positions hold a real token (the conversations are long "
                                 "for this seq_len: few fit together)")
    epoch0 = stream(loader, n_blocks)
    assert loader.state_dict() == {"epoch": 1, "cursor": 0, "seed": 3, "seq_len": SEQ, "n_conversations": 60}
    epoch1 = stream(loader, loader.epoch_units(1))
    for blocks in (epoch0, epoch1):
        assert sorted(c for b in blocks for c in b) == list(range(60))  # no gap, no repeat
    assert epoch0 != epoch1  # reshuffled and repacked each epoch
    assert stream(Loader(chat, batch_size=1, seq_len=SEQ, seed=3), n_blocks) == epoch0
    assert stream(Loader(chat, batch_size=1, seq_len=SEQ, seed=4), n_blocks) != epoch0
    # The batch size does not change the stream; a batch straddles epochs without repeats.
    wide = stream(Loader(chat, batch_size=n_blocks - 3, seq_len=SEQ, seed=3), 2)  # step 2: 3 + (n_blocks - 6)
    assert wide == epoch0 + epoch1[:n_blocks - 6]


def test_chat_ranks_split_the_stream_and_resume_exactly(chat):
    ref, state = assert_two_ranks_continue(chat, stream, SEQ)
    with pytest.raises(UserError, match=r"saved data position is for 59 conversations at seq_len 63, but .* has 60 "
                                        r"conversations at seq_len 63; resume with the same prepared data"):
        ref.load_state_dict({**state, "n_conversations": 59})
    with pytest.raises(UserError, match=r"saved data position \(epoch 0, cursor 999\) is out of range"):
        ref.load_state_dict({**state, "cursor": 999})
    assert ref.state_dict()["seed"] == 7


def test_long_conversations_are_cut_to_the_block_or_left_out(tmp_path):
    long_reply = conv_ids(("system", 3, 1000), ("user", 4, 1000), ("assistant", 60, 1000))  # 8 + 9 + 65 tokens
    long_prompt = conv_ids(("user", 70, 1001), ("assistant", 2, 1001))
    data = PackedData(make_chat_data(tmp_path / "d", {"train": [long_reply, long_prompt] + CONV[2:12]}))
    loader = Loader(data, batch_size=1, seq_len=SEQ)
    assert loader.describe().endswith("; 1 longer than 64 tokens cut to fit, 1 left out (no reply token would fit)")
    rows = stream(loader, loader.epoch_windows)
    assert sorted(c for b in rows for c in b) == [0] + list(range(2, 12))
    loader = Loader(data, batch_size=loader.epoch_windows, seq_len=SEQ)
    batch = loader.next_batch()
    r = next(i for i in range(batch.x.shape[0]) if 0 in row_conversations(batch, i))
    cut = fit_conversation(*long_reply, 64)
    assert len(cut[0]) == 64 and batch.x[r].tolist() == cut[0][:-1].tolist()  # the block holds it alone
    assert batch.y[r].tolist() == np.where(cut[1][1:] == 1, cut[0][1:], -1).tolist()
    with pytest.raises(UserError, match=r"none of its 1 conversations fits in seq_len\+1 = 64 tokens"):
        Loader(PackedData(make_chat_data(tmp_path / "e", {"train": [long_prompt]})), batch_size=1, seq_len=SEQ)
    with pytest.raises(UserError, match=r"10 conversations make \d+ blocks of seq_len\+1 = 64 tokens, but a step "
                                        r"takes batch_size x world_size = 64"):
        Loader(PackedData(make_chat_data(tmp_path / "f", {"train": CONV[:10]})), batch_size=32, seq_len=SEQ,
               world_size=2)


def test_chat_eval_batches_are_the_conversations_in_order(chat):
    val = PackedData(chat.data_dir, "val")
    batches = list(iter_eval_batches(val, batch_size=2, seq_len=SEQ))
    for b in batches:
        check_rows(b)
    held = [c for b in batches for r in range(b.x.shape[0]) for c in row_conversations(b, r)]
    assert sorted(held) == list(range(9))
    again = list(iter_eval_batches(val, batch_size=2, seq_len=SEQ, max_batches=1))
    assert len(again) == 1 and torch.equal(again[0].x, batches[0].x) and torch.equal(again[0].y, batches[0].y)


def test_prepared_chat_data_trains_only_on_replies(tmp_path, tok, tokenizer_dir):
    src = write_jsonl(tmp_path / "chat.jsonl", [{"conversations": c} for c in CONVS[:4] * 5])
    m = prepare([src], tokenizer_dir, tmp_path / "out", format="chat", val_fraction=0, workers=0, quiet=True)
    data = PackedData(tmp_path / "out", tokenizer_fingerprint=m.tokenizer.fingerprint)
    assert data.kind == "chat" and data.n_docs == 20
    loader = Loader(data, batch_size=2, seq_len=191, seed=0)
    replies = {msg["content"] + END for c in CONVS[:4] for msg in c if msg["role"] == "assistant"}
    seen = set()
    for _ in range(loader.epoch_windows // 2):
        batch = loader.next_batch()
        for r in range(2):
            y = batch.y[r]
            for x0, x1 in runs((y >= 0).numpy()):
                seen.add(tok.decode(y[x0:x1].tolist()))
            # A row's segments decode to whole rendered conversations, each from position 0.
            for sid in batch.seg[r].unique().tolist():
                sel = batch.seg[r] == sid
                assert batch.pos[r][sel].tolist() == list(range(int(sel.sum())))
    assert seen == replies


def test_mfu_counts_the_output_projection_at_the_replies_alone(tmp_path, tokenizer_dir, data_dir):
    """On chat data the loss projects only the replies' positions to the vocabulary: the logged MFU counts the
    output projection's FLOPs at those alone (the rest of the model at every position); on text, where every
    position has a target, at all of them."""
    from nanolm.train.configure import load_config
    from nanolm.model.transformer import flops_per_token
    from nanolm.metrics_log import read_metrics
    from nanolm.train.metrics import measured_matmul_flops
    from nanolm.train.trainer import train

    src = write_jsonl(tmp_path / "chat.jsonl", [{"conversations": c} for c in CONVS[:4] * 5])
    prepare([src], tokenizer_dir, tmp_path / "chat", format="chat", val_fraction=0.2, workers=0, quiet=True)
    over = {"train.out_dir": "", "model.vocab_size": 400, "model.d_model": 32, "model.n_layer": 2,
            "model.n_head": 4, "model.n_kv_head": 2, "model.max_seq_len": 192, "train.seq_len": 192,
            "train.batch_size": 2, "train.max_steps": 3, "train.log_interval": 1, "train.eval_interval": 3,
            "train.eval_batches": 1, "train.dtype": "float32"}
    ratios = {}
    for name, data, stage in (("text", data_dir, "pretrain"), ("sft", tmp_path / "chat", "sft")):
        init = {"train.init_from": str(tmp_path / "text")} if stage == "sft" else {}
        cfg = load_config("tiny", overrides={**over, **init, "data.path": str(data), "train.stage": stage,
                                             "train.out_dir": str(tmp_path / name)})
        train(cfg, quiet=True)
        peak = measured_matmul_flops("cpu", torch.float32)  # the run's own peak (measured once per process)
        fpt, head = flops_per_token(cfg.model, cfg.train.seq_len), 6 * 400 * 32
        ratios[name] = [r["mfu"] * peak / r["tokens_per_s"] for r in read_metrics(tmp_path / name / "metrics.jsonl")
                        if "mfu" in r]
        assert len(ratios[name]) == 3
    # FLOPs per token read: fewer than the model's at every position by part of the head's, never all of it
    assert all(fpt - head < r < fpt - 0.2 * head for r in ratios["sft"]), (ratios["sft"], fpt, head)
    assert ratios["text"] == pytest.approx([fpt] * 3, rel=1e-9)
