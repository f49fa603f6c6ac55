"""Metric trackers beside metrics.jsonl: config, TensorBoard event files, W&B calls (through a fake wandb)."""

from __future__ import annotations

import json
import math
import sys
import types
from pathlib import Path

import pytest

from nanolm.config import Config

from nanolm.train.configure import load_config
from nanolm.errors import UserError
from nanolm.train.trainer import train
from nanolm.metrics_log import read_metrics
from nanolm.train.metrics import MetricsWriter, TensorBoardTracker, make_trackers, scalars
from test_train import tiny_cfg


def test_track_config_is_validated():
    cfg = load_config("tiny", overrides={"train.track": "tensorboard,wandb,tensorboard",
                                         "train.wandb_mode": "online", "train.wandb_project": "p"})
    assert cfg.train.track == ("tensorboard", "wandb") and cfg.train.wandb_mode == "online"
    assert Config.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    assert load_config("tiny").train.track == ()
    with pytest.raises(UserError, match=r"train\.track: unknown tracker 'mlflow'; choose from tensorboard, wandb"):
        load_config("tiny", overrides={"train.track": "tensorboard,mlflow"})
    with pytest.raises(UserError, match=r"train\.wandb_mode must be one of offline, online, got 'cloud'"):
        load_config("tiny", overrides={"train.wandb_mode": "cloud"})
    with pytest.raises(UserError, match=r"train\.wandb_project must not be empty"):
        load_config("tiny", overrides={"train.wandb_project": " "})


def test_scalars_flatten_lists_and_skip_strings_and_events():
    rec = {"step": 7, "tokens": 896, "loss": 2.5, "lr": 1e-3, "expert_load": [[0.25, 0.75], [0.5, 0.5]],
           "loss_nan": float("nan")}
    got = scalars(rec)
    assert {k: v for k, v in got.items() if k != "loss_nan"} == {
        "tokens": 896.0, "loss": 2.5, "lr": 1e-3,
        "expert_load/moe_layer_0/expert_0": 0.25, "expert_load/moe_layer_0/expert_1": 0.75,
        "expert_load/moe_layer_1/expert_0": 0.5, "expert_load/moe_layer_1/expert_1": 0.5}
    assert math.isnan(got["loss_nan"])  # a diverged loss shows in the tracker
    assert scalars({"step": 9, "tokens": 9, "event": "stop", "reason": "max_steps"}) == {}


def tb_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """What TensorBoard shows: (step, value) per tag, after its purge of steps trained again."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_resume_replaces_the_steps_trained_again(tmp_path):
    run = tmp_path / "run"
    w = MetricsWriter(run, trackers=[TensorBoardTracker(run)])
    for step in range(1, 6):
        w.write({"step": step, "tokens": 10 * step, "loss": 10.0 - step})
    w.write({"step": 5, "tokens": 50, "event": "stop", "reason": "max_steps"})
    w.close()
    # A crash after step 5 and a resume from the checkpoint at step 3: steps 4 and 5 are trained again.
    w = MetricsWriter(run, trackers=[TensorBoardTracker(run)])
    w.truncate_after(3)
    for step in range(4, 7):
        w.write({"step": step, "tokens": 10 * step, "loss": 100.0 + step})
    w.close()
    shown = tb_scalars(run / "tensorboard")
    assert shown["loss"] == [(1, 9.0), (2, 8.0), (3, 7.0), (4, 104.0), (5, 105.0), (6, 106.0)]
    assert [s for s, _ in shown["tokens"]] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in read_metrics(run / "metrics.jsonl")] == [9.0, 8.0, 7.0, 104.0, 105.0, 106.0]


class FakeRun:
    def __init__(self, log: list, run_id: str) -> None:
        self.calls = log
        self.id = run_id

    def define_metric(self, name: str, **kw) -> None:
        self.calls.append(("define_metric", name, kw))

    def log(self, data: dict, **kw) -> None:
        self.calls.append(("log", data, kw))

    def finish(self) -> None:
        self.calls.append(("finish",))


@pytest.fixture
def fake_wandb(monkeypatch) -> list:
    """A `wandb` module that records its calls: ("init", kwargs), ("log", data, kwargs), ..."""
    calls: list = []
    mod = types.ModuleType("wandb")

    def init(**kw):
        calls.append(("init", kw))
        return FakeRun(calls, kw.get("id") or f"run{sum(c[0] == 'init' for c in calls)}")
    mod.init = init
    monkeypatch.setitem(sys.modules, "wandb", mod)
    return calls


def test_wandb_gets_every_record_and_resumes_the_same_run(data_dir, tmp_path, fake_wandb):
    run = tmp_path / "run"
    over = {"train.track": "wandb,tensorboard", "train.max_steps": 4, "train.eval_interval": 2,
            "train.wandb_project": "proj"}
    cfg = tiny_cfg(data_dir, run, **over)
    train(cfg, quiet=True)
    init = fake_wandb[0]
    assert init == ("init", {"project": "proj", "dir": str(run), "mode": "offline", "config": cfg.to_dict(),
                             "name": "run"})
    assert fake_wandb[1:3] == [("define_metric", "step", {}), ("define_metric", "*", {"step_metric": "step"})]
    logs = [c[1] for c in fake_wandb if c[0] == "log"]
    train_logs = [d for d in logs if "lr" in d]
    assert [d["step"] for d in train_logs] == [1, 2, 3, 4]
    jsonl = [r for r in read_metrics(run / "metrics.jsonl") if "lr" in r]
    assert [d["loss"] for d in train_logs] == [r["loss"] for r in jsonl]
    assert [d["step"] for d in logs if "val_loss" in d] == [2, 4]
    assert fake_wandb[-1] == ("finish",)
    assert json.loads((run / "wandb_run.json").read_text()) == {"id": "run1", "project": "proj", "mode": "offline"}
    assert {t for t in tb_scalars(run / "tensorboard")} >= {"loss", "lr", "grad_norm", "val_loss", "tokens_per_s"}

    fake_wandb.clear()
    train(tiny_cfg(data_dir, run, **{**over, "train.max_steps": 6}), resume=True, quiet=True)
    kw = fake_wandb[0][1]
    assert (kw["id"], kw["resume"]) == ("run1", "allow")
    assert [c[1]["step"] for c in fake_wandb if c[0] == "log" and "lr" in c[1]] == [5, 6]


def test_missing_wandb_names_the_extra(monkeypatch, data_dir, tmp_path):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    cfg = tiny_cfg(data_dir, tmp_path / "run", **{"train.track": "wandb"})
    with pytest.raises(UserError, match=r"wandb, which is not installed; pip install 'nanolm\[wandb\]'"):
        make_trackers(cfg, tmp_path / "run")
    with pytest.raises(UserError, match=r"pip install 'nanolm\[wandb\]'"):
        train(cfg, quiet=True)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_only_rank_zero_starts_trackers(tmp_path, fake_wandb):
    from nanolm.train.metrics import WandbTracker
    w = MetricsWriter(tmp_path, enabled=False, trackers=[WandbTracker(tmp_path, "p", "offline", {})])
    w.write({"step": 1, "loss": 1.0})
    w.close()
    assert fake_wandb == [] and not (tmp_path / "metrics.jsonl").exists()
