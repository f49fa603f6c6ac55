"""Reading a run's metrics.jsonl: the records the trainer logged, one JSON object per line.

The trainer writes the file (`train/metrics.py`'s MetricsWriter, rank 0 only,
appending and flushing a line per event); `nanolm plot`, the report card and
anything else that looks back at a run read it here, below all of them, so
that reading a run never imports the training package.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl, in file order; a line cut short by a crash is skipped."""
    records = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records
