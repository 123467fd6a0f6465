"""The package surface: its exports, and that it pulls in nothing but numpy and msgpack."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import protocol

PACKAGE_DIR = Path(protocol.__file__).parent

EXPORTS = {
    "ProtocolError", "Topics", "validate_name", "parse_agent_topic", "Limits", "DEFAULT_LIMITS",
    "PROTOCOL_VERSION", "Capabilities", "AgentStatus", "CoordinatorStatus", "ModelRef", "Recipe", "Task",
    "Update", "Ack", "Message", "encode", "decode", "encode_tensor", "decode_tensor", "split_payload",
    "Reassembler", "TransferRefused", "CHUNK_SIZE", "PLAN_VERSION", "TrainingPlan", "OptimizerSettings", "LossTerm", "Stage",
    "Adaptation", "Candidate", "MEMORY_DECLINE_REASON", "MEMORY_KILL_REASON",
    "READABLE_VERSIONS", "PROTOCOL_REVISION", "HEAD_ALONE_REVISION", "BytesLike", "Encoded", "encode_parts", "iter_chunks", "payload_version", "Reassembled",
}  # fmt: skip


def test_exports() -> None:
    assert set(protocol.__all__) == EXPORTS
    assert all(hasattr(protocol, name) for name in EXPORTS)
    assert issubclass(protocol.ProtocolError, ValueError)
    assert protocol.__doc__ and "little-endian" in protocol.__doc__


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
    allowed = {"numpy", "msgpack", "protocol", "__future__", "collections", "dataclasses", "hashlib", "math",
               "re", "struct", "threading", "time", "typing"}  # fmt: skip
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
