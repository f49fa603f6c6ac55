"""A token or time budget without max_steps shapes the schedule: the fit, its record in state.json, exact resume."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from nanolm import checkpoint as ckpt
from nanolm.config import OptimConfig
from nanolm.train.configure import load_config
from nanolm.errors import UserError
from nanolm.train.schedule import lr_at, probe_steps, steps_for_time, steps_for_tokens
from test_train import same_weights
from nanolm.train.trainer import Trainer


def budget_cfg(data_dir: Path, out: Path, **over):
    """The tiny model of test_train with no max_steps: the budget in `over` fits it."""
    base = {"data.path": str(data_dir), "train.out_dir": str(out), "model.vocab_size": 400,
            "model.d_model": 32, "model.n_layer": 2, "model.n_head": 4, "model.n_kv_head": 2,
            "model.max_seq_len": 32, "train.seq_len": 32, "train.batch_size": 4,
            "train.log_interval": 1, "train.eval_interval": 5, "train.eval_batches": 2,
            "train.save_interval": 5, "optim.warmup_steps": 3, "optim.lr": 3e-3, "optim.min_lr": 3e-4,
            "model.dropout": 0.1}
    base.update(over)
    return load_config("tiny", overrides=base)


def test_fit_arithmetic():
    assert [probe_steps(w) for w in (0, 1, 3, 7, 100)] == [1, 2, 4, 8, 8]
    assert [steps_for_tokens(t, 128) for t in (1, 128, 129, 1280)] == [1, 1, 2, 10]
    # 60 s budget, 10 s gone after 4 steps of 0.5 s: 50 / 0.5 = 100 more steps.
    assert steps_for_time(60, 10, 4, 0.5) == 104
    # Evaluations every 10 steps costing 2 steps each: a step costs 0.6 s, and the final one takes 1 s first.
    assert steps_for_time(60, 10, 4, 0.5, eval_interval=10, eval_step_fraction=2.0) == 4 + math.floor(49 / 0.6)
    assert steps_for_time(60, 70, 4, 0.5) == 5  # past the budget already: one more step
    # The probe steps are warmup steps: their lr does not depend on max_steps.
    cfg = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=3)
    assert all(lr_at(s, cfg, 5) == lr_at(s, cfg, 500) for s in range(probe_steps(3)))


def test_a_budget_without_max_steps_means_a_fitted_schedule(tmp_path):
    assert load_config("tiny", overrides={"train.max_minutes": "3"}).train.max_steps == 0
    assert load_config("tiny", overrides={"train.max_tokens": "1000"}).train.max_steps == 0
    assert load_config("tiny", overrides={"train.max_minutes": "3", "train.max_steps": "50"}).train.max_steps == 50
    assert load_config("tiny", overrides={"train.max_minutes": "0"}).train.max_steps == 300  # no budget: the preset's
    f = tmp_path / "c.toml"
    f.write_text("[train]\nmax_minutes = 2\n")
    assert load_config("tiny", config_file=f).train.max_steps == 0
    f.write_text("[train]\nmax_minutes = 2\nmax_steps = 40\n")
    assert load_config("tiny", config_file=f, overrides={"train.max_minutes": "1"}).train.max_steps == 40
    with pytest.raises(UserError, match="train.max_steps 0 fits the schedule to a budget; give --train.max_minutes"):
        load_config("tiny", overrides={"train.max_steps": "0"})


def test_token_budget_fixes_max_steps_at_start(data_dir, tmp_path):
    cfg = budget_cfg(data_dir, tmp_path / "run", **{"train.max_tokens": 10 * 4 * 32 - 5})
    res = Trainer(cfg, quiet=True).run()
    assert (res.step, res.stop_reason) == (10, "max_steps")
    state = json.loads((ckpt.resolve_checkpoint(tmp_path / "run", "last") / "state.json").read_text())
    assert state["budget_fit"] == {"max_steps": 10, "at_step": 0, "rule": "max_tokens"}
    lrs = [r["lr"] for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
           if "lr" in r]
    assert lrs == [lr_at(s, cfg.optim, 10) for s in range(10)]  # the cosine reaches min_lr at step 10
    assert lr_at(10, cfg.optim, 10) == cfg.optim.min_lr


class FakeClock:
    """Seconds that pass only in training steps (0.5 each), plus `jump` after step `jump_at`."""

    def __init__(self, jump_at: int = -1, jump: float = 0.0) -> None:
        self.now, self.jump_at, self.jump = 0.0, jump_at, jump

    def __call__(self) -> float:
        return self.now


def timed_trainer(cfg, monkeypatch, clock: FakeClock, **kw) -> Trainer:
    tr = Trainer(cfg, quiet=True, **kw)
    tr.clock = clock
    step = tr.train_step

    def timed(*a, **k):
        out = step(*a, **k)
        clock.now += 0.5
        if tr.step == clock.jump_at:
            clock.now += clock.jump
        return out
    monkeypatch.setattr(tr, "train_step", timed)
    return tr


def test_time_budget_fits_max_steps_from_the_timed_steps_and_resume_keeps_it(data_dir, tmp_path, monkeypatch):
    # 15 s; 4 probe steps (warmup 3) of 0.5 s each leave 13 s. A step costs 0.5 s plus a fifth of an evaluation
    # (2 micro-batches forward = 2/3 of a step), and the final evaluation 1/3 s: floor(12.667 / 0.5667) = 22 more.
    # A quarter into that plan (step 4 + 22 // 4 = 9) the rate since the fit, 0.5 s/step (the fake clock stands
    # still in evaluations), refits: 9 + floor((15 - 4.5 - 1/3) / 0.5) = 29.
    over = {"train.max_minutes": 0.25}
    full = timed_trainer(budget_cfg(data_dir, tmp_path / "full", **over), monkeypatch, FakeClock()).run()
    first = 4 + math.floor((15 - 2 - 0.5 * 2 / 3) / (0.5 * (1 + 2 / 3 / 5)))
    refit = 9 + math.floor((15 - 4.5 - 0.5 * 2 / 3) / 0.5)
    assert (first, refit) == (26, 29) and (full.step, full.stop_reason) == (29, "max_steps")
    state = json.loads((ckpt.resolve_checkpoint(tmp_path / "full", "last") / "state.json").read_text())
    assert state["budget_fit"] == {"max_steps": 29, "at_step": 9, "rule": "max_minutes", "step_s": 0.5,
                                   "timed_steps": "5-9", "first_fit": 26}
    records = map(json.loads, (tmp_path / "full" / "metrics.jsonl").read_text().splitlines())
    lrs = {r["step"]: r["lr"] for r in records if "lr" in r}
    cfg = budget_cfg(data_dir, tmp_path / "x", **over).optim
    assert [lrs[s + 1] for s in range(9)] == [lr_at(s, cfg, 26) for s in range(9)]
    assert [lrs[s + 1] for s in range(9, 29)] == [lr_at(s, cfg, 29) for s in range(9, 29)]

    # The same run, stopped by its clock after step 10 (the budget is spent), then resumed with more minutes
    # and a slower clock: the recorded fit holds, so the steps after the resume are those of the full run.
    part = timed_trainer(budget_cfg(data_dir, tmp_path / "part", **over), monkeypatch,
                         FakeClock(jump_at=10, jump=100.0)).run()
    assert (part.step, part.stop_reason) == (10, "max_minutes")
    resumed = timed_trainer(budget_cfg(data_dir, tmp_path / "part", **{"train.max_minutes": 10}), monkeypatch,
                            FakeClock(), resume=True).run()
    assert (resumed.step, resumed.stop_reason) == (29, "max_steps")
    assert resumed.train_losses == {s: full.train_losses[s] for s in range(11, 30)}
    assert same_weights(tmp_path / "full", tmp_path / "part")


def test_a_short_time_budget_without_a_preset_trains_the_budget_preset(tmp_path):
    from nanolm.config import preset
    from nanolm.config.load import BUDGET_PRESET
    cfg = load_config(overrides={"train.max_minutes": "3"})
    assert BUDGET_PRESET == "cpu-small" and cfg.model == preset("cpu-small").model
    assert cfg.train.max_steps == 0 and cfg.train.batch_size == preset("cpu-small").train.batch_size
    assert cfg.optim.name == "muon"
    assert cfg.note.startswith("preset cpu-small: no preset or model settings were given and the time budget is at "
                               "most 30 minutes")
    assert "note" not in cfg.to_dict()  # said at start-up, not saved
    # The vocabulary follows the tokenizer and may be given; any other model setting, a preset, a long or no
    # budget keep the defaults.
    assert load_config(overrides={"train.max_minutes": "3", "model.vocab_size": "2048"}).model.d_model == 128
    assert load_config(overrides={"train.max_minutes": "3", "model.n_layer": "6"}).model.d_model == 512
    assert load_config("tiny", overrides={"train.max_minutes": "3"}).note == ""
    assert load_config(overrides={"train.max_minutes": "60"}).model.d_model == 512
    assert load_config(overrides={"train.max_tokens": "100000"}).model.d_model == 512
    assert load_config().note == "" and load_config().model.d_model == 512


def test_the_default_path_widens_its_model_where_the_budget_would_see_the_data_many_times(data_dir, tmp_path,
                                                                                          monkeypatch):
    from nanolm.config import preset
    from nanolm.train import sizing
    n = json.loads((data_dir / "manifest.json").read_text())["splits"]["train"]["n_tokens"]
    over = {"data.path": str(data_dir), "train.out_dir": str(tmp_path / "run"), "train.max_minutes": "3"}
    assert sizing.train_tokens(load_config(overrides=over)) == n
    assert sizing.passes(3, 1000.0, 36_000) == 5.0
    rate = {"value": sizing.WIDE_PASSES * n / 180}  # 3 minutes at this rate see the data exactly WIDE_PASSES times
    monkeypatch.setattr(sizing, "step_rate", lambda cfg: rate["value"])
    small = preset("cpu-small").model
    cfg = load_config(overrides=over)
    assert cfg.model == small
    assert cfg.note.endswith(f"; width 128: at {rate['value']:,.0f} tokens/s (timed here) the 128-wide model would "
                             f"see the {n:,} training tokens about {sizing.WIDE_PASSES:.1f} times in 3 minutes, at "
                             f"most {sizing.WIDE_PASSES:g}; weight decay {sizing.MANY_PASSES_WEIGHT_DECAY:g} (not "
                             f"0.1): more than {sizing.DECAY_PASSES:g} passes; schedule cut to {6 * n:,} tokens "
                             f"(6 passes; the time budget stays the ceiling): at {rate['value']:,.0f} tokens/s the "
                             f"128-wide model would see the data 7.0 times, and past 6 it memorises, so the learning "
                             f"rate decays over the passes it can use and the run ends early")
    assert cfg.optim.weight_decay == sizing.MANY_PASSES_WEIGHT_DECAY
    # A weight decay the user gives is kept; at most DECAY_PASSES passes keep the preset's.
    assert load_config(overrides={**over, "optim.weight_decay": "0.05"}).optim.weight_decay == 0.05
    rate["value"] = sizing.DECAY_PASSES * n / 180
    cfg = load_config(overrides=over)
    assert cfg.optim.weight_decay == preset("cpu-small").optim.weight_decay == 0.1
    assert cfg.note.endswith(f"at most {sizing.WIDE_PASSES:g}")
    rate["value"] = sizing.WIDE_PASSES * n / 180
    rate["value"] *= 1.01
    cfg = load_config(overrides=over)
    assert cfg.model == load_config("cpu-small", overrides={"model.d_model": str(sizing.WIDE_D_MODEL)}).model
    assert f"; width {sizing.WIDE_D_MODEL}: at {rate['value']:,.0f} tokens/s" in cfg.note
    # A run resumed in its directory keeps the width and weight decay it started with, whatever the rate now.
    (tmp_path / "run" / "checkpoints" / "step-00000010").mkdir(parents=True)
    (tmp_path / "run" / "checkpoints" / "step-00000010" / "config.json").write_text(json.dumps(cfg.to_dict()))
    rate["value"] = 1.0
    cfg = load_config(overrides=over)
    assert (cfg.model.d_model, cfg.optim.weight_decay) == (sizing.WIDE_D_MODEL, sizing.MANY_PASSES_WEIGHT_DECAY)
    assert cfg.note.endswith(f"; width {sizing.WIDE_D_MODEL}, weight decay {sizing.MANY_PASSES_WEIGHT_DECAY:g}, "
                             f"schedule cut to {6 * n:,} tokens: the run in {tmp_path / 'run'} was started with them")
    given = load_config(overrides={**over, "optim.weight_decay": "0.05"})
    assert (given.model.d_model, given.optim.weight_decay) == (sizing.WIDE_D_MODEL, 0.05)
    assert given.note.endswith(f"; width {sizing.WIDE_D_MODEL}, schedule cut to {6 * n:,} tokens: the run in "
                               f"{tmp_path / 'run'} was started with them")
    # Data that cannot be read, and several processes, leave the preset's width.
    assert load_config(overrides={**over, "data.path": str(tmp_path / "nothing"),
                                  "train.out_dir": str(tmp_path / "new")}).model == small
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = load_config(overrides={**over, "train.out_dir": str(tmp_path / "new")})
    assert cfg.model == small and cfg.note.endswith("under torchrun the width is not sized (pass --model.d_model)")


def test_the_default_path_times_its_step_and_trains_the_width_it_chose(data_dir, tmp_path, capsys):
    from nanolm.train import sizing
    from nanolm.train.trainer import train
    cfg = load_config("tiny", overrides={"train.batch_size": 2, "train.seq_len": 32})
    assert 0 < sizing.step_rate(cfg, steps=1) < 1e9
    # The test corpus is small: 30 minutes of the default path would see it many times, so it trains the wide
    # model (here for 3 steps).
    cfg = load_config(overrides={"data.path": str(data_dir), "train.out_dir": str(tmp_path / "run"),
                                 "train.max_minutes": "30", "train.max_steps": "3"})
    assert cfg.model.d_model == sizing.WIDE_D_MODEL
    train(cfg)
    assert json.loads((tmp_path / "run" / "config.json").read_text())["model"]["d_model"] == sizing.WIDE_D_MODEL
    assert f"width {sizing.WIDE_D_MODEL}: at " in capsys.readouterr().out
