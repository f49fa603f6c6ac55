"""No import cycle inside nanolm/ and no import up a floor: every module's imports of nanolm modules, at its top or
inside a function, form a graph without cycles (a function-level import that goes back up is a cycle too, only a
later one); so do the packages' (a package imports another when any of its modules imports any of the other's); and
each package imports only packages on floors below its own, the floors being the layer picture of
docs/architecture.md, read here so that the page and the test cannot disagree."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import nanolm

ROOT = Path(nanolm.__file__).parent
ARCHITECTURE = ROOT.parent / "docs" / "architecture.md"


def import_graph() -> dict[str, set[str]]:
    """Module name -> the nanolm modules it imports (a `from package import name` counts the submodule when name
    is one)."""
    mods = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            else:
                continue
            graph[name] |= {t for t in targets if t in mods and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def package_of(module: str) -> str:
    """The package a module belongs to: nanolm's subpackage or top-level module it sits in (nanolm.train.rl.ppo ->
    train, nanolm.checkpoint -> checkpoint); nanolm's own __init__ is "nanolm"."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Package -> the other packages its modules import (every import, function-level ones included)."""
    out: dict[str, set[str]] = {package_of(m): set() for m in graph}
    for module, targets in graph.items():
        out[package_of(module)] |= {package_of(t) for t in targets} - {package_of(module)}
    return out


def documented_floors(text: str) -> dict[str, int]:
    """Package -> floor, from the `floor N  name/  name.py  what they hold` lines of the picture under
    "## Layering" (the names are the words ending in / or .py before the first that does not)."""
    section = text.split("## Layering", 1)[1].split("\n## ", 1)[0]
    floors: dict[str, int] = {}
    for n, words in re.findall(r"^floor\s+(\d+)\s+(.+)$", section, flags=re.M):
        for word in words.split():
            if not word.endswith(("/", ".py")):
                break
            floors[word.removesuffix("/").removesuffix(".py")] = int(n)
    return floors


def imports_not_down(packages: dict[str, set[str]], floors: dict[str, int]) -> list[tuple[str, str]]:
    """Every package arrow (a, b) that does not go down a floor (the root package nanolm, which holds only the
    version, sits under every floor)."""
    return sorted((a, b) for a, targets in packages.items() for b in targets
                  if a != "nanolm" and b != "nanolm" and floors[b] >= floors[a])


def module_arrows(graph: dict[str, set[str]], a: str, b: str) -> list[str]:
    """The module imports that make package a import package b (what an assertion shows to mend)."""
    return sorted(f"{m} -> {t}" for m, targets in graph.items() if package_of(m) == a
                  for t in targets if package_of(t) == b)


def test_no_module_of_nanolm_imports_in_a_circle():
    graph = import_graph()
    assert len(graph) > 50 and "nanolm.train.trainer" in graph["nanolm.quickstart"]  # the graph is read
    assert cycles(graph) == []


def test_a_cycle_is_found_where_there_is_one():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_package_of_nanolm_imports_in_a_circle():
    packages = package_graph(import_graph())
    assert {"train", "eval", "data", "checkpoint", "cli"} <= set(packages) and "data" in packages["train"]
    # Which import closes a circle shows in the floor test below, module by module.
    assert cycles(packages) == []


def test_every_package_stands_on_its_documented_floor_and_imports_only_below_it():
    graph = import_graph()
    packages = package_graph(graph)
    floors = documented_floors(ARCHITECTURE.read_text(encoding="utf-8"))
    assert floors["errors"] == 1 and floors["cli"] > floors["train"] > floors["eval"]  # the picture is read
    # Every package has a floor, and every name in the picture is a package (the picture holds no stale room).
    assert sorted(set(packages) - {"nanolm"} - set(floors)) == []
    assert sorted(set(floors) - set(packages)) == []
    wrong = imports_not_down(packages, floors)
    assert wrong == [], [f"floor {floors[a]} -> {floors[b]}: {arrow}" for a, b in wrong
                         for arrow in module_arrows(graph, a, b)]


def test_package_arrows_up_a_floor_and_package_circles_are_found():
    graph = {"nanolm.eval.loss": {"nanolm.train.objectives"}, "nanolm.train.objectives": {"nanolm.data.shards"},
             "nanolm.train.trainer": {"nanolm.eval.loss"}, "nanolm.data.shards": {"nanolm"}, "nanolm": set()}
    packages = package_graph(graph)
    assert packages == {"eval": {"train"}, "train": {"data", "eval"}, "data": {"nanolm"}, "nanolm": set()}
    assert cycles(packages) == [["eval", "train"]]
    floors = documented_floors("# A\n## Layering\n```\nfloor 3  train/  the loop\nfloor  2  eval/  plot.py\n"
                               "floor 1  data/  the shards, shards.py/\n```\n## Next\nfloor 9  stale/\n")
    assert floors == {"train": 3, "eval": 2, "plot": 2, "data": 1}
    assert imports_not_down(packages, floors) == [("eval", "train")]
    assert module_arrows(graph, "eval", "train") == ["nanolm.eval.loss -> nanolm.train.objectives"]
