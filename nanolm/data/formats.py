"""Readers for the text files `nanolm prepare` tokenizes, with validation.

Two pretraining formats, chosen by file suffix:

- `.txt`: the whole file is one document.
- `.jsonl`: one document per line, a JSON object `{"text": "..."}` (MiniMind's
  pretraining format); other keys are ignored.

Both are read as UTF-8 (a leading byte-order mark is dropped) and streamed, so
no file is ever held in memory whole. In `.txt` files CRLF and CR line ends
become LF; in `.jsonl` files a CRLF line end is accepted and blank lines are
skipped. A `.jsonl` line that is not valid UTF-8, not valid JSON, not an object,
or has no string "text" (and a `.txt` line that is not valid UTF-8) raises a
`UserError` naming `file:line`; with `skip_bad=True` the line is skipped
instead and counted in a `ReadStats`. Every `.jsonl` file is read by the one
reader, `nanolm.data.jsonl.read_jsonl`; this module says what a record of each
kind must hold.
Documents with empty text are skipped (they would train nothing) and counted.

The unit the readers yield is a `Piece`: a document's text, or part of it, and
whether it ends the document. A `.jsonl` line is always a single piece. A
`.txt` file larger than `TXT_PIECE_CHARS` characters comes as several pieces,
cut only between a letter or digit and the newline after it: byte-level BPE
with GPT-2-style pre-tokenization (nanolm's tokenizer) never joins those two
characters into one pre-token, so tokenizing the pieces one by one gives the
same ids as tokenizing the whole file at once. The consumer appends exactly
one end-of-text token after each piece with `last=True`. `iter_documents`
joins the pieces back into whole strings for callers that want them.

Chat data (`iter_chat_records`, `iter_conversations`) is `.jsonl` only, one
conversation per line, in any of the formats users have:

- MiniMind: `{"conversations": [{"role": ..., "content": ...}, ...]}`, its
  tools on the system message (`"tools"`: a list or its JSON text) and its
  calls as `"tool_calls"` (a list or its JSON text);
- OpenAI / TRL: `{"messages": [...], "tools": [...]}`;
- Alpaca: `{"instruction": ..., "input": ... (optional), "output": ...,
  "system": ... (optional)}`, read as one user turn (the instruction, then a
  blank line and the input when there is one) and one assistant reply. An
  empty "input" or "system" counts as absent.

Messages are read by `nanolm.chat.message_from_dict` (roles system,
user, assistant, tool; an assistant's `tool_calls` and reasoning, as
`reasoning_content` or a leading `<think>…</think>`), and the conversation's
order checked by `chat.check_conversation`: an optional system message,
then user turns each answered by the assistant, whose tool calls are answered
by tool results before it goes on, ending with an assistant reply. Contents are
strings without the control strings and tags (`<|im_start|>`, `<think>`,
...), which would change the conversation's structure once rendered; every
user and system content, and every reply without a call, is non-empty. A
record that breaks any of this is a bad line (`file:line: what is wrong`),
reported or skipped as for text. So is a conversation the tokenizer's chat
layout cannot render (tools or reasoning with the plain ChatML template of an
old tokenizer), when the layout is given. `iter_chat_records` yields
`chat.Conversation`s; `iter_conversations` the messages as OpenAI dicts.

Preference pairs (`iter_preferences`, for DPO) are `.jsonl` too, one pair per
line, as two conversations that share every message but the final assistant
reply, in either of two formats:

- MiniMind / TRL implicit prompt: `{"chosen": [messages], "rejected":
  [messages]}`, both whole conversations.
- TRL explicit prompt: `{"prompt": ..., "chosen": ..., "rejected": ...}`,
  the prompt a string (one user turn) or an array of messages, each reply a
  string (one assistant turn) or an array of messages; each conversation is
  the prompt followed by its reply.

Each conversation is validated as chat data is (the messages name where they
fail: `"chosen"[1].content is empty`); a pair whose conversations differ
before the last reply, or whose last replies are the same, is a bad line too.

RL prompts (`iter_prompt_records`, for `--stage grpo`) are `.jsonl`, one
prompt per line: `{"prompt": "..."}` (one user turn), `{"prompt": [messages]}`,
or `{"messages": [...]}` / `{"conversations": [...]}` as MiniMind's `rlaif` and
`agent_rl` records hold them (a trailing assistant turn, which MiniMind's
records carry as an empty placeholder, is dropped: the policy writes it). The
messages are checked as a prompt (`check_conversation(complete=False)`: a user
turn, tool results that answer calls, no unanswered call at the end). Any
other field (the reference answers "answer", "solution", "gt", the tools) is
kept with the record for the rewards.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple

from nanolm.chat import (ChatError, ChatFormat, Conversation, Message, check_conversation, checked_text,
                         message_from_dict, tools_from_value)
from nanolm.data.jsonl import BAD_BYTE, BOM, SKIP_HINT, BadRecord, ReadStats, bad_utf8, open_text, read_jsonl
from nanolm.errors import UserError

# A .txt document longer than this (in characters) is yielded as several pieces.
# Past 4x this without a safe cut (a letter or digit, then a newline), a piece
# is cut at the next line end, or inside a line that long.
TXT_PIECE_CHARS = 1 << 20
# Lone surrogates that arrive through JSON escapes ("\ud83d") are not Unicode
# text either, and the tokenizer cannot take them.
_SURROGATE = re.compile("[\ud800-\udfff]")


class Piece(NamedTuple):
    """A document's text, or a consecutive part of it.

    `last` is True on the final piece of a document. `nbytes` is how many bytes
    of the file were read to produce it (approximate per piece, for progress).
    """

    text: str
    last: bool
    nbytes: int


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "true/false"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def _shown(value: str, limit: int = 40, quote: bool = False) -> str:
    """A user's string (a key, a role) for a one-line message: as is when short and printable (quoted if
    `quote`), else quoted with escapes and cut, so a key holding a newline or megabytes of text cannot break
    or flood the line."""
    cut = value[:limit]
    more = "..." if len(value) > limit else ""
    if not (quote or more) and cut.isprintable():
        return cut
    return json.dumps(cut, ensure_ascii=not cut.isprintable()) + more


def _keys(obj: dict) -> str:
    return ", ".join(_shown(k) for k in list(obj)[:5]) or "none"


def _text_of(obj: Any) -> str:
    """The pretraining record: an object with a string "text"."""
    if not isinstance(obj, dict):
        raise BadRecord(f'expected a JSON object like {{"text": "..."}}, got {_json_type(obj)}')
    if "text" not in obj:
        keys = _keys(obj)
        raise BadRecord(f'no "text" field (keys: {keys})')
    text = obj["text"]
    if not isinstance(text, str):
        raise BadRecord(f'"text" must be a string, got {_json_type(text)}')
    m = _SURROGATE.search(text)
    if m:
        raise BadRecord(f'"text" holds an unpaired surrogate escape \\u{ord(m.group()):04x}, '
                         "which is not valid Unicode")
    return text


_CHAT_SHAPE = ('{"conversations": [{"role": ..., "content": ...}, ...]}, {"messages": [...]} '
               'or {"instruction": ..., "output": ...}')


def _check_content(where: str, content: Any) -> str:
    """The content of an Alpaca field, or BadRecord saying what is wrong with it (`chat.checked_text`)."""
    if isinstance(content, str) and not content.strip():
        raise BadRecord(f"{where} is empty" + (" (only whitespace)" if content else ""))
    try:
        return checked_text(where, content)
    except ChatError as e:
        raise BadRecord(str(e)) from None


def _alpaca(obj: dict) -> Conversation:
    if "output" not in obj:
        raise BadRecord('Alpaca record has "instruction" but no "output" (the reply to train on)')
    if "instruction" not in obj:
        raise BadRecord('Alpaca record has "output" but no "instruction"')
    instruction = _check_content('"instruction"', obj["instruction"])
    output = _check_content('"output"', obj["output"])
    extra = obj.get("input")
    if extra is not None and not isinstance(extra, str):
        raise BadRecord(f'"input" must be a string, got {_json_type(extra)}')
    user = instruction + "\n\n" + extra if extra and extra.strip() else instruction
    _check_content('"input"', user)  # a control token in the input
    messages = [Message("user", user), Message("assistant", output)]
    system = obj.get("system")
    if system is not None and not isinstance(system, str):
        raise BadRecord(f'"system" must be a string, got {_json_type(system)}')
    if system and system.strip():
        messages.insert(0, Message("system", _check_content('"system"', system)))
    return Conversation(tuple(messages))


def _conversation_of(obj: Any) -> Conversation:
    """The chat record: a conversation in one of the formats of the module doc, validated."""
    if not isinstance(obj, dict):
        raise BadRecord(f"expected a JSON object like {_CHAT_SHAPE}, got {_json_type(obj)}")
    key = "conversations" if "conversations" in obj else "messages" if "messages" in obj else None
    if key is None:
        if "instruction" in obj or "output" in obj:
            return _alpaca(obj)
        keys = _keys(obj)
        raise BadRecord(f'no "conversations", "messages" or "instruction"/"output" field (keys: {keys}); '
                         f"expected {_CHAT_SHAPE}")
    turns = _turn_list(key, obj[key])
    messages = _check_turns(key, [(f'"{key}"[{i}]', m) for i, m in enumerate(turns)])
    return Conversation(messages, _tools_of(obj, key, turns))


def _tools_of(obj: dict, key: str, turns: list) -> tuple[str, ...]:
    """The tools of a record: its "tools", or (MiniMind) those of its system message."""
    where, value = '"tools"', obj.get("tools")
    first = turns[0] if turns and isinstance(turns[0], dict) else {}
    if value in (None, "", []) and first.get("role") == "system":
        where, value = f'"{key}"[0].tools', first.get("tools")
    if value in (None, "", []):
        return ()
    try:
        return tools_from_value(where, value)
    except ChatError as e:
        raise BadRecord(str(e)) from None


def _turn_list(key: str, turns: Any) -> list:
    """The array of messages under `key`, or BadRecord when it is not a non-empty array."""
    if not isinstance(turns, list):
        raise BadRecord(f'"{key}" must be an array of {{"role": ..., "content": ...}} objects, '
                         f"got {_json_type(turns)}")
    if not turns:
        raise BadRecord(f'"{key}" is empty; a conversation needs a user turn and an assistant reply')
    return turns


def _check_turns(key: str, turns: list[tuple[str, Any]]) -> tuple[Message, ...]:
    """The conversation made of `turns`, (where, message) pairs in order, validated as the module doc says.

    `where` names each message in messages ('"messages"[1]'); `key` names the
    whole conversation in the messages about its last turn.
    """
    try:
        messages = tuple(message_from_dict(where, m) for where, m in turns)
        check_conversation(f'"{key}"', messages, names=[where for where, _ in turns])
    except ChatError as e:
        raise BadRecord(str(e)) from None
    return messages


_PAIR_SHAPE = ('{"chosen": [messages], "rejected": [messages]} or '
               '{"prompt": "..." or [messages], "chosen": "...", "rejected": "..."}')


def _pair_side(obj: dict, side: str, prompt: list[tuple[str, Any]] | None) -> tuple[Message, ...]:
    """The chosen or rejected conversation of a preference record, validated."""
    value = obj[side]
    if prompt is None:
        if isinstance(value, str):
            raise BadRecord(f'"{side}" is a string but there is no "prompt"; give a "prompt", or make "chosen" '
                             'and "rejected" whole conversations (arrays of messages)')
        turns = _turn_list(side, value)
        return _check_turns(side, [(f'"{side}"[{i}]', m) for i, m in enumerate(turns)])
    if isinstance(value, str):
        reply = [(f'"{side}"', {"role": "assistant", "content": _check_content(f'"{side}"', value)})]
    else:
        if not isinstance(value, list) or not value:
            shown = "empty" if isinstance(value, list) else f"{_json_type(value)}"
            raise BadRecord(f'"{side}" must be the reply: a string or an array of messages, got {shown}')
        reply = [(f'"{side}"[{i}]', m) for i, m in enumerate(value)]
    return _check_turns(side, prompt + reply)


def _pair_of(obj: Any) -> tuple[Conversation, Conversation]:
    """The preference record: (chosen, rejected) conversations sharing every turn but the last reply, and
    the tools of the record."""
    if not isinstance(obj, dict):
        raise BadRecord(f"expected a JSON object like {_PAIR_SHAPE}, got {_json_type(obj)}")
    for side in ("chosen", "rejected"):
        if side not in obj:
            keys = _keys(obj)
            raise BadRecord(f'no "{side}" field (keys: {keys}); expected {_PAIR_SHAPE}')
    prompt: list[tuple[str, Any]] | None = None
    if "prompt" in obj:
        value = obj["prompt"]
        if isinstance(value, str):
            prompt = [('"prompt"', {"role": "user", "content": _check_content('"prompt"', value)})]
        elif isinstance(value, list) and value:
            prompt = [(f'"prompt"[{i}]', m) for i, m in enumerate(value)]
        else:
            shown = "empty" if isinstance(value, list) else f"{_json_type(value)}"
            raise BadRecord(f'"prompt" must be a string or an array of messages, got {shown}')
    chosen, rejected = _pair_side(obj, "chosen", prompt), _pair_side(obj, "rejected", prompt)
    if chosen[:-1] != rejected[:-1]:
        n_c, n_r = len(chosen) - 1, len(rejected) - 1
        at = next((i for i in range(min(n_c, n_r)) if chosen[i] != rejected[i]), min(n_c, n_r))
        raise BadRecord(f'"chosen" and "rejected" differ at message {at}, before their final reply; a pair must '
                         "share every turn but the last assistant reply (the prompt)")
    if chosen[-1] == rejected[-1]:
        raise BadRecord('"chosen" and "rejected" have the same final reply, so there is nothing to prefer')
    tools = _tools_of(obj, "chosen", [])
    return Conversation(chosen, tools), Conversation(rejected, tools)


def _records(path: Path, parse: Callable[[Any], Any], skip_bad: bool,
             stats: ReadStats | None) -> Iterator[tuple[Any, int]]:
    """(parse(record), bytes read since the previous one) for each record of a .jsonl file."""
    return ((r.value, r.nbytes) for r in read_jsonl(path, parse, skip_bad=skip_bad, stats=stats))


def _jsonl_path(path: Path, what: str, example: str, fix: str = "convert it") -> Path:
    """`path` as a Path, if its suffix is .jsonl; else the UserError saying that `what` must be one (`example`:
    what its lines hold) and `fix`."""
    path = Path(path)
    if path.suffix.lower() != ".jsonl":
        raise UserError(f"{path}: {what} must be a .jsonl file ({example}), not {path.suffix or '(no suffix)'!r}; "
                        f"{fix}")
    return path


def _format_checked(parse: Callable[[Any], Any], fmt: ChatFormat | None, tokenizer: str,
                    conversation: Callable[[Any], Conversation] = lambda record: record) -> Callable[[Any], Any]:
    """`parse`, then the check that `fmt` can render the parsed record's conversation (`conversation(record)`)."""
    def checked(obj: Any) -> Any:
        record = parse(obj)
        _check_format(fmt, tokenizer, conversation(record))
        return record
    return checked


