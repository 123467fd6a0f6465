"""The packages import one way: protocol, models, common at the bottom; coordinator and edge_agent on them and
never on each other; the fedfit command on them; the load-test rig, loadrig, on top of everything, imported by no
package (benchmarks and tests only). No module of any package imports itself in a circle."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BOTTOM = {"protocol", "models", "common"}
DAEMONS = {"coordinator", "edge_agent"}
#: What each package may import of the others.
ALLOWED = {**{package: BOTTOM for package in BOTTOM | DAEMONS},
           "fedfit": BOTTOM | DAEMONS,
           "loadrig": BOTTOM | DAEMONS | {"fedfit"}}
PACKAGES = set(ALLOWED)


def imports(path: Path) -> list[str]:
    """Every absolute module a file imports (TYPE_CHECKING and function-level imports included)."""
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
            names += [f"{node.module}.{alias.name}" for alias in node.names]  # "from models import memory"
    return names


def modules(package: str) -> dict[str, Path]:
    found = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_imports_run_one_way(package: str) -> None:
    wrong = []
    for name, path in modules(package).items():
        for imported in imports(path):
            root = imported.split(".")[0]
            if root not in PACKAGES or root == package:
                continue
            if root not in ALLOWED[package]:
                wrong.append(f"{name} imports {imported}")
    assert not wrong, wrong


def import_graph() -> dict[str, set[str]]:
    """Every project module and the project modules it imports. ``from a.b import c`` counts as importing ``a.b.c``
    where that is a module, else ``a.b`` (a package's ``__init__``, which imports the modules it re-exports: so
    ``from models import X`` depends on every module of the facade)."""
    known: dict[str, Path] = {}
    for package in PACKAGES:
        known.update(modules(package))

    def module_of(name: str) -> str | None:
        return name if name in known else (name.rsplit(".", 1)[0] if name.rsplit(".", 1)[0] in known else None)

    graph: dict[str, set[str]] = {}
    for name, path in known.items():
        targets = {module_of(imported) for imported in imports(path)}
        graph[name] = {target for target in targets if target and target != name}
    return graph


def test_no_module_imports_itself_in_a_circle() -> None:
    graph = import_graph()

    def reachable(start: str) -> set[str]:
        seen: set[str] = set()
        stack = list(graph.get(start, ()))
        while stack:
            node = stack.pop()
            if node not in seen:
                seen.add(node)
                stack.extend(graph.get(node, ()))
        return seen

    assert len(graph) > 100  # every package was read
    cycles = sorted(name for name in graph if name in reachable(name))
    assert not cycles, cycles
