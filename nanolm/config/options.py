"""A command's options generated from its config dataclass (`SamplingParams`, `ServeConfig`, `PrepareConfig`,
`QuickstartConfig`), and the dataclass built back from the parsed options: the command line states no default of
its own."""

from __future__ import annotations

import argparse
import dataclasses
import typing

from nanolm.config.fields import field_type
from nanolm.errors import UserError


def add_fields(p: argparse.ArgumentParser, cls: type, title: str) -> None:
    """One option per field of the dataclass `cls`, generated from it: field `top_k` is `--top-k` (or the field's
    metadata "flag"), typed as the field (a list's or tuple's items, metadata "nargs" how many), with the field's
    default and its metadata "help" (followed by "(default ...)", but for a None the help explains); a field
    without a default is a required option, or a positional argument with metadata "positional" (and "nargs");
    metadata "choices" lists the values allowed, "type" the command line's type if not the field's. "help" and
    "choices" may be functions, called here. A bool field is `--name` / `--no-name`."""
    g = p.add_argument_group(title)
    for f in dataclasses.fields(cls):
        typ = field_type(cls, f)
        kind = next(t for t in (*typing.get_args(typ), typ) if t is not type(None))
        meta = {k: v() if callable(v) else v for k, v in f.metadata.items() if k in ("help", "choices")}
        helps = meta.get("help", f.name)
        flag = f.metadata.get("flag", "--" + f.name.replace("_", "-"))
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:  # given every time
            if f.metadata.get("positional"):
                g.add_argument(f.name, type=f.metadata.get("type", kind), nargs=f.metadata.get("nargs"), help=helps)
            else:
                g.add_argument(flag, dest=f.name, type=kind, required=True, help=helps)
            continue
        value = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
        if kind is bool:
            g.add_argument(flag, dest=f.name, default=value, action=argparse.BooleanOptionalAction, help=helps)
            continue
        if value is not None or "default" not in helps:  # None's meaning is the help's to say
            shown = (" ".join(map(str, value)) or "none" if isinstance(value, (list, tuple)) else
                     "none" if value is None else '""' if value == "" else value)
            helps = f"{helps} (default {shown})"
        g.add_argument(flag, dest=f.name, type=kind, default=value, nargs=f.metadata.get("nargs"),
                       choices=meta.get("choices"), metavar=None if "choices" in meta else kind.__name__.upper(),
                       help=helps)


def from_fields(args: argparse.Namespace, cls: type):
    """The dataclass `cls` from the options `add_fields` made for it; it validates itself."""
    try:
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})
    except UserError as e:
        raise UserError(f"{args.command}: {e}") from None
