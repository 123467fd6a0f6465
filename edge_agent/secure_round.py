"""The agent's part of a secure round (revision 10; `protocol.secure`, docs/privacy.md). Once a secure task is
trained its update is held here, never sent in the clear: the agent advertises fresh keys and what it trained; with
the coordinator's roster it secret-shares its self-mask seed and mask key among its neighbours, sealed to each;
with the relayed shares of its neighbours it masks its slice (`common.secagg`) and hands the masked update to the
uplink as any other; asked to unmask, it gives back its neighbours' shares. Its secrets live in this process's
memory only: an agent restarted mid-round drops out of it, which the round survives.

A refusal from the coordinator (an :class:`~protocol.Ack` with a reason for a task held here: too few devices, keys
sent too late) is answered with a failed update carrying that reason. A task held past its deadline is let go.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np

from common.logs import Logger
from common.secagg.client import Advert, Neighbour, Roster, SecureClient
from common.secagg.wire import context_of, coverage_from_runs, keep_from_bits
from edge_agent.holdback import HoldBack
from protocol import (
    Ack,
    Message,
    RevealedShare,
    SecureAdvert,
    SecureRelay,
    SecureReveal,
    SecureRoster,
    SecureShares,
    SecureUnmask,
    Task,
    Update,
    UpdateStatus,
)
from protocol.secure import SHARE_BYTES

__all__ = ["FROM_COORDINATOR", "SecureTasks"]

#: The secure round's messages an agent reads (on its ack topic).
FROM_COORDINATOR = (SecureRoster, SecureRelay, SecureUnmask)
#: Seconds past its task's deadline a device keeps a sent update's secrets, to give its shares back.
REVEAL_GRACE_S = 600.0


class Send(Protocol):
    """How an update goes out (`edge_agent.uplink.Uplink.send`)."""

    def __call__(self, update: Update, *, version: int, ask: bool) -> None: ...


@dataclass
class _Held:
    """A secure task in progress: its update (the clear one until it is masked), how to answer it, its secrets."""

    task: Task
    update: Update
    version: int
    done: Callable[[], None]
    client: SecureClient
    sent: bool = False
    roster: SecureRoster | None = None


class SecureTasks:
    """See the module docstring. ``publish(message)``: on the agent's update topic; ``send``: through the uplink (its
    outbox, grants and acks)."""

    def __init__(self, agent_id: str, federation: str, publish: Callable[[Message], object], send: Send,
                 log: Logger) -> None:
        self._agent_id = agent_id
        self._federation = federation
        self._publish = publish
        self._send = send
        self._log = log
        self._held: dict[str, _Held] = {}
        self._lock = threading.Lock()

    def advertise(self, task: Task, update: Update, version: int, done: Callable[[], None], hold: float = 0.0,
                  holdback: HoldBack | None = None) -> None:
        """Hold the trained ``update`` of secure ``task`` and advertise keys for it (``done()`` once it is answered,
        masked or failed, or let go); with ``hold`` seconds of ``slowdown``, ``holdback`` advertises them then."""
        if hold > 0 and holdback is not None and holdback.hold(task.task_id, hold, lambda: self.advertise(
                task, update, version, done)):
            return
        client = SecureClient(task.task_id, context_of(self._federation, task.round))
        with self._lock:
            self._held[task.task_id] = _Held(task, update, version, done, client)
        keys = client.advert()
        self._publish(SecureAdvert(task.task_id, task.round, self._agent_id, keys.cipher, keys.mask,
                                   update.spec_trained, list(update.labels)))
        self._log.info("secure_keys_advertised", task=task.task_id, round=task.round)
        timer = threading.Timer(max(0.0, task.deadline - time.time()), self._expire, (task.task_id, False))
        timer.daemon = True
        timer.start()

    def take(self, message: Message) -> bool:
        """Handle a message of the ack topic that is the secure round's (True), or leave it to the uplink (False)."""
        if isinstance(message, Ack):
            return self._refused(message)
        if not isinstance(message, FROM_COORDINATOR):
            return False
        with self._lock:
            held = self._held.get(message.task_id)
        if held is None or message.round != held.task.round:
            self._log.info("secure_message_ignored", task=message.task_id, kind=type(message).__name__)
            return True
        try:
            if isinstance(message, SecureRoster):
                self._share(held, message)
            elif isinstance(message, SecureRelay):
                self._mask(held, message)
            else:
                self._reveal(held, message)
        except ValueError as exc:
            self._log.warning("secure_round_failed", task=message.task_id, reason=str(exc))
            if not held.sent:
                self._fail(held, f"secure aggregation: {exc}")
            else:
                self._forget(message.task_id)
        return True

    def _share(self, held: _Held, roster: SecureRoster) -> None:
        neighbours = [Neighbour(Advert(peer.task_id, peer.cipher, peer.mask), peer.point,
                                coverage_from_runs(peer.coverage)) for peer in roster.peers]
        sealed = held.client.share(Roster(roster.point, roster.threshold, neighbours))
        held.roster = roster
        self._publish(SecureShares(held.task.task_id, held.task.round, self._agent_id, sealed))

    def _mask(self, held: _Held, relay: SecureRelay) -> None:
        roster = held.roster
        if roster is None or held.sent:
            raise ValueError("shares were relayed before its roster came, or after its update went")
        held.client.receive(relay.sealed)
        coverage, positions = coverage_from_runs(roster.coverage), coverage_from_runs(roster.positions)
        keep = keep_from_bits(relay.keep, coverage)
        prefix = f"{roster.group}/"
        values = {}
        for name, where in positions.items():
            if not name.startswith(prefix) or name[len(prefix):] not in held.update.weights:
                raise ValueError(f"the roster names tensor {name!r}, which its update does not hold")
            trained = np.asarray(held.update.weights[name[len(prefix):]], dtype=np.float64)
            if len(where) != trained.ndim or any(len(pos) and pos.max() >= size
                                                 for pos, size in zip(where, trained.shape, strict=True)):
                raise ValueError(f"the roster's positions of {name!r} lie outside its tensor {trained.shape}")
            values[name] = trained[np.ix_(*where)]
        masked = held.client.mask(values, coverage, {name: tuple(shape) for name, shape in roster.shapes.items()},
                                  keep)
        update = replace(held.update, weights={name[len(prefix):]: array for name, array in masked.items()})
        held.sent, held.update = True, update  # (the clear tensors are let go)
        self._send(update, version=held.version, ask=held.task.ask_to_upload)
        self._log.info("secure_update_sent", task=held.task.task_id, tensors=len(masked))
        held.done()
        timer = threading.Timer(max(0.0, held.task.deadline + REVEAL_GRACE_S - time.time()), self._expire,
                                (held.task.task_id, True))
        timer.daemon = True
        timer.start()

    def _reveal(self, held: _Held, unmask: SecureUnmask) -> None:
        reveals = held.client.reveal(unmask.survivors, unmask.dropped)
        self._forget(held.task.task_id)
        self._publish(SecureReveal(held.task.task_id, held.task.round, self._agent_id,
                                   [RevealedShare(reveal.owner, reveal.kind, reveal.value.to_bytes(SHARE_BYTES, "big"))
                                    for reveal in reveals]))
        self._log.info("secure_shares_given_back", task=held.task.task_id, shares=len(reveals))

    def _refused(self, ack: Ack) -> bool:
        with self._lock:
            held = self._held.get(ack.task_id)
        if held is None or held.sent or ack.round != held.task.round or ack.reason is None:
            return False
        self._log.warning("secure_round_refused", task=ack.task_id, reason=ack.reason)
        self._fail(held, ack.reason)
        return True

    def _fail(self, held: _Held, reason: str) -> None:
        self._forget(held.task.task_id)
        update = held.update
        self._send(Update(update.task_id, update.round, update.agent_id, UpdateStatus.FAILED, None, update.num_samples,
                          list(update.labels), {}, dict(update.metrics), reason=reason),
                   version=held.version, ask=held.task.ask_to_upload)
        held.done()

    def _expire(self, task_id: str, sent: bool) -> None:
        with self._lock:
            held = self._held.get(task_id)
            if held is None or held.sent != sent:
                return
            self._held.pop(task_id)
        self._log.info("secure_task_let_go", task=task_id, sent=sent,
                       reason="its round's deadline passed" + ("" if not sent else " long ago"))
        if not sent:
            held.done()

    def _forget(self, task_id: str) -> None:
        with self._lock:
            self._held.pop(task_id, None)

    def holding(self) -> int:
        """How many secure tasks are held (their secrets in memory)."""
        with self._lock:
            return len(self._held)

