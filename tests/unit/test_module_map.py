"""docs/design.md opens with the module map: every module of the package, its layer and its one
job, and the rule saying which layers a layer may import. These tests keep the map true: a module
added, renamed or removed without its line fails, and so does an import that points the wrong way
(a pure rule importing the OS edge, the worker importing the supervisor)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import trio_agentd

PACKAGE = Path(trio_agentd.__file__).parent
DESIGN = Path(__file__).resolve().parents[2] / "docs" / "design.md"

_ROW = re.compile(r"^\| `([\w/]+\.py)` \| (\w+) \| (.+) \|$")
_RULE = re.compile(r"^- \*\*(\w+)\*\* imports: (.+)$")


def _block(name: str) -> list[str]:
    text = DESIGN.read_text()
    start, end = f"<!-- {name} -->", f"<!-- /{name} -->"
    assert start in text, f"docs/design.md has no {start} block"
    assert end in text, f"docs/design.md's {start} block has no end ({end})"
    return text.split(start, 1)[1].split(end, 1)[0].strip().splitlines()


def documented_modules() -> dict[str, str]:
    """``{"_worker.py": "worker", "agents/_exec.py": "agents", …}`` from the map's table."""
    rows: dict[str, str] = {}
    for line in _block("module-map"):
        m = _ROW.match(line)
        if m:
            assert m.group(1) not in rows, f"{m.group(1)} is on the map twice"
            rows[m.group(1)] = m.group(2)
    return rows


def layer_rules() -> dict[str, set[str]]:
    """``{"core": {"core"}, "worker": {"core", "os", "worker", "agents"}, …}``: the layers each
    layer may import, itself included; ``anything`` allows every layer."""
    rules: dict[str, set[str]] = {}
    for line in _block("layer-rules"):
        m = _RULE.match(line.strip())
        if m:
            rules[m.group(1)] = {w.strip(" `.") for w in m.group(2).split(",")}
    return rules


def package_modules() -> set[str]:
    return {p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py")
            if "__pycache__" not in p.parts}


def _module_name(rel: str) -> str:
    parts = rel[:-3].split("/")
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(["trio_agentd", *parts])


def _file_of(module: str, modules: set[str]) -> str | None:
    """The map's name for a dotted module of the package (``None`` outside the package)."""
    if module != "trio_agentd" and not module.startswith("trio_agentd."):
        return None
    path = module.split(".")[1:]
    for candidate in ("/".join(path) + ".py", "/".join([*path, "__init__.py"])):
        if candidate in modules:
            return candidate
    return None


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def package_imports(rel: str, modules: set[str], source: str | None = None) -> set[str]:
    """Every module of the package ``rel`` imports, at module level or inside a function (a lazy
    import is still an arrow), leaving out imports only a type checker runs."""
    tree = ast.parse((PACKAGE / rel).read_text() if source is None else source)
    here = _module_name(rel)
    package = here if rel.endswith("__init__.py") else here.rsplit(".", 1)[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for other in child.orelse:
                    visit(other)
                continue
            if isinstance(child, ast.Import):
                names = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.split(".")
                    anchor = anchor[: len(anchor) - (child.level - 1)]
                    base = ".".join([*anchor, *([base] if base else [])])
                # `from . import x` and `from .pkg import mod` name modules too
                names = [base] + [f"{base}.{a.name}" for a in child.names]
            else:
                visit(child)
                continue
            for name in names:
                target = _file_of(name, modules)
                if target is not None and target != rel:
                    found.add(target)
    visit(tree)
    return found


def test_every_module_of_the_package_is_on_the_map_and_nothing_else() -> None:
    on_map, in_package = set(documented_modules()), package_modules()
    assert not in_package - on_map, (
        f"modules missing from docs/design.md's module map: {sorted(in_package - on_map)}")
    assert not on_map - in_package, (
        "docs/design.md's module map names modules that do not exist:"
        f" {sorted(on_map - in_package)}")


def test_every_layer_on_the_map_has_a_rule() -> None:
    rules, layers = layer_rules(), set(documented_modules().values())
    assert layers <= set(rules), f"layers with no import rule: {sorted(layers - set(rules))}"
    for layer, allowed in rules.items():
        assert allowed <= set(rules) | {"anything"}, f"{layer} may import unknown layers {allowed}"


def test_imports_point_the_way_the_map_says() -> None:
    layer_of, rules, modules = documented_modules(), layer_rules(), package_modules()
    wrong = []
    for rel in sorted(modules & set(layer_of)):
        allowed = rules[layer_of[rel]]
        if "anything" in allowed:
            continue
        for target in sorted(package_imports(rel, modules)):
            if target.endswith("__init__.py") and target.count("/") == 0:
                continue  # the package itself (its version, its public names)
            if layer_of.get(target) not in allowed:
                wrong.append(f"{rel} ({layer_of[rel]}) imports {target} ({layer_of.get(target)})")
    assert not wrong, "imports against docs/design.md's layer rules:\n" + "\n".join(wrong)


def test_the_import_reader_counts_relative_and_lazy_imports_but_not_type_only_ones() -> None:
    # the checker must be able to fail: run it on a made-up module of a made-up package
    modules = {"a.py", "b.py", "c.py", "d.py", "e.py", "sub/__init__.py", "sub/f.py"}
    source = """
from typing import TYPE_CHECKING
from . import a
from .b import thing
import trio_agentd.sub.f
if TYPE_CHECKING:
    from .c import OnlyForTypes
else:
    pass
def later() -> None:
    from .d import lazy
import os, trio
"""
    assert package_imports("g.py", modules | {"g.py"}, source) == {
        "a.py", "b.py", "sub/f.py", "d.py"}
    # inside sub/, `.` is sub/ itself: `from . import a` names sub/__init__.py (no sub/a.py)
    assert package_imports("sub/g.py", modules | {"sub/g.py"}, source) == {
        "sub/__init__.py", "sub/f.py"}
