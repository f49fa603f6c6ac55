"""A run's configuration in layers, each overriding the one before: a preset (nanolm/config/presets.py), the
stage's defaults (nanolm/train/stages.py), a TOML or JSON file, then command-line overrides (`--model.n_layer 4`),
validated once at the end, with the stage's own checks; a short time budget with no model settings picks and
sizes its preset (nanolm/train/sizing.py).

It sits above the stages it reads, so that the configuration's own package (nanolm/config/: the dataclasses, the
file and override readers) imports nothing of the trainer; importing it registers the built-in stages and their
settings sections.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nanolm.config import Config, preset
from nanolm.config.fields import deep_merge
from nanolm.config.load import BUDGET_PRESET_MINUTES, budget_preset, nonzero, overrides_to_dict, read_config_file
from nanolm.errors import UserError
from nanolm.train import stages
from nanolm.train.sizing import shape_for_budget


def load_config(preset_name: str | None = None, config_file: str | Path | None = None,
                overrides: dict[str, Any] | None = None) -> Config:
    """preset -> file -> overrides, validated once at the end. With no preset, a time budget of at most
    BUDGET_PRESET_MINUTES and no model settings, the preset is BUDGET_PRESET (the config's `note` says so)."""
    file_d = read_config_file(config_file) if config_file else {}
    over_d = overrides_to_dict(overrides) if overrides else {}
    note = ""
    if (picked := budget_preset(preset_name, file_d, over_d)) is not None:
        preset_name = picked
        note = (f"preset {picked}: no preset or model settings were given and the time budget is at most "
                f"{BUDGET_PRESET_MINUTES:g} minutes, so the model is sized for it (pass --preset or --model.* to "
                f"choose)")
    base = preset(preset_name) if preset_name else Config()
    d = base.to_dict()
    source = f"preset {preset_name}" if preset_name else "defaults"
    # The stage (from the overrides, else the file, else the preset) brings its defaults first.
    # (A "train" that is no table is reported when the Config is built, an unknown stage after it.)
    stage = next((t.get("stage") for t in (over_d.get("train"), file_d.get("train")) if isinstance(t, dict)
                  and t.get("stage")), base.train.stage)
    d = deep_merge(d, stages.get(stage).defaults(base) if stage in stages.names() else {})
    if config_file:
        d = deep_merge(d, file_d)
        source = str(config_file)
    if overrides:
        d = deep_merge(d, over_d)
        source = "command line" if not config_file else f"{config_file} + command line"
    # A budget the user gives without max_steps shapes the schedule (max_steps 0: fitted at the start of the run).
    given = [t for t in (file_d.get("train"), over_d.get("train")) if isinstance(t, dict)]
    if any(nonzero(t.get(k)) for t in given for k in ("max_minutes", "max_tokens")) \
            and not any("max_steps" in t for t in given):
        d["train"]["max_steps"] = 0
    cfg = Config.from_dict(d, source)
    if picked is not None:  # its width and weight decay, for the budget and the data (nanolm/train/sizing.py)
        decay_given = any(isinstance(o := g.get("optim"), dict) and "weight_decay" in o for g in (file_d, over_d))
        changed, why = shape_for_budget(cfg, decay_given)
        if changed:
            for part, values in changed.items():
                d[part].update(values)
            cfg = Config.from_dict(d, source)
        note += f"; {why}" if why else ""
    try:
        stages.get(cfg.train.stage).check(cfg)
    except UserError as e:
        raise UserError(f"{source}: {e}") from None
    cfg.note = note
    return cfg
