"""The default path's choice for small data (nanolm/train/sizing.py): the rule's exact choices for given data
sizes, budgets and step rates, and the start-up line that says what it changed and why."""

from __future__ import annotations

import json

import pytest

from nanolm.train.configure import load_config
from nanolm.train import sizing
from nanolm.train.sizing import choose


def test_few_passes_keep_the_preset():
    # 3 minutes at 2,000 tokens/s see 100,000 tokens 3.6 times: nothing changes, and the line says why.
    assert choose(100_000, 3, 2000.0, None, 128, 0.1) == (
        {}, "width 128: at 2,000 tokens/s (timed here) the 128-wide model would see the 100,000 training tokens "
            "about 3.6 times in 3 minutes, at most 7")


def test_more_than_five_passes_decay_more():
    changed, why = choose(100_000, 3, 3000.0, None, 128, 0.1)  # 5.4 passes
    assert changed == {"optim": {"weight_decay": 0.3}}
    assert why.endswith("about 5.4 times in 3 minutes, at most 7; weight decay 0.3 (not 0.1): more than 5 passes")
    assert choose(100_000, 3, 3000.0, None, 128, 0.1, decay_given=True)[0] == {}


def test_many_passes_widen_the_model_and_count_the_wide_models_passes():
    # 9 passes at the preset's rate: 256 wide; at its own 3,000 tokens/s the wide model sees 5.4, under 6: no cut.
    changed, why = choose(100_000, 3, 5000.0, 3000.0, 128, 0.1)
    assert changed == {"model": {"d_model": 256}, "optim": {"weight_decay": 0.3}}
    assert "schedule" not in why
    with pytest.raises(ValueError):  # the wide model's rate is needed where the width changes
        choose(100_000, 3, 5000.0, None, 128, 0.1)


def test_more_passes_than_the_model_can_use_cut_the_schedule():
    # 18 passes of the 128-wide model; the 256-wide one would still see the data 9 times: cut to 6 passes.
    changed, why = choose(100_000, 3, 10_000.0, 5000.0, 128, 0.1)
    assert changed == {"model": {"d_model": 256}, "optim": {"weight_decay": 0.3}, "train": {"max_tokens": 600_000}}
    assert why == (
        "width 256: at 10,000 tokens/s (timed here) the 128-wide model would see the 100,000 training tokens about "
        "18.0 times in 3 minutes, more than 7; a wider model learns more from each pass; weight decay 0.3 (not 0.1): "
        "more than 5 passes; schedule cut to 600,000 tokens (6 passes; the time budget stays the ceiling): at 5,000 "
        "tokens/s the 256-wide model would see the data 9.0 times, and past 6 it memorises, so the learning rate "
        "decays over the passes it can use and the run ends early")
    # The preset's own width, between 6 and 7 passes: the schedule is cut for it.
    assert choose(100_000, 3, 3700.0, None, 128, 0.1)[0] == {"optim": {"weight_decay": 0.3},
                                                            "train": {"max_tokens": 600_000}}
    # A token budget the user gives is kept; exactly 6 passes are not cut.
    assert "train" not in choose(100_000, 3, 10_000.0, 5000.0, 128, 0.1, tokens_given=True)[0]
    assert "train" not in choose(100_000, 3, 10_000.0, 100_000 * 6 / 180, 128, 0.1)[0]


def test_the_default_path_prints_its_schedule_cut_and_trains_with_it(data_dir, tmp_path, monkeypatch, capsys):
    from nanolm.train.trainer import train
    n = json.loads((data_dir / "manifest.json").read_text())["splits"]["train"]["n_tokens"]
    # Rates at which 1 minute sees the data 20 times at width 128 and 10 times at width 256.
    rates = {128: 20 * n / 60, 256: 10 * n / 60}
    monkeypatch.setattr(sizing, "step_rate", lambda cfg: rates[cfg.model.d_model])
    over = {"data.path": str(data_dir), "train.out_dir": str(tmp_path / "run"), "train.max_minutes": "1"}
    cfg = load_config(overrides={**over, "train.max_steps": "2"})  # two steps of it are enough to see the start
    cut = int(sizing.USEFUL_PASSES * n)
    assert (cfg.model.d_model, cfg.optim.weight_decay, cfg.train.max_tokens) == (256, 0.3, cut)
    train(cfg)
    out = capsys.readouterr().out
    assert (f"; schedule cut to {cut:,} tokens (6 passes; the time budget stays the ceiling): at {rates[256]:,.0f} "
            f"tokens/s the 256-wide model would see the data 10.0 times, and past 6 it memorises") in out
    assert json.loads((tmp_path / "run" / "config.json").read_text())["train"]["max_tokens"] == cut
    # Resumed in its directory, the run keeps the cut it was sized with, whatever the rate now.
    rates.update({128: 1.0, 256: 1.0})
    again = load_config(overrides=over)
    assert (again.model.d_model, again.optim.weight_decay, again.train.max_tokens) == (256, 0.3, cut)
    assert again.note.endswith(f"; width 256, weight decay 0.3, schedule cut to {cut:,} tokens: the run in "
                               f"{tmp_path / 'run'} was started with them")
