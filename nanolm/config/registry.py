"""The registry of training stages, kept at the configuration's floor: what the configuration, the evaluation
and the report card ask of a stage, without importing the trainer above them.

The stages themselves are `nanolm.train.stages.Stage` objects; `nanolm.train.stages.register` adds each one here,
and importing nanolm.train.stages registers the built-in ones. The layers below the trainer see a stage through
`StageSpec`: its name, its own settings section (a dataclass that `Config` builds, validates, saves and prints
under the stage's name, so a stage with settings touches no shared module), whether it trains LoRA adapters,
whether it fine-tunes, and what its report-card row measures.

The built-in stages are found the way plugins are: the first lookup in an empty registry loads the module
named by `BUILTIN_STAGES` (by name, as an entry point is loaded), so `Config()` works from any entry point while
nothing at this floor imports the trainer when it is itself imported.
"""

from __future__ import annotations

import importlib
from typing import Any, Protocol

from nanolm.errors import UserError


class StageSpec(Protocol):
    """What the layers below the trainer know of a stage (nanolm/train/stages.py's `Stage` has each)."""

    name: str
    section: type | None  # its own settings: a dataclass, the Config section named after the stage
    adapters: bool  # trains LoRA adapters on a frozen base (Config.uses_lora)
    fine_tunes: bool  # starts from trained weights; its data is in the chat layout (benchmarks default to chat)
    default: bool  # the stage a configuration trains when none is named
    card_measures: str  # what its validation bits per byte are measured on, as the report card says it
    card_baseline: str  # the baseline its card row is set beside: "text", "initial" or "" (none)

    def shows_section(self, cfg: Any) -> bool:
        """Whether the start-of-run summary prints the stage's section for `cfg`."""
        ...


_STAGES: dict[str, StageSpec] = {}
BUILTIN_STAGES = "nanolm.train.stages"  # registers the built-in stages when imported


def add(stage: StageSpec) -> None:
    """Register a stage object (nanolm.train.stages.register does, for each Stage class it is given)."""
    if not stage.name or stage.name in _STAGES:
        raise ValueError(f"stage {stage.name!r}: a stage needs a name of its own")
    _STAGES[stage.name] = stage


def _registered() -> dict[str, StageSpec]:
    if not _STAGES:
        importlib.import_module(BUILTIN_STAGES)
    return _STAGES


def names() -> tuple[str, ...]:
    return tuple(_registered())


def get(name: str) -> StageSpec:
    stages = _registered()
    if name not in stages:
        raise UserError(f"train.stage must be one of {', '.join(stages)}, got {name!r}")
    return stages[name]


def find(name: str) -> StageSpec | None:
    """The stage of that name, or None (a run of a stage not registered here, an imported model's "base")."""
    return _registered().get(name)


def default_name() -> str:
    """The stage a configuration trains when none is named (the one registered with `default`)."""
    name = next((s.name for s in _registered().values() if s.default), None)
    if name is None:
        raise RuntimeError("no registered stage is the default one (a Stage with default = True)")
    return name


def sections() -> dict[str, type]:
    """The stages' own settings sections, by stage name, in the order the stages were registered."""
    return {name: s.section for name, s in _registered().items() if s.section is not None}
