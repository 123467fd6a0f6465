"""One secure round's exchange at the coordinator, as steps that take the devices' messages and return the messages
to send (the room, `coordinator.secure.room`, moves them over MQTT and decides when a step is due):

adverts (each device's keys and the slice it trained) -> rosters -> sealed shares -> relays (with which coordinates
enough devices hold) -> masked updates (through the round's ordinary intake, into the server) -> unmask requests ->
the shares given back -> the unmasked sums.

A device that is left out (its advert came after the rosters, it did not share in time, the round had too few
devices) is told so in an :class:`~protocol.Ack` with the reason, and answers its task as failed. Thread-safe.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from common.secagg.client import Advert, Reveal
from common.secagg.masking import MIN_HOLDERS
from common.secagg.server import SecureServer
from common.secagg.wire import coverage_to_runs, keep_to_bits
from coordinator.secure.slices import Slice
from coordinator.tasks import TaskPlan
from protocol import (
    Ack,
    Message,
    SecureAdvert,
    SecurePeer,
    SecureRelay,
    SecureReveal,
    SecureRoster,
    SecureShares,
    SecureUnmask,
)

__all__ = ["ExchangeRecord", "SecureExchange"]

Outgoing = list[tuple[str, Message]]  # (agent id, message)
Cutter = Callable[[TaskPlan, dict[str, Any] | None, Sequence[int]], Slice]


@dataclass
class ExchangeRecord:
    """What the round's record says of its exchange: how many devices advertised, shared, sent and gave back,
    the bytes of the exchange's own messages, and why it failed (None: it did not)."""

    advertised: int = 0
    shared: int = 0
    sent: int = 0
    revealed: int = 0
    threshold: int = 0
    left_out: int = 0
    bytes_down: int = 0
    bytes_up: int = 0
    seconds: dict[str, float] = field(default_factory=dict)
    failure: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"advertised": self.advertised, "shared": self.shared, "sent": self.sent, "revealed": self.revealed,
                "threshold": self.threshold, "left_out": self.left_out, "bytes_down": self.bytes_down,
                "bytes_up": self.bytes_up,
                "seconds": {key: round(value, 3) for key, value in self.seconds.items()}, "failure": self.failure}


