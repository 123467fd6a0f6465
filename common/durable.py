"""Files that are either wholly there or not at all, even across a crash or a power cut."""

from __future__ import annotations

import os
from pathlib import Path


def write_atomic(path: Path, data: bytes | bytearray | memoryview, mode: int | None = None) -> None:
    """Write ``data`` to ``path`` through a temporary file: fsync, rename over ``path``, fsync the directory.
    With ``mode`` (e.g. 0o600 for a secret) the file has exactly that mode from its creation on, never readable
    by others even for a moment; without it, the umask decides as for any new file."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if mode is not None else 0o666)
    if mode is not None:
        os.fchmod(fd, mode)  # also narrows a leftover temporary file of a crash
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    sync_directory(path.parent)


def sync_directory(directory: Path) -> None:
    """fsync a directory, so that the names created or removed in it are on disk (a no-op where unsupported)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
