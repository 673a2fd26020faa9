"""No import cycles in the package: not at import time, and not through a lazy import inside a
function either (a lazy import that breaks a cycle hides it; it does not remove it). The import
reader is the module map's, so both tests see the same arrows."""

from __future__ import annotations

from collections.abc import Mapping, Set

from tests.unit.test_module_map import package_imports, package_modules


def cycles(graph: Mapping[str, Set[str]]) -> list[list[str]]:
    """The strongly connected components of ``graph`` with more than one node (or a self-loop),
    each sorted: every import cycle, once."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component: list[str] = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph.get(v, ()):
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_package_has_no_import_cycle() -> None:
    modules = package_modules()
    graph = {m: package_imports(m, modules) for m in modules}
    assert cycles(graph) == []


def test_the_finder_sees_a_cycle_through_a_lazy_import() -> None:
    modules = {"a.py", "b.py", "c.py"}
    sources = {
        "a.py": "from . import b\n",
        "b.py": "def f() -> None:\n    from .c import g\n",
        "c.py": "from .a import x\n",
    }
    graph = {m: package_imports(m, modules, sources[m]) for m in modules}
    assert cycles(graph) == [["a.py", "b.py", "c.py"]]
    assert cycles({"x": {"y"}, "y": set()}) == []
