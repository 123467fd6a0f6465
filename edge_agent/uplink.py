"""Delivers updates: publish in chunks and resend until the coordinator acknowledges (QoS 1 alone is not
enough: a broker drops queued messages past its limits, and the coordinator may restart)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

from common.logs import get_logger
from protocol import Update, encode, split_payload

Publish = Callable[[str, bytes], bool]


class Uplink:
    """A per-agent sender thread: one update at a time, each retried until acked or attempts run out."""

    def __init__(self, agent_id: str, topic: str, publish: Publish, ack_timeout_s: float, attempts: int) -> None:
        self.topic = topic
        self._publish = publish
        self._ack_timeout_s = ack_timeout_s
        self._attempts = attempts
        self._outbox: queue.Queue[Update | None] = queue.Queue()
        self._acked: dict[str, threading.Event] = {}
        self._refusals: dict[str, str] = {}
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name=f"{agent_id}-uplink", daemon=True)
        self._log = get_logger("uplink", agent=agent_id)
        self.delivered: list[str] = []
        self.refused: list[str] = []
        self.abandoned: list[str] = []

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._outbox.put(None)
        self._thread.join(timeout)

    def send(self, update: Update) -> None:
        """Queue ``update`` for delivery."""
        with self._lock:
            self._acked.setdefault(update.task_id, threading.Event())
        self._outbox.put(update)

    def on_ack(self, task_id: str, reason: str | None = None) -> bool:
        """Record the coordinator's answer (``reason``: why it refused the update for good); either way the update
        is not sent again. False for an answer about nothing we sent."""
        with self._lock:
            event = self._acked.get(task_id)
            if event is None:
                return False
            if reason is not None:
                self._refusals[task_id] = reason
        event.set()
        return True

    def idle(self) -> bool:
        """Whether nothing is waiting to be delivered."""
        return self._outbox.unfinished_tasks == 0

    def _loop(self) -> None:
        while True:
            update = self._outbox.get()
            try:
                if update is None:
                    return
                self._deliver(update)
            finally:
                self._outbox.task_done()

    def _deliver(self, update: Update) -> None:
        payload = encode(update)
        with self._lock:
            acked = self._acked.setdefault(update.task_id, threading.Event())
        attempt = 0
        while attempt < self._attempts and not acked.is_set():
            attempt += 1
            for chunk in split_payload(payload, f"{update.task_id}.{attempt}"):
                self._publish(self.topic, chunk)
            if not acked.wait(self._ack_timeout_s) and attempt < self._attempts:
                self._log.warning("update_not_acked_resending", task=update.task_id, attempt=attempt)
        # Outstanding no more before the outcome is recorded: a later ack finds nothing and says so.
        with self._lock:
            self._acked.pop(update.task_id, None)
            refusal = self._refusals.pop(update.task_id, None)
        if refusal is not None:
            self.refused.append(update.task_id)
            self._log.warning("update_refused", task=update.task_id, attempts=attempt, reason=refusal)
        elif acked.is_set():
            self.delivered.append(update.task_id)
            self._log.info("update_acked", task=update.task_id, attempts=attempt, bytes=len(payload))
        else:
            self.abandoned.append(update.task_id)
            self._log.error("update_abandoned", task=update.task_id, attempts=self._attempts)
