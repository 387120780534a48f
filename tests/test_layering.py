"""The package stack: every module imports only from its own package or the ones below it,
and no modules import each other in a cycle. Imports inside functions and under
TYPE_CHECKING count as well."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
# bottom up; a package may import from its own level and every level below
STACK = (
    ("config",),
    ("kernels",),
    ("parallel",),
    ("plan",),
    ("batch",),
    ("layers",),
    ("moe",),
    ("models",),
    ("runtime",),
    ("server", "bench"),
    ("testing", "cli"),
    ("__init__",),
)
LEVEL = {name: i for i, names in enumerate(STACK) for name in names}


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts)


def imports_of(path: Path, root: Path) -> set[str]:
    """Every moeserve module `path` imports, at any depth of its code."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.add(target)
            # `from pkg import mod` imports pkg.mod when it is a module of its own
            found.update(f"{target}.{a.name}" for a in node.names)
    return {m for m in found if m == "moeserve" or m.startswith("moeserve.")}


def graph(root: Path) -> dict[str, set[str]]:
    modules = {module_name(p, root): p for p in (root / "moeserve").rglob("*.py")}
    return {m: {i for i in imports_of(p, root) if i in modules and i != m}
            for m, p in modules.items()}


def level(module: str) -> int:
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else "__init__"
    if top not in LEVEL:
        raise AssertionError(f"{module}: package {top!r} is not in the stack of "
                             "tests/test_layering.py; add it at its level")
    return LEVEL[top]


def upward_imports(g: dict[str, set[str]]) -> list[str]:
    levels = {m: level(m) for m in g}  # every module has a place in the stack
    return sorted(f"{m} -> {i}" for m, deps in g.items() for i in deps if levels[i] > levels[m])


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(g[v]):
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

    for v in sorted(g):
        if v not in index:
            visit(v)
    return found


def test_no_package_imports_from_a_package_above_it():
    assert upward_imports(graph(SRC)) == []


def test_no_import_cycles():
    assert cycles(graph(SRC)) == []


def _plant(tmp_path: Path, module: str, line: str) -> Path:
    root = tmp_path / "src"
    for path in (SRC / "moeserve").rglob("*.py"):
        dst = root / path.relative_to(SRC)
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_text(path.read_text())
    target = root / (module.replace(".", "/") + ".py")
    target.write_text(target.read_text() + f"\n\ndef _planted():\n    {line}\n")
    return root


def test_a_planted_upward_import_inside_a_function_is_found(tmp_path):
    root = _plant(tmp_path, "moeserve.kernels.launch.choice", "import moeserve.runtime.engine")
    assert upward_imports(graph(root)) == ["moeserve.kernels.launch.choice -> moeserve.runtime.engine"]


def test_a_planted_cycle_is_found(tmp_path):
    root = _plant(tmp_path, "moeserve.plan.budget", "import moeserve.plan.capacity")
    assert any({"moeserve.plan.budget", "moeserve.plan.capacity"} <= set(c)
               for c in cycles(graph(root)))


def test_a_package_outside_the_stack_is_an_error(tmp_path):
    g = {"moeserve.extra.thing": set()}
    with pytest.raises(AssertionError, match="'extra' is not in the stack"):
        upward_imports(g)
