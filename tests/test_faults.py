"""Hardening: SIGKILL at any moment and full disks lose nothing.

Kill tests (slow): a tiny training run is killed with SIGKILL more than 20
times (mid-step, mid-evaluation, mid-checkpoint-write, mid-pruning, while
writing best.json or a metrics line, at seeded-random moments) and resumed
after each kill; every checkpoint on disk must load after every kill, and the
final weights and optimizer state must equal, bit for bit, those of an
uninterrupted `python -m nanolm train`. `nanolm prepare` is killed (with its
worker processes) at several moments; its output directory must hold the
previous complete data or no manifest, and a re-run must write the same bytes.

Disk tests (fast): a write that fails for lack of space during a checkpoint
save, a shard write or the manifest write leaves the previous files as they
were, leaves no temporary files, and stops with a one-line UserError that says
what failed and how much space is needed and free.
"""

from __future__ import annotations

import errno
import json
import os
import queue
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

import nanolm.data.prepare as prep
import nanolm.data.shards as shards_module
from nanolm.data.prepare import prepare
from nanolm.errors import UserError
from nanolm import checkpoint as ckpt
from nanolm.train.trainer import train

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
       "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
KILLED = -signal.SIGKILL if hasattr(signal, "SIGKILL") else None
posix_only = pytest.mark.skipif(os.name != "posix", reason="SIGKILL, fork and process groups are POSIX")

# --- the training run under fire ----------------------------------------------------------------

MAX_STEPS = 90


def train_args(data_dir: Path, out: Path) -> list[str]:
    """A tiny run with frequent checkpoints and evaluations, dropout on (so the RNG state must resume too)."""
    over = {"data.path": data_dir, "model.vocab_size": 400, "model.d_model": 32, "model.n_layer": 2,
            "model.n_head": 4, "model.n_kv_head": 2, "model.max_seq_len": 32, "model.dropout": 0.1,
            "train.seq_len": 32, "train.batch_size": 4, "train.max_steps": MAX_STEPS, "train.log_interval": 1,
            "train.eval_interval": 5, "train.eval_batches": 2, "train.save_interval": 3, "train.keep_last": 2,
            "optim.warmup_steps": 3, "optim.lr": 3e-3, "optim.min_lr": 3e-4}
    return ["--preset", "tiny", "--out", str(out), *[a for k, v in over.items() for a in (f"--{k}", str(v))]]


