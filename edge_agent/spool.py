"""The agent's outbox on disk: every update waiting for the coordinator's ack is kept as a file until it is
settled, so that a restart (a power cut, the watchdog, an upgrade) loses nothing trained.

One file per update, ``<task id>.update``, holding the encoded message exactly as it goes on the wire (the
protocol's msgpack), written atomically. The directory is bounded by ``max_bytes``: storing an update that would
exceed it drops the oldest ones first (their rounds are the likeliest to have closed), and an update larger than
the whole budget is not stored (it is still sent from memory). A file that does not decode as its task's update
(a damaged disk) is deleted and logged, never resent.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from common.durable import sync_directory, write_atomic
from common.logs import get_logger
from protocol import ProtocolError, Update, decode
from protocol._ids import validate_task_id

SUFFIX = ".update"


@dataclass(frozen=True)
class SpooledUpdate:
    """An update found in the spool: its task id, round and encoded bytes."""

    task_id: str
    round: int
    payload: bytes


class UpdateSpool:
    """A bounded directory of encoded updates waiting for their ack."""

    def __init__(self, directory: Path, max_bytes: int) -> None:
        if max_bytes <= 0:
            raise ValueError(f"the outbox's disk budget must be positive, got {max_bytes}")
        self.directory = directory
        self.max_bytes = max_bytes
        self._log = get_logger("spool", directory=str(directory))
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)

    def _path(self, task_id: str) -> Path:
        return self.directory / f"{validate_task_id(task_id)}{SUFFIX}"

    def _files(self) -> list[tuple[float, Path, int]]:
        """(modification time, path, size) of every stored update, oldest first."""
        found = []
        for path in self.directory.glob(f"*{SUFFIX}"):
            try:
                stat = path.stat()
            except FileNotFoundError:
                continue
            found.append((stat.st_mtime, path, stat.st_size))
        return sorted(found)

    def used_bytes(self) -> int:
        """Bytes the stored updates take."""
        return sum(size for _, _, size in self._files())

    def put(self, task_id: str, payload: bytes) -> bool:
        """Store an encoded update before it is first sent; returns whether it is on disk. Older updates are
        dropped (and logged) to stay within the budget."""
        if len(payload) > self.max_bytes:
            self._log.warning("update_not_spooled", task=task_id, bytes=len(payload), budget=self.max_bytes,
                              message="the update is larger than the outbox's disk budget (outbox_max_bytes): it "
                                      "is sent from memory only and lost if the agent restarts before its ack")
            return False
        path = self._path(task_id)
        files = [entry for entry in self._files() if entry[1] != path]
        used = sum(size for _, _, size in files)
        while files and used + len(payload) > self.max_bytes:
            _, oldest, size = files.pop(0)
            oldest.unlink(missing_ok=True)
            used -= size
            self._log.warning("spooled_update_dropped", file=oldest.name, bytes=size,
                              message="dropped to keep the outbox within outbox_max_bytes")
        try:
            write_atomic(path, payload, mode=0o600)
        except OSError as exc:
            self._log.error("update_not_spooled", task=task_id, error=str(exc))
            return False
        return True

    def remove(self, task_id: str) -> bool:
        """Forget a settled update; whether one was stored."""
        try:
            self._path(task_id).unlink()
        except (FileNotFoundError, ProtocolError):
            return False
        sync_directory(self.directory)
        return True

    def __contains__(self, task_id: str) -> bool:
        try:
            return self._path(task_id).exists()
        except ProtocolError:
            return False

    def task_ids(self) -> list[str]:
        """The stored updates' task ids, oldest first (no file is read)."""
        return [path.name[: -len(SUFFIX)] for _, path, _ in self._files()]

    def load(self, task_id: str) -> SpooledUpdate | None:
        """One stored update, checked to decode as an update of its file's task; None (and the file deleted) when
        it does not, or when it is gone."""
        path = self._path(task_id)
        try:
            payload = path.read_bytes()
        except FileNotFoundError:
            return None
        try:
            update = decode(payload, expected=Update)
            assert isinstance(update, Update)
            if update.task_id != task_id:
                raise ProtocolError(f"the file holds task {update.task_id!r}")
        except ProtocolError as exc:
            path.unlink(missing_ok=True)
            self._log.error("spooled_update_corrupt_deleted", file=path.name, reason=str(exc))
            return None
        return SpooledUpdate(task_id, update.round, payload)
