"""What a run's configuration is built from: a TOML or JSON file read into a nested dict, command-line overrides
(`--model.n_layer 4`) whose names and types come from the dataclasses, and the preset a short time budget picks.
The layers are put together (a preset, the stage's defaults, the file, the overrides) by
nanolm/train/configure.py's `load_config`, above the stages whose defaults it applies."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import fields
from pathlib import Path
from typing import Any

from nanolm.config.fields import field_type, shown
from nanolm.config.train import Config
from nanolm.errors import UserError


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
    """All dotted override names (`model.n_layer`, ...) with their field types, from the dataclasses (a Config's
    sections: its own and the registered stages', `Config.section_types`)."""
    out: dict[str, Any] = {}
    named = cls.section_types() if cls is Config else {f.name: field_type(cls, f) for f in fields(cls)}
    for name, typ in named.items():
        if dataclasses.is_dataclass(typ):
            out.update(override_fields(typ, prefix + name + "."))
        else:
            out[prefix + name] = typ
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


def nonzero(value: Any) -> bool:
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
