"""What Linux's /proc tells about a process's memory, for the bench scripts (they run on other systems too:
there each reading is None)."""

from __future__ import annotations


def status_kib(key: str, pid: int | str = "self") -> int | None:
    """A `key: <n> kB` line of /proc/<pid>/status (VmRSS, VmHWM, RssFile, ...) in KiB; None where there is none."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None
