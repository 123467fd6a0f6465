"""UpdateIntake on its own: an update's chunks put back together (in any order, per agent) and decoded into an
:class:`Arrival`, handed to the round in progress and acked (stored first; refused with the round's reason; held
back when deferred or when it could not be stored), examined and unpacked against its task, and the module's
helpers. The link is a fake that records what is published; no broker."""

from __future__ import annotations

import hashlib
import random
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from common.logs import get_logger
from coordinator import intake as intake_module
from coordinator.config import CoordinatorConfig, ModelConfig, ScreeningConfig
from coordinator.in_flight import InFlight
from coordinator.intake import Arrival, UpdateIntake, _float_tensor, single_threaded_torch, spec_or_none
from coordinator.journal import RoundJournal
from coordinator.metrics import TaskStatus
from coordinator.round import DispatchedTask, Round, Verdict
from coordinator.strategies import StrategyContext, TaskPlan, make_strategy
from coordinator.strategies.leveled import LevelStrategy
from models import SubmodelSpec
from protocol import Ack, ModelRef, ProtocolError, Topics, Update, UpdateStatus, decode, encode, split_payload

HALF = SubmodelSpec.uniform(0.5)
FEDERATION = "lab"
NUM_CLASSES = 10


class RecordingLink:
    """What the intake asks of the MQTT link: ``publish``. Keeps every message, and what ``look()`` said at the
    moment it was published (to see what was stored before an ack went out)."""

    def __init__(self) -> None:
        self.published: list[tuple[str, bytes]] = []
        self.look: Callable[[], object] | None = None
        self.seen: list[object] = []

    def publish(self, topic: str, payload: bytes, *, qos: int = 1, retain: bool = False) -> bool:
        self.published.append((topic, bytes(payload)))
        if self.look is not None:
            self.seen.append(self.look())
        return True

    def acks(self) -> list[tuple[str, Ack]]:
        decoded = [(topic, decode(payload)) for topic, payload in self.published]
        assert all(isinstance(message, Ack) for _, message in decoded)
        return decoded  # type: ignore[return-value]


class Bench:
    """An intake over a two-level HeteroFL (widths 1 and 0.5 of a small CNN), its journal in a temporary folder,
    recording what it publishes and what its callbacks are told."""

    def __init__(self, strategy: LevelStrategy, directory: Path) -> None:
        self.strategy = strategy
        self.family = strategy.family
        self.in_flight = InFlight(strategy.initial_states(0))
        self.journal = RoundJournal(directory, ModelRef("cnn", NUM_CLASSES, 1, {"hidden": [4, 8]}))
        self.link = RecordingLink()
        self.topics = Topics(FEDERATION)
        self.accepted: list[Round] = []
        self.receipts: list[tuple[str, int, int | None]] = []
        self.intake = UpdateIntake(self.family, strategy, self.journal, NUM_CLASSES, self.in_flight,
                                   self.link, self.topics, get_logger("coordinator"),  # type: ignore[arg-type]
                                   on_accepted=self.accepted.append,
                                   on_receipt=lambda verdict, size, answers: self.receipts.append(
                                       (verdict, size, answers)))

    def task(self, level: str = "b", agent: str = "dev") -> TaskPlan:
        chosen = next(candidate for candidate in self.strategy.levels if candidate.name == level)
        return TaskPlan(agent, chosen.name, chosen.spec, self.strategy.level_plan(chosen, 1))

    def open_round(self, number: int, tasks: dict[str, TaskPlan]) -> Round:
        """A round of ``tasks``, journaled (as the planner does before it opens one) and in progress."""
        self.journal.begin(number, time.time() + 60, tasks, [])
        current = Round(number, tasks, [], time.time() + 60, self.strategy.begin_aggregate(self.in_flight.states),
                        ScreeningConfig(enabled=False), self.intake)
        self.in_flight.install(current)
        return current

    def update(self, spec: SubmodelSpec | None = HALF, *, task_id: str = "r1-dev-1", agent: str = "dev",
               round_number: int = 1, status: str = "ok", fill: float | None = None, seed: int = 0,
               labels: tuple[int, ...] = (0, 1)) -> Update:
        """An update of ``spec`` (None: it names no trained spec and carries HALF's tensors), every trainable
        tensor random (``seed``) or ``fill``."""
        of = spec or HALF
        shapes = self.family.shapes(of, track_bn_stats=False)
        rng = np.random.default_rng(seed)
        weights = {key: (np.full(shapes[key], fill, np.float32) if fill is not None
                         else rng.standard_normal(shapes[key]).astype(np.float32))
                   for key in self.family.trainable_keys(of)} if status in ("ok", "adapted") else {}
        return Update(task_id, round_number, agent, UpdateStatus(status), None if spec is None else spec.to_dict(), 12,
                      list(labels), weights, {"loss": 0.5}, None if status in ("ok", "adapted") else "no memory")

    def arrive(self, update: Update, transfer: str | None = None, *, agent: str | None = None) -> Arrival:
        """``update`` through :meth:`UpdateIntake.on_chunk`, in order, as ``agent`` (default: its own) sends it."""
        arrival = None
        for chunk in split_payload(encode(update), transfer or f"{update.task_id}.1", chunk_size=200):
            assert arrival is None, "whole before its last chunk"
            arrival = self.intake.on_chunk(agent or update.agent_id, chunk)
        assert arrival is not None
        return arrival


