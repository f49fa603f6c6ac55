"""Building the configuration dataclasses from nested dicts (files, the command line): each value checked
and converted to its field's declared type, with one-line errors naming the field."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import types
import typing
from dataclasses import fields
from typing import Any

from nanolm.errors import UserError


def check(cond: bool, msg: str) -> None:
    if not cond:
        raise UserError(msg)


@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)  # slow (it evaluates the annotations), and the same every time


def field_type(cls: type, f: dataclasses.Field) -> Any:
    return _type_hints(cls)[f.name]


def _coerce(value: Any, typ: Any, where: str) -> Any:
    """Check/convert a JSON/TOML/CLI value to the field's declared type."""
    origin = typing.get_origin(typ)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(typ) if a is not type(None)]
        if value is None:
            return None
        return _coerce(value, args[0], where)
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
            return value.lower() in ("true", "1", "yes", "on")
        raise UserError(f"{where}: expected true or false, got {value!r}")
    if typ is int:
        if isinstance(value, bool):
            raise UserError(f"{where}: expected an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(float(value)) if ("e" in value.lower() and float(value).is_integer()) else int(value)
            except ValueError:
                pass
        raise UserError(f"{where}: expected an integer, got {value!r}")
    if typ is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):
            try:
                number = float(value)
            except ValueError:
                pass
        if number is None:
            raise UserError(f"{where}: expected a number, got {value!r}")
        if not math.isfinite(number):  # no field means "unlimited" by inf; nan passes no range check
            raise UserError(f"{where}: expected a finite number, got {value!r}")
        return number
    if typ is str:
        if isinstance(value, str):
            return value
        raise UserError(f"{where}: expected a string, got {value!r}")
    if origin is tuple:  # tuple[str, ...]: a list in files, comma-separated on the command line
        items = value.split(",") if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)) or not all(isinstance(i, str) and i.strip() for i in items):
            raise UserError(f"{where}: expected a list of names (comma-separated on the command line), got {value!r}")
        return tuple(i.strip() for i in items)
    return value


def _dataclass_items(typ: Any) -> type | None:
    """The item type of a `tuple[SomeDataclass, ...]` field, else None."""
    args = typing.get_args(typ)
    if typing.get_origin(typ) is tuple and args and dataclasses.is_dataclass(args[0]):
        return args[0]
    return None


def shown(key: str, limit: int = 40) -> str:
    """A user's key for a one-line message: as is when short and printable, else quoted with escapes and cut."""
    if len(key) <= limit and key.isprintable():
        return key
    return json.dumps(key[:limit]) + ("..." if len(key) > limit else "")


def build_config(cls: type, d: Any, source: str, prefix: str) -> Any:
    if not isinstance(d, dict):
        raise UserError(f"{source}: {prefix.rstrip('.') or 'top level'} must be a table/object, got {type(d).__name__}")
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(d) - set(known))
    if unknown:
        raise UserError(f"{source}: unknown field {prefix}{shown(unknown[0])}; known fields: "
                        f"{', '.join(prefix + k for k in known)}")
    kwargs = {}
    for name, value in d.items():
        typ = field_type(cls, known[name])
        if dataclasses.is_dataclass(typ):
            kwargs[name] = build_config(typ, value, source, prefix + name + ".")
        elif (item := _dataclass_items(typ)) is not None:  # tuple[DataSetConfig, ...]: a list of tables
            if not isinstance(value, (list, tuple)):
                raise UserError(f"{source}: {prefix}{name} must be a list of tables/objects ([[{prefix}{name}]] in "
                                f"TOML), got {type(value).__name__}")
            kwargs[name] = tuple(build_config(item, v, source, f"{prefix}{name}[{i}].") for i, v in enumerate(value))
        else:
            kwargs[name] = _coerce(value, typ, f"{source}: {prefix}{name}")
    try:
        return cls(**kwargs)
    except UserError as e:
        raise UserError(f"{source}: {e}") from None


def deep_merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out

