"""The package surface: what it exports, and that it pulls in nothing but numpy and msgpack."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import protocol

PACKAGE_DIR = Path(protocol.__file__).parent


def test_dunder_all_is_exactly_the_public_names_the_package_holds() -> None:
    # ``from protocol import *`` gives what __all__ lists: a listed name the package lacks (a rename left behind) or
    # a private one fails here, and so does a public name the package imports for its users but does not list.
    assert len(set(protocol.__all__)) == len(protocol.__all__), "a name is listed twice"
    public = {name for name, value in vars(protocol).items()
              if not name.startswith("_") and not isinstance(value, ModuleType)}
    assert set(protocol.__all__) == public
    assert issubclass(protocol.ProtocolError, ValueError)  # callers may catch it as a ValueError


def test_plan_types_live_in_protocol_plan() -> None:
    import protocol.plan

    for name in ("PLAN_VERSION", "TrainingPlan", "OptimizerSettings", "LossTerm", "Stage", "Recipe"):
        assert getattr(protocol, name) is getattr(protocol.plan, name), name
    assert protocol.PLAN_VERSION == 1


def test_imports_neither_torch_nor_paho_nor_other_packages() -> None:
    code = (
        "import sys, protocol\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
        "{'torch', 'paho', 'models', 'coordinator', 'edge_agent', 'fedfit'})\n"
        "print(','.join(bad))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=PACKAGE_DIR.parent
    )
    assert result.stdout.strip() == ""


def test_sources_import_only_stdlib_numpy_msgpack_and_themselves() -> None:
    allowed = {"numpy", "msgpack", "protocol", "__future__", "collections", "dataclasses", "enum", "hashlib",
               "math", "re", "struct", "threading", "time", "typing"}  # fmt: skip
    sources = sorted(PACKAGE_DIR.glob("*.py"))
    assert len(sources) >= 8
    for source in sources:
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            for name in names:
                assert name.split(".")[0] in allowed, f"{source.name} imports {name}"
