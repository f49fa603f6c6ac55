"""Message builders and a JSONL writer shared by the chat and preference data tests."""

from __future__ import annotations

import json
from pathlib import Path

HINT = "; fix the line or pass --skip-bad to skip such lines"
END = "<|im_end|>"


def u(text: str) -> dict:
    return {"role": "user", "content": text}


def a(text: str) -> dict:
    return {"role": "assistant", "content": text}


def s(text: str) -> dict:
    return {"role": "system", "content": text}


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return path


def assert_two_ranks_continue(data, stream, seq_len: int):
    """Save a 1-rank loader's position, resume it on 2 ranks, and check they continue the same global stream.

    stream(loader, n_steps) -> the units that loader yields over n steps. Returns the 1-rank loader and its
    saved state, for further checks.
    """
    import json as _json

    from nanolm.data.loader import Loader
    ref = Loader(data, batch_size=4, seq_len=seq_len, seed=7)
    stream(ref, 3)
    state = _json.loads(_json.dumps(ref.state_dict()))
    continuation = stream(ref, 12)  # crosses into later epochs
    ranks = [Loader(data, batch_size=2, seq_len=seq_len, rank=r, world_size=2) for r in range(2)]
    for r in ranks:
        r.load_state_dict(state)
    resumed = []
    for _ in range(12):
        parts = [stream(r, 1) for r in ranks]
        resumed += parts[0] + parts[1]
    assert resumed == continuation
    assert ranks[0].state_dict() == ranks[1].state_dict() == ref.state_dict()
    return ref, state


def write_masked_data(root: Path, splits: dict, fmt: str, split_extra: dict | None = None,
                      vocab_size: int = 70000) -> Path:
    """A chat or preference data directory (`nanolm prepare`'s format) from (ids, mask) per conversation:
    one uint32 shard per split, each conversation followed by an EOT with mask 0."""
    import numpy as np

    from nanolm.data.shards import FORMAT_VERSION
    root.mkdir(parents=True, exist_ok=True)
    entries = {}
    for split, convs in splits.items():
        ids = np.concatenate([np.r_[c, 0] for c, _ in convs]).astype(np.uint32)
        mask = np.concatenate([np.r_[mk, 0] for _, mk in convs]).astype(np.uint8)
        offsets = np.r_[0, np.cumsum([len(c) + 1 for c, _ in convs])].astype(np.uint64)
        stem = f"{split}-00000"
        ids.tofile(root / f"{stem}.bin")
        mask.tofile(root / f"{stem}.mask")
        offsets.tofile(root / f"{stem}.idx")
        shard = {"bin": f"{stem}.bin", "idx": f"{stem}.idx", "mask": f"{stem}.mask", "n_tokens": len(ids),
                 "n_docs": len(convs), "n_trainable": int(mask.sum())}
        entries[split] = {"shards": [shard], "n_tokens": len(ids), "n_docs": len(convs),
                          **(split_extra or {}).get(split, {})}
    manifest = {"format": "nanolm-tokens", "version": FORMAT_VERSION, "dtype": "uint32", "splits": entries,
                "options": {"format": fmt, "max_tokens": 1024},
                "tokenizer": {"path": "/x/tokenizer.json", "fingerprint": "ab" * 32, "vocab_size": vocab_size,
                              "eot_id": 0}}
    (root / "manifest.json").write_text(json.dumps(manifest))
    return root


def read_masked_docs(out: Path, m, split: str = "train") -> list:
    """(ids, mask) of each document of a split of chat or preference data, shard by shard, checking the file
    layout: one uint8 per token, as many TARGET bits as the manifest's n_trainable, EXCHANGE bits only on
    <|im_start|> tokens. The masks returned hold the TARGET bit alone."""
    import numpy as np
    shards = []
    for sh in m.splits[split]["shards"]:  # m: the Manifest prepare returned
        ids = np.fromfile(out / sh["bin"], dtype=m.dtype).astype(np.int64)
        mask = np.fromfile(out / sh["mask"], dtype=np.uint8)
        offsets = np.fromfile(out / sh["idx"], dtype=np.uint64).astype(np.int64)
        assert len(mask) == len(ids) == sh["n_tokens"] and int((mask & 1).sum()) == sh["n_trainable"]
        assert set(np.unique(mask).tolist()) <= {0, 1, 2}
        assert (ids[(mask & 2) > 0] == 1).all()  # an exchange starts at an <|im_start|>
        shards.append([(ids[x:y], mask[x:y] & 1) for x, y in zip(offsets[:-1], offsets[1:])])
    return shards


def old_chatml_tokenizer(tokenizer_dir: Path, dest: Path):
    """A copy of a tokenizer as nanolm wrote them before tools and reasoning: the plain ChatML template."""
    from nanolm.chat import CHATML
    from nanolm.tokenizer import Tokenizer
    tok = Tokenizer.load(tokenizer_dir)
    tok.config = {**tok.config, "chat_template": CHATML.template}
    tok.save(dest)
    return Tokenizer.load(dest)
