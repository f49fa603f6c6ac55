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
