"""Built-in block tasks on digit strings (`nanolm data blocks`): the data that shows what a non-causal model is for.

Each record is `{"input": "93517", "output": "13579"}`: a string of digits,
its length drawn uniformly from min_len to max_len, and its digits sorted
(`sort`) or reversed (`reverse`). Every input occurs once in the file, so the
validation split that `nanolm prepare --format blocks` makes (record i when
i % k == 1) holds inputs that no training record has: it is the held-out set.
The draws are fixed by the seed. The tasks are bd4sur's Nano's example of its
non-causal mode: the whole input decides every output position, which a
model that sees the whole block writes in one pass.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from nanolm.errors import UserError
from nanolm.io import write_text_atomic

TASKS = {"sort": lambda s: "".join(sorted(s)), "reverse": lambda s: s[::-1]}


def digit_records(task: str, n: int, min_len: int, max_len: int, seed: int = 0) -> list[dict[str, str]]:
    """n records of `task` with distinct inputs (module doc)."""
    if task not in TASKS:
        raise UserError(f"--task {task}: choose one of {', '.join(TASKS)}")
    if not 1 <= min_len <= max_len:
        raise UserError(f"--min-len {min_len} --max-len {max_len}: need 1 <= min-len <= max-len")
    possible = sum(10 ** k for k in range(min_len, max_len + 1))
    if not 1 <= n <= possible // 2:
        raise UserError(f"--n {n}: must be from 1 to {possible // 2} (half the {possible} digit strings of "
                        f"{min_len} to {max_len} digits, so that the draws stay distinct); raise --max-len")
    rng, seen, out = random.Random(seed), set(), []
    while len(out) < n:
        k = rng.randint(min_len, max_len)
        s = "".join(rng.choice("0123456789") for _ in range(k))
        if s not in seen:
            seen.add(s)
            out.append({"input": s, "output": TASKS[task](s)})
    return out


def write_digit_task(out: Path, task: str, n: int, min_len: int, max_len: int, seed: int = 0) -> Path:
    """Write the records of `digit_records` to the .jsonl file `out` (atomically); returns its path."""
    out = Path(out)
    if out.suffix.lower() != ".jsonl":
        raise UserError(f"--out {out}: give a .jsonl file to write")
    lines = "".join(json.dumps(r) + "\n" for r in digit_records(task, n, min_len, max_len, seed))
    out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out, lines)
    return out
