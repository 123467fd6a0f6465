"""coordinator.secure: a secure round's exchange between the coordinator (`SecureExchange`, `SecureAggregate`, the
room's unpacking) and the devices' own part (`edge_agent.secure_round.SecureTasks`), in one process without a broker:
its messages pass through the codec as they would over MQTT. The unmasked mean equals the plain masked mean of the
devices that sent, with and without a device dropping out after it shared; what it refuses is refused in a sentence."""

from __future__ import annotations

import math
import random
import time
from dataclasses import replace
from unittest import mock

import numpy as np
import pytest
import torch

from common.logs import get_logger
from common.secagg.masking import MIN_HOLDERS
from common.secagg.wire import context_of
from coordinator.aggregation import RoundAggregate
from coordinator.config import CoordinatorConfig
from coordinator.secure.aggregate import SecureAggregate
from coordinator.secure.exchange import SecureExchange
from coordinator.secure.room import SecureRounds
from coordinator.secure.settings import SecureAggregationConfig
from coordinator.secure.slices import cut_slice, global_shapes
from coordinator.tasks import TaskPlan, TaskResult
from edge_agent.secure_round import SecureTasks
from models import SubmodelSpec
from models.registry import get_family
from protocol import (
    Ack,
    Message,
    ModelRef,
    SecureAdvert,
    SecureReveal,
    SecureShares,
    Task,
    Topics,
    TrainingPlan,
    Update,
    UpdateStatus,
    decode,
    encode,
)
from protocol.plan import LossTerm

FAMILY = get_family("cnn", 10, 1, hidden=(4, 8, 8))
FEDERATION = "sa-unit"
ROUND = 3
LOG = get_logger("test")
MASKED_CE = TrainingPlan(loss=(LossTerm("ce", masked=True),))


def secure_room() -> SecureRounds:
    config = CoordinatorConfig(federation=FEDERATION, secure_aggregation=SecureAggregationConfig(enabled=True))
    return SecureRounds(config, mock.Mock(), Topics(FEDERATION), FAMILY, 10, LOG)


def wire(message: Message) -> Message:
    """``message`` as the other side reads it."""
    return decode(encode(message))


