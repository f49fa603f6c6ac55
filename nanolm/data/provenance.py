"""What every kind of prepared data shares, below the kinds and the driver: the split rule, what a source file
was (path, size, time, content hash) and whether an output directory may be replaced.

`nanolm prepare` (data/prepare.py) and the data kinds (data/kinds/) take them from here; the manifest's
fields are `Manifest`'s (data/shards.py).
"""

from __future__ import annotations

import hashlib
import re
import threading
from pathlib import Path
from typing import Any

from nanolm.data.shards import MANIFEST, SHARD_FILE
from nanolm.errors import UserError

# Where nanolm 0.1 wrote inside out_dir before its data was written whole beside it; a leftover of one goes with
# the directory it is in.
OLD_TEMP = re.compile(r"^\.prepare-\d+-")


def val_every(val_fraction: float) -> int:
    """k of the split policy (document i is val when i % k == 1); 0 means no val split."""
    if isinstance(val_fraction, bool) or not isinstance(val_fraction, (int, float)) \
            or not 0.0 <= val_fraction <= 0.5:
        raise UserError(f"val_fraction={val_fraction!r}: must be a number from 0 (no validation split) to 0.5")
    return 0 if val_fraction == 0 else max(2, round(1 / val_fraction))


def sha256_of(path: Path, stop: threading.Event | None = None) -> str:
    """Hex sha256 of the file; "" if `stop` is set before it is done."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            if stop is not None and stop.is_set():
                return ""
            h.update(chunk)
    return h.hexdigest()


def source_stat(path: Path) -> dict[str, Any]:
    """A source file as a manifest records it: its resolved path, size and modification time."""
    st = path.stat()
    return {"path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def check_replaceable(out_dir: Path) -> None:
    """UserError when out_dir holds anything but prepared data: the new data replaces the whole directory."""
    if not out_dir.is_dir():
        return
    for p in sorted(out_dir.iterdir()):
        if not (p.name == MANIFEST or SHARD_FILE.match(p.name) or OLD_TEMP.match(p.name)):
            raise UserError(f"{out_dir}: holds {p.name}, which nanolm prepare did not write, and prepared data "
                            f"replaces the whole directory; move it out of {out_dir}, or choose another --out")
