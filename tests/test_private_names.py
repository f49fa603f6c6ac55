"""No private name crosses modules inside nanolm/: no `from nanolm.x import _name` and no `x._name` on an imported
nanolm module, anywhere in the package (at the top of a module or inside a function). A name another module needs
is public, or it moves to where it is used."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "nanolm"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_imports(source: str, module: str, is_package: bool, modules: set[str]) -> list[str]:
    """Each private name `module` takes from another nanolm module: `from X import _a` (absolute or relative)
    and `X._a` where X names an imported nanolm module; as "line: X._a"."""
    tree = ast.parse(source)
    found, module_aliases = [], {}
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, up level - 1 packages
                up = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([node.module] if node.module else []))
            if not base.startswith("nanolm"):
                continue
            for alias in node.names:
                if f"{base}.{alias.name}" in modules:  # a module imported from its package
                    module_aliases[alias.asname or alias.name] = f"{base}.{alias.name}"
                elif _private(alias.name) and base != module:
                    found.append(f"{node.lineno}: {base}.{alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("nanolm"):
                    module_aliases[alias.asname or alias.name] = alias.name
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr) and isinstance(node.value, ast.Name):
            target = module_aliases.get(node.value.id)
            if target is not None and target != module:
                found.append(f"{node.lineno}: {target}.{node.attr}")
    return found


def test_no_private_name_is_imported_across_modules():
    files = sorted(ROOT.rglob("*.py"))
    modules = {_module_name(p) for p in files}
    crossings = [f"{p.relative_to(ROOT.parent)}:{hit}" for p in files
                 for hit in private_imports(p.read_text(encoding="utf-8"), _module_name(p), p.name == "__init__.py",
                                            modules)]
    assert len(files) > 50  # the package is read
    assert crossings == []


def test_the_scan_finds_each_way_of_reaching_a_private_name():
    modules = {"nanolm.a", "nanolm.b", "nanolm.pkg", "nanolm.pkg.c"}
    source = ("from nanolm.b import _x, y\n"
              "from . import b\n"
              "from .b import _z\n"
              "import nanolm.pkg.c as c\n"
              "def f():\n"
              "    from nanolm.pkg import c as cc\n"
              "    return b._w, c._v, cc._u, b.__doc__, _own\n")
    assert private_imports(source, "nanolm.a", False, modules) == [
        "1: nanolm.b._x", "3: nanolm.b._z", "7: nanolm.b._w", "7: nanolm.pkg.c._v", "7: nanolm.pkg.c._u"]
    assert private_imports("from nanolm.a import _mine\n", "nanolm.a", False, modules) == []
