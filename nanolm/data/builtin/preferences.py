"""A small preference set made from real chat data, for DPO tests, docs and the quickstart.

`build_idiom_preferences` turns the built-in idioms corpus (`nanolm.corpora.fetch("idioms")`:
one question about a 成语 and its dictionary answer per conversation) into
preference pairs without writing a word of text itself: for a sampled
question, `chosen` is its own answer and `rejected` the answer to the same
kind of question (same wording with another idiom: meaning, source or
example) about a different idiom. Both replies are real dictionary text and
look alike, so what separates them is whether the answer is about the idiom
asked, which is what a model tuned on the pairs has to learn. `nanolm data
preferences` builds them from the corpus's training view, without the idioms
of the built-in benchmark (`nanolm.corpora.holdout`).
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

from nanolm.data.formats import iter_conversations
from nanolm.errors import UserError
from nanolm.io import write_bytes_atomic

# The idiom inside a question ("「一帆风顺」是什么意思？"); the question with it blanked out is its kind.
_QUOTED = re.compile("「[^」]*」")
# Draws from a question's own kind before falling back to any other conversation.
_TRIES = 64


def build_idiom_preferences(idioms_jsonl: Path, out: Path, n: int, seed: int = 0) -> Path:
    """Write n preference pairs made from the conversations of idioms_jsonl to `out` (.jsonl) and return it.

    Each line is {"chosen": [question, its answer], "rejected": [question,
    the answer to another question of the same kind]} (MiniMind's DPO format,
    read by `nanolm.data.formats.iter_preferences`). Questions are a sample
    of n conversations without repeats, written in their file order; the
    same file and seed always give the same pairs. A question whose kind has
    no other answer gets the answer of any other conversation.
    """
    idioms_jsonl, out = Path(idioms_jsonl), Path(out)
    convs = list(iter_conversations(idioms_jsonl))
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= len(convs):
        raise UserError(f"n={n!r}: must be an integer from 1 to {len(convs)}, the conversations in {idioms_jsonl}")
    answers = [c[-1]["content"] for c in convs]
    if len(set(answers)) < 2:
        raise UserError(f"{idioms_jsonl}: every conversation has the same answer, so no pair can prefer one; "
                        "use a file with different answers")
    kinds: dict[str, list[int]] = {}
    for i, c in enumerate(convs):
        kinds.setdefault(_QUOTED.sub("「」", c[-2]["content"]), []).append(i)
    rng = random.Random(seed)
    lines = []
    for i in sorted(rng.sample(range(len(convs)), n)):
        same_kind = kinds[_QUOTED.sub("「」", convs[i][-2]["content"])]
        j = i
        for _ in range(_TRIES if len(same_kind) > 1 else 0):
            j = same_kind[rng.randrange(len(same_kind))]
            if answers[j] != answers[i]:
                break
        if answers[j] == answers[i]:
            j = rng.choice([k for k, a in enumerate(answers) if a != answers[i]])
        rejected = convs[i][:-1] + [convs[j][-1]]
        lines.append(json.dumps({"chosen": convs[i], "rejected": rejected}, ensure_ascii=False) + "\n")
    out.parent.mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(out, "".join(lines).encode("utf-8"))
    return out
