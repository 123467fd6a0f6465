"""Validation of the identifiers that travel in topics and payloads."""

from __future__ import annotations

import re

from protocol.errors import ProtocolError

_NAME_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_ID_RE = re.compile(r"[A-Za-z0-9_.:-]{1,128}")
#: A sha256 as the protocol writes it: 64 lowercase hex digits.
SHA256_HEX = re.compile(r"[0-9a-f]{64}")


def shown(value: object, width: int = 60) -> str:
    """Short printable form of an arbitrary (possibly huge or hostile) value for error messages."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return f"{len(value)} bytes"
    if isinstance(value, dict):
        return f"a map of {len(value)} entries"
    if isinstance(value, (list, tuple)):
        return f"a list of {len(value)} items"
    text = repr(value)
    text = text if len(text) <= width else text[: width - 3] + "..."
    return f"{type(value).__name__} {text}"


def validate_name(name: object, what: str = "name") -> str:
    """Check a federation or agent id: one MQTT topic level of 1..64 chars of ``[A-Za-z0-9_.-]``.

    "." and ".." are refused too, so an id is also safe as a file name. Returns the name.
    """
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name) or name in (".", ".."):
        raise ProtocolError(
            f"{what} must be 1 to 64 characters of letters, digits, '_', '.' or '-' (and not '.' or '..'), "
            f"got {shown(name)}"
        )
    return name


def validate_task_id(task_id: object, what: str = "task id") -> str:
    """Check a task or transfer id: 1..128 chars of ``[A-Za-z0-9_.:-]``. Returns the id."""
    if not isinstance(task_id, str) or not _ID_RE.fullmatch(task_id):
        raise ProtocolError(
            f"{what} must be 1 to 128 characters of letters, digits, '_', '.', ':' or '-', "
            f"got {shown(task_id)}"
        )
    return task_id


def reason_of(exc: BaseException) -> str:
    """``"TypeName: message"`` (or just the type name when the message is empty) for wrapped errors."""
    text = str(exc)
    return f"{type(exc).__name__}: {text[:200]}" if text else type(exc).__name__