# A fork server: it imports torch and nanolm once (about 3 s of a `python -m nanolm train` start on a
# small machine) and then forks one child per training attempt, so that 20+ killed attempts fit in a CI
# test. Each child is a whole `nanolm train` run (nanolm.cli.main), killed with SIGKILL like any
# process. The parent runs no torch op, so no thread pool exists at fork time. A job can ask the child to
# kill itself at a chosen point (`fault`), through wrappers installed in the child only; every child
# records where it is (`phase`) in a small file, which says where an outside kill landed.
FORK_SERVER = r'''
import collections, io, json, os, shutil, signal, sys, traceback
from pathlib import Path

import torch
import torch._dynamo  # noqa: F401  (the optimizer's first use imports it: pay that once, here)
import nanolm.cli
import nanolm.checkpoint as ckpt
import nanolm.io
import nanolm.train.trainer as trainer
import nanolm.train.metrics as metrics
import nanolm.train.validation as validation


def child(job):
    log = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    phase = os.open(job["phase"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    point, nth = job.get("point"), job.get("nth", 1)
    seen = collections.Counter()
    now = {"step": 0, "save": 0}

    def mark(text):
        os.pwrite(phase, text.encode().ljust(120)[:120], 0)

    def hit(name):
        seen[name] += 1
        return name == point and seen[name] == nth

    def die(text):
        mark("killed: " + text)
        os.kill(os.getpid(), signal.SIGKILL)

    mark("setup")
    # The MFU denominator: a constant instead of a 0.5 s matmul benchmark per attempt (it feeds only the
    # MFU column, and uses its own generator, so the run is the same either way).
    trainer.peak_flops = lambda device, dtype: (1e12, "constant (fault-injection test)")

    real_lr_at = trainer.lr_at
    def lr_at(step, *a, **k):
        now["step"] = step + 1  # the step being computed, 1-based as logged
        mark(f"step {step + 1}")
        return real_lr_at(step, *a, **k)
    trainer.lr_at = lr_at

    real_clip = torch.nn.utils.clip_grad_norm_
    def clip(*a, **k):
        if hit("step"):
            die(f"mid-step {now['step']} (after backward, before the optimizer step)")
        return real_clip(*a, **k)
    torch.nn.utils.clip_grad_norm_ = clip

    real_eval = validation.iter_eval_batches
    def eval_batches(*a, **k):
        mark(f"eval after step {now['step']}")
        for i, b in enumerate(real_eval(*a, **k)):
            if i == 1 and hit("eval"):
                die(f"mid-eval after step {now['step']} (one of two batches done)")
            yield b
    validation.iter_eval_batches = eval_batches

    real_save = ckpt.save_checkpoint
    def save_checkpoint(run_dir, step, *a, **k):
        now["save"] = step
        mark(f"save {step}: start")
        out = real_save(run_dir, step, *a, **k)
        mark(f"save {step}: done")
        return out
    ckpt.save_checkpoint = save_checkpoint

    real_save_file = ckpt.save_file
    def save_file(tensors, path, *a, **k):
        mark(f"save {now['save']}: writing model.safetensors")
        real_save_file(tensors, path, *a, **k)
        if hit("weights"):
            die(f"mid-checkpoint-write {now['save']} (weights written, optimizer.pt not yet)")
        mark(f"save {now['save']}: json")
    ckpt.save_file = save_file

    real_torch_save = torch.save
    def torch_save(obj, f, *a, **k):
        mark(f"save {now['save']}: writing optimizer.pt")
        if hit("optimizer"):
            buf = io.BytesIO()
            real_torch_save(obj, buf)
            Path(f).write_bytes(buf.getvalue()[: len(buf.getvalue()) // 2])
            die(f"mid-checkpoint-write {now['save']} (optimizer.pt half written)")
        real_torch_save(obj, f, *a, **k)
        mark(f"save {now['save']}: tokenizer copy, fsync, rename")
    torch.save = torch_save

    real_fsync_dir = nanolm.io.fsync_dir
    def fsync_dir(path):  # atomic_directory's last call, after the rename
        real_fsync_dir(path)
        if hit("renamed"):
            die(f"checkpoint {now['save']} renamed into place, best.json and pruning not done")
        mark(f"save {now['save']}: best.json, pruning")
    nanolm.io.fsync_dir = fsync_dir

    real_write_json = ckpt.write_json_atomic
    def write_json_atomic(path, obj):
        if Path(path).name == "best.json" and hit("best"):
            # what write_json_atomic leaves when killed mid-write: a torn temporary file beside best.json
            Path(path).with_name(f".best.json.{os.getpid()}.0badc0de.tmp").write_text(json.dumps(obj)[:9])
            die(f"writing best.json for checkpoint {now['save']} (torn temp file left)")
        real_write_json(path, obj)
    ckpt.write_json_atomic = write_json_atomic

    real_rmtree = shutil.rmtree
    def rmtree(path, *a, **k):
        name = Path(path).name
        if (name.startswith("step-") or name.startswith(".del-step-")) and hit("prune"):
            # missing_ok: a directory a kill left half deleted (cleared as a leftover) may have lost it already
            (Path(path) / "model.safetensors").unlink(missing_ok=True)
            die(f"pruning {name} while saving {now['save']} (model.safetensors deleted, the rest not)")
        return real_rmtree(path, *a, **k)
    shutil.rmtree = rmtree

    real_write = metrics.MetricsWriter.write
    def write(self, record):
        if hit("metrics"):
            line = json.dumps(record)
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(line[: len(line) // 2])
            die(f"writing metrics.jsonl at step {record.get('step')} (half a line written)")
        real_write(self, record)
    metrics.MetricsWriter.write = write

    return nanolm.cli.main(["train", *job["args"]])


for line in sys.stdin:
    job = json.loads(line)
    sys.stdout.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = child(job)
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    print(json.dumps({"pid": pid}), flush=True)
    _, status = os.waitpid(pid, 0)
    sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else 0
    print(json.dumps({"pid": pid, "returncode": -sig if sig else os.WEXITSTATUS(status)}), flush=True)
'''


