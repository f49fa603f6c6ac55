"""Data parallelism through torchrun with gloo on CPU: 2 processes (DDP or FSDP2) train as 1 does, resume
across sizes both ways, and never take the same sample within an epoch."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nanolm import checkpoint as ckpt
from nanolm.train.trainer import train
from test_train import (ONE_STEP, assert_close_all, masked_lm_data, micro_batch_gradients, read_metrics, same_weights,
                        tiny_cfg)

OVER = {"train.max_steps": 8, "train.grad_accum": 2, "train.eval_interval": 4, "train.save_interval": 4,
        "model.dropout": 0.0}


def torchrun_cmd(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """torchrun with 2 processes; past `timeout` seconds the whole launch (agent and workers, one process
    group) is killed, so that a hung run fails its test instead of leaving workers behind for the rest."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *args]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                         start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        pytest.fail(f"torchrun did not finish in {timeout} s: {' '.join(args)}\n{out[-2000:]}\n{err[-2000:]}")
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


def torchrun(data_dir: Path, out: Path, *extra: str, **over) -> subprocess.CompletedProcess:
    cfg = tiny_cfg(data_dir, out, **{**OVER, **over})
    out.parent.mkdir(parents=True, exist_ok=True)
    config = out.parent / f"{out.name}.json"
    config.write_text(json.dumps(cfg.to_dict()))
    return torchrun_cmd("-m", "nanolm", "train", "--config", str(config), *extra)


def losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run) if "loss" in r}


def assert_same_losses(got: dict[int, float], ref: dict[int, float], steps) -> None:
    """The losses of these steps equal the reference run's, to float tolerance (reductions run in another order)."""
    for s in steps:
        assert got[s] == pytest.approx(ref[s], rel=1e-4, abs=1e-5), s


@pytest.mark.slow
def test_two_processes_train_as_one_and_resume_as_one(data_dir, tmp_path):
    one = train(tiny_cfg(data_dir, tmp_path / "one", **OVER), quiet=True)

    r = torchrun(data_dir, tmp_path / "two")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "data parallel: 2 processes (ddp) | 1 micro-batch(es) per rank per step" in r.stdout
    assert r.stdout.count("step      8/8") == 1  # only rank 0 logs
    two = losses(tmp_path / "two")
    assert list(two) == list(range(1, 9))  # each step once in metrics.jsonl: only rank 0 writes
    assert_same_losses(two, one.train_losses, two)

    # stopped after 4 steps with 2 processes, resumed with 1: the same stream and losses
    r = torchrun(data_dir, tmp_path / "switch", **{"train.max_tokens": 4 * 2 * 4 * 32})
    assert r.returncode == 0, r.stderr[-2000:]
    state = json.loads((tmp_path / "switch" / "checkpoints" / "step-00000004" / "state.json").read_text())
    assert state["loader"]["cursor"] == 4 * 2 * 4  # 4 steps x 2 micro-batches x batch 4 windows
    resumed = train(tiny_cfg(data_dir, tmp_path / "switch", **OVER), resume=True, quiet=True)
    assert_same_losses(resumed.train_losses, one.train_losses, range(5, 9))


@pytest.mark.slow
def test_two_processes_train_as_one_with_muon(data_dir, tmp_path):
    """optim.name muon under DDP: the Muon and AdamW steps of 2 processes follow the one-process run (to the
    rounding of torch's bf16 orthogonalisation of a gradient summed in another order), and its checkpoint resumes."""
    muon = {**OVER, "optim.name": "muon"}
    one = train(tiny_cfg(data_dir, tmp_path / "one", **muon), quiet=True)
    r = torchrun(data_dir, tmp_path / "two", **{"optim.name": "muon", "train.max_tokens": 4 * 2 * 4 * 32})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    two = losses(tmp_path / "two")
    assert list(two) == [1, 2, 3, 4]
    for s in two:
        assert two[s] == pytest.approx(one.train_losses[s], rel=1e-3), s
    resumed = train(tiny_cfg(data_dir, tmp_path / "two", **muon), resume=True, quiet=True)
    for s in range(5, 9):
        assert resumed.train_losses[s] == pytest.approx(one.train_losses[s], rel=1e-3), s


