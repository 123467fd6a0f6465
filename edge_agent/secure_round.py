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
from collections import OrderedDict
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
#: How the coordinator's refusals of a secure round's step begin (`coordinator.secure.exchange`).
REFUSAL = "secure aggregation: "
#: How many tasks let go it remembers, to tell a late refusal of one of their steps from its update's.
SETTLED_KEPT = 64


class Send(Protocol):
    """How an update goes out (`edge_agent.uplink.Uplink.send`)."""

    def __call__(self, update: Update, *, version: int, ask: bool) -> None: ...


@dataclass
class _Held:
    """A secure task in progress: its update (the clear one until it is masked), how to answer it, its secrets."""

    task: Task
    update: Update
    version: int
    done: Callable[[Update | None], None]
    client: SecureClient
    sent: bool = False
    roster: SecureRoster | None = None
    answered: bool = False  # its answer (masked, failed) went, or it was let go: once, whichever comes first
    timer: threading.Timer | None = None  # when it is let go


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
        self._settled: OrderedDict[str, None] = OrderedDict()  # the latest tasks let go (their late refusals ignored)
        self._lock = threading.Lock()

    def advertise(self, task: Task, update: Update, version: int, done: Callable[[Update | None], None],
                  hold: float = 0.0, holdback: HoldBack | None = None) -> None:
        """Hold the trained ``update`` of secure ``task`` and advertise keys for it (``done(answer)`` once it is
        answered, masked or failed; ``done(None)`` when it is let go unanswered); with ``hold`` seconds of
        ``slowdown``, ``holdback`` advertises them then."""
        if hold > 0 and holdback is not None and holdback.hold(task.task_id, hold, lambda: self.advertise(
                task, update, version, done)):
            return
        client = SecureClient(task.task_id, context_of(self._federation, task.round))
        entry = _Held(task, update, version, done, client)
        with self._lock:
            self._held[task.task_id] = entry
        keys = client.advert()
        self._publish(SecureAdvert(task.task_id, task.round, self._agent_id, keys.cipher, keys.mask,
                                   update.spec_trained, list(update.labels)))
        self._log.info("secure_keys_advertised", task=task.task_id, round=task.round)
        self._expire_at(entry, task.deadline, sent=False)

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
        except Exception as exc:  # noqa: BLE001 - a message it cannot serve: its task fails, said why
            self._log.warning("secure_round_failed", task=message.task_id, reason=str(exc) or type(exc).__name__)
            if not held.sent:
                self._fail(held, f"secure aggregation: {str(exc) or type(exc).__name__}")
            else:
                self._forget(message.task_id)
        return True

    def _share(self, held: _Held, roster: SecureRoster) -> None:
        if held.roster is not None:  # the same roster again (a resent message): shared already
            self._log.info("secure_message_repeated", task=held.task.task_id, kind="SecureRoster")
            return
        neighbours = [Neighbour(Advert(peer.task_id, peer.cipher, peer.mask), peer.point,
                                coverage_from_runs(peer.coverage)) for peer in roster.peers]
        sealed = held.client.share(Roster(roster.point, roster.threshold, neighbours))
        held.roster = roster
        self._publish(SecureShares(held.task.task_id, held.task.round, self._agent_id, sealed))

    def _mask(self, held: _Held, relay: SecureRelay) -> None:
        roster = held.roster
        if held.sent:  # the same relay again (a resent message): its update went already
            self._log.info("secure_message_repeated", task=held.task.task_id, kind="SecureRelay")
            return
        if roster is None:
            raise ValueError("shares were relayed before its roster came")
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
            if name not in coverage or [len(pos) for pos in where] != [len(index) for index in coverage[name]] or any(
                    len(np.unique(pos)) != len(pos) for pos in where):
                raise ValueError(f"the roster's positions of {name!r} are not as many as its slice's, or repeat")
            values[name] = trained[np.ix_(*where)]
        masked = held.client.mask(values, coverage, {name: tuple(shape) for name, shape in roster.shapes.items()},
                                  keep)
        update = replace(held.update, weights={name[len(prefix):]: array for name, array in masked.items()})
        if not self._first_answer(held, sent=True):
            return
        held.update = update  # (the clear tensors are let go)
        self._send(update, version=held.version, ask=held.task.ask_to_upload)
        self._log.info("secure_update_sent", task=held.task.task_id, tensors=len(masked))
        held.done(update)
        self._expire_at(held, held.task.deadline + REVEAL_GRACE_S, sent=True)

    def _reveal(self, held: _Held, unmask: SecureUnmask) -> None:
        if not held.sent:
            raise ValueError("asked for its shares before its masked update went")
        reveals = held.client.reveal(unmask.survivors, unmask.dropped)
        self._forget(held.task.task_id)
        self._publish(SecureReveal(held.task.task_id, held.task.round, self._agent_id,
                                   [RevealedShare(reveal.owner, reveal.kind, reveal.value.to_bytes(SHARE_BYTES, "big"))
                                    for reveal in reveals]))
        self._log.info("secure_shares_given_back", task=held.task.task_id, shares=len(reveals))

    def _refused(self, ack: Ack) -> bool:
        with self._lock:
            held = self._held.get(ack.task_id)
        if held is None:  # a refusal of a step of a task it answered already: not its answer's (the uplink's)
            with self._lock:
                settled = ack.task_id in self._settled
            if settled and (ack.reason or "").startswith(REFUSAL):
                self._log.info("secure_refusal_ignored", task=ack.task_id, reason=ack.reason)
                return True
            return False
        if ack.round != held.task.round or ack.reason is None:
            return False
        if held.sent:  # the exchange's refusal of a step it took already (a resent message): not its update's
            if not ack.reason.startswith(REFUSAL):
                return False  # (the masked update refused: the uplink's to settle)
            self._log.info("secure_refusal_ignored", task=ack.task_id, reason=ack.reason)
            return True
        self._log.warning("secure_round_refused", task=ack.task_id, reason=ack.reason)
        self._fail(held, ack.reason)
        return True

    def _fail(self, held: _Held, reason: str) -> None:
        self._forget(held.task.task_id)
        if not self._first_answer(held):
            return
        update = held.update
        failed = Update(update.task_id, update.round, update.agent_id, UpdateStatus.FAILED, None, update.num_samples,
                        list(update.labels), {}, dict(update.metrics), reason=reason)
        self._send(failed, version=held.version, ask=held.task.ask_to_upload)
        held.done(failed)

    def _expire(self, task_id: str, sent: bool) -> None:
        with self._lock:
            held = self._held.get(task_id)
            if held is None or held.sent != sent:
                return
            self._held.pop(task_id)
        self._log.info("secure_task_let_go", task=task_id, sent=sent,
                       reason="its round's deadline passed" + ("" if not sent else " long ago"))
        if not sent and self._first_answer(held):
            held.done(None)

    def _first_answer(self, held: _Held, sent: bool = False) -> bool:
        """Whether ``held`` is answered (or let go) now for the first time (``sent``: with its masked update)."""
        with self._lock:
            first, held.answered = not held.answered, True
            held.sent = held.sent or (first and sent)
            return first

    def _forget(self, task_id: str) -> None:
        with self._lock:
            held = self._held.pop(task_id, None)
            self._settled[task_id] = None
            while len(self._settled) > SETTLED_KEPT:
                self._settled.popitem(last=False)
        if held is not None and held.timer is not None:
            held.timer.cancel()

    def _expire_at(self, held: _Held, when: float, *, sent: bool) -> None:
        if held.timer is not None:
            held.timer.cancel()
        held.timer = threading.Timer(max(0.0, when - time.time()), self._expire, (held.task.task_id, sent))
        held.timer.daemon = True
        held.timer.start()

    def close(self) -> None:
        """The agent stops: every round's secrets forgotten (its rounds go on without it), the timers cancelled."""
        with self._lock:
            held, self._held = list(self._held.values()), {}
        for entry in held:
            if entry.timer is not None:
                entry.timer.cancel()

    def holding(self) -> int:
        """How many secure tasks are held (their secrets in memory)."""
        with self._lock:
            return len(self._held)

