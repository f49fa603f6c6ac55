"""The one reader of JSON Lines files a user gives (data, tasks, tool-use items) and of the records files nanolm
writes, with the UTF-8 checks it shares with the `.txt` reader of nanolm/data/formats.py.

`read_jsonl(path, parse)` streams a file line by line (never whole), read as
UTF-8 with a leading byte-order mark dropped; a CRLF line end is accepted and
blank lines are skipped. A line that is not valid UTF-8, not valid JSON, or
that `parse` refuses (by raising `BadRecord`) is a one-line `UserError`,
`file:line: what is wrong; the fix`, or, with `skip_bad`, skipped and counted
in a `ReadStats`. What it yields per line carries the line number, for
messages about the record that its caller checks itself, and the bytes read
since the line before, for progress.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple, TextIO

from nanolm.errors import UserError

# Bad lines whose location is kept for the final report when skip_bad is on.
MAX_EXAMPLES = 5

BOM = "\ufeff"  # a UTF-8 byte-order mark at the start of a file is dropped
SKIP_HINT = "fix the line or pass --skip-bad to skip such lines"

# Files are decoded with errors="surrogateescape": a byte that is not valid
# UTF-8 becomes a lone surrogate in U+DC80..U+DCFF, which valid UTF-8 can never
# decode to, so a regex search finds bad bytes line by line at C speed.
BAD_BYTE = re.compile("[\udc80-\udcff]")


@dataclass
class ReadStats:
    """What the readers skipped: bad lines (with skip_bad) and empty documents."""

    bad_lines: int = 0
    examples: list[str] = field(default_factory=list)  # first MAX_EXAMPLES "file:line: problem"
    empty_docs: int = 0

    def add_bad(self, where: str) -> None:
        self.bad_lines += 1
        if len(self.examples) < MAX_EXAMPLES:
            self.examples.append(where)


class BadRecord(Exception):
    """A record-level problem, raised by a `parse` function; the reader adds file:line and the fix."""


class JsonLine(NamedTuple):
    """One line of a JSON Lines file: `parse` of its JSON value, its line number and the bytes of the file read
    since the line yielded before it."""

    value: Any
    line: int
    nbytes: int


def open_text(path: Path, newline: str | None) -> TextIO:
    """`path` opened for reading as UTF-8, bad bytes kept as lone surrogates (`BAD_BYTE` finds them); a missing,
    unreadable or directory path is a UserError."""
    try:
        # Plain utf-8, the BOM dropped by the readers: "utf-8-sig" silently loses a file of one or two bytes
        # that begin a BOM (b"\xef"), where the file's invalid UTF-8 must be reported.
        return open(path, encoding="utf-8", errors="surrogateescape", newline=newline)
    except FileNotFoundError:
        raise UserError(f"{path}: no such file; check the path") from None
    except IsADirectoryError:
        raise UserError(f"{path}: is a directory; pass the files in it, or the directory to `nanolm prepare`") from None
    except PermissionError:
        raise UserError(f"{path}: permission denied; make the file readable") from None


def bad_utf8(m: re.Match) -> str:
    """What is wrong where `BAD_BYTE` matched in a line."""
    return f"invalid UTF-8 (byte 0x{ord(m.group()) - 0xDC00:02x} at column {m.start() + 1})"


def read_jsonl(path: Path, parse: Callable[[Any], Any] | None = None, *, fix: str = SKIP_HINT,
               skip_bad: bool = False, stats: ReadStats | None = None,
               invalid: str = "invalid JSON") -> Iterator[JsonLine]:
    """A `JsonLine` of parse(value) (the value itself without `parse`) for each non-blank line of `path`.

    fix: what the message of a bad line ends with ("" for none); skip_bad: skip bad lines instead, counting
    them in `stats`; invalid: how that message names a line that is not JSON (the task files' messages say
    "not valid JSON").
    """
    stats = stats if stats is not None else ReadStats()
    with open_text(Path(path), newline="\n") as f:
        raw = f.buffer.raw  # type: ignore[attr-defined]
        pos = 0
        for lineno, line in enumerate(f, 1):
            if lineno == 1:
                line = line.removeprefix(BOM)
            if not line or line.isspace():
                continue
            try:
                m = BAD_BYTE.search(line)
                if m:
                    raise BadRecord(bad_utf8(m))
                body = line.rstrip("\r\n")  # parsed without its line break, so a line reads alike at the file's end
                try:
                    obj = json.loads(body)
                except json.JSONDecodeError as e:
                    col = min(e.pos, len(body)) + 1  # past the end of the text means at its end
                    raise BadRecord(f"{invalid} ({e.msg.removesuffix(' at')} at column {col})") from None
                except RecursionError:  # e.g. a line of a million "["
                    raise BadRecord(f"{invalid} (nested too deeply)") from None
                value = obj if parse is None else parse(obj)
            except BadRecord as e:
                where = f"{path}:{lineno}: {e}"
                if not skip_bad:
                    raise UserError(f"{where}; {fix}" if fix else where) from None
                stats.add_bad(where)
                continue
            now = raw.tell()
            yield JsonLine(value, lineno, now - pos)
            pos = now
