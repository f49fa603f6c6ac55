"""Data larger than memory: peak RSS of training and of `nanolm prepare` as the data grows 100x.

Two parts, each comparing a large input with a small one; both should peak at
about the same resident set size (RSS), since neither holds its data in memory:

1. train: writes a token set of --gb GB (and one of --small-mb MB) directly in
   `nanolm prepare`'s on-disk format (token shards, document offsets,
   manifest.json; random ids below the vocabulary, documents ended by the
   end-of-text token), written a chunk at a time through prepare's own shard
   writer. On the large set it times the loader: `PackedData.gather` (one
   os.pread per window) against fancy indexing into the shards' memory maps
   (how windows were read before), on the same random windows, cold (the
   shards evicted from the page cache before each batch with posix_fadvise,
   Linux: as when the data is much larger than RAM) and warm, and the growth
   of this process's file-backed RSS (RssFile) over each; the same for
   `Loader.next_batch` (shuffle, read, tensors).
   Then it trains the `tiny` preset for --steps steps on each set, each in a
   child process (`python -m nanolm train --preset tiny ...`, CPU), and reports
   each child's peak RSS and their ratio.
2. prepare: writes JSONL text files of --text-mb sizes (documents of random
   words, Zipf-distributed like real words), trains a tokenizer on a sample of
   the smallest, and runs `python -m nanolm prepare` on each with --workers
   worker processes, reporting the peak RSS and the MB/s of each run.

A child's peak RSS is measured two ways: `os.wait4`'s ru_maxrss, the kernel's
high-water mark of the largest process among the child and the children it
reaped (exact; for prepare usually its main process), and the largest sum of
VmRSS over the child and all its descendants, sampled every 50 ms from /proc
(Linux; a sample can miss a short peak). RSS counts file pages mapped into a
process as well as its own memory: that is why reading windows through a
memory map shows up in it.

Run from the repository root with nanolm installed (`pip install -e .`;
`PYTHONPATH=.` works too):

    python bench/bigdata.py                       # about 5 GB and 50 MB sets, 20 and 200 MB of text
    python bench/bigdata.py --gb 20 --steps 300   # larger; needs the disk space (--workdir)

Everything generated goes under --workdir (default: a new temporary
directory), removed at the end unless --keep. Progress goes to stderr; stdout
gets the tables and, as its last line, one JSON object with every figure
(`--json-out FILE` also writes it to FILE). Child processes run with
OMP_NUM_THREADS=--threads; on a CPU shared with other busy processes, the
times (not the memory figures) vary from run to run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from nanolm.data.loader import Loader

# prepare's own shard writer and split rule, so the generated set is in exactly its format.
from nanolm.data.prepare import val_every
from nanolm.data.shards import FORMAT_VERSION, MANIFEST, SPLITS, Manifest, PackedData, SplitWriter, token_dtype, write_splits
from nanolm.io import write_json_atomic
from nanolm.progress import fmt_bytes
from nanolm.tokenizer import EOT_ID
from procfs import status_kib  # bench/procfs.py, beside this script

_T0 = time.perf_counter()
LINUX = sys.platform.startswith("linux")


def say(msg: str) -> None:
    """Progress line on stderr, so stdout holds only the report."""
    print(f"[{time.perf_counter() - _T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- generated data

def write_token_set(out: Path, n_tokens: int, *, vocab_size: int = 6400, mean_doc: int = 1000,
                    shard_tokens: int = 100_000_000, val_fraction: float = 0.01, seed: int = 0,
                    chunk: int = 1 << 23) -> dict[str, Any]:
    """A prepared data directory of n_tokens random ids in [1, vocab_size), in documents of 1..2*mean_doc
    tokens each ended by EOT, split and sharded as `nanolm prepare` does; written `chunk` tokens at a time."""
    out.mkdir(parents=True, exist_ok=True)
    dtype = token_dtype(vocab_size)
    k = val_every(val_fraction)
    rng = np.random.default_rng(seed)
    writers = {split: SplitWriter(out, split, dtype, shard_tokens) for split in SPLITS}
    done = docs = 0
    while done < n_tokens:
        n = min(chunk, n_tokens - done)
        tokens = rng.integers(EOT_ID + 1, vocab_size, size=n, dtype=dtype)
        lens = rng.integers(1, 2 * mean_doc, size=2 * (n // mean_doc) + 2)  # more documents than the chunk holds
        ends = np.cumsum(lens)
        last = int(np.searchsorted(ends, n))  # the document the chunk ends in, cut to end with it
        lens = lens[:last + 1]
        lens[-1] = n - (int(ends[last - 1]) if last else 0)
        tokens[np.cumsum(lens) - 1] = EOT_ID
        is_val = (k > 0) & (np.arange(docs, docs + len(lens)) % max(k, 1) == 1)  # prepare's split rule
        write_splits(writers, is_val, tokens, lens, np.ones(len(lens), dtype=bool))
        done += n
        docs += len(lens)
    splits = {split: w.finish() for split, w in writers.items()}
    manifest = {
        "format": "nanolm-tokens", "version": FORMAT_VERSION,
        "tokenizer": {"path": "", "fingerprint": hashlib.sha256(b"bench/bigdata.py random ids").hexdigest(),
                      "vocab_size": vocab_size, "eot_id": EOT_ID},
        "dtype": dtype.name, "splits": splits,
        "totals": {"n_tokens": n_tokens, "n_docs": docs, "bytes": 0}, "sources": [],
        "options": {"val_fraction": val_fraction, "skip_bad": False, "shard_tokens": shard_tokens},
        "split_policy": {"val_every": k, "rule": "document i goes to val when val_every > 0 and i % val_every == 1"},
        "generated_by": "bench/bigdata.py",
    }
    write_json_atomic(out / MANIFEST, manifest)
    return manifest


def _lexicon(rng: np.random.Generator, n: int = 20000) -> list[str]:
    """n distinct made-up words of 1 to 4 syllables."""
    syllables = ["ka", "to", "ri", "an", "el", "mo", "su", "ne", "la", "di", "or", "ve", "po", "qu", "im", "sa",
                 "the", "er", "in", "on", "st", "re", "ch", "ou", "ba", "gi", "fu", "wy", "ex", "al", "um", "ni"]
    words: dict[str, None] = {}
    while len(words) < n:
        k = int(rng.integers(1, 5))
        words["".join(syllables[i] for i in rng.integers(0, len(syllables), size=k))] = None
    return list(words)


def write_text(path: Path, nbytes: int, seed: int = 0) -> int:
    """A JSONL file of about nbytes: {"text": ...} documents of 3..60 sentences of 4..20 words drawn
    with Zipf frequencies. Returns its size."""
    rng = np.random.default_rng(seed)
    lexicon = np.array(_lexicon(rng), dtype=object)
    p = 1.0 / np.arange(1, len(lexicon) + 1) ** 1.1
    p /= p.sum()
    written = 0
    with open(path, "w", encoding="utf-8") as f:
        while written < nbytes:
            words = lexicon[rng.choice(len(lexicon), size=1 << 17, p=p)].tolist()
            cuts = np.cumsum(rng.integers(4, 21, size=len(words) // 4)).tolist()
            sentences = [" ".join(words[a:b]).capitalize() + "." for a, b in zip([0, *cuts], cuts) if b <= len(words)]
            doc_cuts = np.cumsum(rng.integers(3, 61, size=len(sentences))).tolist()
            lines = [json.dumps({"text": " ".join(sentences[a:b])}) + "\n"
                     for a, b in zip([0, *doc_cuts], doc_cuts) if b <= len(sentences)]
            for line in lines:
                f.write(line)
                written += len(line)
                if written >= nbytes:
                    break
    return path.stat().st_size


# ----------------------------------------------------------------------------- child processes

@dataclass
class ChildRun:
    seconds: float
    peak_rss_bytes: int  # ru_maxrss from os.wait4: the largest of the command and the children it reaped
    tree_peak_rss_bytes: int | None  # largest sampled sum of VmRSS over the command and its descendants (Linux)


# Runs argv[2:] and writes "exit_code ru_maxrss" to argv[1]. A fresh interpreter of about 10 MB: a
# child's ru_maxrss starts from its parent's peak at the fork, which for this bench would be the
# memory it used itself (up to GBs after reading through memory maps), not the command's.
_LAUNCHER = """import os, sys
pid = os.posix_spawn(sys.argv[2], sys.argv[2:], os.environ)
_, status, usage = os.wait4(pid, 0)
with open(sys.argv[1], "w") as f:
    f.write(f"{os.waitstatus_to_exitcode(status)} {usage.ru_maxrss}")
