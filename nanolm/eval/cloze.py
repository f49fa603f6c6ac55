"""The built-in continuation benchmark: which of four passages follows a held-out context, in Chinese and English.

`cloze`: an item is a context of 200-300 characters from a built-in text corpus
(sanguo, shakespeare, sotu) and four continuations of 60-120 characters: the
one that follows the context in the corpus, and three taken from elsewhere in
the same corpus file's held-out text, each of a length within 10% (at least 6
characters) of the right one's. Every context starts at a sentence start and
ends at a sentence end; every continuation starts right after a sentence end
(with the whitespace that follows it in the text, so the delimiter is "") and
ends at the first sentence end at least 60 characters on, so neither the cut
nor the length tells the right one apart. Sentence ends: 。！？ (and closing
quotes after them) in Chinese; . ! ? (and closing quotes or brackets) before
whitespace in English, not after a capital (speaker tags such as "DUKE.",
"U.S.") nor after Mr, Mrs, Dr, St. Continuations of one document follow each
other (an item's context may hold the previous item's right continuation); a
distractor never overlaps its item's context or right continuation, nor
another distractor. Chance is 25%. Chinese (sanguo) and English items
(shakespeare and sotu in turn) alternate while both last, so the first n of
any size are a mix; each corpus's items are shuffled with a fixed seed: 282
items on the built-in corpora (159 sanguo, 61 shakespeare, 62 sotu). An
item's `where` is file:line:character (the JSONL line of the document, the
context's first character in its text).

The task's score is `acc_mutual_info` (nanolm/eval/scoring.py): the choice
the context raises most above its likelihood as a text of its own. Four
passages of a book differ in how likely they are as text far more than a
context of 200-300 characters moves them, so the summed log-probability
(`acc`) mostly ranks the passages themselves; what the task asks is whether
the model reads the context.

Held out: text that no training path of nanolm reads as training data.
`nanolm prepare` splits validation by document or by position
(nanolm/data/kinds/text.py): a document of at least LONG_DOC_CHARS characters
gives its last val_fraction of characters to val; the shorter ones are
numbered across all sources in order, document i going to val when i % k == 1,
k = `val_every(val_fraction)`. Three layouts train on the built-in text
corpora, and a passage is used only when it is validation (or absent) in all:

1. `nanolm prepare CORPUS`, one corpus alone, at the default val_fraction 0.01
   (k = 100);
2. `nanolm prepare sanguo shakespeare sotu` (the multi-GPU recipe's default),
   the same split with the documents numbered across the three files;
3. the quickstart: copies of each corpus holding the JSONL lines that start
   within its first 2,000,000 characters (`truncated_copies`), prepared
   together at 0.02 (k = 50); a document past its copy is not trained on.

So, per document of a corpus file:

- a long document (>= LONG_DOC_CHARS characters; all of shakespeare's works
  but three, 144 of sotu's 249 speeches) gives its last 1% of characters
  (from int(n * 0.99)), when it lies past the quickstart's copy. That tail
  is validation in layouts 1 and 2 at any val_fraction >= 0.01, and in the
  quickstart's copy too; the copy is left out as a margin, because the other
  training on a corpus reads its first works whole (bench/quality.py trains
  on the first 90% of the first 1,000,000 characters);
- a short document is used whole when it is validation in all three layouts:
  i % 100 == 1 for its number i in its file (layout 1) and across the full
  files (layout 2), and, when it is inside its copy, i % 50 == 1 for its
  number across the copies (layout 3). Only the first corpus has the same
  numbers in all of them: sanguo, whose 120 chapters are all short and
  all inside the quickstart's copy, gives chapters 2 and 102 (documents 1
  and 101), about 12,000 characters. No other text of sanguo is held out
  under both the quickstart and `nanolm prepare sanguo`; bench/quality.py
  --corpus sanguo trains on these two as well (its first 90%), so a model
  from that bench has seen the Chinese items.

Beyond the split, a context or continuation whose text also occurs verbatim
in the rest of its corpus file (sotu repeats lines of earlier speeches) is
left out. The tokenizer training of the quickstart and of `nanolm tokenizer
train CORPUS` reads the whole text, validation included; that learns merges,
not the passages.
"""

from __future__ import annotations

import bisect
import json
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from nanolm.data.kinds.text import LONG_DOC_CHARS
from nanolm.data.provenance import val_every
from nanolm.errors import UserError
from nanolm.eval.tasks import MCItem, Task
from nanolm.corpora import TEXT_CORPORA

SEED = 0
DEFAULT_VAL_FRACTION = 0.01  # `nanolm prepare`'s (and prepare()'s) default
QUICKSTART_VAL_FRACTION = 0.02  # the quickstart's prepare of its text corpora
QUICKSTART_MAX_CHARS = 2_000_000  # the quickstart's --max-chars: its copy of each text corpus
CONTEXT_CHARS = (200, 300)
CHOICE_CHARS = (60, 120)
LENGTH_TOLERANCE = 0.1  # a distractor's length is within this share of the right one's (at least MIN_SLACK)
MIN_SLACK = 6