def _iter_jsonl_text(path: Path, skip_bad: bool, stats: ReadStats) -> Iterator[Piece]:
    for text, nbytes in _records(path, _text_of, skip_bad, stats):
        if not text:
            stats.empty_docs += 1
            continue
        yield Piece(text, True, nbytes)


def _iter_txt(path: Path, skip_bad: bool, stats: ReadStats, piece_chars: int) -> Iterator[Piece]:
    """One document per file, in pieces cut where tokenization does not change (see module doc)."""
    piece_max = 4 * piece_chars
    with open_text(path, newline=None) as f:
        raw = f.buffer.raw  # type: ignore[attr-defined]
        pos = 0
        buf: list[str] = []
        buf_len = 0
        emitted = False
        lineno = 0
        at_line_start = True
        while True:
            # readline's limit keeps a file with no newlines from being read whole.
            seg = f.readline(piece_chars)
            if not seg:
                break
            if lineno == 0:
                seg = seg.removeprefix(BOM)
            if at_line_start:
                lineno += 1
            at_line_start = seg.endswith("\n")
            m = BAD_BYTE.search(seg)
            if m:
                where = f"{path}:{lineno}: {bad_utf8(m)}"
                if not skip_bad:
                    raise UserError(f"{where}; {SKIP_HINT}")
                stats.add_bad(where)
                continue
            buf.append(seg)
            buf_len += len(seg)
            if buf_len < piece_chars:
                continue
            if at_line_start and len(seg) >= 2 and seg[-2].isalnum():
                # Cut between the letter/digit and its newline; the newline opens the next piece.
                buf[-1] = seg[:-1]
                now = raw.tell()
                yield Piece("".join(buf), False, now - pos)
                pos, emitted = now, True
                buf, buf_len = ["\n"], 1
            elif buf_len >= piece_max:
                now = raw.tell()
                yield Piece("".join(buf), False, now - pos)
                pos, emitted = now, True
                buf, buf_len = [], 0
        if buf_len == 0 and not emitted:
            stats.empty_docs += 1
            return
        yield Piece("".join(buf), True, raw.tell() - pos)