@pytest.mark.slow
def test_two_processes_weigh_every_target_token_the_same(tmp_path):
    """Rank 0's micro-batch holds 1 target token and rank 1's 9: the step's gradient is still the summed loss of
    the 10 targets over 10, as in one process holding both (DDP averages over the ranks; the step counts the
    targets of every rank first)."""
    from safetensors.torch import load_file
    data = masked_lm_data(tmp_path / "data")
    cfg = tiny_cfg(data, tmp_path / "two", **ONE_STEP)
    config, out = tmp_path / "two.json", tmp_path / "grads.safetensors"
    config.write_text(json.dumps(cfg.to_dict()))
    r = torchrun_cmd(str(Path(__file__).parent / "grad_worker.py"), str(config), str(out))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    saved = load_file(str(out))
    weights = [saved[k] for k in sorted(saved) if k.startswith("weight.")]
    got = [saved[k] for k in sorted(saved) if k.startswith("grad.")]
    (n1, g1, _, _), (n2, g2, _, _) = micro_batch_gradients(cfg, weights, 2)
    assert sorted((n1, n2)) == [1, 9]
    assert_close_all(got, [(a + b) / 10 for a, b in zip(g1, g2)])


@pytest.mark.slow
def test_a_killed_rank_comes_back_under_max_restarts_and_ends_as_the_uninterrupted_run(data_dir, tmp_path):
    """`torchrun --max-restarts 1`: rank 1 is SIGKILLed after step 6 (the last checkpoint is step 4's); torchrun
    restarts both workers, which resume from step 4 by themselves, and the run ends bit-identical."""
    r = torchrun(data_dir, tmp_path / "whole")
    assert r.returncode == 0, r.stderr[-2000:]
    cfg = tiny_cfg(data_dir, tmp_path / "killed", **OVER)
    config = tmp_path / "killed.json"
    config.write_text(json.dumps(cfg.to_dict()))
    r = torchrun_cmd("--max-restarts", "1", str(Path(__file__).parent / "kill_worker.py"), str(config), "6")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "rank 0 attempt 1: done at step 8" in r.stdout and "attempt 0: done" not in r.stdout
    assert same_weights(tmp_path / "whole", tmp_path / "killed")
    assert list(losses(tmp_path / "killed")) == list(range(1, 9))  # steps 5 and 6 logged once, as redone
    assert losses(tmp_path / "killed") == losses(tmp_path / "whole")


def test_grad_accum_must_split_over_the_processes(data_dir, tmp_path, monkeypatch):
    from nanolm.errors import UserError
    from nanolm.train import distributed
    info = distributed.DistInfo(0, 0, 2, distributed.resolve_device("cpu"))
    assert distributed.per_rank_accum(4, info) == 2
    with pytest.raises(UserError, match=r"train.grad_accum \(3\) must be a multiple of the number of processes"):
        distributed.per_rank_accum(3, info)


