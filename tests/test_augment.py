"""SFT augmentations of `nanolm prepare --format chat`: a share of the conversations given a built-in system
prompt, a share trained on their empty think blocks; each conversation's draw from the seed and its place in
the input, so the bytes do not depend on the workers."""

from __future__ import annotations

import json

import numpy as np
import pytest

from nanolm.chat import TARGET
from nanolm.data.kinds.chat import SYSTEM_PROMPTS
from nanolm.data.prepare import prepare
from nanolm.data.shards import PackedData
from nanolm.errors import UserError
from nanolm.special_tokens import THINK_END

N = 120


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
    path = tmp_path_factory.mktemp("chats") / "chats.jsonl"
    lines = []
    for i in range(N):
        msgs = [{"role": "user", "content": f"What is {i} plus one?"},
                {"role": "assistant", "content": f"It is {i + 1}."}]
        if i % 10 == 0:  # a conversation that has a system message keeps it
            msgs.insert(0, {"role": "system", "content": "Reply in one sentence."})
        lines.append(json.dumps({"messages": msgs}))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def conversations(out, tok):
    """Each conversation's text and the text of its trained tokens, in input order."""
    docs = []
    for split in ("train",):  # prepared with val_fraction 0: every conversation is here, in input order
        d = PackedData(out, split)
        for shard, start, length in zip(*d.documents()):
            ids = d.doc_ids(int(shard), int(start), int(length))
            mask = (np.asarray(d.masks[int(shard)][start:start + length]) & TARGET) != 0  # trained tokens
            docs.append((tok.decode(ids.tolist()), tok.decode(ids[mask].tolist())))
    return docs


def test_shares_are_drawn_per_conversation_and_do_not_depend_on_the_workers(chats, tokenizer_dir, tok, tmp_path):
    opts = dict(format="chat", system_ratio=0.5, empty_think_ratio=0.5, seed=7, val_fraction=0.0)
    m = prepare([chats], tokenizer_dir, tmp_path / "a", workers=2, **opts)
    prepare([chats], tokenizer_dir, tmp_path / "b", workers=0, **opts)
    for name in ("train-00000.bin", "train-00000.mask"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    counts = m.section["augmented"]
    assert 0.35 * N < counts["system_prompt"] < 0.6 * N and 0.35 * N < counts["empty_think"] < 0.65 * N
    assert m.options["system_ratio"] == 0.5 and m.options["seed"] == 7

    docs = conversations(tmp_path / "a", tok)
    given = [text for text, _ in docs if any(p in text for p in SYSTEM_PROMPTS)]
    assert len(given) == counts["system_prompt"]
    # a conversation with its own system message is never given another
    assert all(text.count("<|im_start|>system") == 1 for text, _ in docs if "Reply in one sentence." in text)
    assert not any(any(p in text for p in SYSTEM_PROMPTS) for text, _ in docs if "Reply in one sentence." in text)
    # trained on: the reply, and for the augmented share the empty think block's close before it
    trained_close = [trained for _, trained in docs if THINK_END in trained]
    assert len(trained_close) == counts["empty_think"]
    assert all(trained.startswith(f"\n{THINK_END}\n\nIt is ") for trained in trained_close)
    assert all(trained.startswith("It is ") for _, trained in docs if THINK_END not in trained)
    # every rendered text is the plain layout's: an augmentation changes what is trained, not the layout
    assert all(f"<think>\n\n{THINK_END}\n\nIt is " in text for text, _ in docs)

    other = prepare([chats], tokenizer_dir, tmp_path / "c", workers=0, **{**opts, "seed": 8})
    assert other.section["augmented"] != counts or \
        (tmp_path / "c" / "train-00000.mask").read_bytes() != (tmp_path / "a" / "train-00000.mask").read_bytes()


def test_off_by_default_and_checked(chats, tokenizer_dir, tmp_path):
    plain = prepare([chats], tokenizer_dir, tmp_path / "p", format="chat", workers=0)
    assert "augmented" not in plain.section and "system_ratio" not in plain.options
    with pytest.raises(UserError, match=r"system_ratio=1\.5: must be a share from 0 to 1"):
        prepare([chats], tokenizer_dir, tmp_path / "x", format="chat", system_ratio=1.5)
    with pytest.raises(UserError, match="empty_think_ratio=0.2 augments conversations for fine-tuning, not text"):
        prepare([chats], tokenizer_dir, tmp_path / "y", format="text", empty_think_ratio=0.2)