def iter_pieces(path: Path, *, skip_bad: bool = False, stats: ReadStats | None = None,
                txt_piece_chars: int | None = None) -> Iterator[Piece]:
    """Stream the documents of one file as `Piece`s, in file order.

    txt_piece_chars: the .txt piece size (default TXT_PIECE_CHARS).
    """
    path = Path(path)
    stats = stats if stats is not None else ReadStats()
    suffix = path.suffix.lower()
    if suffix == ".txt":
        return _iter_txt(path, skip_bad, stats, txt_piece_chars or TXT_PIECE_CHARS)
    if suffix == ".jsonl":
        return _iter_jsonl_text(path, skip_bad, stats)
    raise UserError(f"{path}: unsupported file type {suffix or '(no suffix)'!r}; use .txt (one document per file) "
                    'or .jsonl (one {"text": "..."} object per line)')


def iter_chat_records(path: Path, *, skip_bad: bool = False, stats: ReadStats | None = None,
                      fmt: ChatFormat | None = None, tokenizer: str = "") -> Iterator[tuple[Conversation, int]]:
    """(conversation, bytes of the file read since the previous one) for each conversation of a .jsonl file.

    fmt: the chat layout the data is for (that of `tokenizer`): a conversation it cannot render (tools with the
    plain ChatML of old tokenizers) is a bad line.
    """
    path = _jsonl_path(path, "chat data", 'one conversation per line, e.g. {"conversations": [...]}',
                       "convert it, or prepare it with --format text")
    return _records(path, _format_checked(_conversation_of, fmt, tokenizer), skip_bad, stats)