@pytest.mark.slow
def test_fsdp_trains_as_one_saves_full_weights_and_resumes_across_sizes(data_dir, tmp_path):
    one = train(tiny_cfg(data_dir, tmp_path / "one", **OVER), quiet=True)

    r = torchrun(data_dir, tmp_path / "fsdp", **{"train.parallel": "fsdp"})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "data parallel: 2 processes (fsdp) | 1 micro-batch(es) per rank per step" in r.stdout
    fsdp = losses(tmp_path / "fsdp")
    assert list(fsdp) == list(range(1, 9))
    assert_same_losses(fsdp, one.train_losses, fsdp)
    # The checkpoint holds full, unsharded weights that one process loads, equal to the 1-process run's.
    model, src = ckpt.load_model(tmp_path / "fsdp", "last")
    ref, _ = ckpt.load_model(tmp_path / "one", "last")
    assert src.name == "step-00000008"
    for (name, a), (_, b) in zip(model.state_dict().items(), ref.state_dict().items()):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-5), name
    optim = ckpt.read_optimizer(src)
    assert optim["state"]["embed_tokens.weight"]["exp_avg"].shape == (400, 32)  # unsharded

    # saved by 2 FSDP processes after 4 steps, resumed by 1 process
    r = torchrun(data_dir, tmp_path / "down", **{"train.parallel": "fsdp", "train.max_tokens": 4 * 2 * 4 * 32})
    assert r.returncode == 0, r.stderr[-2000:]
    resumed = train(tiny_cfg(data_dir, tmp_path / "down", **OVER), resume=True, quiet=True)
    assert_same_losses(resumed.train_losses, one.train_losses, range(5, 9))

    # saved by 1 process after 4 steps, resumed by 2 FSDP processes
    part = train(tiny_cfg(data_dir, tmp_path / "up", **{**OVER, "train.max_tokens": 4 * 2 * 4 * 32}), quiet=True)
    assert part.step == 4
    r = torchrun(data_dir, tmp_path / "up", "--resume", **{"train.parallel": "fsdp"})
    assert r.returncode == 0, r.stderr[-2000:]
    assert "resumed from" in r.stdout and r.stdout.count("resumed from") == 1
    up = losses(tmp_path / "up")
    assert_same_losses(up, one.train_losses, range(5, 9))


@pytest.mark.slow
def test_two_ranks_never_take_the_same_window_within_an_epoch(tokenizer_dir, tmp_path):
    from nanolm.data.loader import Loader
    from nanolm.data.prepare import prepare
    from nanolm.data.shards import PackedData
    # Counting text: no two windows hold the same tokens, so a repeat in the rows is a repeated window.
    corpus = tmp_path / "count.txt"
    corpus.write_text("\n\n".join(" ".join(f"{i:05d}" for i in range(d * 100, d * 100 + 100)) for d in range(40)))
    data_dir = tmp_path / "data"
    prepare([corpus], tokenizer_dir, data_dir, val_fraction=0.0, workers=1, quiet=True)
    out = tmp_path / "rows.json"
    r = torchrun_cmd(str(Path(__file__).parent / "dist_worker.py"), str(data_dir), str(out), "2", "16")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    got = json.loads(out.read_text())
    n, steps = got["epoch_windows"], got["steps"]
    # The stream of one process with the same seed and the global batch, to compare with.
    single = Loader(PackedData(data_dir), 4, 16, seed=7)
    expected = [single.next_batch().x.tolist() for _ in range(steps)]
    rank0, rank1 = got["rows"]
    seen: list[tuple] = []
    for s in range(steps):
        assert rank0[s] + rank1[s] == expected[s]  # rank r takes the r-th half of each global batch
        seen += [tuple(row) for row in rank0[s] + rank1[s]]
    epoch0 = seen[:n]
    assert len(set(epoch0)) == len(epoch0) == n  # every window once, on one rank or the other
    assert set(seen[n:2 * n]) == set(epoch0)  # the next epoch: the same windows, in another order
    assert seen[n:2 * n] != epoch0


@pytest.mark.slow
def test_a_mixture_trains_on_two_processes_as_on_one(data_dir, tokenizer_dir, tmp_path):
    from conftest import make_corpus

    from nanolm.data.prepare import prepare
    other = tmp_path / "other"
    prepare([make_corpus(tmp_path, n_docs=80, seed=5)], tokenizer_dir, other, val_fraction=0.1, workers=1,
            quiet=True)
    sets = {"data.path": "", "data.mode": "mixture",
            "data.sets": [{"path": str(data_dir), "weight": 2}, {"path": str(other), "weight": 1}]}
    one = train(tiny_cfg(data_dir, tmp_path / "one", **OVER, **sets), quiet=True)
    r = torchrun(data_dir, tmp_path / "two", **sets)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "data: 2 sets as a mixture" in r.stdout
    two = losses(tmp_path / "two")
    assert list(two) == list(range(1, 9))
    assert_same_losses(two, one.train_losses, two)
    logged = [r["data"]["set"] for r in read_metrics(tmp_path / "two") if "loss" in r]
    assert len(set(logged)) == 2  # both sets took part