"""


def _process_tree(root: int) -> list[int]:
    """root and its descendants, from the parent ids in /proc/*/stat."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])  # the command name may hold spaces or ')'
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo += children.get(pid, [])
    return tree


def run_child(cmd: list[str], log: Path, threads: int) -> ChildRun:
    """Run cmd (an absolute executable first) to completion, output to log, measuring its peak RSS;
    SystemExit with the log's tail on failure."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
    result = log.with_suffix(".rusage")
    start = time.perf_counter()
    with open(log, "wb") as f:
        launcher = subprocess.Popen([sys.executable, "-c", _LAUNCHER, str(result), *cmd], stdout=f,
                                    stderr=subprocess.STDOUT, env=env)
    tree_peak = [0]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.05):
            rss = [status_kib("VmRSS", pid) for pid in _process_tree(launcher.pid)[1:]]  # not the launcher
            tree_peak[0] = max(tree_peak[0], sum(r for r in rss if r) * 1024)

    sampler = threading.Thread(target=sample, daemon=True)
    if LINUX:
        sampler.start()
    launcher.wait()
    seconds = time.perf_counter() - start
    done.set()
    if LINUX:
        sampler.join()
    code, maxrss = (int(x) for x in result.read_text(encoding="ascii").split()) if result.is_file() else (-1, 0)
    if launcher.returncode != 0 or code != 0:
        tail = log.read_text(encoding="utf-8", errors="replace").splitlines()[-15:]
        raise SystemExit(f"{' '.join(cmd)} failed (exit {code}); the end of {log}:\n" + "\n".join(tail))
    peak = maxrss if sys.platform == "darwin" else maxrss * 1024  # macOS: bytes, Linux: KiB
    return ChildRun(seconds, peak, tree_peak[0] if LINUX else None)


# ----------------------------------------------------------------------------- 1. train

def _memmap_gather(data: PackedData, windows: np.ndarray, seq_len: int) -> np.ndarray:
    """Windows read by fancy indexing into the shards' memory maps: the baseline (how gather read them before)."""
    starts = np.concatenate([[0], np.cumsum(data.n_windows(seq_len))])
    shard = np.searchsorted(starts, windows, side="right") - 1
    out = np.empty((len(windows), seq_len + 1), dtype=np.int64)
    cols = np.arange(seq_len + 1)
    for s in np.unique(shard):
        rows = np.nonzero(shard == s)[0]
        out[rows] = data.shards[s][(windows[rows] - starts[s])[:, None] * seq_len + cols]
    return out


def _evict(data: PackedData) -> bool:
    """Drop the shards' pages from the page cache (clean pages not mapped anywhere); False where unsupported."""
    if not hasattr(os, "posix_fadvise"):
        return False
    split = data.manifest.splits[data.split]
    for s in split["shards"]:
        fd = os.open(data.data_dir / s["bin"], os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


def _read_ahead_kib(path: Path) -> int | None:
    """The read-ahead of the block device holding path (Linux): how much a page fault in a memory map reads."""
    dev = os.stat(path).st_dev
    base = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    for queue in (base / "queue", base / ".." / "queue"):  # a whole disk, or a partition of one
        try:
            return int((queue / "read_ahead_kb").read_text())
        except (OSError, ValueError):
            continue
    return None


def _rss_file() -> int | None:
    kib = status_kib("RssFile") if LINUX else None
    return None if kib is None else kib * 1024


def _time_batches(read: Any, batches: np.ndarray, seq_len: int, evict: Any = None) -> list[float]:
    """Seconds of each read(windows, seq_len) over the batches; evict() before each one (untimed) if given."""
    times = []
    for w in batches:
        if evict is not None:
            evict()
        t0 = time.perf_counter()
        read(w, seq_len)
        times.append(time.perf_counter() - t0)
    return times


def loader_figures(data_dir: Path, batch_size: int, seq_len: int, n_batches: int, cold_batches: int,
                   seed: int) -> dict[str, Any]:
    """Per-batch read times and RSS growth, pread against memory-map indexing, cold and warm (see module doc).

    Cold: the shards are evicted from the page cache before each batch, as when the data is much larger
    than RAM and a random window is almost never in memory. Warm: a second pass over the same batches.
    """
    data = PackedData(data_dir)
    n = int(data.n_windows(seq_len).sum())
    batches = np.random.default_rng(seed).integers(0, n, size=(n_batches, batch_size))
    res: dict[str, Any] = {"batch_size": batch_size, "seq_len": seq_len, "batches": n_batches,
                           "cold_batches": cold_batches, "windows": n, "read_ahead_kib": _read_ahead_kib(data_dir)}
    can_evict = _evict(data)

    def record(name: str, read: Any, rewind: Any = lambda: None) -> None:
        before = _rss_file()
        if can_evict:
            rewind()
            res[f"{name}_cold_median_s"] = statistics.median(
                _time_batches(read, batches[:cold_batches], seq_len, lambda: _evict(data)))
        rewind()
        _time_batches(read, batches, seq_len)  # brings the pages in
        rewind()
        times = _time_batches(read, batches, seq_len)
        res[f"{name}_warm_median_s"] = statistics.median(times)
        after = _rss_file()
        res[f"{name}_rss_growth_bytes"] = None if before is None or after is None else after - before
        cold = res.get(f"{name}_cold_median_s")
        say(f"loader {name}: " + ("" if cold is None else f"cold {cold * 1e6:.0f} us/batch, ")
            + f"warm {res[f'{name}_warm_median_s'] * 1e6:.0f} us/batch")

    record("pread", data.gather)
    record("memmap", lambda w, t: _memmap_gather(data, w, t))
    # The whole Loader (shuffle, read, tensors): its first batches, from the start of the stream each time.
    loader = Loader(data, batch_size, seq_len, seed=seed)
    start = loader.state_dict()
    record("Loader", lambda w, t: loader.next_batch(), lambda: loader.load_state_dict(start))
    return res


def train_part(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    res: dict[str, Any] = {"steps": args.steps, "sets": {}}
    sizes = {"big": int(args.gb * 1e9) // 2, "small": int(args.small_mb * 1e6) // 2}  # uint16 tokens
    for name, n_tokens in sizes.items():
        t0 = time.perf_counter()
        say(f"writing the {name} token set: {n_tokens:,} tokens ({fmt_bytes(2 * n_tokens)})")
        m = write_token_set(work / f"tokens-{name}", n_tokens, seed=args.seed)
        res["sets"][name] = {"tokens": n_tokens, "bytes": 2 * n_tokens, "shards": len(m["splits"]["train"]["shards"]),
                             "write_s": time.perf_counter() - t0}
    res["loader"] = loader_figures(work / "tokens-big", 8, 256, args.loader_batches, args.cold_batches,
                                   args.seed)  # the tiny preset's batch shape
    for name in sizes:
        say(f"training the tiny preset for {args.steps} steps on the {name} set")
        cmd = [sys.executable, "-m", "nanolm", "train", "--preset", "tiny", "--data", str(work / f"tokens-{name}"),
               "--out", str(work / f"run-{name}"), "--train.max_steps", str(args.steps), "--train.device", "cpu",
               "--train.seed", str(args.seed)]
        run = run_child(cmd, work / f"train-{name}.log", args.threads)
        res["sets"][name].update(asdict(run))
        say(f"  peak RSS {fmt_bytes(run.peak_rss_bytes)}, {run.seconds:.0f}s")
    res["peak_rss_ratio"] = res["sets"]["big"]["peak_rss_bytes"] / res["sets"]["small"]["peak_rss_bytes"]
    res["data_ratio"] = sizes["big"] / sizes["small"]
    return res


# ----------------------------------------------------------------------------- 2. prepare

def prepare_part(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from nanolm.data.formats import iter_documents
    from nanolm.tokenizer import train_tokenizer

    res: dict[str, Any] = {"workers": args.workers, "runs": []}
    files = []
    for mb in args.text_mb_list:
        path = work / f"text-{mb:g}mb.jsonl"
        t0 = time.perf_counter()
        size = write_text(path, int(mb * 1e6), seed=args.seed)
        say(f"wrote {path.name}: {fmt_bytes(size)} in {time.perf_counter() - t0:.1f}s")
        files.append((path, size))
    sample = work / "tokenizer-sample.jsonl"
    write_text(sample, int(2e6), seed=args.seed)
    say(f"training a tokenizer (vocab {args.vocab_size}) on {fmt_bytes(sample.stat().st_size)} of the same text")
    tok = train_tokenizer(iter_documents(sample), work / "tokenizer", vocab_size=args.vocab_size, quiet=True)
    res["vocab_size"] = tok.vocab_size
    for path, size in files:
        runs = []
        for r in range(args.repeats):
            out = work / f"prepared-{path.stem}-{r}"
            say(f"nanolm prepare {path.name} ({fmt_bytes(size)}), {args.workers} workers, run {r + 1}/{args.repeats}")
            cmd = [sys.executable, "-m", "nanolm", "prepare", str(path), "--tokenizer", str(work / "tokenizer"),
                   "--out", str(out), "--workers", str(args.workers)]
            run = run_child(cmd, work / f"prepare-{path.stem}-{r}.log", args.threads)
            manifest = Manifest.read(out)
            runs.append({**asdict(run), "tokens": manifest.totals["n_tokens"],
                         "tokenize_mb_per_s": manifest.throughput["mb_per_s"],
                         "wall_mb_per_s": size / 1e6 / run.seconds})
            say(f"  peak RSS {fmt_bytes(run.peak_rss_bytes)}, {runs[-1]['wall_mb_per_s']:.2f} MB/s wall")
            shutil.rmtree(out)
        med = {key: statistics.median(r[key] for r in runs) for key in runs[0] if runs[0][key] is not None}
        res["runs"].append({"file": path.name, "bytes": size, "repeats": args.repeats, **med})
    big, small = res["runs"][-1], res["runs"][0]
    res["peak_rss_ratio"] = big["peak_rss_bytes"] / small["peak_rss_bytes"]
    res["data_ratio"] = big["bytes"] / small["bytes"]
    return res


# ----------------------------------------------------------------------------- report

def print_report(res: dict[str, Any]) -> None:
    tr = res.get("train")
    if tr:
        lo = tr["loader"]
        print(f"\nloader on the big set: {lo['windows']:,} windows, batches of {lo['batch_size']} x "
              f"{lo['seq_len'] + 1} tokens at random; median time per batch over {lo['cold_batches']} batches "
              f"read cold (page cache emptied before each) and {lo['batches']} read warm")
        print(f"  {'read':<10}{'cold us/batch':>15}{'warm us/batch':>15}{'RssFile growth':>16}")
        for name in ("pread", "memmap", "Loader"):
            cold, growth = lo.get(f"{name}_cold_median_s"), lo[f"{name}_rss_growth_bytes"]
            print(f"  {name:<10}{'-' if cold is None else f'{cold * 1e6:.0f}':>15}"
                  f"{lo[f'{name}_warm_median_s'] * 1e6:>15.0f}{'-' if growth is None else fmt_bytes(growth):>16}")
        print("  pread: PackedData.gather; memmap: fancy indexing into the shards' memory maps (the earlier way);")
        print("  Loader: next_batch (shuffle, pread, tensors), from the start of its stream")
        if lo["read_ahead_kib"] is not None:
            print(f"  the disk's read-ahead, which a fault in a memory map reads: {lo['read_ahead_kib']} KiB")
        print(f"\ntrain: tiny preset, {tr['steps']} steps on CPU, one child process per token set")
        print(f"  {'set':<8}{'tokens':>16}{'on disk':>12}{'peak RSS':>12}{'tree peak':>12}{'seconds':>9}")
        for name, s in tr["sets"].items():
            tree = s["tree_peak_rss_bytes"]
            print(f"  {name:<8}{s['tokens']:>16,}{fmt_bytes(s['bytes']):>12}{fmt_bytes(s['peak_rss_bytes']):>12}"
                  f"{'-' if tree is None else fmt_bytes(tree):>12}{s['seconds']:>9.0f}")
        print(f"  peak RSS big / small = {tr['peak_rss_ratio']:.3f} for {tr['data_ratio']:.0f}x the data")
    pr = res.get("prepare")
    if pr:
        print(f"\nprepare: nanolm prepare, {pr['workers']} workers, tokenizer vocab {pr['vocab_size']} "
              f"(median of {pr['runs'][0]['repeats']} run(s) each)")
        print(f"  {'file':<20}{'size':>11}{'tokens':>14}{'peak RSS':>12}{'tree peak':>12}{'MB/s tok':>10}"
              f"{'MB/s wall':>11}")
        for r in pr["runs"]:
            tree = r.get("tree_peak_rss_bytes")
            print(f"  {r['file']:<20}{fmt_bytes(r['bytes']):>11}{int(r['tokens']):>14,}"
                  f"{fmt_bytes(r['peak_rss_bytes']):>12}{'-' if tree is None else fmt_bytes(tree):>12}"
                  f"{r['tokenize_mb_per_s']:>10.2f}{r['wall_mb_per_s']:>11.2f}")
        print(f"  peak RSS largest / smallest = {pr['peak_rss_ratio']:.3f} for {pr['data_ratio']:.0f}x the text")
    print(f"\nthis process: peak RSS {fmt_bytes(res['self_peak_rss_bytes'])}; total {res['elapsed_s']:.0f}s")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--parts", default="train,prepare", help="which of train,prepare to run")
    p.add_argument("--workdir", type=Path, default=None,
                   help="where to write the generated data (None: a new temporary directory)")
    p.add_argument("--keep", action="store_true", help="keep what was generated instead of removing it at the end")
    p.add_argument("--gb", type=float, default=5.0, help="size of the large token set, GB (uint16 tokens)")
    p.add_argument("--small-mb", type=float, default=50.0, help="size of the small token set, MB")
    p.add_argument("--steps", type=int, default=100, help="training steps per token set")
    p.add_argument("--loader-batches", type=int, default=2000, help="batches timed warm per way of reading")
    p.add_argument("--cold-batches", type=int, default=100,
                   help="of those, batches timed cold (the shards evicted from the page cache before each)")
    p.add_argument("--text-mb", default="20,200", help="comma-separated sizes of the text files to prepare, MB")
    p.add_argument("--workers", type=int, default=2, help="nanolm prepare --workers")
    p.add_argument("--vocab-size", type=int, default=4096, help="vocabulary of the tokenizer trained for prepare")
    p.add_argument("--repeats", type=int, default=1, help="runs of nanolm prepare per file (median)")
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of the child processes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", type=Path, default=None, help="also write the JSON results to this file")
    args = p.parse_args(argv)
    args.parts_list = [s.strip() for s in args.parts.split(",") if s.strip()]
    bad = [s for s in args.parts_list if s not in ("train", "prepare")]
    if bad or not args.parts_list:
        p.error(f"--parts: unknown part(s) {', '.join(bad) or '(none)'}; choose from train,prepare")
    try:
        args.text_mb_list = sorted(float(s) for s in args.text_mb.split(",") if s.strip())
    except ValueError:
        p.error(f"--text-mb {args.text_mb!r}: give comma-separated numbers of MB, e.g. 20,200")
    if not args.text_mb_list or min(args.text_mb_list) <= 0:
        p.error("--text-mb: give at least one positive size")
    for name in ("gb", "small_mb"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    for name in ("steps", "loader_batches", "cold_batches", "workers", "repeats", "threads", "vocab_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="nanolm-bigdata-"))
    work.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(work).free
    need = ("train" in args.parts_list) * (args.gb + args.small_mb / 1e3) * 1e9 \
        + ("prepare" in args.parts_list) * sum(args.text_mb_list) * 1e6 * 1.5
    if need > 0.9 * free:
        raise SystemExit(f"{work}: {fmt_bytes(free)} free, the bench needs about {fmt_bytes(need)}; "
                         "lower --gb / --text-mb, or choose another --workdir")
    say(f"working in {work}")
    res: dict[str, Any] = {"workdir": str(work), "args": {k: (str(v) if isinstance(v, Path) else v)
                                                          for k, v in vars(args).items()}}
    try:
        if "train" in args.parts_list:
            res["train"] = train_part(args, work)
        if "prepare" in args.parts_list:
            res["prepare"] = prepare_part(args, work)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
            say(f"removed {work}")
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    res["self_peak_rss_bytes"] = rss if sys.platform == "darwin" else rss * 1024
    res["elapsed_s"] = time.perf_counter() - _T0
    print_report(res)
    print(json.dumps(res), flush=True)
    if args.json_out:
        write_json_atomic(args.json_out, res)
        say(f"wrote {args.json_out}")
    return res


if __name__ == "__main__":
    main()