def _check_format(fmt: ChatFormat | None, tokenizer: str, conv: Conversation) -> None:
    if fmt is not None:
        try:
            fmt.check("the conversation", conv.messages, conv.tools, tokenizer)
        except ChatError as e:
            raise BadRecord(str(e)) from None


def iter_conversations(path: Path, *, skip_bad: bool = False,
                       stats: ReadStats | None = None) -> Iterator[list[dict[str, Any]]]:
    """The messages of each conversation of a chat .jsonl file, validated, as OpenAI dicts (`Message.to_dict`:
    {"role", "content"}, and "reasoning_content", "tool_calls" where there are some); `iter_chat_records` gives
    the tools too."""
    return ([m.to_dict() for m in conv.messages] for conv, _ in iter_chat_records(path, skip_bad=skip_bad,
                                                                                   stats=stats))


def iter_preference_records(path: Path, *, skip_bad: bool = False, stats: ReadStats | None = None,
                            fmt: ChatFormat | None = None, tokenizer: str = ""
                            ) -> Iterator[tuple[tuple[Conversation, Conversation], int]]:
    """((chosen, rejected), bytes of the file read since the previous one) for each pair of a .jsonl file;
    fmt as for `iter_chat_records`."""
    path = _jsonl_path(path, "preference data", 'one pair per line, e.g. {"chosen": [...], "rejected": [...]}')
    return _records(path, _format_checked(_pair_of, fmt, tokenizer, lambda pair: pair[0]), skip_bad, stats)


