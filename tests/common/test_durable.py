"""Files written whole or not at all, with the mode asked for."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from common.durable import write_atomic


def test_write_atomic_replaces_the_file_and_leaves_no_temporary(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    write_atomic(path, b"one")
    write_atomic(path, b"two")
    assert path.read_bytes() == b"two" and os.listdir(tmp_path) == ["state.json"]


def test_a_mode_is_exact_whatever_the_umask_and_a_leftover_temporary(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    leftover = tmp_path / ".secret.tmp"
    leftover.write_bytes(b"half a secret from a crash")
    leftover.chmod(0o666)
    old = os.umask(0)
    try:
        write_atomic(path, b"s3cret", mode=0o600)
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and path.read_bytes() == b"s3cret"
    assert not leftover.exists()
