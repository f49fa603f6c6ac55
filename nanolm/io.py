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