_CJK = re.compile(r"[\u3400-\u9fff\uf900-\ufaff]")
_SENTENCE_END = {
    "zh": re.compile(r"[。！？][”’」』）]*"),
    "en": re.compile(r"(?<![A-Z])(?<!Mr)(?<!Mrs)(?<!Dr)(?<!St)[.!?][\"'”’)\]]*(?=\s|$)"),
}
_SPEAKER = re.compile(r"\s*[A-Z][a-z]*\.")  # a line of one capitalised word: a speaker tag ("Kent."), not a sentence


@dataclass(frozen=True)
class HeldOut:
    """A document of a corpus file and where its held-out part starts (its end is the document's end)."""

    path: Path
    line: int  # the document's line in the JSONL file
    text: str
    start: int  # the first held-out character


@dataclass(frozen=True)
class _Segment:
    doc: int  # index into the file's held-out documents
    start: int
    end: int
    text: str


def _documents(path: Path, max_chars: int) -> list[tuple[int, str, bool]]:
    """(line, text, whether the quickstart's copy holds it) of each document, numbered as prepare numbers them
    (non-blank lines whose text is not empty); the copy holds the lines that start before max_chars characters
    of the file (0: the whole file)."""
    docs, seen = [], 0
    with open(path, encoding="utf-8") as f:  # read as the quickstart's copy reads it, counting characters
        for lineno, line in enumerate(f, 1):
            copied = not max_chars or seen < max_chars
            seen += len(line)
            if not line.strip():
                continue
            try:
                text = json.loads(line.removeprefix("\ufeff"))["text"]
            except (ValueError, TypeError, KeyError):
                raise UserError(f"{path}:{lineno}: not a text record {{\"text\": \"...\"}}; the cloze task reads "
                                "the built-in text corpora (`nanolm data fetch sanguo`)") from None
            if not isinstance(text, str):
                raise UserError(f"{path}:{lineno}: \"text\" is not a string; fix the line")
            if text:
                docs.append((lineno, text, copied))
    return docs


def held_out_documents(files: Sequence[Path], max_chars: int = QUICKSTART_MAX_CHARS) -> list[list[HeldOut]]:
    """For text corpus files in the quickstart's order, each file's documents with a held-out part (the rule of
    the module docstring); max_chars: the quickstart's copy of each file."""
    k_default, k_quick = val_every(DEFAULT_VAL_FRACTION), val_every(QUICKSTART_VAL_FRACTION)
    out, n_full, n_copied = [], 0, 0  # documents of the files before this one, whole and in the copies
    for path in map(Path, files):
        docs = _documents(path, max_chars)
        held = []
        for i, (line, text, copied) in enumerate(docs):
            if len(text) >= LONG_DOC_CHARS:  # split by position: the tail, past the quickstart's copy
                if not copied:
                    held.append(HeldOut(path, line, text, int(len(text) * (1 - DEFAULT_VAL_FRACTION))))
            elif i % k_default == 1 and (n_full + i) % k_default == 1 and (not copied or (n_copied + i) % k_quick == 1):
                held.append(HeldOut(path, line, text, 0))
        out.append(held)
        n_full += len(docs)
        n_copied += sum(copied for _, _, copied in docs)
    return out


def language_of(text: str) -> str:
    """"zh" when CJK characters make up more than a third of the text, else "en"."""
    return "zh" if len(_CJK.findall(text)) * 3 > len(text) else "en"


def _boundaries(doc: HeldOut, lang: str) -> list[int]:
    """Positions in the held-out part right after a sentence end (and its start, when it is the document's)."""
    text = doc.text
    ends = [m.end() for m in _SENTENCE_END[lang].finditer(text, doc.start)
            if not _SPEAKER.fullmatch(text, text.rfind("\n", 0, m.start()) + 1, m.end())]
    return ([0] if doc.start == 0 else []) + [b for b in ends if b > 0]


def _segment_end(bounds: list[int], b: int) -> int | None:
    """The first sentence end at least CHOICE_CHARS[0] characters after b, if it is within CHOICE_CHARS[1]."""
    j = bisect.bisect_left(bounds, b + CHOICE_CHARS[0])
    return bounds[j] if j < len(bounds) and bounds[j] - b <= CHOICE_CHARS[1] else None


def _context_start(doc: HeldOut, bounds: list[int], b: int) -> int | None:
    """The start of the longest context of at most CONTEXT_CHARS[1] characters ending at b that starts a
    sentence (its leading whitespace dropped), if it is at least CONTEXT_CHARS[0] long."""
    j = bisect.bisect_left(bounds, b - CONTEXT_CHARS[1] - 8)  # (a start's whitespace is skipped below)
    for s in bounds[j:]:
        if s >= b:
            break
        s += len(doc.text[s:b]) - len(doc.text[s:b].lstrip())
        if b - s <= CONTEXT_CHARS[1]:
            return s if b - s >= CONTEXT_CHARS[0] else None
    return None


