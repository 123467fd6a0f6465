"""docs/architecture.md's map stays true: every file it names exists, and every coordinator module the daemon
imports (the rooms it makes and calls on a round's path) is named there, so a new room cannot land off the map."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAP = (ROOT / "docs" / "architecture.md").read_text()
#: A file the map names: `coordinator/round.py`, `edge_agent/daemon.py`, or a room of the coordinator by its name.
NAMED = re.compile(r"`((?:coordinator|edge_agent|models|common|protocol|fedfit)/[\w/.-]+\.py)")
ROOM = re.compile(r"`(\w+\.py)`")


def _daemon_imports() -> set[str]:
    """The coordinator modules ``coordinator/daemon.py`` imports, by file name (``round.py``; a package's own
    name for ``coordinator.strategies.base``)."""
    tree = ast.parse((ROOT / "coordinator" / "daemon.py").read_text())
    modules: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module is not None:
            if node.module == "coordinator":
                modules.update(alias.name for alias in node.names)
            elif node.module.startswith("coordinator."):
                modules.add(node.module.split(".")[1])
    return modules


def test_every_file_the_map_names_exists() -> None:
    named = NAMED.findall(MAP)
    assert named  # the map names files as paths
    for path in named:
        assert (ROOT / path).is_file(), f"docs/architecture.md names {path}, which does not exist"
    for room in ROOM.findall(MAP):
        assert list(ROOT.glob(f"*/{room}")) or list(ROOT.glob(f"*/*/{room}")), (
            f"docs/architecture.md names {room}, which no package has")


def test_every_coordinator_module_the_daemon_imports_is_on_the_map() -> None:
    imported = _daemon_imports()
    assert {"round", "round_planner", "in_flight"} <= imported  # what the daemon's round crosses, read from it
    missing = sorted(name for name in imported  # as a path, as a room's bare name, or as a package
                     if not any(form in MAP for form in (f"`coordinator/{name}.py`", f"`{name}.py`",
                                                         f"`coordinator/{name}/")))
    assert not missing, f"docs/architecture.md does not name {', '.join(missing)} (coordinator/daemon.py imports them)"
