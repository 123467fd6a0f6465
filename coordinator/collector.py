"""Collects one round's updates: dedupes by task id and wakes the round when all are in."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from coordinator.strategies import TaskPlan
from protocol import Update


@dataclass(frozen=True)
class DispatchedTask:
    """What the coordinator sent: the strategy's task plan, with its id, round and when its answer is due."""

    task_id: str
    round: int
    task: TaskPlan
    deadline: float


class RoundCollector:
    """Thread-safe inbox of one round's updates."""

    def __init__(self, round_number: int, tasks: dict[str, DispatchedTask]) -> None:
        self.round = round_number
        self.tasks = tasks
        self.updates: dict[str, Update] = {}
        self.update_bytes: dict[str, int] = {}
        self._digests: dict[str, str] = {}
        self._closed = False
        self._interrupted = False
        self._done = threading.Condition()

    def interrupt(self) -> None:
        """End :meth:`wait` now (the run is ending)."""
        with self._done:
            self._interrupted = True
            self._done.notify_all()

    def offer(self, update: Update, size: int, digest: str = "") -> str:
        """Take an update: returns "accepted", "duplicate" (the same message again: a resend), "conflict" (another
        update for a task that has one: not used), "late" or "unknown". ``digest`` fingerprints the message as it
        arrived (e.g. its sha256); without one, any second update for a task is a duplicate."""
        with self._done:
            task = self.tasks.get(update.task_id)
            if task is None or update.round != self.round or task.task.agent_id != update.agent_id:
                return "unknown"
            if update.task_id in self.updates:
                first = self._digests.get(update.task_id, "")
                return "conflict" if digest and first and digest != first else "duplicate"
            if self._closed:
                return "late"
            self.updates[update.task_id] = update
            self.update_bytes[update.task_id] = size
            self._digests[update.task_id] = digest
            self._done.notify_all()
            return "accepted"

    def unanswered(self, agent_id: str) -> list[DispatchedTask]:
        """The tasks of ``agent_id`` still waiting for an update (none once the round has closed)."""
        with self._done:
            if self._closed:
                return []
            return [task for task_id, task in self.tasks.items()
                    if task.task.agent_id == agent_id and task_id not in self.updates]

    def wait(self, deadline: float, extension: Callable[[], float] = lambda: 0.0) -> bool:
        """Block until every task has an update or the wall-clock ``deadline`` plus ``extension()`` seconds (read
        as it grows, e.g. a broker outage) passes; then close."""
        with self._done:
            while len(self.updates) < len(self.tasks) and not self._interrupted:
                remaining = deadline + extension() - time.time()
                if remaining <= 0:
                    break
                self._done.wait(min(remaining, 1.0))
            self._closed = True
            return len(self.updates) == len(self.tasks)
