"""Data parallelism through torchrun with gloo on CPU: 2 processes train as 1 does, and resume across sizes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nanolm.train.loop import train
from test_train import read_metrics, tiny_cfg

OVER = {"train.max_steps": 8, "train.grad_accum": 2, "train.eval_interval": 4, "train.save_interval": 4,
        "model.dropout": 0.0}


def torchrun(data_dir: Path, out: Path, **over) -> subprocess.CompletedProcess:
    cfg = tiny_cfg(data_dir, out, **{**OVER, **over})
    out.parent.mkdir(parents=True, exist_ok=True)
    config = out.parent / f"{out.name}.json"
    config.write_text(json.dumps(cfg.to_dict()))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           "-m", "nanolm", "train", "--config", str(config)],
                          capture_output=True, text=True, env=env, timeout=600)


def losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run) if "loss" in r}


@pytest.mark.slow
def test_two_processes_train_as_one_and_resume_as_one(data_dir, tmp_path):
    one = train(tiny_cfg(data_dir, tmp_path / "one", **OVER), quiet=True)

    r = torchrun(data_dir, tmp_path / "two")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "data parallel: 2 processes | 1 micro-batch(es) per rank per step" in r.stdout
    assert r.stdout.count("step      8/8") == 1  # only rank 0 logs
    two = losses(tmp_path / "two")
    assert list(two) == list(range(1, 9))  # each step once in metrics.jsonl: only rank 0 writes
    for s in two:
        assert two[s] == pytest.approx(one.train_losses[s], rel=1e-4, abs=1e-5)

    # stopped after 4 steps with 2 processes, resumed with 1: the same stream and losses
    r = torchrun(data_dir, tmp_path / "switch", **{"train.max_tokens": 4 * 2 * 4 * 32})
    assert r.returncode == 0, r.stderr[-2000:]
    state = json.loads((tmp_path / "switch" / "checkpoints" / "step-00000004" / "state.json").read_text())
    assert state["loader"]["cursor"] == 4 * 2 * 4  # 4 steps x 2 micro-batches x batch 4 windows
    resumed = train(tiny_cfg(data_dir, tmp_path / "switch", **OVER), resume=True, quiet=True)
    for s in range(5, 9):
        assert resumed.train_losses[s] == pytest.approx(one.train_losses[s], rel=1e-4, abs=1e-5)


def test_grad_accum_must_split_over_the_processes(data_dir, tmp_path, monkeypatch):
    from nanolm.errors import UserError
    from nanolm.train import distributed
    info = distributed.DistInfo(0, 0, 2, distributed.resolve_device("cpu"))
    assert distributed.per_rank_accum(4, info) == 2
    with pytest.raises(UserError, match=r"train.grad_accum \(3\) must be a multiple of the number of processes"):
        distributed.per_rank_accum(3, info)
