"""The coordinator's secure-aggregation room (``secure_aggregation``; docs/privacy.md): every task of a round marked
secure, the round's aggregate a `SecureAggregate`, the exchange (`coordinator.secure.exchange`) moved over MQTT:
the devices' adverts, shares and reveals taken from their update topics, the rosters, relays, unmask requests and
refusals sent on their ack topics. A step is due when every device it waits for has answered (a task answered
without weights counts), or when its time passed: the adverts close ``2 * phase_s`` before the round's deadline,
the shares ``phase_s`` after the rosters, and the reveals ``phase_s`` after the requests.

A secure round resumed from the journal after a coordinator restart cannot be unmasked (its keys and the devices'
secrets are gone): its masked updates are rejected with the reason and it aggregates nothing.
"""

from __future__ import annotations

import random
import secrets
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from common.logs import Logger
from common.mqtt_link import MqttLink
from common.secagg.wire import context_of
from coordinator.aggregation import RoundAggregate
from coordinator.config import CoordinatorConfig
from coordinator.secure.aggregate import SecureAggregate
from coordinator.secure.exchange import Outgoing, SecureExchange
from coordinator.secure.settings import SecureAggregationConfig
from coordinator.secure.slices import Slice, cut_slice, global_shapes
from coordinator.tasks import TaskPlan, TaskResult
from models import ModelFamily
from protocol import (
    SECURE_AGGREGATION_REVISION,
    Ack,
    SecureAdvert,
    SecureReveal,
    SecureShares,
    Topics,
    Update,
    decode,
    encode,
)

__all__ = ["SecureRounds", "secure_misfit"]

#: How many rounds' exchanges are kept (the round in progress and the one before, whose late messages are ignored).
KEPT_ROUNDS = 2


def secure_misfit(settings: SecureAggregationConfig, revision: int) -> str | None:
    """Why an agent of protocol ``revision`` cannot take part in a secure run (None: it can)."""
    if settings.enabled and revision < SECURE_AGGREGATION_REVISION:
        return (f"its protocol revision {revision} predates secure aggregation (revision "
                f"{SECURE_AGGREGATION_REVISION}): upgrade the agent")
    return None


