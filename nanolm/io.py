"""Atomic file writes: a reader sees the old file or the new one, never half of either.

Every file nanolm writes in place of another (checkpoints, manifests,
tokenizers, cached corpora) goes through here: write to a unique temporary
name in the same directory, fsync, then `os.replace`, which is atomic on POSIX
and Windows.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from pathlib import Path
from typing import Any

from nanolm.errors import UserError


def write_bytes_atomic(path: Path, data: bytes) -> None:
    path = Path(path)
    # A unique name opened with "xb" (not mkstemp, whose files are 0600), so the file gets the usual permissions.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "xb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text_atomic(path: Path, text: str) -> None:
    write_bytes_atomic(path, text.encode("utf-8"))


def write_json_atomic(path: Path, obj: Any) -> None:
    write_text_atomic(path, json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


def read_json_object(path: Path, what: str, fix: str) -> dict[str, Any]:
    """A JSON object from `path`; a missing, damaged or non-object file is a one-line UserError ending in `fix`."""
    try:
        d = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"{path}: missing {what}; {fix}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: corrupt {what} ({e}); {fix}") from None
    except RecursionError:  # e.g. a file of a million "["
        raise UserError(f"{path}: corrupt {what} (nested too deeply); {fix}") from None
    if not isinstance(d, dict):
        raise UserError(f"{path}: corrupt {what} (not a JSON object); {fix}")
    return d


def fsync_dir(path: Path) -> None:
    """Make a rename inside `path` durable; a no-op where directories cannot be opened (Windows)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def pid_alive(pid: int) -> bool:
    """Whether process `pid` runs on this machine; True where that cannot be told (not POSIX).

    Tells leftovers of a killed writer (named with its pid) from files a running one is writing.
    """
    if os.name != "posix":
        return True  # on Windows os.kill(pid, 0) would terminate the process
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: it exists, under another user
        return True
    return True


def first_line(e: BaseException, limit: int | None = 200) -> str:
    """An exception's message cut to its first line (at most `limit` characters), for a one-line error:
    torch's and safetensors' messages run to many lines."""
    return (str(e).strip().splitlines() or [""])[0][:limit]


def write_failure(e: BaseException) -> str:
    """Why a write failed, in one line: the OS's words for an OSError, else the first line of the message
    (safetensors and torch.save raise their own types: "... No space left on device (os error 28)")."""
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    line = first_line(e, limit=None)
    return f"{type(e).__name__}: {line}" if line else type(e).__name__


def space_note(path: Path, needed: int) -> str:
    """For the message of a failed write under `path`: "about 1.2 MiB needed, 0.4 MiB free on that disk"."""
    note = f"about {needed / 2**20:.1f} MiB needed"
    try:
        return f"{note}, {shutil.disk_usage(path).free / 2**20:.1f} MiB free on that disk"
    except OSError:
        return note
