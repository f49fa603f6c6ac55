"""A stage owns all of its parts: no module of nanolm/ names a registered stage as a string, but the stages' own
(nanolm/train/stages.py and the reinforcement-learning stages' modules under nanolm/train/rl/). Whatever else
needs a stage's trait (its memory, its config section, its report-card row, whether it trains blocks) asks the
registry."""

from __future__ import annotations

import ast
from pathlib import Path

import nanolm
from nanolm.train import stages

ROOT = Path(nanolm.__file__).parent

# The stages and their own modules.
OWNERS = ("train/stages.py", "train/rl/")

# Strings that are a stage's name but mean something else, or name a stage as a user's command line does.
ALLOWED = {
    ("cli.py", "lora"): "the `nanolm lora merge` command",
    ("cli.py", "blocks"): "the `nanolm data blocks` built-in data set",
    ("data/", "blocks"): "the blocks data kind, which shares the stage's name (data kinds are nanolm/data/kinds/'s)",
    ("data/", "dpo"): "the pairs data kind's former name, read from old manifests (data/shards.py's RENAMED_KINDS)",
    ("data/builtin/arith.py", "sft"): "the key of the arithmetic set's worked-reply conversations file",
    ("quickstart.py", "sft"): "the arithmetic set's worked-reply file, by its key in write_arith's files",
}


def stage_strings(source: str, names: set[str]) -> list[tuple[int, str]]:
    """(line, name) of each string constant (f-string parts included) that is exactly a stage's name."""
    return [(node.lineno, node.value) for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names]


def test_the_scan_finds_a_stage_name_wherever_it_is_written():
    found = stage_strings('x = "dpo"\nif stage in ("sft", "other"):\n    f"{a}sft"\n', {"dpo", "sft"})
    assert sorted(found) == [(1, "dpo"), (2, "sft"), (3, "sft")]
    assert stage_strings('x = "dpo.beta"  # dpo\n', {"dpo"}) == []  # a longer string, a comment: not a name


def test_no_module_outside_the_stages_names_a_stage():
    names = set(stages.names())
    assert {"pretrain", "sft", "lora", "dpo", "distill", "grpo", "ppo", "blocks"} <= names
    seen_in_owners, offenders = set(), []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        found = stage_strings(path.read_text(encoding="utf-8"), names)
        if rel.startswith(OWNERS):
            seen_in_owners |= {name for _, name in found}
            continue
        offenders += [f"nanolm/{rel}:{line}: {name!r}" for line, name in found
                      if (rel, name) not in ALLOWED and not (rel.startswith("data/") and ("data/", name) in ALLOWED)]
    assert seen_in_owners >= names  # the scan reads the stages themselves
    assert offenders == [], "a stage named outside its own module; ask the stage registry instead"
