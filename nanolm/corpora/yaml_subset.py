"""The strict reader of the YAML subset that chatterbot-corpus's .yml files are written in.

PyYAML is not a dependency, and a general YAML reader would read a malformed
file some way or other; this one reads exactly the constructs those files use
and refuses anything else with a one-line `UserError` naming file:line.
"""

from __future__ import annotations

import re
from typing import Sequence

from nanolm.errors import UserError

_YAML_SUBSET = ("nanolm reads only the YAML subset of chatterbot-corpus: top-level 'categories:' and "
                "'conversations:', '- ' / '- - ' / '  - ' items, and plain, quoted or '|' block strings")
_YAML_KEY = re.compile(r"(categories|conversations):[ ]*")
_YAML_DQ_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "n": "\n", "t": "\t", "r": "\r", "0": "\0"}


def _yaml_error(path: str, line: int, what: str) -> UserError:
    return UserError(f"{path}:{line}: {what}; {_YAML_SUBSET}")


def _indent(line: str, path: str, lineno: int) -> int:
    stripped = line.lstrip(" ")
    if stripped.startswith("\t"):
        raise _yaml_error(path, lineno, "tab in indentation")
    return len(line) - len(stripped)


def parse_chatterbot_yml(text: str, path: str) -> dict[str, list]:
    """{"categories": [str], "conversations": [[str] or str]} of one chatterbot-corpus .yml file.

    A small, strict reader for exactly the YAML those files use (PyYAML is not
    a dependency): two top-level keys, each a block sequence; a conversation
    starts with "- - text" and goes on with "  - text" (a "- text" item is
    a string, not a conversation, as YAML reads it); a string is plain
    (folded over more-indented lines), 'single' or "double" quoted (possibly
    over several lines), or a "|" literal block. Anything else (a mapping, a
    comment, anchors, flow collections, other block styles) raises UserError
    naming file:line rather than being read some way YAML would not.
    """
    lines = text.replace("\r\n", "\n").split("\n")
    out: dict[str, list] = {}
    i = 0
    while i < len(lines):
        if not lines[i].strip():
            i += 1
            continue
        key = _YAML_KEY.fullmatch(lines[i])
        if key is None:
            raise _yaml_error(path, i + 1, f"expected 'categories:' or 'conversations:', found {lines[i]!r}")
        if key.group(1) in out:
            raise _yaml_error(path, i + 1, f"second {key.group(1)!r} key")
        items: list = []
        out[key.group(1)] = items
        i += 1
        while i < len(lines):
            line = lines[i]
            if not line.strip():
                i += 1
            elif key.group(1) == "categories" and line.startswith("- "):
                value, i = _yaml_scalar(lines, i, 2, 0, path)
                items.append(value)
            elif key.group(1) == "conversations" and line.startswith("- - "):
                value, i = _yaml_scalar(lines, i, 4, 2, path)
                items.append([value])
            elif key.group(1) == "conversations" and line.startswith("  - ") and items \
                    and isinstance(items[-1], list):
                value, i = _yaml_scalar(lines, i, 4, 2, path)
                items[-1].append(value)
            elif key.group(1) == "conversations" and line.startswith("- "):
                # A string where a list of turns belongs (english/trivia.yml has one); YAML folds
                # the more-indented lines below into it. The extractor skips it.
                value, i = _yaml_scalar(lines, i, 2, 0, path)
                items.append(value)
            elif _indent(line, path, i + 1) == 0 and not line.startswith("-"):
                break  # the next top-level key
            else:
                expected = "'- ' item" if key.group(1) == "categories" else "'- - ' or '  - ' item"
                raise _yaml_error(path, i + 1, f"expected a {expected} under {key.group(1)!r}, found {line!r}")
    if "conversations" not in out:
        raise _yaml_error(path, 1, "no 'conversations:' key")
    return {"categories": out.get("categories", []), "conversations": out["conversations"]}


def _yaml_scalar(lines: Sequence[str], i: int, col: int, parent: int, path: str) -> tuple[str, int]:
    """The string starting at lines[i][col:], and the index of the line after it.

    `parent` is the column of the sequence the item belongs to: the string's
    further lines must be indented more than that.
    """
    first = lines[i][col:]
    if first[:1] in ("'", '"'):
        return _yaml_quoted(lines, i, col, parent, path)
    if first.rstrip(" ") == "|":
        return _yaml_literal(lines, i, parent, path)
    pieces = [first.rstrip(" ")]
    _check_plain(pieces[0], path, i + 1, first_line=True)
    j = i + 1
    while j < len(lines) and (not lines[j].strip() or _indent(lines[j], path, j + 1) > parent):
        pieces.append(lines[j].strip(" "))
        if pieces[-1]:
            _check_plain(pieces[-1], path, j + 1, first_line=False)
        j += 1
    while not pieces[-1]:  # blank lines after the string belong to no one
        pieces.pop()
    return _fold(pieces), j