def iter_preferences(path: Path, *, skip_bad: bool = False, stats: ReadStats | None = None
                     ) -> Iterator[tuple[list[dict[str, Any]], list[dict[str, Any]]]]:
    """Each preference pair of a .jsonl file as (chosen, rejected) conversations, validated (see module doc).

    Both are whole conversations of {"role", "content"} dicts that share every
    message but the last, an assistant reply.
    """
    return (([m.to_dict() for m in c.messages], [m.to_dict() for m in r.messages])
            for (c, r), _ in iter_preference_records(path, skip_bad=skip_bad, stats=stats))


def iter_documents(path: Path, *, skip_bad: bool = False, stats: ReadStats | None = None) -> Iterator[str]:
    """Each document of one file as one string (a .txt file is read whole into memory)."""
    parts: list[str] = []
    for piece in iter_pieces(path, skip_bad=skip_bad, stats=stats):
        parts.append(piece.text)
        if piece.last:
            yield "".join(parts)
            parts = []


_PROMPT_SHAPE = '{"prompt": "..."}, {"prompt": [messages]} or {"messages": [...]}'


def _prompt_of(obj: Any) -> tuple[Conversation, dict[str, Any]]:
    """The RL prompt record: (its prompt conversation, validated, and the record itself)."""
    if not isinstance(obj, dict):
        raise BadRecord(f"expected a JSON object like {_PROMPT_SHAPE}, got {_json_type(obj)}")
    key = next((k for k in ("prompt", "messages", "conversations") if k in obj), None)
    if key is None:
        raise BadRecord(f'no "prompt", "messages" or "conversations" field (keys: {_keys(obj)}); expected '
                         f"{_PROMPT_SHAPE}")
    value = obj[key]
    if key == "prompt" and isinstance(value, str):
        turns: list = [{"role": "user", "content": value}]
    elif isinstance(value, list) and not value:
        raise BadRecord(f'"{key}" is empty; a prompt needs a user turn')
    else:
        turns = list(_turn_list(key, value))
    if turns and isinstance(turns[-1], dict) and turns[-1].get("role") == "assistant" and len(turns) > 1 \
            and not turns[-1].get("tool_calls"):
        turns = turns[:-1]  # MiniMind's empty reply placeholder: the policy writes the reply
    try:
        messages = tuple(message_from_dict(f'"{key}"[{i}]', m) for i, m in enumerate(turns))
        check_conversation(f'"{key}"', messages, complete=False, names=[f'"{key}"[{i}]' for i in range(len(turns))])
    except ChatError as e:
        raise BadRecord(str(e)) from None
    return Conversation(messages, _tools_of(obj, key, turns)), obj


