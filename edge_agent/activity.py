"""What an agent is doing, for its status and its report: the tasks it serves (busy while there is one), since when
it has been online or busy, the tasks it has seen (a task sent again is not trained twice), the last answer it gave
and how many tasks it has answered.

Changed on the link's dispatcher (a task taken), the training threads and the hold-back's threads (a task answered,
over): one lock, held only inside these methods.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict

from protocol import AgentReport, Task, Update

__all__ = ["REPORT_TEXT", "SEEN_TASKS", "AgentActivity"]

#: How many task ids the agent remembers, to ignore a task sent again (a resumed coordinator's, a QoS-1 duplicate).
SEEN_TASKS = 1024
#: Characters of a trained spec or a reason its report carries.
REPORT_TEXT = 300


class AgentActivity:
    """The agent's tasks and answers (see the module docstring)."""

    def __init__(self, seen_tasks: int = SEEN_TASKS) -> None:
        self._lock = threading.Lock()
        self._seen: OrderedDict[str, None] = OrderedDict()
        self._seen_tasks = seen_tasks
        self._training: dict[str, int] = {}  # task id -> round, of the tasks being served
        self._since = time.time()  # when the agent went online or busy (its report's ``since``)
        self._last_answer: dict[str, object] = {}  # its report's last_* fields
        #: The latest round of a task this agent took (what its budget schedule is read at).
        self.last_round = 0
        #: Tasks answered.
        self.tasks_done = 0

    def first_sight(self, task_id: str) -> bool:
        """Whether ``task_id`` is new; remembers it among the last ``seen_tasks``."""
        with self._lock:
            return self._first_sight(task_id)

    def _first_sight(self, task_id: str) -> bool:
        if task_id in self._seen:
            return False
        self._seen[task_id] = None
        while len(self._seen) > self._seen_tasks:
            self._seen.popitem(last=False)
        return True

    def take(self, task: Task, *, answered_already: bool = False) -> bool:
        """Take ``task`` (busy with it from now on) unless it was seen before or ``answered_already`` (its update
        is out, e.g. a previous process's); whether it was taken."""
        with self._lock:
            if not self._first_sight(task.task_id) or answered_already:
                return False
            if not self._training:
                self._since = time.time()
            self._training[task.task_id] = task.round
            self.last_round = max(self.last_round, task.round)
            return True

    def answered(self, task: Task, update: Update) -> None:
        """``update`` went out for ``task``: counted, and kept for the report."""
        trained = update.spec_trained
        with self._lock:
            self.tasks_done += 1
            self._last_answer = {
                "last_task": task.task_id, "last_round": task.round, "last_status": str(update.status),
                "last_trained": ((" ".join(f"{key}={value}" for key, value in trained.items()) or "the full model")
                                 if isinstance(trained, dict) else "")[:REPORT_TEXT],
                "last_reason": (update.reason or "")[:REPORT_TEXT], "last_finished_at": time.time()}

    def over(self, task_id: str) -> None:
        """Done with the task (its update sent, or none coming): busy no more unless with another."""
        with self._lock:
            self._training.pop(task_id, None)
            if not self._training:
                self._since = time.time()

    @property
    def busy(self) -> bool:
        with self._lock:
            return bool(self._training)

    def training(self) -> list[str]:
        """The ids of the tasks being served, oldest first."""
        with self._lock:
            return list(self._training)

    def seen(self) -> list[str]:
        """The task ids remembered, oldest first."""
        with self._lock:
            return list(self._seen)

    def report(self, outbox: int, outbox_bytes: int) -> AgentReport:
        """What ``fedfit status`` shows of this agent, its uplink's ``outbox`` (updates and bytes) given."""
        with self._lock:
            task, task_round = next(reversed(self._training.items()), ("", 0))
            return AgentReport(self._since, task, task_round, outbox=outbox, outbox_bytes=outbox_bytes,
                               **self._last_answer)  # type: ignore[arg-type]