@pytest.fixture
def bench(make_context: Callable[..., StrategyContext], tmp_path: Path) -> Bench:
    config = CoordinatorConfig(model=ModelConfig(family="cnn", options={"hidden": [4, 8]}), levels=[1.0, 0.5],
                               screening=ScreeningConfig(enabled=False))
    strategy = make_strategy("heterofl", make_context(config))
    assert isinstance(strategy, LevelStrategy)
    return Bench(strategy, tmp_path / "journal")


def assert_same_weights(got: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> None:
    assert set(got) == set(expected)
    for key, value in expected.items():
        assert got[key].dtype == value.dtype and np.array_equal(got[key], value), key


# ---------------------------------------------------------------------------------------------- on_chunk
@pytest.mark.parametrize("version", [1, 2])
def test_a_chunked_update_reassembled_in_any_order_decodes_to_the_same_tensors(bench: Bench, version: int) -> None:
    update = bench.update(seed=3)
    payload = encode(update, version=version)
    count = len(split_payload(payload, "probe", chunk_size=128, version=version))
    assert count > 4
    orders = {"forward": list(range(count)), "reversed": list(range(count))[::-1],
              "shuffled": random.Random(7).sample(range(count), count)}
    for name, order in orders.items():  # each a transfer of its own
        chunks = split_payload(payload, f"r1-dev-1.{name}", chunk_size=128, version=version)
        fed = [bench.intake.on_chunk("dev", chunks[seq]) for seq in order]
        assert fed[:-1] == [None] * (count - 1)  # nothing until the transfer is whole
        arrival = fed[-1]
        assert isinstance(arrival, Arrival)
        assert bytes(arrival.payload) == payload and arrival.digest == hashlib.sha256(payload).hexdigest()
        assert (arrival.update.task_id, arrival.update.round, arrival.update.agent_id) == ("r1-dev-1", 1, "dev")
        assert_same_weights(arrival.update.weights, update.weights)


def test_the_same_transfer_id_from_two_agents_is_two_transfers(bench: Bench) -> None:
    first, second = bench.update(agent="a", task_id="r1-a-1", seed=1), bench.update(agent="b", task_id="r1-b-1",
                                                                                    seed=2)
    a_chunks = split_payload(encode(first), "same.1", chunk_size=200)
    b_chunks = split_payload(encode(second), "same.1", chunk_size=200)
    arrivals = {}
    for a_chunk, b_chunk in zip(a_chunks, b_chunks):  # interleaved, one transfer id
        for agent, chunk in (("a", a_chunk), ("b", b_chunk)):
            if (arrival := bench.intake.on_chunk(agent, chunk)) is not None:
                arrivals[agent] = arrival
    assert set(arrivals) == {"a", "b"}
    assert_same_weights(arrivals["a"].update.weights, first.weights)
    assert_same_weights(arrivals["b"].update.weights, second.weights)


def test_an_update_on_another_agents_topic_or_a_message_that_is_no_update_is_refused(bench: Bench) -> None:
    with pytest.raises(ProtocolError, match="update from agent 'dev' published on the topic of 'mallory'"):
        bench.arrive(bench.update(), agent="mallory")
    ack = split_payload(encode(Ack("r1-dev-1", 1, "dev")), "not-an-update.1")
    with pytest.raises(ProtocolError, match="expected Update message, got 'ack'"):
        bench.intake.on_chunk("dev", ack[0])
    assert bench.link.published == []  # refused: never answered here


# ---------------------------------------------------------------------------------------------- take
def test_a_valid_update_is_journaled_before_its_ack_and_folded_into_the_round(bench: Bench) -> None:
    current = bench.open_round(1, {"r1-dev-1": bench.task(), "r1-dev-2": bench.task()})
    arrival = bench.arrive(bench.update())
    bench.link.look = lambda: bench.journal.read_update("r1-dev-1").task_id  # raises while not stored
    receipt = bench.intake.take(arrival, current)
    assert receipt is not None and receipt.verdict is Verdict.ACCEPTED and receipt.refusal is None
    assert bench.link.acks() == [(bench.topics.agent_ack("dev"), Ack("r1-dev-1", 1, "dev"))]
    assert bench.link.seen == ["r1-dev-1"]  # on disk when the ack went out
    assert_same_weights(bench.journal.read_update("r1-dev-1").weights, arrival.update.weights)
    assert current.answers["r1-dev-1"].aggregated and current.answers["r1-dev-1"].digest == arrival.digest
    assert bench.accepted == [current]
    assert bench.receipts == [("accepted", len(arrival.payload), 1)]


def test_with_no_round_in_progress_an_update_is_refused_unless_the_next_round_carries_it(bench: Bench) -> None:
    unknown = bench.arrive(bench.update(task_id="r1-dev-9"))
    receipt = bench.intake.take(unknown, None)
    reason = "unknown task 'r1-dev-9' of round 1: no round is in progress"
    assert receipt is not None and receipt.verdict is Verdict.UNKNOWN and receipt.refusal == reason
    assert bench.link.acks() == [(bench.topics.agent_ack("dev"), Ack("r1-dev-9", 1, "dev", reason))]
    assert bench.receipts == [("unknown", len(unknown.payload), None)]
    bench.in_flight.carry([DispatchedTask("r1-dev-1", 1, bench.task(), time.time() + 60)],
                          {1: bench.in_flight.states})
    carried = bench.arrive(bench.update(task_id="r1-dev-1"))
    receipt = bench.intake.take(carried, None)
    assert receipt is not None and receipt.verdict is Verdict.DEFERRED  # for the caller to hold
    assert len(bench.link.published) == 1 and len(bench.receipts) == 1  # not answered, not counted
    with pytest.raises(ValueError, match="holds no update"):
        bench.journal.read_update("r1-dev-1")
    assert bench.accepted == []


def test_an_update_for_a_task_not_in_the_round_is_refused_with_the_rounds_reason(bench: Bench) -> None:
    current = bench.open_round(2, {"r2-dev-1": bench.task()})
    cases = [bench.update(task_id="r1-dev-1", round_number=1),  # an earlier round's
             bench.update(task_id="r2-dev-1", round_number=1),  # the task's id, another round
             bench.update(task_id="r2-dev-1", round_number=2, agent="other")]  # another agent's
    for number, update in enumerate(cases):
        receipt = bench.intake.take(bench.arrive(update, f"t.{number}"), current)
        assert receipt is not None and receipt.verdict is Verdict.UNKNOWN
        reason = f"unknown task {update.task_id!r} of round {update.round}: round 2 is in progress"
        assert bench.link.acks()[-1] == (bench.topics.agent_ack(update.agent_id),
                                         Ack(update.task_id, update.round, update.agent_id, reason))
    assert current.answers == {} and bench.accepted == []
    assert [verdict for verdict, _, answers in bench.receipts] == ["unknown"] * 3
    assert {answers for _, _, answers in bench.receipts} == {0}


def test_the_same_update_again_is_acked_again_and_another_for_its_task_is_refused(bench: Bench) -> None:
    current = bench.open_round(1, {"r1-dev-1": bench.task()})
    first = bench.update(fill=0.1)
    assert bench.intake.take(bench.arrive(first, "a.1"), current).verdict is Verdict.ACCEPTED  # type: ignore[union-attr]
    again = bench.intake.take(bench.arrive(first, "a.2"), current)
    assert again is not None and again.verdict is Verdict.DUPLICATE and again.refusal is None
    other = bench.intake.take(bench.arrive(bench.update(fill=0.2), "a.3"), current)
    assert other is not None and other.verdict is Verdict.CONFLICT
    acks = [ack for _, ack in bench.link.acks()]
    assert acks[:2] == [Ack("r1-dev-1", 1, "dev")] * 2
    assert (acks[2].reason or "").startswith("another update for task 'r1-dev-1' arrived first and is the one kept")
    assert bench.accepted == [current]  # only the first was new
    assert_same_weights(bench.journal.read_update("r1-dev-1").weights, first.weights)  # the first one kept


def test_an_update_that_cannot_be_journaled_is_not_acked_and_can_be_sent_again(bench: Bench,
                                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    current = bench.open_round(1, {"r1-dev-1": bench.task()})
    arrival = bench.arrive(bench.update())

    def disk_full(update: Update, payload: object) -> None:
        raise OSError("No space left on device")

    monkeypatch.setattr(bench.journal, "store", disk_full)
    assert bench.intake.take(arrival, current) is None
    assert bench.link.published == [] and bench.receipts == [] and current.answers == {}
    monkeypatch.undo()
    receipt = bench.intake.take(bench.arrive(bench.update(), "r1-dev-1.2"), current)  # the agent sends it again
    assert receipt is not None and receipt.verdict is Verdict.ACCEPTED and receipt.refusal is None


def test_an_invalid_update_is_acked_with_why_it_is_rejected_and_never_stored(bench: Bench) -> None:
    current = bench.open_round(1, {"r1-dev-1": bench.task()})
    receipt = bench.intake.take(bench.arrive(bench.update(SubmodelSpec.full())), current)
    assert receipt is not None and receipt.verdict is Verdict.ACCEPTED  # an answer to its task: not asked again
    assert receipt.refusal == "update rejected: agent trained width=1, which is not inside the width=0.5 sent"
    assert bench.link.acks()[-1][1].reason == receipt.refusal
    assert not current.answers["r1-dev-1"].aggregated
    with pytest.raises(ValueError, match="holds no update"):
        bench.journal.read_update("r1-dev-1")


# ---------------------------------------------------------------------------------------------- examine, unpack
def test_examine_records_a_decline_with_what_was_sent_and_no_result(bench: Bench) -> None:
    task = bench.task()
    declined = bench.update(status="declined")
    declined.spec_trained = {"colour": "red"}  # what it tried, malformed
    examined = bench.intake.examine(declined, task)
    assert examined.result is None and examined.refusal is None
    record = examined.record
    assert record.status == TaskStatus.DECLINED and record.reason == "no memory"
    assert record.spec_sent == HALF.describe() and record.params_sent == bench.family.param_count(HALF)
    assert record.spec_trained == "(malformed spec)" and record.level_trained is None


def test_examine_names_the_level_an_adapted_update_trained_or_rejects_an_invalid_one(bench: Bench) -> None:
    top = bench.task("a")
    examined = bench.intake.examine(bench.update(HALF, status="adapted"), top)
    assert examined.result is not None and examined.refusal is None and examined.result.spec == HALF
    record = examined.record
    assert (record.status, record.level, record.level_trained) == (TaskStatus.ADAPTED, "a", "b")
    assert record.spec_trained == HALF.describe() and record.params_returned == bench.family.param_count(HALF)
    assert record.params_sent == bench.family.param_count(SubmodelSpec.full()) > record.params_returned
    missing = bench.update(HALF)
    del missing.weights["conv1.bias"]
    rejected = bench.intake.examine(missing, bench.task())
    assert rejected.result is None and rejected.record.status == TaskStatus.REJECTED
    assert rejected.refusal == f"update rejected: {rejected.record.reason}"
    assert "missing ['conv1.bias']" in (rejected.record.reason or "")


def test_unpack_gives_float32_views_of_the_arrival_and_one_index_map_per_spec(bench: Bench) -> None:
    arrival = bench.arrive(bench.update(seed=5, labels=(0, 3, NUM_CLASSES, 99)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "not writable" warning from a read-only view
        result = bench.intake.unpack(arrival.update, bench.task())
    assert result.spec == HALF and result.labels == [0, 3]  # labels the dataset does not have are dropped
    assert set(result.state) == set(result.index_map) == set(bench.family.trainable_keys(HALF))
    family_map = bench.family.index_map(HALF)
    for key, tensor in result.state.items():
        assert tensor.dtype == torch.float32
        assert tuple(tensor.shape) == tuple(len(index) for index in result.index_map[key])
        assert all(torch.equal(a, b) for a, b in zip(result.index_map[key], family_map[key]))
        assert np.array_equal(tensor.numpy(), arrival.update.weights[key])
        assert np.shares_memory(tensor.numpy(), arrival.update.weights[key])  # not copied
    again = bench.intake.unpack(bench.update(seed=6), bench.task())
    assert all(again.index_map[key] is result.index_map[key] for key in result.index_map)  # made once per spec


def test_a_rolled_tasks_update_sits_where_the_task_says_not_where_the_agent_says(bench: Bench) -> None:
    rolled = HALF.rolled(1)
    task = TaskPlan("dev", "b", rolled, bench.task().plan)
    result = bench.intake.unpack(bench.update(HALF), task)  # the agent trained the unrolled sub-model
    assert result.spec == rolled
    assert torch.equal(result.index_map["conv1.weight"][0], bench.family.index_map(rolled)["conv1.weight"][0])
    assert not torch.equal(result.index_map["conv1.weight"][0], bench.family.index_map(HALF)["conv1.weight"][0])
    assert bench.intake.unpack(bench.update(None), task).spec == rolled  # no spec named: the task's
    assert bench.intake.level_of(rolled) == bench.intake.level_of(HALF) == "b"
    assert bench.intake.level_of(SubmodelSpec.full()) == "a"
    assert bench.intake.level_of(SubmodelSpec.uniform(0.25)) is None


# ---------------------------------------------------------------------------------------------- module helpers
def test_spec_or_none_reads_a_spec_and_answers_none_for_no_spec_or_a_malformed_one() -> None:
    assert spec_or_none({"width": 0.5}) == HALF
    assert spec_or_none({"width": 0.5, "roll": 2}) == HALF.rolled(2)
    assert spec_or_none(None) is None
    assert spec_or_none({"colour": "red"}) is None
    assert spec_or_none({"width": "wide"}) is None


def test_float_tensor_shares_a_float32_arrays_memory_and_converts_any_other() -> None:
    frozen = np.arange(6, dtype=np.float32).reshape(2, 3)
    frozen.flags.writeable = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        shared = _float_tensor(frozen)
    assert shared.shape == (2, 3) and np.shares_memory(shared.numpy(), frozen)
    doubles = np.linspace(0, 1, 4)
    converted = _float_tensor(doubles)
    assert converted.dtype == torch.float32 and not np.shares_memory(converted.numpy(), doubles)
    torch.testing.assert_close(converted, torch.tensor(doubles, dtype=torch.float32))
    assert _float_tensor(np.array(2.5, dtype=np.float32)).shape == ()  # a 0-d shape kept


def test_single_threaded_torch_sets_one_thread_once_per_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(intake_module.torch, "set_num_threads", calls.append)

    def twice() -> None:
        single_threaded_torch()
        single_threaded_torch()

    for _ in range(2):  # two message threads, one after the other
        thread = threading.Thread(target=twice)
        thread.start()
        thread.join()
    assert calls == [1, 1]
