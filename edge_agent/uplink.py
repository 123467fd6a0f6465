"""Delivers updates: publish in chunks and resend until the coordinator acknowledges (QoS 1 alone is not
enough: a broker drops queued messages past its limits, and the coordinator may restart).

With a spool (``edge_agent.spool``) every update is on disk from before its first send until the coordinator
settles it, and the ones a previous process left are sent first: a restart loses nothing trained. Attempts are
counted only while the broker is connected (an outage does not use them up, nor fill the client's queue with
copies), and an update whose attempts run out is parked in the spool, to be sent again when the coordinator comes
back online (:meth:`Uplink.resend_parked`) or the agent restarts.

An update goes out in the protocol version of the task it answers (a coordinator that wrote version 2 reads it;
version 1, which every coordinator reads, when that is not known), and its chunks in the version of its payload.
When its task says so (:attr:`protocol.Task.ask_to_upload`, protocol revision 6) the uplink asks before each send
(:class:`protocol.UploadRequest`) and sends once the coordinator grants it (:meth:`Uplink.on_grant`): a send whose
grant does not come within the ack's wait counts as an attempt, and it asks again. A coordinator of revision 7 says
when a request waits its turn (:meth:`Uplink.on_wait`: room in its window, or the next round): the uplink then keeps
waiting for the grant, asking again every ``ack_timeout_s`` to keep its place, and spends no attempt while each ask
is answered so.
"""

from __future__ import annotations

import hashlib
import queue
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from common.logs import get_logger
from edge_agent.spool import UpdateSpool
from protocol import Update, UploadRequest, encode, iter_chunks, payload_version

Publish = Callable[[str, bytes], bool]

#: Seconds between looks at the connection while the broker is away.
_CONNECTION_POLL_S = 0.5
#: The wait for an ack doubles with every send of an update, up to this many times ``ack_timeout_s``, and is
#: spread by +-10% from the second send on: a thousand devices whose first sends went unanswered (a coordinator
#: absorbing a whole fleet's updates) do not resend together, every ``ack_timeout_s``, until the broker's queues
#: burst (measured: 1000 agents resending every 10 s filled mosquitto to 10.8 GB).
MAX_BACKOFF = 8


@dataclass
class _Outgoing:
    """An update to deliver: its encoded payload and, when it must ask before each send, its task's round (and,
    once asked for, the payload's sha256)."""

    task_id: str
    payload: bytes
    round: int | None = None
    digest: str = ""