class ForkServer:
    """Runs training attempts as children of the fork server; kill(), wait() and phase() drive one attempt."""

    def __init__(self, dir: Path) -> None:
        self.dir = dir
        (dir / "fork_server.py").write_text(FORK_SERVER)
        self.log = dir / "attempts.log"
        self.phase_file = dir / "phase"
        self.proc = subprocess.Popen([sys.executable, str(dir / "fork_server.py")], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=ENV, cwd=dir)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.pid: int | None = None
        self._ended: int | None = None  # the return code ended() saw

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(json.loads(line))
        self.lines.put(None)

    def _next(self, timeout: float) -> dict:
        try:
            msg = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no word from the fork server in {timeout:.0f}s; log:\n{self.tail()}") from None
        assert msg is not None, f"the fork server died; log:\n{self.tail()}"
        return msg

    def start(self, args: list[str], point: str | None = None, nth: int = 1) -> None:
        with open(self.log, "a") as f:
            f.write(f"\n=== attempt: {point or 'no self-kill'} (nth {nth})\n")
        self.phase_file.write_bytes(b"")
        job = {"args": args, "point": point, "nth": nth, "log": str(self.log), "phase": str(self.phase_file)}
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        self.pid = self._next(60)["pid"]

    def phase(self) -> str:
        return self.phase_file.read_bytes().decode(errors="replace").strip()

    def ended(self) -> bool:
        """Whether the attempt has ended (its return code is kept for wait())."""
        if self._ended is None:
            try:
                msg = self.lines.get_nowait()
            except queue.Empty:
                return False
            assert msg is not None, f"the fork server died; log:\n{self.tail()}"
            self._ended = msg["returncode"]
        return True

    def kill(self) -> None:
        """SIGKILL the attempt, unless it has ended (its pid may then belong to another process)."""
        if self.pid is not None and not self.ended():
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:  # it ended just now
                pass

    def wait(self, timeout: float = 120) -> int:
        if self._ended is None:
            self._ended = self._next(timeout)["returncode"]
        rc, self._ended, self.pid = self._ended, None, None  # the pid is reaped: it may be reused
        return rc

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:] if self.log.exists() else ""

    def close(self) -> None:
        self.kill()  # an attempt still running after a failed check
        self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def first_int(text: str) -> int:
    m = re.search(r"\d+", text)
    return int(m.group()) if m else 0


def check_checkpoints(run: Path) -> list[int]:
    """Every complete checkpoint of `run` loads strictly; best.json, if any, names one of them. Returns the steps."""
    steps = []
    for d in ckpt.step_dirs(run):
        step = int(d.name.removeprefix("step-"))
        model, src = ckpt.load_model(d)  # config.json and model.safetensors, strictly
        assert src == d and ckpt.read_run_config(d).train.max_steps == MAX_STEPS
        assert ckpt.read_json(d / "state.json", "training state")["step"] == step
        assert ckpt.read_optimizer(d)["state"], d
        steps.append(step)
    best = run / "checkpoints" / "best.json"
    if best.exists():
        best_step = json.loads(best.read_text())["step"]
        assert best_step in steps, f"best.json names step {best_step}, not on disk (steps: {steps})"
    return steps


def landed(phase: str) -> str:
    """Where a kill landed, in the words of the report."""
    p = phase.removeprefix("killed: ")
    if p.startswith("save") or "checkpoint" in p or "best.json" in p or "pruning" in p:
        return "checkpoint write"
    if "eval" in p:
        return "evaluation"
    if p.startswith("step") or "mid-step" in p:
        return "training step"
    if "metrics" in p:
        return "metrics write"
    return "start-up"


