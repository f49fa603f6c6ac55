"""What checking the shards' and weights' checksums costs at the start of a run.

Writes --gb GB of prepared text data (random token ids through the shard
writer that `nanolm prepare` uses, so each file's CRC-32 is recorded as it is
written, in shards of --shard-tokens tokens) and a tokenizer-free `tiny` run
config on it, then times, in fresh processes (each file is checked once per
process), --runs times each:

- `verify`: the check alone (`PackedData` of the train split, every file's
  CRC-32 against the manifest) and without it (the manifest's CRC-32s left
  out), the difference being what checking costs;
- `start-up`: from the start of `nanolm train` to its first step (imports,
  data, model, optimizer, the matrix-product peak measured for MFU), with and
  without the check.

The files are read from the page cache when the machine has the memory (a
second reading of data just written); a run on data that is not cached reads
it from disk once for the check, which the first epoch's reads then find in
the cache. Run from the repository root:

    .venv/bin/python bench/checksums.py --gb 1 --runs 3

Prints the medians and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD_VERIFY = """
import sys, time
t = time.perf_counter()
from nanolm.data.shards import PackedData
PackedData(sys.argv[1], "train")
print(time.perf_counter() - t)
"""


def write_data(out: Path, gb: float, shard_tokens: int) -> None:
    import numpy as np

    from nanolm.data.shards import FORMAT_VERSION, MANIFEST, SplitWriter
    from nanolm.io import write_json_atomic
    out.mkdir(parents=True, exist_ok=True)
    n = int(gb * 1e9) // 2  # uint16 tokens
    rng = np.random.default_rng(0)
    w = SplitWriter(out, "train", np.dtype(np.uint16), shard_tokens)
    doc = 1 << 20
    for start in range(0, n, doc):
        k = min(doc, n - start)
        w.append(rng.integers(1, 400, k, dtype=np.uint16), np.array([k]), np.array([True]))
    train = w.finish()
    manifest = {"format": "nanolm-tokens", "version": FORMAT_VERSION, "dtype": "uint16",
                "tokenizer": {"path": "", "fingerprint": "0" * 64, "vocab_size": 400, "eot_id": 0},
                "splits": {"train": train, "val": {"shards": [], "n_tokens": 0, "n_docs": 0}},
                "options": {"format": "text"}}
    write_json_atomic(out / MANIFEST, manifest)
    bare = json.loads(json.dumps(manifest))
    for s in bare["splits"]["train"]["shards"]:
        s.pop("crc32")
    (out.parent / "nocrc").mkdir(exist_ok=True)
    for f in out.iterdir():
        if f.suffix in (".bin", ".idx"):
            target = out.parent / "nocrc" / f.name
            if not target.exists():
                target.symlink_to(f)
    write_json_atomic(out.parent / "nocrc" / MANIFEST, bare)


def start_up(data: Path, run: Path) -> float:
    """Seconds from launching `nanolm train` to its first step's line."""
    shutil.rmtree(run, ignore_errors=True)
    cmd = [sys.executable, "-m", "nanolm", "train", "--preset", "tiny", "--data", str(data), "--out", str(run),
           "--model.vocab_size", "400", "--train.max_steps", "1", "--train.eval_interval", "0",
           "--train.save_interval", "0", "--train.log_interval", "1"]
    t = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    took = None
    for line in p.stdout:  # type: ignore[union-attr]
        if took is None and line.startswith("step "):
            took = time.perf_counter() - t
    p.wait()
    if took is None or p.returncode:
        raise SystemExit(f"nanolm train failed (exit {p.returncode})")
    return took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--shard-tokens", type=int, default=100_000_000)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--workdir", default=None)
    a = ap.parse_args()
    work = Path(a.workdir or tempfile.mkdtemp(prefix="nanolm-checksums-"))
    data = work / "data"
    if not (data / "manifest.json").is_file():
        t = time.perf_counter()
        write_data(data, a.gb, a.shard_tokens)
        print(f"wrote {a.gb:g} GB of shards in {time.perf_counter() - t:.1f} s -> {data}", flush=True)
    res: dict[str, list[float]] = {k: [] for k in ("verify", "no_verify", "start", "start_no_verify")}
    for i in range(a.runs):
        for key, d in (("verify", data), ("no_verify", work / "nocrc")):
            out = subprocess.run([sys.executable, "-c", CHILD_VERIFY, str(d)], capture_output=True, text=True,
                                 check=True)
            res[key].append(float(out.stdout.strip()))
        for key, d in (("start", data), ("start_no_verify", work / "nocrc")):
            res[key].append(start_up(d, work / f"run-{key}-{i}"))
    med = {k: statistics.median(v) for k, v in res.items()}
    cost = med["verify"] - med["no_verify"]
    print(f"{a.gb:g} GB of shards: opening the train split {med['verify']:.2f} s with the check, "
          f"{med['no_verify']:.2f} s without (the check: {cost:.2f} s, {a.gb / max(cost, 1e-9):.1f} GB/s)")
    print(f"start-up to the first step: {med['start']:.2f} s with the check, {med['start_no_verify']:.2f} s "
          f"without: the check is {100 * (med['start'] - med['start_no_verify']) / med['start']:.1f}% of it "
          f"(medians of {a.runs})")
    print(json.dumps({"gb": a.gb, "runs": res, "medians": med}))


if __name__ == "__main__":
    main()