def iter_prompt_records(path: Path, *, skip_bad: bool = False, stats: ReadStats | None = None,
                        fmt: ChatFormat | None = None, tokenizer: str = ""
                        ) -> Iterator[tuple[tuple[Conversation, dict[str, Any]], int]]:
    """((prompt conversation, record), bytes read since the previous one) for each RL prompt of a .jsonl file;
    fmt as for `iter_chat_records`."""
    path = _jsonl_path(path, "RL prompts", 'one prompt per line, e.g. {"prompt": "...", "answer": "..."}')
    return _records(path, _format_checked(_prompt_of, fmt, tokenizer, lambda pair: pair[0]), skip_bad, stats)


_BLOCK_SHAPE = '{"input": "...", "output": "..."} or, cut at --block-len, {"text": "..."}'


def _block_of(obj: Any) -> tuple[str, str | None]:
    """A block record (`--format blocks`): (input, output) of an input/output record, or (text, None) of a
    sequence in bd4sur's Nano's layout, which prepare cuts at the block length."""
    if not isinstance(obj, dict):
        raise BadRecord(f"expected a JSON object like {_BLOCK_SHAPE}, got {_json_type(obj)}")
    if "input" in obj or "output" in obj:
        out = []
        for key in ("input", "output"):
            if key not in obj:
                raise BadRecord(f'no "{key}" field (keys: {_keys(obj)}); expected {_BLOCK_SHAPE}')
            value = obj[key]
            if not isinstance(value, str):
                raise BadRecord(f'"{key}" must be a string, got {_json_type(value)}')
            if not value:
                raise BadRecord(f'"{key}" is empty; a block record needs text in both')
            if _SURROGATE.search(value):
                raise BadRecord(f'"{key}" holds an unpaired surrogate escape, which is not valid Unicode')
            out.append(value)
        return out[0], out[1]
    if "text" in obj:
        text = _text_of(obj)
        if not text:
            raise BadRecord('"text" is empty')
        return text, None
    raise BadRecord(f'no "input"/"output" or "text" field (keys: {_keys(obj)}); expected {_BLOCK_SHAPE}')