class SecureExchange:
    """See the module docstring. ``tasks``: the round's, by task id; ``cut``: an update's slice from its task, spec
    trained and labels (`coordinator.secure.slices.cut_slice`); ``shapes``: the global tensors by secure name."""

    def __init__(self, round_number: int, context: bytes, tasks: Mapping[str, TaskPlan], cut: Cutter,
                 shapes: Mapping[str, tuple[int, ...]], rng: random.Random) -> None:
        self.round = round_number
        self.context = context
        self.tasks = dict(tasks)
        self._cut = cut
        self._shapes = dict(shapes)
        self._rng = rng
        self._lock = threading.RLock()
        self.phase = "adverts"
        self.adverts: dict[str, tuple[Advert, Slice, SecureAdvert]] = {}
        self.server: SecureServer | None = None
        self._bundles: dict[str, dict[str, bytes]] = {}
        self._asked: list[str] = []
        self._reveals: dict[str, list[Reveal]] = {}
        self.record = ExchangeRecord()
        self._told: set[str] = set()  # tasks told they are out (once)
        #: Agents whose masked update was left out of the sum (`SecureServer.left_out`).
        self.left_out: set[str] = set()
        self._started = time.monotonic()
        self.rostered_at = 0.0
        self._asked_at = 0.0

    def task_of(self, agent_id: str) -> str:
        """The task id ``agent_id`` holds in the round (one per device in a synchronous round)."""
        for task_id, task in self.tasks.items():
            if task.agent_id == agent_id:
                return task_id
        raise ValueError(f"{agent_id!r} holds no task in secure round {self.round}")

    def slice_of(self, task_id: str) -> tuple[Slice, SecureAdvert]:
        """The slice ``task_id`` advertised and its advert; ValueError when it sent none that was taken."""
        with self._lock:
            if task_id not in self.adverts:
                raise ValueError("it advertised no keys this round before its rosters went out, so its masks cannot "
                                 "be taken away")
            _, cut, advert = self.adverts[task_id]
            return cut, advert

    # ------------------------------------------------------------- adverts
    def advert(self, message: SecureAdvert, size: int) -> Outgoing:
        """Take a device's advert (or tell it why not)."""
        with self._lock:
            self.record.bytes_up += size
            task = self.tasks.get(message.task_id)
            if task is None or task.agent_id != message.agent_id:
                return []  # not this round's: nothing to answer (the agent's task is another round's)
            if message.task_id in self.adverts:
                known = self.adverts[message.task_id][2]
                if (known.cipher, known.mask) == (message.cipher, message.mask):
                    return []  # the same advert again (a resent message)
                if self.phase != "adverts":  # (its neighbours hold its old keys)
                    return [self._refusal(message.task_id, "its keys changed after the rosters went out (an agent "
                                                           "restarted)")]
            elif self.phase != "adverts":
                return [self._refusal(message.task_id, f"its keys came after round {self.round}'s rosters went out")]
            try:
                cut = self._cut(task, message.spec_trained, message.labels)
            except ValueError as exc:
                return [self._refusal(message.task_id, f"its advert names no slice of its task: {exc}")]
            self.adverts[message.task_id] = (Advert(message.task_id, message.cipher, message.mask), cut, message)
            return []

    def waiting_for_adverts(self, answered: Collection[str]) -> bool:
        """Whether some task has neither advertised nor answered (a decline, a failure)."""
        with self._lock:
            return any(task_id not in self.adverts and task_id not in answered for task_id in self.tasks)

    def rosters(self) -> Outgoing:
        """The adverts close: each advertiser's roster, or with fewer than three, each told the round cannot be
        secure."""
        with self._lock:
            if self.phase != "adverts":
                return []
            self.phase = "sharing"
            self.rostered_at = time.monotonic()
            self.record.seconds["adverts"] = self.rostered_at - self._started
            self.record.advertised = len(self.adverts)
            if len(self.adverts) < MIN_HOLDERS:
                return self._fail(f"{len(self.adverts)} device(s) trained and advertised keys: secure aggregation "
                                  f"needs at least {MIN_HOLDERS} (with fewer, one could read another's update from "
                                  f"the sum)", self.adverts)
            try:
                self.server = SecureServer(self.context, self._shapes,
                                           {task_id: cut.coverage for task_id, (_, cut, _) in self.adverts.items()},
                                           self._rng)
                rosters = self.server.rosters({task_id: advert for task_id, (advert, _, _) in self.adverts.items()})
            except ValueError as exc:
                return self._fail(str(exc), self.adverts)
            self.record.threshold = self.server.threshold
            runs = {task_id: coverage_to_runs(cut.coverage) for task_id, (_, cut, _) in self.adverts.items()}
            return [(self.tasks[task_id].agent_id, self._roster(task_id, roster.point, roster.threshold,
                                                                 [neighbour.advert.device for neighbour in
                                                                  roster.neighbours], runs))
                    for task_id, roster in rosters.items()]

    def _roster(self, task_id: str, point: int, threshold: int, neighbours: list[str],
                runs: Mapping[str, dict[str, list[list[int]]]]) -> SecureRoster:
        assert self.server is not None
        cut = self.adverts[task_id][1]
        peers = [SecurePeer(other, self.adverts[other][0].cipher, self.adverts[other][0].mask,
                            self.server.points[other], runs[other]) for other in neighbours]
        named = set(cut.coverage).union(*(self.adverts[other][1].coverage for other in neighbours))
        return SecureRoster(task_id, self.round, self.tasks[task_id].agent_id, cut.group, point, threshold,
                            runs[task_id], coverage_to_runs(cut.positions),
                            {name: list(self._shapes[name]) for name in sorted(named)}, peers)

    # -------------------------------------------------------------- shares
    def shares(self, message: SecureShares, size: int) -> Outgoing:
        """Take a device's sealed shares."""
        with self._lock:
            self.record.bytes_up += size
            if message.task_id not in self.adverts or self.tasks[message.task_id].agent_id != message.agent_id:
                return []
            if message.task_id in self._bundles:
                return []  # the same shares again (a resent message)
            if self.phase != "sharing":
                return [self._refusal(message.task_id, f"its shares came after round {self.round}'s were relayed")]
            assert self.server is not None
            wanted = set(self.server.graph[message.task_id])
            if set(message.sealed) != wanted:  # its neighbours would mask with it one-sidedly: it is left out
                return [self._refusal(message.task_id, f"it sealed shares for {len(message.sealed)} device(s), not "
                                                       f"for its {len(wanted)} neighbours")]
            self._bundles[message.task_id] = dict(message.sealed)
            return []

    def waiting_for_shares(self, answered: Collection[str]) -> bool:
        """Whether some device of the roster has neither shared nor answered its task."""
        with self._lock:
            return self.phase == "sharing" and any(task_id not in self._bundles and task_id not in answered
                                                   for task_id in self.adverts)

    def relays(self) -> Outgoing:
        """The shares close: each sharer's relay; those that did not share are told they are out."""
        with self._lock:
            if self.phase != "sharing":
                return []
            assert self.server is not None
            self.phase = "uploading"
            self.record.seconds["shares"] = time.monotonic() - self.rostered_at
            late = [self._refusal(task_id, f"it did not share its keys within round {self.round}'s time for it")
                    for task_id in self.adverts if task_id not in self._bundles and task_id not in self._told]
            try:
                if len(self._bundles) < MIN_HOLDERS:
                    raise ValueError(f"{len(self._bundles)} device(s) shared their keys: secure aggregation needs at "
                                     f"least {MIN_HOLDERS}")
                relayed = self.server.relay(self._bundles)
            except ValueError as exc:
                return late + self._fail(str(exc), self._bundles)
            self.record.shared = len(relayed)
            kept = self.server.keep()
            return late + [(self.tasks[task_id].agent_id,
                            SecureRelay(task_id, self.round, self.tasks[task_id].agent_id, sealed,
                                        keep_to_bits(kept[task_id])))
                           for task_id, sealed in relayed.items()]

    # ----------------------------------------------------------- unmasking
    def fail(self, reason: str) -> None:
        """The round cannot be unmasked for ``reason`` (the room's), unless it was already."""
        with self._lock:
            if self.phase in ("adverts", "sharing", "uploading", "unmasking"):
                self.phase, self.record.failure = "failed", self.record.failure or reason

    def requests(self) -> Outgoing:
        """The round stopped collecting: ask the survivors for their shares (nothing when the round cannot be
        unmasked: its failure says why)."""
        with self._lock:
            if self.phase in ("adverts", "sharing"):
                what = "adverts" if self.phase == "adverts" else "shares"
                return self._fail(f"round {self.round} closed before its {what} were in", self.adverts)
            if self.phase != "uploading" or self.server is None:
                return []
            self.phase = "unmasking"
            self._asked_at = time.monotonic()
            self.record.sent = len(self.server.sent)
            try:
                survivors, dropped = self.server.request()
            except ValueError as exc:
                self.phase, self.record.failure = "failed", str(exc)
                return []
            self.record.left_out = len(self.server.left_out)
            self.left_out = {self.tasks[task_id].agent_id for task_id in self.server.left_out}
            self._asked = survivors
            return [(self.tasks[task_id].agent_id,
                     SecureUnmask(task_id, self.round, self.tasks[task_id].agent_id, survivors, dropped))
                    for task_id in survivors]

    def reveal(self, message: SecureReveal, size: int) -> None:
        """Take a survivor's shares."""
        with self._lock:
            self.record.bytes_up += size
            if self.phase != "unmasking" or message.task_id not in self._asked:
                return
            if self.tasks[message.task_id].agent_id != message.agent_id:
                return
            assert self.server is not None
            point = self.server.points[message.task_id]
            asked = ({(owner, "self") for owner in self.server.sent}
                     | {(owner, "mask") for owner in self.server.shared - self.server.sent})
            neighbours = set(self.server.graph[message.task_id])
            self._reveals[message.task_id] = [Reveal(share.owner, share.kind, point, int.from_bytes(share.value, "big"))
                                              for share in message.shares
                                              if (share.owner, share.kind) in asked and share.owner in neighbours]

    def waiting_for_reveals(self) -> bool:
        with self._lock:
            return self.phase == "unmasking" and any(task_id not in self._reveals for task_id in self._asked)

    def unmask(self) -> dict[str, tuple[np.ndarray, np.ndarray]] | None:
        """The round's sums and counts, or None when it cannot be unmasked (the failure says why)."""
        with self._lock:
            if self.phase != "unmasking":
                return None
            assert self.server is not None
            self.record.seconds["unmask"] = time.monotonic() - self._asked_at
            self.record.revealed = len(self._reveals)
            try:
                sums = self.server.unmask(self._reveals)
            except ValueError as exc:
                self.phase, self.record.failure = "failed", str(exc)
                return None
            finally:
                self.server, self._bundles, self._reveals = None, {}, {}  # (the sums and the shares let go)
            self.phase = "done"
            return sums

    # ------------------------------------------------------------- helpers
    def _refusal(self, task_id: str, reason: str) -> tuple[str, Message]:
        self._told.add(task_id)
        agent = self.tasks[task_id].agent_id
        return agent, Ack(task_id, self.round, agent, reason=f"secure aggregation: {reason}")

    def _fail(self, reason: str, told: Collection[str]) -> Outgoing:
        self.phase, self.record.failure = "failed", reason
        return [self._refusal(task_id, reason) for task_id in told if task_id not in self._told]