# The kills, in order: a self-kill at a chosen point (see FORK_SERVER), or "random": a SIGKILL from this
# test at a seeded-random moment 1-3 steps past the newest checkpoint ("random-setup": during start-up).
SCHEDULE = ["weights", "random", "metrics", "random", "eval", "random", "random-setup", "optimizer", "random",
            "renamed", "random", "best", "random", "prune", "random", "step", "random",
            "weights", "random", "metrics", "random", "eval", "random", "optimizer", "random-setup", "random",
            "renamed", "random", "best", "random", "prune", "random", "step", "random", "random", "random"]


@pytest.mark.slow
@posix_only
def test_training_killed_at_random_and_chosen_moments_resumes_bit_identically(data_dir, tmp_path):
    rng = random.Random(7)
    run, ref = tmp_path / "run", tmp_path / "ref"
    # The uninterrupted reference: a real `python -m nanolm train`, on the other core meanwhile.
    reference = subprocess.Popen([sys.executable, "-m", "nanolm", "train", *train_args(data_dir, ref)], env=ENV,
                                 cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    server = ForkServer(tmp_path)
    kills: list[tuple[str, str]] = []  # (what was asked, where it landed)
    try:
        for what in SCHEDULE:
            steps = check_checkpoints(run)
            resume = ["--resume"] if steps else []
            newest = steps[-1] if steps else 0
            if what.startswith("random"):
                server.start(train_args(data_dir, run) + resume)
                if what == "random":  # wait until 1-3 steps past the newest checkpoint are under way
                    target, deadline = newest + rng.randint(0, 2), time.monotonic() + 60
                    while not server.ended() and time.monotonic() < deadline:
                        p = server.phase()
                        if p.startswith(("step", "eval", "save")) and first_int(p) > target:
                            break
                        time.sleep(0.002)
                time.sleep(rng.uniform(0.0, 0.15) if what == "random-setup" else rng.uniform(0.0, 0.06))
                phase = server.phase()
                server.kill()
            else:
                server.start(train_args(data_dir, run) + resume, point=what, nth=3 if what == "metrics" else 1)
            rc = server.wait()
            if not what.startswith("random"):
                phase = server.phase()
                assert phase.startswith("killed: "), phase
            assert rc == KILLED, f"attempt {what!r} ended with {rc}, not by SIGKILL (phase {phase!r}); " \
                                 f"log:\n{server.tail()}"
            kills.append((what, phase))
            print(f"kill {len(kills)} ({what}): {phase}")  # shown if a later check fails
        # Every checkpoint left by the last kill loads; then the run goes to its end.
        steps = check_checkpoints(run)
        server.start(train_args(data_dir, run) + (["--resume"] if steps else []))
        assert server.wait() == 0, server.tail()
    finally:
        server.close()
        try:
            reference.wait(180)
        except subprocess.TimeoutExpired:
            reference.kill()
    assert reference.returncode == 0, reference.stderr.read()[-2000:]

    assert len(kills) >= 20
    where = [landed(p) for _, p in kills]
    print(f"\n{len(kills)} kills: " + ", ".join(f"{w} {where.count(w)}" for w in sorted(set(where))))
    for what, p in kills:
        print(f"  {what:>12}: {p}")
    assert {"checkpoint write", "evaluation", "training step"} <= set(where)
    # metrics.jsonl: what the kills left in it (reported, not asserted)
    lines = (run / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(x)["step"] for x in lines if x.startswith("{") and x.endswith("}") and '"loss"' in x]
    print(f"metrics.jsonl: {len(lines)} lines, {sum(not x.endswith('}') for x in lines)} torn, "
          f"{len(steps) - len(set(steps))} duplicated train steps")

    final = f"step-{MAX_STEPS:08d}"
    a, b = run / "checkpoints" / final, ref / "checkpoints" / final
    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    oa, ob = ckpt.read_optimizer(a), ckpt.read_optimizer(b)
    assert oa["state"].keys() == ob["state"].keys()
    assert all(torch.equal(oa["state"][n][k], ob["state"][n][k]) for n in oa["state"] for k in oa["state"][n])
    sa, sb = (json.loads((d / "state.json").read_text()) for d in (a, b))
    assert sa["loader"] == sb["loader"] and sa["rng"] == sb["rng"] and sa["best_value"] == sb["best_value"]
    assert json.loads((run / "checkpoints" / "best.json").read_text()) == \
        json.loads((ref / "checkpoints" / "best.json").read_text())
    assert [d.name for d in ckpt.step_dirs(run)] == [d.name for d in ckpt.step_dirs(ref)]
    # The killed attempts' temporary files are cleaned up by later saves.
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == \
        sorted(p.name for p in (ref / "checkpoints").iterdir())


def test_a_stale_best_json_is_repaired_and_what_killed_saves_left_is_removed(data_dir, tmp_path):
    from test_train import tiny_cfg
    from nanolm.model.transformer import Transformer
    run = tmp_path / "run"
    ck = run / "checkpoints"
    cfg = tiny_cfg(data_dir, run)
    model = Transformer(cfg.model)

    def save(step: int, best_val: float, is_best: bool) -> None:
        ckpt.save_checkpoint(run, step, model, None, cfg, {"tokens": 0, "best_metric": "val_loss", "best_value": best_val}, keep_last=2,
                             is_best=is_best)
    save(1, 3.0, True)
    save(2, 2.0, True)
    # A kill after step 2 was renamed into place, before best.json named it ...
    (ck / "best.json").write_text(json.dumps({"step": 1, "val_loss": 3.0}))
    # ... and the leftovers of killed saves: a pid that is gone (a re-save of step 2 killed between its two
    # renames, a temp dir, a pruned dir half deleted, a temp file of best.json), and one of a live process.
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    os.replace(ck / "step-00000002", ck / f".old-step-00000002-{dead}")
    (ck / f".tmp-step-00000003-{dead}").mkdir()
    (ck / f".del-step-00000000-{dead}").mkdir()
    (ck / f".best.json.{dead}.0badc0de.tmp").write_text("{")
    (ck / f".tmp-step-00000005-{os.getppid()}").mkdir()
    save(3, 2.0, False)
    assert hidden(ck) == [f".tmp-step-00000005-{os.getppid()}"]
    assert json.loads((ck / "best.json").read_text()) == {"step": 2, "metric": "val_loss", "value": 2.0}
    assert json.loads((ck / "step-00000003" / "state.json").read_text())["best_step"] == 2
    save(4, 2.0, False)
    # keep_last=2 plus the best, step 2 (with best.json left naming step 1, step 2 would be pruned here)
    assert [d.name for d in ckpt.step_dirs(run)] == ["step-00000002", "step-00000003", "step-00000004"]
    assert ckpt.resolve_checkpoint(run, "best").name == "step-00000002"


# --- prepare under fire ------------------------------------------------------------------------------


def snapshot(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.is_file()}


def data_files(snap: dict[str, bytes]) -> dict[str, bytes]:
    """The shards, and the manifest without the fields that say when and how fast it was made."""
    out = {k: v for k, v in snap.items() if k != "manifest.json"}
    m = json.loads(snap["manifest.json"])
    for k in ("created", "throughput"):
        m.pop(k)
    out["manifest.json"] = json.dumps(m, sort_keys=True).encode()
    return out


def temp_bytes(out: Path) -> int | None:
    """Bytes in prepare's new directory, written beside `out` (None when there is none yet), read while it runs."""
    try:
        tmp = [p for p in out.parent.iterdir() if p.name.startswith(f".tmp-{out.name}-")]
        return sum(f.stat().st_size for d in tmp for f in d.iterdir()) if tmp else None
    except FileNotFoundError:  # it finished meanwhile
        return None


def prepare_cmd(src: Path, tok: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "nanolm", "prepare", str(src), "--tokenizer", str(tok), "--out", str(out),
            "--workers", "2", "--val-fraction", "0.05"]


# `nanolm prepare` that kills itself (SIGKILL) after moving `n` shard files into place: mid-install.
KILL_MID_SWAP = r'''
import os, signal, sys
out = os.path.abspath(sys.argv[1])
real = os.replace
def replace(src, dst):
    real(src, dst)
    if os.path.abspath(str(src)) == out:  # the old data moved aside, the new data not yet in its place
        os.kill(os.getpid(), signal.SIGKILL)
os.replace = replace
from nanolm.cli import main
sys.exit(main(sys.argv[2:]))
'''


@pytest.mark.slow
@posix_only
def test_prepare_killed_midway_keeps_the_old_data_and_reruns_to_the_same_shards(tmp_path, tokenizer_dir):
    from conftest import make_corpus
    src = make_corpus(tmp_path, n_docs=20000, seed=3)  # 9 MiB: a few seconds with 2 workers
    (tmp_path / "old").mkdir()
    old_src = make_corpus(tmp_path / "old", n_docs=300, seed=4)
    ref, out = tmp_path / "ref", tmp_path / "out"
    t0 = time.monotonic()
    subprocess.run(prepare_cmd(src, tokenizer_dir, ref), env=ENV, check=True, capture_output=True)
    took = time.monotonic() - t0
    want = data_files(snapshot(ref))
    # out holds complete data made from another corpus: a killed run must leave it whole or unlisted.
    prepare([old_src], tokenizer_dir, out, workers=0, quiet=True, val_fraction=0.05)
    old = snapshot(out)
    rng = random.Random(11)
    landings = []
    for frac in (rng.uniform(i / 4, (i + 1) / 4) * 0.95 for i in range(4)):  # one in each quarter of a run
        proc = subprocess.Popen(prepare_cmd(src, tokenizer_dir, out), env=ENV, start_new_session=True,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(frac * took)
        written = temp_bytes(out)
        os.killpg(proc.pid, signal.SIGKILL)  # the main process and its tokenizer workers
        proc.wait()
        landings.append(f"{frac * took:.2f}s: " + ("start-up, no temp dir yet" if written is None else
                                                   "workers starting, no shard bytes yet" if written == 0 else
                                                   f"tokenizing, {written} bytes of shards written"))
        now = snapshot(out) if out.exists() else {}
        if "manifest.json" in now:  # the old data whole, or (if the run got that far) the new data
            assert now == old or data_files(now) == want
    # Killed between the two renames that swap the directories: the old data was moved aside whole, so no data
    # is listed under `out`, and the next run puts the old data back before it writes the new.
    prepare([old_src], tokenizer_dir, out, workers=0, quiet=True, val_fraction=0.05)  # (a kill may have come late)
    old = snapshot(out)
    proc = subprocess.run([sys.executable, "-c", KILL_MID_SWAP, str(out), *prepare_cmd(src, tokenizer_dir, out)[3:]],
                          env=ENV, capture_output=True, text=True)
    assert proc.returncode == KILLED, proc.stderr
    landings.append("swapping, the old data moved aside and the new not yet in place")
    assert not out.exists()
    aside = [p for p in tmp_path.iterdir() if p.name.startswith(".old-out-")]
    assert len(aside) == 1 and snapshot(aside[0]) == old
    t0 = time.monotonic()
    proc = subprocess.run(prepare_cmd(src, tokenizer_dir, out), env=ENV, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    print(f"\nprepare: reference {took:.1f}s, re-run {time.monotonic() - t0:.1f}s; kills: " + "; ".join(landings))
    assert data_files(snapshot(out)) == want
    # The killed runs' directories are gone.
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in ref.iterdir())
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]


# --- metrics.jsonl after a kill before the first checkpoint --------------------------------------------


def test_fresh_start_after_a_kill_before_the_first_checkpoint_writes_metrics_anew(data_dir, tmp_path, monkeypatch):
    from test_train import read_metrics, tiny_cfg
    run = tmp_path / "run"
    # What a kill during the first save leaves: metrics of steps 1..3, a torn line, no checkpoint.
    def killed(*a, **k):
        raise KeyboardInterrupt
    with monkeypatch.context() as m:
        m.setattr(ckpt, "save_checkpoint", killed)
        with pytest.raises(KeyboardInterrupt):
            train(tiny_cfg(data_dir, run, **{"train.save_interval": 3}), quiet=True)
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "tokens": 5')
    train(tiny_cfg(data_dir, run, **{"train.max_steps": 5}), quiet=True)
    assert [r["step"] for r in read_metrics(run) if "loss" in r] == [1, 2, 3, 4, 5]


# --- full disks ----------------------------------------------------------------------------------------

ENOSPC = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def mib(msg: str, what: str) -> float:
    m = re.search(rf"([\d.]+) MiB {what}", msg)
    assert m, f"no '<n> MiB {what}' in: {msg}"
    return float(m.group(1))


def hidden(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir() if p.name.startswith("."))


def _disk_full_at(monkeypatch, where: str) -> None:
    """Make the checkpoint writer fail at `where` as it does on a full disk (the error types are those the
    real writers raise: see test_real_write_failures_in_a_checkpoint)."""
    if where == "weights":
        def save_file(tensors, path, metadata=None):
            Path(path).write_bytes(b"\0" * 1000)  # a partial file, then the error
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        monkeypatch.setattr(ckpt, "save_file", save_file)
    elif where == "optimizer":
        real = torch.save

        def save(obj, f, *a, **k):
            if str(f).endswith("optimizer.pt"):
                Path(f).write_bytes(b"PK\3\4")
                raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")
            return real(obj, f, *a, **k)
        monkeypatch.setattr(torch, "save", save)
    elif where == "state":
        real_json = ckpt.write_json_atomic

        def write_json_atomic(path, obj):
            if Path(path).name == "state.json":
                raise ENOSPC
            return real_json(path, obj)
        monkeypatch.setattr(ckpt, "write_json_atomic", write_json_atomic)
    elif where == "tokenizer":
        def copyfile(a, b, **k):
            Path(b).write_bytes(Path(a).read_bytes()[:100])
            raise ENOSPC
        monkeypatch.setattr(ckpt.shutil, "copyfile", copyfile)


@pytest.mark.parametrize("where", ["weights", "optimizer", "state", "tokenizer"])
def test_full_disk_during_a_checkpoint_keeps_the_previous_one(data_dir, tmp_path, monkeypatch, where):
    from test_train import tiny_cfg
    run = tmp_path / "run"
    train(tiny_cfg(data_dir, run, **{"train.max_steps": 5}), quiet=True)
    good = ckpt.resolve_checkpoint(run, "last")
    before = {p: p.read_bytes() for p in sorted((run / "checkpoints").rglob("*")) if p.is_file()}
    size = sum(p.stat().st_size for p in good.iterdir()) / 2**20
    _disk_full_at(monkeypatch, where)
    with pytest.raises(UserError) as e:
        train(tiny_cfg(data_dir, run, **{"train.max_steps": 10}), resume=True, quiet=True)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{run / 'checkpoints' / 'step-00000010'}: could not write checkpoint")
    if where != "optimizer":  # torch.save's error does not say why; the sizes do
        assert "No space left on device" in msg
    assert 0.8 * size <= mib(msg, "needed") <= 1.3 * size
    assert mib(msg, "free") > 0 and "the previous checkpoints are untouched" in msg and "--resume" in msg
    assert {p: p.read_bytes() for p in sorted((run / "checkpoints").rglob("*")) if p.is_file()} == before
    assert hidden(run / "checkpoints") == []
    monkeypatch.undo()
    assert train(tiny_cfg(data_dir, run, **{"train.max_steps": 10}), resume=True, quiet=True).step == 10


@pytest.mark.skipif(not hasattr(signal, "SIGXFSZ"), reason="needs RLIMIT_FSIZE")
@pytest.mark.parametrize("limit", [100_000, 500_000])
def test_real_write_failures_in_a_checkpoint(data_dir, tmp_path, limit):
    """The real writers failing mid-file (RLIMIT_FSIZE: writes past `limit` bytes fail with EFBIG): at 100 kB
    safetensors fails on the weights (SafetensorError), at 500 kB torch.save on optimizer.pt (RuntimeError)."""
    import resource
    from test_train import tiny_cfg
    run = tmp_path / "run"
    train(tiny_cfg(data_dir, run, **{"train.max_steps": 5}), quiet=True)
    before = {p: p.read_bytes() for p in sorted((run / "checkpoints").rglob("*")) if p.is_file()}
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, old_limit[1]))
    try:
        with pytest.raises(UserError) as e:
            train(tiny_cfg(data_dir, run, **{"train.max_steps": 10}), resume=True, quiet=True)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)
    msg = str(e.value)
    assert "could not write checkpoint" in msg and ("model.safetensors" if limit < 300_000 else "optimizer.pt") in msg
    assert mib(msg, "needed") > 1.0 and "the previous checkpoints are untouched" in msg
    assert {p: p.read_bytes() for p in sorted((run / "checkpoints").rglob("*")) if p.is_file()} == before
    assert hidden(run / "checkpoints") == []


