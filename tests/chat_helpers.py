"""Message builders and a JSONL writer shared by the chat and preference data tests."""

from __future__ import annotations

import json
from pathlib import Path

HINT = "; fix the line or pass --skip-bad to skip such lines"
END = "<|im_end|>"


def u(text: str) -> dict:
    return {"role": "user", "content": text}


def a(text: str) -> dict:
    return {"role": "assistant", "content": text}


def s(text: str) -> dict:
    return {"role": "system", "content": text}


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return path
