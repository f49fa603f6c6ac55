"""A run's configuration in layers: a preset, the stage's defaults (nanolm/train/stages.py), a TOML or JSON
file, then command-line overrides (`--model.n_layer 4`) whose names and types come from the dataclasses."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import fields
from pathlib import Path
from typing import Any

from nanolm.config.fields import deep_merge, field_type, shown
from nanolm.config.presets import preset
from nanolm.config.train import Config
from nanolm.errors import UserError
from nanolm.train import stages


def read_config_file(path: str | Path) -> dict[str, Any]:
    """Read a TOML or JSON config file into a nested dict."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"{p}: config file not found; pass an existing .toml or .json file")
    text = p.read_bytes()
    if p.suffix == ".json":
        try:
            d = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise UserError(f"{p}: invalid JSON ({e}); fix the file") from None
        except RecursionError:
            raise UserError(f"{p}: invalid JSON (nested too deeply); fix the file") from None
    elif p.suffix == ".toml":
        try:
            import tomllib
        except ModuleNotFoundError:  # Python 3.10
            import tomli as tomllib
        try:
            d = tomllib.loads(text.decode("utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise UserError(f"{p}: invalid TOML ({e}); fix the file") from None
        except RecursionError:
            raise UserError(f"{p}: invalid TOML (nested too deeply); fix the file") from None
    else:
        raise UserError(f"{p}: config files must end in .toml or .json")
    if not isinstance(d, dict):
        raise UserError(f"{p}: the top level must be a table/object with model/data/optim/train sections")
    return d


def override_fields(cls: type = Config, prefix: str = "") -> dict[str, Any]:
    """All dotted override names (`model.n_layer`, ...) with their field types, from the dataclasses."""
    out: dict[str, Any] = {}
    for f in fields(cls):
        typ = field_type(cls, f)
        if dataclasses.is_dataclass(typ):
            out.update(override_fields(typ, prefix + f.name + "."))
        else:
            out[prefix + f.name] = typ
    return out


def overrides_to_dict(overrides: dict[str, Any]) -> dict[str, Any]:
    """{'model.n_layer': '4'} -> {'model': {'n_layer': '4'}} (values are coerced when the Config is built)."""
    nested: dict[str, Any] = {}
    known = override_fields()
    for key, value in overrides.items():
        if key not in known:
            raise UserError(f"unknown option --{shown(key)}; see `nanolm train --help` for the list")
        node = nested
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return nested


def _nonzero(value: Any) -> bool:
    """Whether a budget value from a file or the command line (a number or its text) is set and not 0."""
    try:
        return float(value) != 0
    except (TypeError, ValueError):
        return value is not None  # not a number: the Config build reports it


# A time budget up to this many minutes, with no preset and no model settings, trains BUDGET_PRESET: nanolm's
# default model (minimind-26m's shape) takes ~33 steps in 3 CPU-minutes and ends far behind a small one.
BUDGET_PRESET, BUDGET_PRESET_MINUTES = "cpu-small", 30.0


def budget_preset(preset_name: str | None, file_d: dict[str, Any], over_d: dict[str, Any]) -> str | None:
    """The preset a short time budget picks when neither a preset nor any model.* setting is given, else None."""
    if preset_name:
        return None
    given = [d for d in (file_d, over_d) if isinstance(d, dict)]
    if any(isinstance(d.get("model"), dict) and set(d["model"]) - {"vocab_size"} for d in given):
        return None
    minutes = [t.get("max_minutes") for d in given if isinstance(t := d.get("train"), dict)]
    try:
        last = float([m for m in minutes if m is not None][-1])
    except (IndexError, TypeError, ValueError):
        return None
    return BUDGET_PRESET if 0 < last <= BUDGET_PRESET_MINUTES else None


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
    # (A "train" that is no table is reported when the Config is built.)
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
    if any(_nonzero(t.get(k)) for t in given for k in ("max_minutes", "max_tokens")) \
            and not any("max_steps" in t for t in given):
        d["train"]["max_steps"] = 0
    cfg = Config.from_dict(d, source)
    if picked is not None:  # its width and weight decay, for the budget and the data (nanolm/train/sizing.py)
        from nanolm.train.sizing import shape_for_budget
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