class Uplink:
    """A per-agent sender thread: one update at a time, each retried until acked or attempts run out."""

    def __init__(self, agent_id: str, topic: str, publish: Publish, ack_timeout_s: float, attempts: int, *,
                 connected: Callable[[], bool] = lambda: True, spool: UpdateSpool | None = None,
                 on_backlog: Callable[[], object] | None = None) -> None:
        """``on_backlog()`` is called whenever the updates waiting for their ack change (queued, settled, parked):
        an agent republishes its status then."""
        self.agent_id = agent_id
        self.topic = topic
        self._publish = publish
        self._connected = connected
        self._spool = spool
        self._ack_timeout_s = ack_timeout_s
        self._attempts = attempts
        self._outbox: queue.Queue[_Outgoing | None] = queue.Queue()
        self._acked: dict[str, threading.Event] = {}
        self._granted: dict[str, threading.Event] = {}  # task ids asked for, set when the grant comes
        self._told_to_wait: dict[str, threading.Event] = {}  # task ids asked for, set when told to wait
        self._grant_waits: dict[str, float] = {}  # seconds each update in delivery waited for grants (its thread's)
        self._refusals: dict[str, str] = {}
        self._parked: dict[str, int | None] = {}  # task ids whose attempts ran out, kept in the spool: their
        # round when they ask before each send
        self._sizes: dict[str, int] = {}  # payload bytes of the updates queued, in delivery or parked
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"{agent_id}-uplink", daemon=True)
        self._log = get_logger("uplink", agent=agent_id)
        self._on_backlog = on_backlog
        self.delivered: list[str] = []
        self.refused: list[str] = []
        self.abandoned: list[str] = []
        self.restored: list[str] = []  # task ids of updates a previous process left in the spool

    def start(self) -> None:
        """Queue what the spool holds from before (oldest first), then start sending."""
        if self._spool is not None:
            for task_id in self._spool.task_ids():
                spooled = self._spool.load(task_id)
                if spooled is not None:  # (sent without asking: a coordinator takes an update it did not grant)
                    self.restored.append(task_id)
                    self._queue(_Outgoing(task_id, spooled.payload))
            if self.restored:
                self._log.info("spooled_updates_restored", count=len(self.restored), tasks=self.restored)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stopping.set()
        self._outbox.put(None)
        if self._thread.is_alive():  # (never started: nothing to wait for)
            self._thread.join(timeout)

    def send(self, update: Update, *, version: int = 1, ask: bool = False) -> None:
        """Store ``update`` in the spool (when there is one) and queue it for delivery, encoded in protocol
        ``version``: that of the task it answers (`protocol.payload_version`), 1 when unknown; ``ask``: the task
        said :attr:`protocol.Task.ask_to_upload` (each send waits for the coordinator's grant)."""
        self.send_later(update, version=version, ask=ask)()

    def send_later(self, update: Update, *, version: int = 1, ask: bool = False) -> Callable[[], None]:
        """:meth:`send` in two halves: store ``update`` in the spool now (a stop before it is sent loses nothing: the
        next start sends it) and return the call that queues it for delivery (the agent's ``slowdown`` holds a
        trained update back in between, ``edge_agent.holdback``)."""
        payload = encode(update, version=version)
        if self._spool is not None:
            self._spool.put(update.task_id, payload)
        outgoing = _Outgoing(update.task_id, payload, update.round if ask else None)
        return lambda: self._queue(outgoing)

    def _queue(self, outgoing: _Outgoing) -> None:
        with self._lock:
            self._acked.setdefault(outgoing.task_id, threading.Event())
            self._sizes[outgoing.task_id] = len(outgoing.payload)
        self._outbox.put(outgoing)
        self._backlog_changed()

    def _backlog_changed(self) -> None:
        if self._on_backlog is not None:
            try:
                self._on_backlog()
            except Exception as exc:  # noqa: BLE001 - a status not published must not stop a delivery
                self._log.warning("backlog_report_failed", error=f"{type(exc).__name__}: {exc}")

    def unacked(self) -> list[str]:
        """The task ids of the updates queued, in delivery or parked: not yet acknowledged as stored."""
        with self._lock:
            return sorted({task_id for task_id, event in self._acked.items() if not event.is_set()} | set(self._parked))

    def backlog(self) -> tuple[int, int]:
        """The updates queued, in delivery or parked (not yet acknowledged as stored), and their bytes."""
        with self._lock:
            waiting = {task_id for task_id, event in self._acked.items() if not event.is_set()} | set(self._parked)
            for task_id in [known for known in self._sizes if known not in waiting]:
                del self._sizes[task_id]  # delivered, refused or abandoned since
            return len(waiting), sum(self._sizes.get(task_id, 0) for task_id in waiting)

    def pending(self, task_id: str) -> bool:
        """Whether an update for ``task_id`` is queued, being sent, or parked: the task needs no training."""
        with self._lock:
            if task_id in self._acked or task_id in self._parked:
                return True
        return self._spool is not None and task_id in self._spool

    def on_ack(self, task_id: str, reason: str | None = None) -> bool:
        """Record the coordinator's answer (``reason``: why it refused the update for good); either way the update
        is not sent again and leaves the spool. False for an answer about nothing we sent."""
        with self._lock:  # settled before the file goes: _deliver never parks an acked update
            event = self._acked.get(task_id)
            if event is not None:
                if reason is not None:
                    self._refusals[task_id] = reason
                event.set()
            parked = task_id in self._parked
            if parked:
                del self._parked[task_id]
                self._sizes.pop(task_id, None)
        spooled = self._spool.remove(task_id) if self._spool is not None else False
        if parked:  # (one in delivery leaves the backlog when its delivery ends, and says so then)
            self._backlog_changed()
        return event is not None or parked or spooled

    def on_grant(self, task_id: str) -> bool:
        """The coordinator grants the upload of ``task_id`` now; False when it is not waiting for one."""
        with self._lock:
            granted = self._granted.get(task_id)
        if granted is not None:
            granted.set()
        return granted is not None

    def on_wait(self, task_id: str, reason: str) -> bool:
        """The coordinator says the request to upload ``task_id`` waits its turn (``reason``); False when it is not
        asking for one."""
        with self._lock:
            told = self._told_to_wait.get(task_id)
        if told is None:
            return False
        if not told.is_set():
            self._log.info("upload_waiting", task=task_id, reason=reason)
        told.set()
        return True

    def resend_parked(self) -> int:
        """Queue again the updates whose attempts ran out (the coordinator is back); returns how many."""
        with self._lock:
            parked, self._parked = self._parked, {}
        count = 0
        for task_id, ask_round in parked.items():
            spooled = self._spool.load(task_id) if self._spool is not None else None
            if spooled is not None:
                self._queue(_Outgoing(task_id, spooled.payload, ask_round))
                count += 1
        if count:
            self._log.info("parked_updates_resent", count=count)
        return count

    def idle(self) -> bool:
        """Whether nothing is waiting to be delivered."""
        return self._outbox.unfinished_tasks == 0

    def _loop(self) -> None:
        while True:
            item = self._outbox.get()
            try:
                if item is None:
                    return
                self._deliver(item)
            finally:
                self._outbox.task_done()

    def _wait_connected(self, acked: threading.Event) -> bool:
        """Wait for the broker (an outage uses no attempts); False when stopping or settled meanwhile."""
        while not self._connected():
            if self._stopping.wait(_CONNECTION_POLL_S) or acked.is_set():
                return False
        return not self._stopping.is_set()

    def ack_wait(self, attempt: int) -> float:
        """Seconds to wait for the ack after send number ``attempt`` (1, 2, ...): ``ack_timeout_s``, doubled each
        send up to :data:`MAX_BACKOFF` times, spread by +-10% from the second send on."""
        if attempt <= 1:
            return self._ack_timeout_s
        return self._ack_timeout_s * min(2 ** (attempt - 1), MAX_BACKOFF) * random.uniform(0.9, 1.1)

    def _wait_for(self, event: threading.Event, acked: threading.Event, attempt: int,
                  seconds: float | None = None) -> bool:
        """Wait up to :meth:`ack_wait` (or ``seconds``) for ``event`` (the ack, or a grant), until the ack, or until
        stop() (which need not wait out the timeout); whether ``event`` is set."""
        deadline = time.monotonic() + (self.ack_wait(attempt) if seconds is None else seconds)
        while not event.is_set() and not acked.is_set() and not self._stopping.is_set():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            event.wait(min(remaining, _CONNECTION_POLL_S))
        return event.is_set()

    def _granted_now(self, outgoing: _Outgoing, acked: threading.Event, attempt: int) -> bool:
        """Ask for the upload of ``outgoing`` and wait for the grant (at once True when it need not ask). While the
        coordinator answers that the request waits its turn, ask again every ``ack_timeout_s`` (keeping its place)
        without spending the attempt; an ask it does not answer so ends the wait as before."""
        if outgoing.round is None:
            return True
        task_id = outgoing.task_id
        with self._lock:
            granted = self._granted[task_id] = threading.Event()
            told = self._told_to_wait[task_id] = threading.Event()
        if not outgoing.digest:
            outgoing.digest = hashlib.sha256(outgoing.payload).hexdigest()
        request = encode(UploadRequest(task_id, outgoing.round, self.agent_id, len(outgoing.payload),
                                       outgoing.digest))
        asked = time.monotonic()
        try:
            seconds = None  # the attempt's wait
            while True:
                self._publish(self.topic, request)
                if self._wait_for(granted, acked, attempt, seconds):
                    return True
                if not told.is_set() or acked.is_set() or self._stopping.is_set() or not self._connected():
                    return False
                told.clear()  # told to wait: its next ask must be answered so again to wait on
                # Asked again every ack_timeout_s, spread by +-10%: a fleet told to wait does not ask in step.
                seconds = self._ack_timeout_s * random.uniform(0.9, 1.1)
        finally:
            self._grant_waits[task_id] = self._grant_waits.get(task_id, 0.0) + time.monotonic() - asked
            with self._lock:
                self._granted.pop(task_id, None)
                self._told_to_wait.pop(task_id, None)

    def _deliver(self, outgoing: _Outgoing) -> None:
        try:
            self._deliver_until_settled(outgoing)
        finally:
            self._grant_waits.pop(outgoing.task_id, None)

    def _deliver_until_settled(self, outgoing: _Outgoing) -> None:
        task_id, payload = outgoing.task_id, outgoing.payload
        with self._lock:
            acked = self._acked.setdefault(task_id, threading.Event())
        attempt = 0
        while attempt < self._attempts and not acked.is_set() and not self._stopping.is_set():
            if not self._wait_connected(acked):
                break
            attempt += 1
            if not self._granted_now(outgoing, acked, attempt):
                if not acked.is_set() and attempt < self._attempts and not self._stopping.is_set():
                    self._log.warning("upload_not_granted_asking_again", task=task_id, attempt=attempt)
                continue
            if acked.is_set():  # answered while it asked (stored already): nothing to send
                break
            for chunk in iter_chunks(payload, f"{task_id}.{attempt}", version=payload_version(payload)):
                self._publish(self.topic, chunk)
            if (not self._wait_for(acked, acked, attempt) and attempt < self._attempts
                    and not self._stopping.is_set()):
                self._log.warning("update_not_acked_resending", task=task_id, attempt=attempt)
        # Outstanding no more before the outcome is recorded: a later ack finds nothing and says so.
        with self._lock:
            self._acked.pop(task_id, None)
            refusal = self._refusals.pop(task_id, None)
            parked = not acked.is_set() and self._spool is not None and task_id in self._spool
            if parked:
                self._parked[task_id] = outgoing.round
            else:
                self._sizes.pop(task_id, None)
        self._backlog_changed()
        if refusal is not None:
            self.refused.append(task_id)
            self._log.warning("update_refused", task=task_id, attempts=attempt, reason=refusal)
        elif acked.is_set():
            self.delivered.append(task_id)
            waited = self._grant_waits.get(task_id)
            self._log.info("update_acked", task=task_id, attempts=attempt, bytes=len(payload),
                           **({"waited_for_grant_s": round(waited, 3)} if waited is not None else {}))
        elif self._stopping.is_set():
            self._log.info("update_left_for_next_start", task=task_id, spooled=parked)
        elif parked:
            self.abandoned.append(task_id)
            self._log.error("update_parked", task=task_id, attempts=attempt,
                            message="no ack after every attempt: kept on disk, sent again when the coordinator "
                                    "comes back online or the agent restarts")
        else:
            self.abandoned.append(task_id)
            self._log.error("update_abandoned", task=task_id, attempts=attempt)