def _check_plain(piece: str, path: str, lineno: int, *, first_line: bool) -> None:
    """Refuse a plain line that YAML would read as something other than text."""
    if not piece:
        raise _yaml_error(path, lineno, "empty item")
    if first_line and (piece[0] in "[]{}#&*!|>%@`," or piece[:2] in ("- ", "? ", ": ") or piece in ("-", "?", ":")):
        raise _yaml_error(path, lineno, f"a plain string may not start with {piece[0]!r}")
    if not first_line and piece[0] == "#":
        raise _yaml_error(path, lineno, "a comment line inside a plain string")
    if ": " in piece or piece.endswith(":"):
        raise _yaml_error(path, lineno, "': ' in a plain string makes a mapping; quote the string")
    if " #" in piece or "\t#" in piece:
        raise _yaml_error(path, lineno, "' #' in a plain string starts a comment; quote the string")


def _fold(pieces: Sequence[str]) -> str:
    """Join a flow string's trimmed lines: one break becomes a space, n empty lines n newlines."""
    out = pieces[0]
    empty = 0
    for k, piece in enumerate(pieces[1:], start=1):
        if not piece and k < len(pieces) - 1:
            empty += 1
            continue
        out += ("\n" * empty if empty else " ") + piece
        empty = 0
    return out


def _yaml_quoted(lines: Sequence[str], i: int, col: int, parent: int, path: str) -> tuple[str, int]:
    quote = lines[i][col]
    raws: list[str] = []
    j, start = i, col + 1
    while True:
        line = lines[j]
        end = _closing_quote(line, start, quote, path, j + 1)
        if end is not None:
            raws.append(line[start:end])
            if line[end + 1:].strip(" "):
                raise _yaml_error(path, j + 1, f"text after the closing {quote}")
            break
        raws.append(line[start:])
        j += 1
        if j == len(lines) or (lines[j].strip() and _indent(lines[j], path, j + 1) <= parent):
            raise _yaml_error(path, i + 1, f"string opened with {quote} is not closed")
        start = 0
    if len(raws) > 1:  # a line break folds: the spaces around it go
        raws = [raws[0].rstrip(" ")] + [r.strip(" ") for r in raws[1:-1]] + [raws[-1].lstrip(" ")]
    decode = (lambda r: r.replace("''", "'")) if quote == "'" else (lambda r: _dq_unescape(r, path, i + 1))
    return _fold([decode(r) for r in raws]), j + 1


def _closing_quote(line: str, start: int, quote: str, path: str, lineno: int) -> int | None:
    """The column of the quote that closes the string in `line` from `start`, or None."""
    k = start
    while k < len(line):
        if quote == "'" and line[k] == "'":
            if line[k + 1:k + 2] != "'":
                return k
            k += 2
        elif quote == '"' and line[k] == "\\":
            if k + 1 == len(line):
                raise _yaml_error(path, lineno, "escaped line break in a double-quoted string")
            k += 2
        elif quote == '"' and line[k] == '"':
            return k
        else:
            k += 1
    return None


def _dq_unescape(raw: str, path: str, lineno: int) -> str:
    def one(m: re.Match) -> str:
        esc = m.group(1)
        if esc in _YAML_DQ_ESCAPES:
            return _YAML_DQ_ESCAPES[esc]
        if esc[0] == "u" and re.fullmatch(r"u[0-9a-fA-F]{4}", esc):
            return chr(int(esc[1:], 16))
        raise _yaml_error(path, lineno, f"escape \\{esc[0]} in a double-quoted string")
    return re.sub(r"\\(u[0-9a-fA-F]{4}|.)", one, raw)


def _yaml_literal(lines: Sequence[str], i: int, parent: int, path: str) -> tuple[str, int]:
    """A "|" block: its lines less their common indentation, with one final newline."""
    j = i + 1
    while j < len(lines) and not lines[j].strip():
        j += 1
    if j == len(lines) or _indent(lines[j], path, j + 1) <= parent:
        raise _yaml_error(path, i + 1, "empty '|' block")
    indent = _indent(lines[j], path, j + 1)
    if any(len(lines[k]) > indent for k in range(i + 1, j)):
        raise _yaml_error(path, i + 2, "a blank line before a '|' block's text is indented more than the text")
    body: list[str] = []
    j = i + 1
    while j < len(lines):
        line = lines[j]
        if line.strip() and _indent(line, path, j + 1) < indent:
            if _indent(line, path, j + 1) > parent:
                raise _yaml_error(path, j + 1, "line indented less than the '|' block it is in")
            break
        body.append(line[indent:])
        j += 1
    while body and not body[-1].strip():
        body.pop()
    return "\n".join(body) + "\n", j
