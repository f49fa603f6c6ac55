"""Atomic files and directories: a reader sees the old one or the new one, never half of either.

Every file nanolm writes in place of another (manifests, tokenizers, cached
corpora, best.json, a GGUF export) goes through `atomic_file`: write to a
unique temporary name in the same directory, fsync, then `os.replace`, which
is atomic on POSIX and Windows.

Every directory nanolm writes (a training checkpoint, a merged LoRA model, an
HF export or import, prepared data) goes through `atomic_directory`: its files
are written into `.tmp-<name>-<pid>` beside it, fsynced, and the directory is
renamed into place; an existing one is first moved aside to
`.old-<name>-<pid>` and deleted after. A directory is deleted by renaming it
out of sight (`.del-<name>-<pid>`) first (`remove_directory`), so a kill
mid-delete leaves no half of it under its own name. What a killed writer
leaves (those hidden names, with the pid of a process that is gone) is cleared
by `remove_leftovers`: temporary and half-deleted directories go, and a
directory moved aside whose new copy never arrived goes back into place.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from nanolm.errors import UserError


@contextmanager
def atomic_file(path: Path) -> Iterator[Path]:
    """Write the file `path` whole or not at all: yields a unique temporary path beside it for the block to
    write; when the block ends the file is fsynced and renamed into place, when it raises it is removed."""
    path = Path(path)
    # A unique name, not mkstemp's (whose files are 0600), so the file gets the usual permissions.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_bytes_atomic(path: Path, data: bytes) -> None:
    with atomic_file(path) as tmp, open(tmp, "xb") as f:
        f.write(data)


def write_text_atomic(path: Path, text: str) -> None:
    write_bytes_atomic(path, text.encode("utf-8"))


def write_json_atomic(path: Path, obj: Any) -> None:
    write_text_atomic(path, json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


# Files are checksummed in chunks of this size.
_CRC_CHUNK = 64 << 20


def crc32_of(path: Path) -> str:
    """The CRC-32 of a file's bytes, as 8 hex digits. CRC-32 catches every change of up to 4 consecutive bytes
    (a flipped byte, a torn sector's first bytes) with certainty and other changes all but 1 in 2^32 times;
    zlib's computes about 4 GB/s on one core, twice SHA-256's here. The file is read through a memory map (no
    copy into a buffer: 0.3 s for 1 GB in the page cache, where reads into a buffer take 0.5 s); zlib lets
    other threads run meanwhile, so several files can be checked at once."""
    import mmap
    import zlib
    crc = 0
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return f"{crc:08x}"
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            view = memoryview(m)
            try:
                for i in range(0, len(view), _CRC_CHUNK):
                    crc = zlib.crc32(view[i:i + _CRC_CHUNK], crc)
            finally:
                view.release()
    return f"{crc:08x}"


# The files whose CRC-32 this process has checked, as they stood: (path, size, mtime_ns, the CRC they matched).
_crc_checked: set[tuple[str, int, int, str]] = set()


def _crc_key(path: Path, want: str) -> tuple[str, int, int, str]:
    st = Path(path).stat()
    return str(Path(path).resolve()), st.st_size, st.st_mtime_ns, want


def crc32_checked(path: Path, want: str) -> bool:
    """Whether this process has already found the file, as it stands (size, modification time), to match `want`."""
    return _crc_key(path, want) in _crc_checked


def check_crc32(path: Path, want: str, where: str, fix: str) -> None:
    """UserError when the file's CRC-32 is not `want` (recorded in `where`): one line naming the file and `fix`.
    A file is read once per process as it stands: a second check of it unchanged costs a stat."""
    key = _crc_key(path, want)
    if key in _crc_checked:
        return
    got = crc32_of(path)
    if got != want:
        raise UserError(f"{path}: its checksum is {got}, not the {want} that {where} recorded when it was written: "
                        f"the file has been damaged or changed since; {fix}")
    _crc_checked.add(key)


# What killed writers leave: a directory being written, moved aside or deleted, and a temporary file of
# write_bytes_atomic; each named with the writer's pid.
_LEFTOVER_DIR = re.compile(r"^\.(?P<kind>tmp|old|del)-(?P<name>.+)-(?P<pid>\d+)$")
_LEFTOVER_FILE = re.compile(r"^\.(?P<name>.+)\.(?P<pid>\d+)\.[0-9a-f]{8}\.tmp$")


def _hidden(kind: str, path: Path) -> Path:
    return path.with_name(f".{kind}-{path.name}-{os.getpid()}")


@contextmanager
def atomic_directory(final: Path, *, replace: bool = False) -> Iterator[Path]:
    """Write the directory `final` whole or not at all.

    Yields an empty temporary directory beside `final`. When the block ends, every file in it is fsynced and
    it takes `final`'s place (with `replace`, an existing `final` is moved aside first and deleted after;
    without it, `final` must be absent or an empty directory, else a UserError before anything is written);
    when the block raises, it is removed and `final` is as it was. Leftovers of killed writers of `final` are
    cleared first.
    """
    final = Path(final)
    if not replace:
        check_new_directory(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    remove_leftovers(final.parent, final.name)
    tmp = _hidden("tmp", final)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        yield tmp
        for f in sorted(tmp.rglob("*")):
            if f.is_file():
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if final.exists():
        old = _hidden("old", final)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    fsync_dir(final.parent)


def check_new_directory(path: Path) -> None:
    """UserError unless `path` is absent or an empty directory: a new output is never written over files."""
    path = Path(path)
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise UserError(f"{path}: already exists and is not an empty directory; choose a new output directory "
                        f"or remove it")


def remove_directory(path: Path) -> None:
    """Delete a directory, renamed out of sight first: a kill mid-delete leaves no partial `path`."""
    gone = _hidden("del", Path(path))
    os.replace(path, gone)
    shutil.rmtree(gone, ignore_errors=True)


def remove_leftovers(parent: Path, name: str | None = None) -> None:
    """Clear what killed writers left in `parent` (see the module doc), only for `name` when given; the
    entries of live processes (a writer at work) are left alone."""
    for p in Path(parent).iterdir():
        m = _LEFTOVER_DIR.match(p.name) or _LEFTOVER_FILE.match(p.name)
        if m is None or (name is not None and m["name"] != name):
            continue
        pid = int(m["pid"])
        if pid == os.getpid() or pid_alive(pid):
            continue
        kind = m.groupdict().get("kind")
        if kind == "old" and not (p.parent / m["name"]).exists():
            os.replace(p, p.parent / m["name"])  # the new copy never arrived: the old one goes back
        elif p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)


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