class Fleet:
    """Devices (``SecureTasks``) and the coordinator's exchange for one round, messages carried by hand."""

    def __init__(self, specs: dict[str, SubmodelSpec], labels: dict[str, list[int]] | None = None,
                 plan: TrainingPlan | None = None, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.states = {"global": FAMILY.build().state_dict()}
        self.tasks = {f"r{ROUND}-{name}": TaskPlan(name, "a", spec, plan or TrainingPlan(), secure=True)
                      for name, spec in specs.items()}
        self.labels = labels or {name: list(range(10)) for name in specs}
        self.exchange = SecureExchange(
            ROUND, context_of(FEDERATION, ROUND), self.tasks,
            lambda task, spec, labels: cut_slice(FAMILY, task, spec, labels, self.states, FAMILY.classifier_keys(),
                                                 10),
            global_shapes(self.states), random.Random(seed))
        self.aggregate = SecureAggregate(self.states, list(FAMILY.classifier_keys()), lambda: self.exchange.server,
                                         self.exchange.task_of, self.unmask)
        self.published: dict[str, list[Message]] = {name: [] for name in specs}
        self.sent: dict[str, list[Update]] = {name: [] for name in specs}
        self.devices = {name: SecureTasks(name, FEDERATION, lambda message, name=name: self.published[name].append(
            wire(message)), lambda update, *, version, ask, name=name: self.sent[name].append(update), LOG)
            for name in specs}
        self.clear: dict[str, dict[str, torch.Tensor]] = {}
        generator = torch.Generator().manual_seed(seed + 1)
        for task_id, task in self.tasks.items():  # each device's trained slice: the global one moved at random
            sent = FAMILY.extract(self.states["global"], task.spec, keys=FAMILY.trainable_keys(task.spec))
            self.clear[task.agent_id] = {key: value + torch.randn(value.shape, generator=generator)
                                         if value.is_floating_point() else value for key, value in sent.items()}
            update = Update(task_id, ROUND, task.agent_id, UpdateStatus.OK, None, 100, self.labels[task.agent_id],
                            {key: value.numpy() for key, value in self.clear[task.agent_id].items()}, {})
            message = Task(task_id, ROUND, task.agent_id, time.time() + 600, ModelRef("cnn", 10, 1, {}), task.spec.to_dict(), None,
                           {}, plan=task.plan, secure=True)
            self.devices[task.agent_id].advertise(message, update, 2, lambda _answer: None)

    def deliver(self, outgoing: list[tuple[str, Message]]) -> None:
        for agent, message in outgoing:
            self.devices[agent].take(wire(message))

    def take(self, kind: type) -> list[tuple[str, Message]]:
        """The devices' published messages of ``kind``, taken (by agent)."""
        taken = [(agent, message) for agent, messages in self.published.items() for message in messages
                 if isinstance(message, kind)]
        for agent in self.published:
            self.published[agent] = [message for message in self.published[agent] if not isinstance(message, kind)]
        return taken

    def run(self, crash_after_sharing: frozenset[str] = frozenset()) -> dict[str, dict[str, torch.Tensor]]:
        """The whole exchange; the devices in ``crash_after_sharing`` never mask (a process gone after sharing)."""
        for _, advert in self.take(SecureAdvert):
            assert self.exchange.advert(advert, 100) == []
        assert not self.exchange.waiting_for_adverts(set())
        self.deliver(self.exchange.rosters())
        for _, shares in self.take(SecureShares):
            assert self.exchange.shares(shares, 100) == []
        assert not self.exchange.waiting_for_shares(set())
        relays = self.exchange.relays()
        self.deliver([(agent, relay) for agent, relay in relays if agent not in crash_after_sharing])
        room = secure_room()
        room._exchanges[ROUND] = self.exchange
        for task in self.tasks.values():
            for update in self.sent[task.agent_id]:
                self.aggregate.add(room.unpack(wire(update), task))
        return self.aggregate.result()

    def unmask(self) -> dict[str, tuple[np.ndarray, np.ndarray]] | None:
        """What the room does once the round stopped collecting (`SecureRounds.unmask`), messages carried by hand."""
        self.deliver(self.exchange.requests())
        for _, reveal in self.take(SecureReveal):
            self.exchange.reveal(reveal, 100)
        return self.exchange.unmask()

    def plain(self, senders: set[str]) -> dict[str, dict[str, torch.Tensor]]:
        """What plain uniform masked aggregation makes of the senders' clear updates, where at least three hold a
        coordinate (the others keep their value)."""
        aggregate = RoundAggregate(self.states, lambda _result: 1.0, list(FAMILY.classifier_keys()))
        counts = RoundAggregate(self.states, lambda _result: 1.0, list(FAMILY.classifier_keys()))
        for task in self.tasks.values():
            if task.agent_id not in senders:
                continue
            index_map = FAMILY.index_map(task.spec)
            state = {key: value for key, value in self.clear[task.agent_id].items() if value.is_floating_point()}
            aggregate.add(TaskResult(task, task.spec, state, {key: index_map[key] for key in state}, 100,
                                     self.labels[task.agent_id]))
            counts.add(TaskResult(task, task.spec, {key: torch.ones_like(value) for key, value in state.items()},
                                  {key: index_map[key] for key in state}, 100, self.labels[task.agent_id]))
        merged, held = aggregate.result(), counts._aggregators["global"]
        return {"global": {key: torch.where(held.weights(key) >= MIN_HOLDERS, value, self.states["global"][key])
                           if value.is_floating_point() else value for key, value in merged["global"].items()}}


SPECS = {"d0": SubmodelSpec(), "d1": SubmodelSpec(), "d2": SubmodelSpec(width=0.5), "d3": SubmodelSpec(width=0.5),
         "d4": SubmodelSpec(width=0.5), "d5": SubmodelSpec(width=0.25)}


def assert_states_close(got: dict[str, dict[str, torch.Tensor]], want: dict[str, dict[str, torch.Tensor]]) -> None:
    for key, value in want["global"].items():
        if value.is_floating_point() and "running" not in key:  # (BN statistics are not sent: recomputed)
            torch.testing.assert_close(got["global"][key], value, rtol=1e-6, atol=1e-6, msg=key)


def test_the_unmasked_mean_is_the_plain_masked_mean_of_width_slices() -> None:
    fleet = Fleet(SPECS)
    got = fleet.run()
    assert_states_close(got, fleet.plain(set(SPECS)))
    assert fleet.exchange.record.sent == len(SPECS) and fleet.exchange.record.failure is None
    # conv1's channels 2 and 3 only the two full-width devices hold: fewer than three, so no sum of them is
    # unmasked (it would give each the other's values) and they keep their value; channels 0 and 1 (all six) move.
    old = fleet.states["global"]["conv1.weight"]
    assert torch.equal(got["global"]["conv1.weight"][2:], old[2:])
    assert not torch.equal(got["global"]["conv1.weight"][:2], old[:2])


def test_a_device_gone_after_sharing_is_unmasked_away_and_the_mean_is_the_others() -> None:
    fleet = Fleet({**SPECS, "d6": SubmodelSpec(width=0.25), "d7": SubmodelSpec(width=0.5)}, seed=2)
    got = fleet.run(crash_after_sharing=frozenset({"d7"}))
    record = fleet.exchange.record
    assert (record.shared, record.sent, record.failure) == (8, 7, None)
    assert_states_close(got, fleet.plain(set(SPECS) | {"d6"}))


def test_rows_of_classes_a_device_never_saw_are_left_out_under_masked_cross_entropy() -> None:
    labels = {"d0": [0, 1, 2], "d1": [0, 1, 2, 3], "d2": [0, 1, 2, 3], "d3": [1, 2, 3], "d4": [2, 3, 4],
              "d5": [0, 1, 2, 3, 4, 5]}
    fleet = Fleet(SPECS, labels, MASKED_CE, seed=3)
    got = fleet.run()
    # Plain aggregation leaves those rows out of each update too (`coordinator.aggregation.restrict_rows`).
    assert_states_close(got, fleet.plain(set(SPECS)))
    old, new = fleet.states["global"]["classifier.weight"], got["global"]["classifier.weight"]
    assert torch.equal(new[5:], old[5:])  # class 5 only d5 saw, 4 only d4 and d5, 6-9 none: not aggregated
    assert torch.equal(new[4], old[4]) and not torch.equal(new[2], old[2])  # class 2: all six


def test_fewer_than_three_devices_are_each_told_the_round_cannot_be_secure() -> None:
    fleet = Fleet({"d0": SubmodelSpec(), "d1": SubmodelSpec()})
    for _, advert in fleet.take(SecureAdvert):
        fleet.exchange.advert(advert, 100)
    refusals = fleet.exchange.rosters()
    assert {agent for agent, _ in refusals} == {"d0", "d1"} and all(isinstance(ack, Ack) for _, ack in refusals)
    fleet.deliver(refusals)
    for name in ("d0", "d1"):  # each answers its task failed, with the reason, and nothing in the clear
        [update] = fleet.sent[name]
        assert update.status is UpdateStatus.FAILED and update.weights == {}
        assert "secure aggregation needs at least 3" in (update.reason or "")
    assert fleet.aggregate.result()["global"] is fleet.states["global"]  # nothing aggregated
    assert "needs at least 3" in (fleet.exchange.record.failure or "")


def test_an_advert_after_the_rosters_and_an_update_sent_in_the_clear_are_refused() -> None:
    fleet = Fleet({"d0": SubmodelSpec(), "d1": SubmodelSpec(), "d2": SubmodelSpec(), "late": SubmodelSpec()})
    adverts = fleet.take(SecureAdvert)
    for agent, advert in adverts:
        if agent != "late":
            fleet.exchange.advert(advert, 100)
    fleet.deliver(fleet.exchange.rosters())
    [(agent, refusal)] = fleet.exchange.advert(next(advert for agent, advert in adverts if agent == "late"), 100)
    assert agent == "late" and isinstance(refusal, Ack) and "after round 3's rosters" in (refusal.reason or "")
    room = secure_room()
    room._exchanges[ROUND] = fleet.exchange
    task_id, task = next((task_id, task) for task_id, task in fleet.tasks.items() if task.agent_id == "d0")
    clear = Update(task_id, ROUND, "d0", UpdateStatus.OK, None, 100, list(range(10)),
                   {key: value.numpy() for key, value in fleet.clear["d0"].items() if value.is_floating_point()}, {})
    with pytest.raises(ValueError, match="not masked \\(uint64\\): under secure aggregation an update is never sent"):
        room.unpack(clear, task)
    late_id, late = next((task_id, task) for task_id, task in fleet.tasks.items() if task.agent_id == "late")
    with pytest.raises(ValueError, match="advertised no keys this round before its rosters went out"):
        room.unpack(replace(clear, task_id=late_id, agent_id="late"), late)
    room._exchanges.clear()  # a coordinator restarted mid-round
    with pytest.raises(ValueError, match="the coordinator restarted during the round"):
        room.unpack(clear, task)


def test_a_masked_slice_is_uncorrelated_with_the_values_under_it() -> None:
    fleet = Fleet({"d0": SubmodelSpec(), "d1": SubmodelSpec(), "d2": SubmodelSpec()}, seed=4)
    for _, advert in fleet.take(SecureAdvert):
        fleet.exchange.advert(advert, 100)
    fleet.deliver(fleet.exchange.rosters())
    for _, shares in fleet.take(SecureShares):
        fleet.exchange.shares(shares, 100)
    fleet.deliver(fleet.exchange.relays())
    [update] = fleet.sent["d0"]
    masked = np.concatenate([np.asarray(value).view(np.int64).astype(np.float64).ravel()
                             for value in update.weights.values()])
    clear = np.concatenate([fleet.clear["d0"][key].numpy().astype(np.float64).ravel() for key in update.weights])
    assert masked.size == clear.size and all(np.asarray(v).dtype == np.uint64 for v in update.weights.values())
    assert abs(np.corrcoef(masked, clear)[0, 1]) < 5 / math.sqrt(masked.size)


def test_an_advert_or_shares_resent_by_the_broker_are_taken_once_and_never_refused() -> None:
    fleet = Fleet({"d0": SubmodelSpec(), "d1": SubmodelSpec(), "d2": SubmodelSpec()})
    adverts = fleet.take(SecureAdvert)
    for _, advert in adverts:
        assert fleet.exchange.advert(advert, 100) == []
    fleet.deliver(fleet.exchange.rosters())
    assert all(fleet.exchange.advert(advert, 100) == [] for _, advert in adverts)  # after the rosters: the same
    shares = fleet.take(SecureShares)
    for _, bundle in shares:
        assert fleet.exchange.shares(bundle, 100) == []
    fleet.deliver(fleet.exchange.relays())
    assert all(fleet.exchange.shares(bundle, 100) == [] for _, bundle in shares)
    assert all(len(fleet.sent[name]) == 1 and fleet.sent[name][0].status is UpdateStatus.OK for name in fleet.sent)


def test_shares_for_only_some_neighbours_leave_that_device_out_and_the_round_goes_on() -> None:
    fleet = Fleet({f"d{index}": SubmodelSpec() for index in range(4)})
    for _, advert in fleet.take(SecureAdvert):
        fleet.exchange.advert(advert, 100)
    fleet.deliver(fleet.exchange.rosters())
    for agent, bundle in fleet.take(SecureShares):
        if agent == "d3":
            bundle = replace(bundle, sealed=dict(list(bundle.sealed.items())[:1]))
            [(told, refusal)] = fleet.exchange.shares(bundle, 100)
            assert told == "d3" and "sealed shares for 1 device(s), not for its 3 neighbours" in refusal.reason
        else:
            assert fleet.exchange.shares(bundle, 100) == []
    relays = fleet.exchange.relays()  # (d3 is not told again)
    assert sorted(agent for agent, _ in relays) == ["d0", "d1", "d2"] and fleet.exchange.record.failure is None


def test_a_round_that_closes_before_its_shares_are_in_tells_its_devices() -> None:
    fleet = Fleet({f"d{index}": SubmodelSpec() for index in range(3)})
    for _, advert in fleet.take(SecureAdvert):
        fleet.exchange.advert(advert, 100)
    fleet.deliver(fleet.exchange.rosters())
    fleet.take(SecureShares)  # (none of them reaches the coordinator before the round's deadline)
    told = fleet.exchange.requests()
    assert sorted(agent for agent, _ in told) == ["d0", "d1", "d2"] and all(isinstance(ack, Ack) for _, ack in told)
    assert fleet.exchange.record.failure == "round 3 closed before its shares were in"
    fleet.deliver(told)
    assert all(fleet.sent[name][0].status is UpdateStatus.FAILED for name in fleet.sent)


def test_an_advert_for_a_round_the_coordinator_runs_no_exchange_for_is_refused() -> None:
    link = mock.Mock()
    config = CoordinatorConfig(federation=FEDERATION, secure_aggregation=SecureAggregationConfig(enabled=True))
    room = SecureRounds(config, link, Topics(FEDERATION), FAMILY, 10, LOG)
    advert = SecureAdvert("r9-d0", 9, "d0", b"k" * 32, b"m" * 32, None, [0])
    room.on_message("d0", encode(advert))
    [(topic, payload), _] = link.publish.call_args
    refusal = decode(payload)
    assert topic == Topics(FEDERATION).agent_ack("d0") and isinstance(refusal, Ack)
    assert "round 9 has no exchange here" in (refusal.reason or "")


def test_a_device_restarted_before_the_rosters_advertises_anew_and_the_round_goes_on_with_its_new_keys() -> None:
    fleet = Fleet({f"d{index}": SubmodelSpec() for index in range(3)})
    adverts = dict(fleet.take(SecureAdvert))
    for advert in adverts.values():
        fleet.exchange.advert(advert, 100)
    # d0's process restarted: its task trained again, fresh keys (its first secrets are gone with the process)
    task_id, task = next((task_id, task) for task_id, task in fleet.tasks.items() if task.agent_id == "d0")
    fleet.devices["d0"] = SecureTasks("d0", FEDERATION, lambda message: fleet.published["d0"].append(wire(message)),
                                      lambda update, *, version, ask: fleet.sent["d0"].append(update), LOG)
    message = Task(task_id, ROUND, "d0", time.time() + 600, ModelRef("cnn", 10, 1, {}), task.spec.to_dict(), None, {},
                   plan=task.plan, secure=True)
    fleet.devices["d0"].advertise(message, Update(task_id, ROUND, "d0", UpdateStatus.OK, None, 100, list(range(10)),
                                                  {k: v.numpy() for k, v in fleet.clear["d0"].items()}, {}),
                                  2, lambda _answer: None)
    [(_, fresh)] = fleet.take(SecureAdvert)
    assert fresh.cipher != adverts["d0"].cipher and fleet.exchange.advert(fresh, 100) == []
    assert_states_close(fleet.run(), fleet.plain(set(fleet.devices)))
    # After the rosters, keys that changed again are refused (its neighbours hold the ones it advertised)
    late = replace(fresh, cipher=b"x" * 32)
    [(agent, refusal)] = fleet.exchange.advert(late, 100)
    assert agent == "d0" and "keys changed after the rosters went out" in (refusal.reason or "")
