"""Uploads the coordinator grants (protocol revision 6): a window of bytes in transfer.

A fleet answering at once would otherwise send every update together, and what the message thread has not yet taken
waits in the coordinator's memory (1000 agents of a 1M-parameter model: a 3.4-4.1 GB peak against 0.85-1 GiB between
rounds). An agent whose task says :attr:`protocol.Task.ask_to_upload` asks first (:class:`protocol.UploadRequest`,
with its update's size); :class:`UploadGrants` answers in the order asked, as long as the bytes granted and not yet
in stay within the window (one upload larger than the window goes alone), so that the updates in transfer, wherever
they wait (the broker, the link's queue, reassembly), hold at most the window whatever the fleet's size. A grant is
taken back once its update is in (or its transfer was refused), or when no chunk of its agent came for ``idle_s``
(its grant was lost, say: the agent asks again), and an agent gone offline leaves the queue; a request whose update
the round would no longer take (in already, its round closed, or held for the next round) leaves the queue when its
turn comes, and is handed back (:meth:`UploadGrants.take_dropped`) for the coordinator to answer. Agents that
predate revision 6 send at once, as before, and are taken as ever; so is an update sent without asking (one a
restarted agent restores from its spool).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from protocol import UploadGrant

__all__ = ["Asked", "UploadGrants"]

#: Seconds between looks for grants gone idle, at most once per this many seconds of messages.
_SWEEP_S = 1.0


@dataclass(frozen=True)
class Asked:
    """A request to upload that left the queue without a grant (:meth:`UploadGrants.take_dropped`)."""

    agent_id: str
    task_id: str
    round: int
    size: int
    sha256: str = ""


@dataclass
class _Lease:
    """A grant out: its upload's bytes and when its agent last showed life (monotonic)."""

    round: int
    size: int
    touched: float


