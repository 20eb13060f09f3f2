"""The house rules of docs/architecture.md, checked on the source: no import cycle
between kvengine's modules, no module over ~450 lines, every module says what it
owns, and the handles (Transfer, LayerStream) reach no engine private."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "kvengine"
MODULES = sorted(p for p in PKG.rglob("*.py"))
MAX_LINES = 450


def _name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _runtime_imports(path: Path) -> set[str]:
    """kvengine modules ``path`` imports when it is imported: module level, outside
    ``if TYPE_CHECKING:`` (imports inside functions run later and cannot close a cycle
    at import time, but they are counted too unless they are in a function)."""
    tree = ast.parse(path.read_text())
    here = _name(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    found: set[str] = set()

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                visit(node.orelse)
                continue
            if isinstance(node, (ast.If, ast.Try, ast.With)):
                for block in (getattr(node, "body", []), getattr(node, "orelse", []),
                              getattr(node, "finalbody", []),
                              *[h.body for h in getattr(node, "handlers", [])]):
                    visit(block)
                continue
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name.startswith("kvengine"))
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - node.level + 1]
                    mod = ".".join(base + ([node.module] if node.module else []))
                else:
                    mod = node.module or ""
                if not mod.startswith("kvengine"):
                    continue
                for a in node.names:   # `from . import plan` imports a module
                    sub = f"{mod}.{a.name}"
                    found.add(sub if (PKG.parent / (sub.replace(".", "/") + ".py")).exists() else mod)
    visit(tree.body)
    found.discard(here)
    return {m for m in found if m != "kvengine" or here == "kvengine"}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (module -> modules it imports), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def walk(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n in graph and not state.get(n):
                found = walk(n)
                if found:
                    return found
        stack.pop()
        state[m] = 2
        return None

    for m in graph:
        if not state.get(m):
            found = walk(m)
            if found:
                return found
    return None


def test_the_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_no_import_cycle_between_kvengine_modules():
    graph = {_name(p): _runtime_imports(p) for p in MODULES}
    assert graph["kvengine.engine"] >= {"kvengine.parts"}, "the checker lost the engine's imports"
    assert graph["kvengine.parts"] >= {"kvengine.links", "kvengine.scheduler"}
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PKG)))
def test_each_module_is_short_and_says_what_it_owns(path: Path):
    text = path.read_text()
    lines = text.count("\n")
    assert lines <= MAX_LINES, f"{path.name} has {lines} lines (the house limit is ~{MAX_LINES})"
    doc = ast.get_docstring(ast.parse(text))
    assert doc, f"{path.name} opens with no docstring"


@pytest.mark.parametrize("handle", ["transfer.py", "layers.py"])
def test_handles_reach_no_engine_private(handle: str):
    """A handle talks to its owner through a typing.Protocol, never to KvEngine's
    internals (``engine._x``) and never imports the engine or its parts."""
    tree = ast.parse((PKG / handle).read_text())
    imports = _runtime_imports(PKG / handle)
    assert not imports & {"kvengine.engine", "kvengine.parts", "kvengine.links", "kvengine.registry"}, imports
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            owner = ast.unparse(node.value)
            assert owner in ("self", "t", "cls") or owner.startswith("self."), \
                f"{handle}: {ast.unparse(node)} reaches into another object's private"