def _file_items(docs: Sequence[HeldOut], outside: str, rng: random.Random) -> list[MCItem]:
    """The items of one corpus file's held-out documents; `outside` is the rest of the file's text, where no
    context or choice may occur."""
    if not docs:
        return []
    lang = language_of("".join(d.text[d.start:] for d in docs[:3]))
    bounds = [_boundaries(d, lang) for d in docs]
    pool = []  # every continuation-shaped segment of the held-out text, by length
    for i, (d, bs) in enumerate(zip(docs, bounds)):
        for b in bs:
            e = _segment_end(bs, b)
            if e is not None:
                pool.append(_Segment(i, b, e, d.text[b:e]))
    pool.sort(key=lambda s: (len(s.text), s.doc, s.start))
    lengths = [len(s.text) for s in pool]
    clean: dict[str, bool] = {}

    def unseen(text: str) -> bool:  # not a repeat of text outside the held-out part
        if text not in clean:
            clean[text] = text not in outside
        return clean[text]

    items = []
    for i, (d, bs) in enumerate(zip(docs, bounds)):
        j = 0
        while j < len(bs):
            b = bs[j]
            s, e = _context_start(d, bs, b), _segment_end(bs, b)
            if s is None or e is None or not (unseen(d.text[s:b]) and unseen(d.text[b:e])):
                j += 1
                continue
            right = d.text[b:e]
            others = _distractors(pool, lengths, _Segment(i, s, e, right), rng, unseen)
            if others is not None:
                choices = [right, *others]
                rng.shuffle(choices)
                context = d.text[s:b]
                items.append(MCItem(context, tuple(choices), choices.index(right), context, "",
                                    f"{d.path}:{d.line}:{s + 1}"))
            j = bisect.bisect_left(bs, e)  # the next item's continuation follows this one's
    return items


def _distractors(pool: list[_Segment], lengths: list[int], item: _Segment, rng: random.Random,
                 unseen: Callable[[str], bool]) -> list[str] | None:
    """Three segments of about the right continuation's length, none overlapping the item (its context and
    right continuation, `item.start` to `item.end`) or each other, all of different texts; None if there are
    not three."""
    n = len(item.text)
    slack = max(MIN_SLACK, round(LENGTH_TOLERANCE * n))
    lo, hi = bisect.bisect_left(lengths, n - slack), bisect.bisect_right(lengths, n + slack)
    candidates = pool[lo:hi]
    order = rng.sample(range(len(candidates)), len(candidates))
    picked: list[_Segment] = []
    texts = {item.text.strip()}
    for k in order:
        c = candidates[k]
        if c.text.strip() in texts or _overlaps(c, item) or any(_overlaps(c, p) for p in picked):
            continue
        if not unseen(c.text):
            continue
        picked.append(c)
        texts.add(c.text.strip())
        if len(picked) == 3:
            return [p.text for p in picked]
    return None


def _overlaps(a: _Segment, b: _Segment) -> bool:
    return a.doc == b.doc and a.start < b.end and b.start < a.end


def _outside(path: Path, docs: Sequence[HeldOut], max_chars: int) -> str:
    """The file's text outside its held-out parts, documents apart by a character no text holds."""
    start = {d.line: d.start for d in docs}
    return "\x00".join(text[:start.get(line, len(text))] for line, text, _ in _documents(path, max_chars))


def cloze_task(files: Sequence[Path] | None = None, n: int | None = None, seed: int = SEED, *,
               max_chars: int = QUICKSTART_MAX_CHARS) -> Task:
    """The built-in continuation task over text corpus files given in the quickstart's order (default: the
    built-in sanguo, shakespeare and sotu, fetched on first use); the first n items when n is given. max_chars:
    the quickstart's copy of each file, which holds none of the items (module docstring)."""
    if files is None:
        from nanolm.corpora import fetch
        files = [fetch(name, quiet=True) for name in TEXT_CORPORA]
    files = [Path(f) for f in files]
    rng = random.Random(seed)
    by_lang: dict[str, list[list[MCItem]]] = {"zh": [], "en": []}
    for path, docs in zip(files, held_out_documents(files, max_chars)):
        items = _file_items(docs, _outside(path, docs, max_chars), rng)
        if not items:
            chars = sum(len(d.text) - d.start for d in docs)
            raise UserError(f"{path}: its held-out part ({len(docs)} document(s), {chars:,} characters) gives no "
                            f"cloze item; use the whole built-in corpus, as `nanolm data fetch {path.stem}` caches "
                            "it")
        rng.shuffle(items)
        by_lang[language_of(items[0].prompt)].append(items)
    items = _round_robin([_round_robin(lists) for lists in by_lang.values()])
    return Task("cloze", "mc", items[:n] if n else items, ", ".join(map(str, files)),
                "built-in held-out continuation", metric="acc_mutual_info")


def _round_robin(lists: Sequence[list[MCItem]]) -> list[MCItem]:
    """The lists' items in turn (one of each, then the next of each, ...), the longer lists' rest at the end."""
    out = []
    for k in range(max(map(len, lists), default=0)):
        out += [items[k] for items in lists if k < len(items)]
    return out
