"""Which prepared data a run trains on: one set or several as a curriculum or mixture (`DataConfig`), and
the `--data DIR:key=value,...` spelling of a set."""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from nanolm.config.fields import shown, check as _check
from nanolm.errors import UserError


DATA_MODES = ("curriculum", "mixture")
# Keys of one data set on the command line (`--data DIR:epochs=2,name=wiki`).
_SET_KEYS = ("epochs", "tokens", "weight", "name")
_SET_OPTIONS = re.compile(r"^\w+=[^,=]*(,\w+=[^,=]*)*$")
_SET_NAME = re.compile(r"^[\w.-]+$")
_COUNT_SUFFIXES = {"K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}


def default_set_name(path: str) -> str:
    """A data set's name when none is given: its directory's basename, with characters other than
    letters, digits, '_', '.' and '-' replaced by '_' (the name is part of a metrics key, val_loss/<name>)."""
    base = os.path.basename(os.path.normpath(path)) if path else ""
    return re.sub(r"[^\w.-]", "_", base) if base not in ("", ".", "..") else "data"


@dataclass
class DataSetConfig:
    """One prepared data set of a curriculum or a mixture (a `[[data.sets]]` table in TOML).

    In a curriculum it is used for `epochs` (of its epoch 0; fractions
    allowed) or `tokens`, then the next set takes over; with neither (the last
    set only) until the run stops. In a mixture, `weight` is its share of the
    micro-batches. `DataConfig` checks it, as it knows the set's place.
    """

    path: str = ""
    epochs: float = 0.0
    tokens: int = 0
    weight: float = 1.0
    name: str = ""  # "" = the directory's basename, made unique

    @property
    def has_budget(self) -> bool:
        return bool(self.epochs or self.tokens)


@dataclass
class DataConfig:
    """Where the prepared token shards are (the output of `nanolm prepare`).

    One data set is `path`. Several are `sets`: used in turn, each for its
    epochs or tokens (`mode = "curriculum"`), or sampled by weight (`mode =
    "mixture"`); see nanolm/data/stream.py.
    """

    path: str = ""
    sets: tuple[DataSetConfig, ...] = ()
    mode: str = "curriculum"  # how data.sets are used: curriculum (in order) or mixture (by weight)

    def __post_init__(self) -> None:
        _check(isinstance(self.path, str), "data.path must be a string (a directory made by `nanolm prepare`)")
        _check(self.mode in DATA_MODES, f"data.mode must be one of {', '.join(DATA_MODES)}, got {self.mode!r}")
        _check(isinstance(self.sets, (tuple, list)) and all(isinstance(s, DataSetConfig) for s in self.sets),
               "data.sets must be a list of data sets ([[data.sets]] tables in TOML, objects in JSON)")
        _check(not (self.path and self.sets),
               "data.path and data.sets are both set; give one data set as data.path or several as data.sets")
        sets: list[DataSetConfig] = []
        taken = {s.name for s in self.sets}
        for i, s in enumerate(self.sets):
            _check(isinstance(s.path, str) and bool(s.path),
                   f"data.sets[{i}].path is empty; give a directory made by `nanolm prepare`")
            if s.name:
                _check(bool(_SET_NAME.match(s.name)),
                       f"data.sets[{i}].name {s.name!r} may hold only letters, digits, '_', '.' and '-'")
                _check(sum(t.name == s.name for t in self.sets) == 1,
                       f"data.sets[{i}].name {s.name!r} is used twice; give each data set its own name")
            else:  # the basename, with -2, -3 ... where two sets would share it
                base, n, name = default_set_name(s.path), 1, default_set_name(s.path)
                while name in taken:
                    n += 1
                    name = f"{base}-{n}"
                taken.add(name)
                s = dataclasses.replace(s, name=name)
            where = f"data.sets[{i}] ({s.name})"
            _check(s.epochs >= 0 and math.isfinite(s.epochs), f"{where}: epochs must be >= 0, got {s.epochs}")
            _check(s.tokens >= 0, f"{where}: tokens must be >= 0, got {s.tokens}")
            _check(not (s.epochs and s.tokens), f"{where}: give epochs or tokens, not both")
            _check(s.weight > 0 and math.isfinite(s.weight), f"{where}: weight must be > 0, got {s.weight:g}")
            if self.mode == "mixture":
                _check(not s.has_budget, f"{where}: epochs and tokens are budgets of a curriculum; a mixture samples "
                       "its sets by weight until the run stops (drop them, or use data.mode curriculum)")
            else:
                _check(s.weight == 1, f"{where}: weight {s.weight:g} applies only to a mixture; a curriculum uses "
                       "its sets in turn (use data.mode mixture, or drop the weight)")
                _check(s.has_budget or i == len(self.sets) - 1,
                       f"{where} needs epochs or tokens: in a curriculum every set but the last has a budget "
                       "(the last one may repeat until the run stops)")
            sets.append(s)
        self.sets = tuple(sets)


def parse_data_set(spec: str) -> dict[str, Any]:
    """`DIR` or `DIR:key=value[,key=value]` (keys epochs, tokens, weight, name) -> a data set's fields.

    The options start after the last ':' when what follows is a list of
    key=value pairs, so a directory whose name holds ':' still reads as a
    path. tokens takes K, M, B (or G) and T suffixes: 5M = 5,000,000.
    """
    path, sep, options = spec.rpartition(":")
    if not sep or not _SET_OPTIONS.match(options):
        return {"path": spec}
    where = f"--data {shown(spec, 200)}"
    out: dict[str, Any] = {"path": path}
    for item in options.split(","):
        key, value = item.split("=", 1)
        if key not in _SET_KEYS:
            raise UserError(f"{where}: unknown key {key!r}; use {', '.join(_SET_KEYS)}")
        if key == "tokens":
            out[key] = _parse_count(value, f"{where}: tokens")
        elif key == "name":
            out[key] = value
        else:
            try:
                out[key] = float(value)
            except ValueError:
                raise UserError(f"{where}: {key} must be a number, got {value!r}") from None
    return out


def _parse_count(value: str, where: str) -> int:
    """'5000000', '5M', '2B', '1.5K', '1e6' -> an integer."""
    v = value.strip()
    scale = _COUNT_SUFFIXES.get(v[-1:].upper(), 1)
    try:
        n = float(v[:-1] if scale > 1 else v) * scale
    except ValueError:
        n = float("nan")
    if not (math.isfinite(n) and n >= 0 and n.is_integer()):
        raise UserError(f"{where} must be a whole number of tokens such as 5000000, 5M or 2B, got {value!r}")
    return int(n)


def data_overrides(values: Sequence[str]) -> dict[str, Any]:
    """The values of `--data` as overrides: one plain directory is data.path; otherwise each value,
    `DIR` or `DIR:key=value,...`, is one of data.sets. Either replaces the data a preset or file chose."""
    specs = [parse_data_set(v) for v in values]
    if len(specs) == 1 and len(specs[0]) == 1:
        return {"data.path": specs[0]["path"], "data.sets": []}
    return {"data.path": "", "data.sets": specs}


def format_data_set(d: dict[str, Any]) -> str:
    """A data set's fields (as `Config.to_dict` gives them) in the command-line spelling `DIR:key=value,...`."""
    opts = [f"epochs={d['epochs']:g}"] if d.get("epochs") else []
    opts += [f"tokens={d['tokens']}"] if d.get("tokens") else []
    opts += [f"weight={d['weight']:g}"] if d.get("weight", 1.0) != 1.0 else []
    opts.append(f"name={d.get('name')}")
    return f"{d.get('path')}:{','.join(opts)}"