def iter_block_records(path: Path, *, skip_bad: bool = False, stats: ReadStats | None = None,
                       encode: Callable[[str], list[int]] | None = None, block_len: int = 0
                       ) -> Iterator[tuple[tuple[Any, Any], int]]:
    """(record, bytes read since the previous one) for each record of a .jsonl file of blocks (`nanolm prepare
    --format blocks`): (input, output) or, for Nano's layout, (text, None); with `encode`, (input ids, output
    ids), a text cut at block_len tokens, each checked to fit block_len (0: any length; a text needs one)."""
    path = _jsonl_path(path, "block records", f"one record per line, {_BLOCK_SHAPE}")

    def parse(obj: Any) -> tuple[Any, Any]:
        a, b = _block_of(obj)
        if encode is None:
            return a, b
        if b is None:
            if not block_len:
                raise UserError(f'{path}: a {{"text": ...}} record is one sequence that is cut into its input and '
                                "output blocks at the block length; pass --block-len N")
            ids = encode(a)
            if not block_len < len(ids) <= 2 * block_len:
                raise BadRecord(f'"text" is {len(ids)} tokens: a sequence cut at --block-len {block_len} needs more '
                                 f"than {block_len} (an input, then an output) and at most {2 * block_len}")
            return ids[:block_len], ids[block_len:]
        pair = encode(a), encode(b)
        for key, ids in zip(("input", "output"), pair):
            if block_len and len(ids) > block_len:
                raise BadRecord(f'"{key}" is {len(ids)} tokens, longer than --block-len {block_len}; shorten it or '
                                 "raise --block-len")
        return pair
    return _records(path, parse, skip_bad, stats)