class SecureRounds:
    """See the module docstring; nothing happens when the section is off."""

    def __init__(self, config: CoordinatorConfig, link: MqttLink, topics: Topics, family: ModelFamily,
                 num_classes: int, log: Logger) -> None:
        self.settings: SecureAggregationConfig = config.secure_aggregation
        self._federation = config.federation
        self._link = link
        self._topics = topics
        self._family = family
        self._num_classes = num_classes
        self._log = log
        self._exchanges: dict[int, SecureExchange] = {}
        self._records: dict[int, dict[str, Any]] = {}  # the rounds unmasked (or not), until settled
        self._timers: dict[int, list[threading.Timer]] = {}  # each round's cut-offs, cancelled once it is over
        self._answered: dict[int, set[str]] = {}
        self._changed = threading.Condition()
        self._rng = random.Random(secrets.randbits(64))  # the neighbour graph: not the run's seed

    @property
    def enabled(self) -> bool:
        return self.settings.enabled

    def plan(self, tasks: dict[str, TaskPlan]) -> dict[str, TaskPlan]:
        """The round's tasks, marked secure."""
        if not self.enabled:
            return tasks
        return {task_id: replace(task, secure=True) for task_id, task in tasks.items()}

    def aggregate(self, round_number: int, tasks: Mapping[str, TaskPlan], deadline: float,
                  aggregate: RoundAggregate) -> RoundAggregate:
        """The round's aggregate: ``aggregate`` itself, or for a secure round a :class:`SecureAggregate` with its
        exchange begun (the adverts close ``2 * phase_s`` before ``deadline``, wall clock)."""
        if not self.enabled or not any(task.secure for task in tasks.values()):
            return aggregate
        states, keys = aggregate.states, aggregate.classifier_keys

        def cut(task: TaskPlan, spec: dict[str, Any] | None, labels: Sequence[int]) -> Slice:
            return cut_slice(self._family, task, spec, labels, states, keys, self._num_classes)

        exchange = SecureExchange(round_number, context_of(self._federation, round_number), tasks, cut,
                                  global_shapes(states), self._rng)
        with self._changed:
            self._exchanges[round_number] = exchange
            self._answered[round_number] = set()
            for old in sorted(self._exchanges)[:-KEPT_ROUNDS]:
                self._exchanges.pop(old)
                self._answered.pop(old, None)
        close_at = deadline - 2 * self.settings.phase_s - time.time()
        self._after(close_at, round_number, "adverts")
        return SecureAggregate(states, keys, lambda: exchange.server, exchange.task_of,
                               lambda: self.unmask(round_number), lambda: exchange.record.failure,
                               lambda: exchange.left_out)

    # ------------------------------------------------------------- messages
    def on_message(self, agent_id: str, payload: bytes) -> None:
        """A device's advert, shares or reveal (on its update topic; ProtocolError when malformed)."""
        message = decode(payload, expected=(SecureAdvert, SecureShares, SecureReveal))
        assert isinstance(message, (SecureAdvert, SecureShares, SecureReveal))
        if message.agent_id != agent_id:
            self._log.warning("secure_message_refused", agent=agent_id, claimed=message.agent_id,
                              reason="published on another agent's topic")
            return
        exchange = self._exchanges.get(message.round)
        if exchange is None:
            self._log.info("secure_message_ignored", agent=agent_id, round=message.round, kind=type(message).__name__)
            if isinstance(message, SecureAdvert):  # its round is not (or no longer) one this coordinator runs
                self._send([(agent_id, Ack(message.task_id, message.round, agent_id,
                                           reason=f"secure aggregation: round {message.round} has no exchange here (a "
                                                  f"coordinator restarted during it, or a round long over)"))])
            return
        if isinstance(message, SecureAdvert):
            self._send(exchange.advert(message, len(payload)))
        elif isinstance(message, SecureShares):
            self._send(exchange.shares(message, len(payload)))
        else:
            exchange.reveal(message, len(payload))
        self._advance(exchange)

    def answered(self, round_number: int, task_ids: set[str]) -> None:
        """The round's tasks answered so far (a decline or failure counts as no advert coming)."""
        exchange = self._exchanges.get(round_number)
        if exchange is None:
            return
        with self._changed:
            self._answered[round_number] = task_ids
        self._advance(exchange)

    def _advance(self, exchange: SecureExchange, due: str = "") -> None:
        """Take every step that is due (on the link's message thread)."""
        if exchange.phase == "adverts" and (due == "adverts" or not exchange.waiting_for_adverts(
                self._answered.get(exchange.round, set()))):
            self._send(exchange.rosters())
            self._log.info("secure_rosters_sent", round=exchange.round, devices=exchange.record.advertised,
                           threshold=exchange.record.threshold, failure=exchange.record.failure)
            if exchange.phase == "sharing":
                self._after(self.settings.phase_s, exchange.round, "shares")
        if exchange.phase == "sharing" and (due == "shares" or not exchange.waiting_for_shares(
                self._answered.get(exchange.round, set()))):
            self._send(exchange.relays())
            self._log.info("secure_shares_relayed", round=exchange.round, devices=exchange.record.shared,
                           failure=exchange.record.failure)
        with self._changed:
            self._changed.notify_all()

    def _after(self, seconds: float, round_number: int, due: str) -> None:
        """Have step ``due`` of ``round_number``'s exchange taken in ``seconds`` if it is still waiting then."""
        def fire() -> None:
            exchange = self._exchanges.get(round_number)
            if exchange is not None:
                self._link.call_soon(lambda: self._advance(exchange, due))
        timer = threading.Timer(max(0.0, seconds), fire)
        timer.daemon = True
        timer.start()
        with self._changed:
            self._timers.setdefault(round_number, []).append(timer)

    def _send(self, outgoing: Outgoing) -> None:
        for agent_id, message in outgoing:
            payload = encode(message)
            exchange = self._exchanges.get(getattr(message, "round", -1))
            if exchange is not None:
                exchange.record.bytes_down += len(payload)
            self._link.publish(self._topics.agent_ack(agent_id), payload)

    # --------------------------------------------------------- the round
    def unpack(self, update: Update, task: TaskPlan) -> TaskResult:
        """A masked update checked against the slice its device advertised (ValueError when it does not match it, is
        not masked, or its round cannot be unmasked)."""
        exchange = self._exchanges.get(update.round)
        if exchange is None:
            raise ValueError("its secure round's exchange is gone (the coordinator restarted during the round): its "
                             "masks cannot be taken away")
        cut, advert = exchange.slice_of(update.task_id)
        if update.spec_trained != advert.spec_trained or sorted(update.labels) != sorted(advert.labels):
            raise ValueError("its update names another sub-model or label set than its advert")
        keys = {cut.key_of(name): name for name in cut.coverage}
        if set(update.weights) != set(keys):
            raise ValueError(f"its masked tensors {sorted(update.weights)[:3]} are not its slice's "
                             f"{sorted(keys)[:3]}")
        masked = {}
        for key, name in keys.items():
            array = np.asarray(update.weights[key])
            if array.dtype != np.uint64:
                raise ValueError(f"tensor {key!r} is {array.dtype}, not masked (uint64): under secure aggregation an "
                                 f"update is never sent in the clear")
            if array.shape != cut.shape(name):
                raise ValueError(f"tensor {key!r} has shape {array.shape}, its slice {cut.shape(name)}")
            masked[name] = array
        return TaskResult(task, cut.spec, {}, {}, update.num_samples, list(update.labels), masked=masked)

    def unmask(self, round_number: int) -> dict[str, tuple[np.ndarray, np.ndarray]] | None:
        """Round ``round_number`` stopped collecting (its aggregate asks, `SecureAggregate.result`): ask its survivors
        for their shares, wait for them (``phase_s`` at most) and return its sums and counts (None when it cannot
        be unmasked: logged, and its record says why)."""
        exchange = self._exchanges.get(round_number)
        if exchange is None:
            return None
        requested = threading.Event()

        def request() -> None:
            try:
                self._send(exchange.requests())
            finally:
                requested.set()
        self._link.call_soon(request)
        waited_until = time.monotonic() + self.settings.phase_s
        if not requested.wait(self.settings.phase_s):
            exchange.fail("its unmask requests could not go out in time")
        with self._changed:
            while exchange.waiting_for_reveals():
                left = waited_until - time.monotonic()
                if left <= 0:
                    break
                self._changed.wait(min(left, 1.0))
        sums = exchange.unmask()
        with self._changed:
            for timer in self._timers.pop(round_number, []):
                timer.cancel()
        if sums is None:
            self._log.warning("secure_round_not_unmasked", round=round_number, reason=exchange.record.failure)
        self._records[round_number] = exchange.record.as_dict()
        return sums

    def settle(self, round_number: int) -> dict[str, Any] | None:
        """What round ``round_number``'s record says of its exchange (None: not a secure round)."""
        return self._records.pop(round_number, None)
