"""Items of the built-in data kept out of training, for the built-in benchmarks (`nanolm.eval.builtin`).

An idiom is held out when a sha256 of it falls in the first HELD_OUT_PER_MILLE
of a thousand buckets: about 3% of the idioms corpus (about 930 of its 30,895
idioms), the same on every machine, with no list to keep. Wherever a built-in
corpus is read by name as training data (`resolve_sources`: `nanolm prepare
idioms`, `nanolm tokenizer train idioms`, the quickstart; and `nanolm data
preferences`), its training view is read instead: the cached corpus without
the held-out conversations, written once in the cache. The cached corpus itself
stays whole and pinned (its sha256 is the registry's), and the benchmark is
built from it.

A chatterbot conversation is held out the same way, by a sha256 of its first
user turn (stripped and lowercased, so that the corpus's repeated and
recased questions all fall on one side): the first HELD_OUT_CHAT_PER_MILLE of
a thousand buckets, about 10% of its 2,492 conversations. The built-in
`everyday` task is built from both corpora's held-out conversations.

Generated problems (the tool-use set's arithmetic, the arithmetic task) hold
out their numbers the same way (`numbers_held_out`): about 10% of the number
tuples of each problem shape, never written into training data.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

HELD_OUT_PER_MILLE = 30
HELD_OUT_NUMBERS_PER_MILLE = 100  # of generated problems' number tuples (`numbers_held_out`)
HELD_OUT_CHAT_PER_MILLE = 100  # of chatterbot's conversations (`chatterbot_held_out`)
_SALT = b"nanolm held-out v1:"
_QUOTED = re.compile("「([^」]+)」")


def _bucket(key: str) -> int:
    """The key's bucket of a thousand: a salted sha256, the same on every machine."""
    return int.from_bytes(hashlib.sha256(_SALT + key.encode("utf-8")).digest()[:8], "big") % 1000


def is_held_out(idiom: str) -> bool:
    """Whether the idiom belongs to the built-in benchmark (and so to no built-in training data)."""
    return _bucket(idiom) < HELD_OUT_PER_MILLE


def question_held_out(question: str) -> bool:
    """Whether a chatterbot conversation whose first user turn is `question` is held out (by the turn stripped
    and lowercased: "What is AI?" and "what is ai?" fall together)."""
    return _bucket("chatterbot:" + question.strip().lower()) < HELD_OUT_CHAT_PER_MILLE


def idiom_of(question: str) -> str | None:
    """The idiom a question of the idioms corpus asks about ("「一帆风顺」是什么意思？" -> 一帆风顺)."""
    m = _QUOTED.search(question)
    return m.group(1) if m else None


def conversation_held_out(line: str) -> bool:
    """Whether a line of the idioms corpus (one conversation) asks about a held-out idiom."""
    import json
    question = json.loads(line)["conversations"][0]["content"]
    idiom = idiom_of(question)
    return idiom is not None and is_held_out(idiom)


def chatterbot_held_out(line: str) -> bool:
    """Whether a line of the chatterbot corpus (one conversation) is held out (`question_held_out`)."""
    import json
    return question_held_out(json.loads(line)["conversations"][0]["content"])


def numbers_held_out(task: str, *numbers: int) -> bool:
    """Whether the numbers of a generated problem (`task`: "calc" for the tool-use set, "arith" for the
    arithmetic task) belong to its built-in benchmark: a sha256 of the task and the ordered numbers falls in the
    first HELD_OUT_NUMBERS_PER_MILLE of a thousand buckets. The generators never write such numbers into data
    they make for training, so the benchmark's problems are new to every model nanolm trains."""
    return _bucket(f"{task}:" + ",".join(str(n) for n in numbers)) < HELD_OUT_NUMBERS_PER_MILLE


# Built-in corpora with a held-out part: name -> the test of one of its lines.
HOLDOUTS = {"idioms": conversation_held_out, "chatterbot": chatterbot_held_out}


def training_view(name: str, path: Path) -> Path:
    """The file to train on for built-in corpus `name` cached at `path`: `path` itself, or for a corpus with a
    held-out part a copy without it (`<cache>/training-views/<name>-<sha12>.jsonl`, named by a checksum of the
    corpus file and the held-out shares, so a new corpus version or a new rule gets a new view; written
    atomically once). It lies outside the
    corpus directory, so a user who passes the corpora directory as data does not read it twice."""
    held_out = HOLDOUTS.get(name)
    if held_out is None:
        return path
    from nanolm.corpora.cache import cache_dir
    from nanolm.io import write_bytes_atomic
    data = Path(path).read_bytes()
    rule = f"{HELD_OUT_PER_MILLE},{HELD_OUT_CHAT_PER_MILLE}:".encode()
    view = cache_dir() / "training-views" / f"{name}-{hashlib.sha256(rule + data).hexdigest()[:12]}.jsonl"
    if not view.is_file():
        view.parent.mkdir(parents=True, exist_ok=True)
        kept = [line for line in data.decode("utf-8").splitlines(keepends=True)
                if line.strip() and not held_out(line)]
        write_bytes_atomic(view, "".join(kept).encode("utf-8"))
    return view