class UploadGrants:
    """The window (see the module docstring): ``window_bytes`` in transfer at most, grants idle for ``idle_s``
    taken back. Thread-safe; every method returns the grants to send now."""

    def __init__(self, window_bytes: int, idle_s: float, *, clock: Callable[[], float] = time.monotonic,
                 wanted: Callable[[str, str, int], bool] = lambda agent_id, task_id, round_number: True) -> None:
        """``wanted(agent_id, task_id, round)``: whether the update a request is for would still be taken, asked
        when its turn comes (a request that is not leaves the queue, kept for :meth:`take_dropped`)."""
        if window_bytes < 1 or idle_s <= 0:
            raise ValueError(f"an upload window needs positive bytes and idle seconds, got {window_bytes} and "
                             f"{idle_s}")
        self.window_bytes = window_bytes
        self.idle_s = idle_s
        self._clock = clock
        self._wanted = wanted
        self._lock = threading.Lock()
        self._waiting: OrderedDict[tuple[str, str], Asked] = OrderedDict()  # by (agent, task)
        self._dropped: list[Asked] = []  # left the queue unwanted, not yet taken by take_dropped
        self._granted: dict[str, dict[str, _Lease]] = {}  # agent -> task -> its lease (a chunk finds its agent's)
        self._leases = 0
        self._in_flight = 0
        self._last_sweep = clock()
        #: Grants sent, and grants taken back because their upload went idle (counters).
        self.granted_total = 0
        self.expired_total = 0
        #: Requests dropped when their turn came, their update no longer wanted.
        self.dropped_total = 0
        #: The most bytes granted at once.
        self.peak_in_flight = 0

    @property
    def in_flight(self) -> int:
        """Bytes granted whose update is not in yet."""
        with self._lock:
            return self._in_flight

    @property
    def waiting(self) -> int:
        """Requests waiting for a grant."""
        with self._lock:
            return len(self._waiting)

    def is_waiting(self, agent_id: str, task_id: str) -> bool:
        """Whether the request of ``agent_id`` for ``task_id`` waits in the queue."""
        with self._lock:
            return (agent_id, task_id) in self._waiting

    def take_dropped(self) -> list[Asked]:
        """The requests that left the queue since the last call because their update was no longer wanted (to be
        answered: its ack, or held for the next round)."""
        with self._lock:
            dropped, self._dropped = self._dropped, []
        return dropped

    def ask(self, agent_id: str, task_id: str, round_number: int, size: int, sha256: str = "") -> list[UploadGrant]:
        """An agent asks to send ``size`` bytes (of that ``sha256``) for ``task_id``: it waits its turn (asking
        again keeps its place); one asking again for an upload granted already is granted again (its grant may
        have been lost)."""
        key = (agent_id, task_id)
        with self._lock:
            now = self._clock()
            lease = self._granted.get(agent_id, {}).get(task_id)
            if lease is not None:
                lease.touched = now
                self.granted_total += 1
                return [UploadGrant(task_id, lease.round, agent_id)]
            if key not in self._waiting:
                self._waiting[key] = Asked(agent_id, task_id, round_number, max(0, size), sha256)
            self._expire(now)
            return self._grant_next(now)

    def withdraw(self, agent_id: str, task_id: str) -> None:
        """The request of ``agent_id`` for ``task_id`` leaves the queue (it is answered otherwise)."""
        with self._lock:
            self._waiting.pop((agent_id, task_id), None)

    def chunk_from(self, agent_id: str) -> list[UploadGrant]:
        """A chunk of ``agent_id`` came: its grants are alive. (Looks for idle grants, at most once a second.)"""
        with self._lock:
            now = self._clock()
            for lease in self._granted.get(agent_id, {}).values():
                lease.touched = now
            if now - self._last_sweep < _SWEEP_S:
                return []
            self._expire(now)
            return self._grant_next(now)

    def finished(self, agent_id: str, task_id: str | None = None) -> list[UploadGrant]:
        """The upload of ``task_id`` is in (None: every upload of ``agent_id`` ended, e.g. malformed); its
        bytes leave the window."""
        with self._lock:
            leases = self._granted.get(agent_id, {})
            for task in [task_id] if task_id is not None else list(leases):
                self._take_back(agent_id, task)
            return self._grant_next(self._clock())

    def forget(self, agent_id: str) -> list[UploadGrant]:
        """``agent_id`` went offline: its requests leave the queue and its grants the window (it asks again when it
        is back)."""
        with self._lock:
            for key in [key for key in self._waiting if key[0] == agent_id]:
                del self._waiting[key]
        return self.finished(agent_id)

    def _take_back(self, agent_id: str, task_id: str) -> bool:
        """Give the lease of ``task_id`` back to the window (lock held); whether there was one."""
        leases = self._granted.get(agent_id, {})
        lease = leases.pop(task_id, None)
        if lease is None:
            return False
        if not leases:
            del self._granted[agent_id]
        self._in_flight -= lease.size
        self._leases -= 1
        return True

    def _expire(self, now: float) -> None:
        self._last_sweep = now
        for agent_id, task_id in [(agent_id, task_id) for agent_id, leases in self._granted.items()
                                  for task_id, lease in leases.items() if now - lease.touched >= self.idle_s]:
            self._take_back(agent_id, task_id)
            self.expired_total += 1

    def _grant_next(self, now: float) -> list[UploadGrant]:
        grants = []
        while self._waiting:
            key, asked = next(iter(self._waiting.items()))
            if not self._wanted(asked.agent_id, asked.task_id, asked.round):
                del self._waiting[key]
                self.dropped_total += 1
                self._dropped.append(asked)
                continue
            if self._leases and self._in_flight + asked.size > self.window_bytes:
                break
            del self._waiting[key]
            self._granted.setdefault(asked.agent_id, {})[asked.task_id] = _Lease(asked.round, asked.size, now)
            self._leases += 1
            self._in_flight += asked.size
            self.peak_in_flight = max(self.peak_in_flight, self._in_flight)
            self.granted_total += 1
            grants.append(UploadGrant(asked.task_id, asked.round, asked.agent_id))
        return grants