class _SmallDisk:
    """open() for prepare's shard files on a disk with `room` bytes left: the write that does not fit
    writes what fits, then raises ENOSPC, as a real full disk does."""

    def __init__(self, room: int) -> None:
        self.room = room

    def __call__(self, path, mode="r", *a, **k):
        f = open(path, mode, *a, **k)
        if "w" not in mode:
            return f
        disk, real_write = self, f.write

        def write(data):
            n = len(memoryview(data).cast("B"))
            if n > disk.room:
                real_write(memoryview(data).cast("B")[:disk.room])
                disk.room = 0
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            disk.room -= n
            return real_write(data)
        f.write = write
        return f


def test_full_disk_during_shard_and_manifest_writes_keeps_the_previous_data(tmp_path, tokenizer_dir, monkeypatch):
    from conftest import make_corpus
    src = make_corpus(tmp_path, n_docs=400, seed=5)
    out = tmp_path / "out"
    prepare([src], tokenizer_dir, out, workers=0, quiet=True, val_fraction=0.05)
    good = snapshot(out)
    total = sum(len(v) for k, v in good.items() if k != "manifest.json") / 2**20
    # Other input, so there is work to do; shards of a few kB, several batches.
    make_corpus(tmp_path, n_docs=400, seed=6)
    monkeypatch.setattr(prep, "BATCH_PIECES", 50)

    monkeypatch.setattr(shards_module, "open", _SmallDisk(int(total * 2**20) // 2), raising=False)
    with pytest.raises(UserError) as e:
        prepare([src], tokenizer_dir, out, workers=0, quiet=True, val_fraction=0.05, shard_tokens=20_000)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{out}: could not write the token shards")
    assert "No space left on device" in msg and f"{out} is left as it was" in msg
    assert 0.6 * total <= mib(msg, "needed") <= 1.6 * total and mib(msg, "free") > 0
    assert snapshot(out) == good and hidden(out) == []

    monkeypatch.delattr(shards_module, "open")
    real_json = shards_module.write_json_atomic  # Manifest.write's

    def write_json_atomic(path, obj):
        if Path(path).name == "manifest.json":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_json(path, obj)
    monkeypatch.setattr(shards_module, "write_json_atomic", write_json_atomic)
    with pytest.raises(UserError) as e:
        prepare([src], tokenizer_dir, out, workers=0, quiet=True, val_fraction=0.05)
    msg = str(e.value)
    assert "could not write" in msg and "manifest.json" in msg and "No space left on device" in msg
    assert 0.6 * total <= mib(msg, "needed") <= 1.6 * total
    assert snapshot(out) == good and hidden(out) == []

    monkeypatch.undo()
    m = prepare([src], tokenizer_dir, out, workers=0, quiet=True, val_fraction=0.05)
    assert m.sources[0]["sha256"] != json.loads(good["manifest.json"])["sources"][0]["sha256"]
    assert np.fromfile(out / "train-00000.bin", dtype=np.uint16).size == m.splits["train"]["n_tokens"]
