"""A small progress bar with rate and ETA, and byte/number formatting.

Written here rather than taken from a dependency: it is 80 lines, and the core
of nanolm depends only on torch, tokenizers, safetensors and numpy.
On a terminal the bar redraws in place; elsewhere (CI logs, pipes) it prints
a plain line at most every `min_interval_plain` seconds so logs stay short.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


def fmt_duration(seconds: float) -> str:
    """1:02:03 style, or 42s for short spans."""
    if seconds != seconds or seconds == float("inf"):  # NaN or inf
        return "?"
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    if h:
        return f"{h}:{m:02d}:{s:02d}"
    if m:
        return f"{m}:{s:02d}"
    return f"{s}s"


def fmt_count(n: float) -> str:
    """Human-readable count: 950, 1.2K, 3.4M, 5.6B."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{n:.0f}" if float(n).is_integer() or abs(n) >= 100 else f"{n:.3g}"


def fmt_bytes(n: float) -> str:
    """Human-readable size in binary units."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


class Progress:
    """Progress of `total` units (None when unknown), with rate and ETA.

    Use as a context manager; call `update(n)` as work completes.
    """

    def __init__(self, total: float | None, desc: str, unit: str = "it", *,
                 stream: TextIO | None = None, enabled: bool = True,
                 scale_bytes: bool = False, min_interval_plain: float = 10.0) -> None:
        self.total = total
        self.desc = desc
        self.unit = unit
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.scale_bytes = scale_bytes
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.min_interval = 0.2 if self.tty else min_interval_plain
        self.n = 0.0
        self.start = time.perf_counter()
        self._last_draw = 0.0

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _fmt(self, x: float) -> str:
        return fmt_bytes(x) if self.scale_bytes else fmt_count(x)

    def line(self) -> str:
        elapsed = time.perf_counter() - self.start
        rate = self.n / elapsed if elapsed > 0 else 0.0
        rate_s = f"{self._fmt(rate)}/s" if self.scale_bytes else f"{fmt_count(rate)} {self.unit}/s"
        if self.total:
            frac = min(self.n / self.total, 1.0)
            width = 24
            filled = int(frac * width)
            bar = "#" * filled + "-" * (width - filled)
            eta = (self.total - self.n) / rate if rate > 0 else float("inf")
            return (f"{self.desc} [{bar}] {frac * 100:5.1f}% {self._fmt(self.n)}/{self._fmt(self.total)}"
                    f" {rate_s} elapsed {fmt_duration(elapsed)} ETA {fmt_duration(eta)}")
        return f"{self.desc} {self._fmt(self.n)} {rate_s} elapsed {fmt_duration(elapsed)}"

    def update(self, n: float = 1) -> None:
        self.n += n
        now = time.perf_counter()
        if self.enabled and now - self._last_draw >= self.min_interval:
            self._last_draw = now
            self._draw()

    def _draw(self, final: bool = False) -> None:
        if self.tty:
            self.stream.write("\r\033[K" + self.line() + ("\n" if final else ""))
        else:
            self.stream.write(self.line() + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self._draw(final=True)
            self.enabled = False
