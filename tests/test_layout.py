"""The package layout: imports run one way, down the layers, with no circle.

Read from the source (``ast``), not from a running interpreter, so every import counts,
also those inside functions that a test run might never reach. An edge ``a -> b`` is a
module of ``a`` importing a module of ``b``; ``from pkg import sub`` counts as an import
of ``pkg.sub`` when ``sub`` is a module, else of ``pkg``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src"

# package -> the packages of syncbn its modules may import (besides their own); the
# face's leaf modules syncbn._version and syncbn._moved import nothing of syncbn and may
# be imported by anyone. Documented in CONTRIBUTING.md, "Architecture".
ALLOWED = {
    "syncbn.core": set(),
    "syncbn.torch": {"syncbn.core"},
    # on the torch backend, Keras's collectives are syncbn.torch's (imported there only)
    "syncbn.keras": {"syncbn.core", "syncbn.torch"},
    "syncbn.flax": {"syncbn.core"},
    "syncbn.tools": {"syncbn.core", "syncbn.torch"},
    "syncbn.demo": {"syncbn.core", "syncbn.torch", "syncbn.keras", "syncbn.flax", "syncbn.tools"},
    "syncbn.bench": {"syncbn.core", "syncbn.torch", "syncbn.keras", "syncbn.flax", "syncbn.tools", "syncbn.demo"},
    "syncbn": {"syncbn.torch"},  # the face: __init__ (lazily), cli (its subcommands by name)
}
LEAVES = {"syncbn._version", "syncbn._moved"}
# what may sit at the top level: the package's face and the sibling packages
TOP_LEVEL = {"__init__.py", "__main__.py", "_version.py", "_moved.py", "cli.py", "py.typed",
             "core", "torch", "keras", "flax", "tools", "demo", "bench"}


def _modules():
    mods = {}
    for path in (SRC / "syncbn").rglob("*.py"):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        mods[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)
    return mods


def _edges(mods):
    """{module: {imported syncbn module: first line}}."""
    edges = {}
    for name, (path, is_pkg) in mods.items():
        out = edges.setdefault(name, {})
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = name.split(".") if is_pkg else name.split(".")[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module
                subs = [f"{module}.{a.name}" for a in node.names]
                targets = [s for s in subs if s in mods]
                if len(targets) < len(subs):
                    targets.append(module)
            else:
                continue
            for target in targets:
                if target in mods and target != name:
                    out.setdefault(target, node.lineno)
    return edges


SIBLINGS = ("core", "torch", "keras", "flax", "tools", "demo", "bench")


def _package(module: str) -> str:
    """The sibling package a module belongs to (``syncbn`` for the face's modules)."""
    parts = module.split(".")
    return f"syncbn.{parts[1]}" if len(parts) > 1 and parts[1] in SIBLINGS else "syncbn"


def _cycles(edges):
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_no_import_circle_between_modules():
    assert _cycles(_edges(_modules())) == []


def test_no_import_circle_between_packages():
    package_edges = {}
    for source, targets in _edges(_modules()).items():
        for target in targets:
            if target not in LEAVES and _package(source) != _package(target):
                package_edges.setdefault(_package(source), {})[_package(target)] = 1
    assert _cycles(package_edges) == []


def test_every_import_runs_down_the_layers():
    wrong = []
    for source, targets in sorted(_edges(_modules()).items()):
        own = _package(source)
        for target, line in sorted(targets.items()):
            other = _package(target)
            if target in LEAVES or other == own or other in ALLOWED[own]:
                continue
            if target == "syncbn" and source in {"syncbn.cli", "syncbn.__main__"}:
                continue
            wrong.append(f"{source}:{line} imports {target}")
    assert wrong == []


def test_nothing_imports_the_package_face_from_below():
    """``import syncbn`` / ``from syncbn import X`` inside the package would run the layers
    back up through the face's lazy names."""
    up = [f"{source}:{line}" for source, targets in _edges(_modules()).items()
          for target, line in targets.items()
          if target == "syncbn" and not source.startswith("syncbn._") and source not in {"syncbn.cli", "syncbn.__main__"}
          and source != "syncbn"]
    assert up == []


def test_top_level_holds_only_the_face_and_the_sibling_packages():
    names = {p.name for p in (SRC / "syncbn").iterdir() if p.name != "__pycache__"}
    assert names - TOP_LEVEL == set()


def test_every_package_has_a_rule():
    assert {_package(m) for m in _modules()} == set(ALLOWED)


@pytest.mark.parametrize("source, target", [
    ("syncbn.torch.fingerprint", "syncbn.torch.batchnorm"),  # a circle inside a package
    ("syncbn.core.fingerprint", "syncbn.torch.stats"),  # core needing a framework
    ("syncbn.torch.conversion", "syncbn.bench.plan"),  # the library needing a tool
])
def test_the_checks_see_a_wrong_import(source, target):
    """The checks above fail on a graph with one wrong edge added."""
    edges = _edges(_modules())
    edges[source] = dict(edges[source], **{target: 1})
    circle = _cycles(edges) != []
    wrong_layer = _package(target) not in ALLOWED[_package(source)] | {_package(source)}
    assert circle or wrong_layer
