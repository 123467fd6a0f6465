"""Dispatcher on its own: task ids, the training seed of a run, round and agent, a task cut from its round's states
and sent in chunks that an agent puts back together, a round's tasks sent (fresh ones, unanswered ones again to an
agent back online, carried ones again), the pacing of chunks against the broker's window, and what an agent of an
older protocol revision is sent (its version's layout, no field it cannot read). The link is a fake that records
what is published and answers the waits for room; no broker."""

from __future__ import annotations

import functools
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import pytest
import structlog
import torch

from common.logs import get_logger
from coordinator import dispatch as dispatch_module
from coordinator.aggregation import RoundAggregate
from coordinator.config import ScreeningConfig
from coordinator.dispatch import DISPATCH_WAIT_S, DISPATCH_WINDOW_BYTES, Dispatcher
from coordinator.in_flight import InFlight
from coordinator.metrics import TaskRecord, TaskStatus
from coordinator.registry import AgentRecord, FleetRegistry
from coordinator.round import DispatchedTask, Examined, Round
from coordinator.strategies import TaskPlan
from coordinator.strategies.base import State
from models import SubmodelSpec, get_family
from protocol import (
    HEAD_ALONE_REVISION,
    ORDERED_DROPOUT_REVISION,
    PROTOCOL_REVISION,
    PROTOCOL_VERSION,
    UPLOAD_GRANT_REVISION,
    Adaptation,
    AgentStatus,
    Candidate,
    LossTerm,
    ModelRef,
    Reassembler,
    Task,
    Topics,
    TrainingPlan,
    Update,
    decode,
    iter_chunks,
    payload_version,
)
from protocol.chunking import CHUNK_SIZE, parse_chunk

HALF = SubmodelSpec.uniform(0.5)
FAMILY = get_family("cnn", 10, 1, hidden=[4, 8])
MODEL = ModelRef("cnn", 10, 1, {"hidden": [4, 8]})
TOPICS = Topics("lab")
#: What a task is trained with: ordered dropout (FjORD's widths and self-distillation) on top of cross-entropy.
DROPOUT_PLAN = TrainingPlan(loss=(LossTerm.ce(), LossTerm.width_kd()), widths=(0.5, 0.25))


class WindowLink:
    """What the dispatcher asks of the MQTT link: ``publish`` (recorded), ``bytes_in_flight`` (set by the test) and
    ``wait_for_room`` (answered with ``room`` at once, each call recorded)."""

    def __init__(self, room: bool = True) -> None:
        self.published: list[tuple[str, bytes]] = []
        self.room = room
        self.waits: list[tuple[int, float]] = []
        self.bytes_in_flight = 0

    def publish(self, topic: str, payload: bytes, *, qos: int = 1, retain: bool = False) -> bool:
        self.published.append((topic, bytes(payload)))
        return True

    def wait_for_room(self, limit: int, timeout: float) -> bool:
        self.waits.append((limit, timeout))
        return self.room


@dataclass
class Received:
    """One task as its agent puts it back together: on its topic, the round its chunks declare, their version."""

    topic: str
    task: Task
    chunk_round: int | None
    version: int
    chunks: int


def received(link: WindowLink) -> dict[str, Received]:
    """Task id -> the task published through ``link``, its chunks reassembled as an agent does."""
    reassembler = Reassembler()
    counted: dict[str, int] = {}
    out = {}
    for topic, chunk in link.published:
        header = parse_chunk(chunk, CHUNK_SIZE)
        counted[header.transfer] = counted.get(header.transfer, 0) + 1
        whole = reassembler.feed_transfer(chunk, source=topic)
        if whole is not None:
            assert payload_version(whole.payload) == whole.version
            task = decode(whole.payload, expected=Task)
            assert isinstance(task, Task) and task.task_id == header.transfer
            out[task.task_id] = Received(topic, task, header.round, whole.version, counted[header.transfer])
    return out


def states(value: float | None = None) -> dict[str, State]:
    """The global model's states: seeded random weights, or every tensor ``value``."""
    torch.manual_seed(0)
    state = FAMILY.build(SubmodelSpec.full()).state_dict()
    if value is not None:
        state = {key: torch.full_like(tensor, value) for key, tensor in state.items()}
    return {"global": state}


class Declines:
    """The round's intake for updates that only decline (what :meth:`Round.receive` asks of one)."""

    def examine(self, update: Update, task: TaskPlan) -> Examined:
        return Examined(TaskRecord(update.agent_id, task.level, TaskStatus.answered(update.status),
                                   task.spec.describe()))


def declined(task_id: str, agent: str, round_number: int) -> Update:
    return Update(task_id, round_number, agent, "declined", None, 0, [], {}, {}, "no memory")  # type: ignore[arg-type]


def plan_for(agent: str, plan: TrainingPlan | None = None, adaptation: Adaptation | None = None) -> TaskPlan:
    return TaskPlan(agent, "b", HALF, plan or TrainingPlan(), adaptation=adaptation)


class Bench:
    """A dispatcher of a small CNN's tasks over a :class:`WindowLink`, and the fleet it reads revisions from."""

    def __init__(self, make_agent: Callable[..., AgentRecord], *, seed: int = 7, grants_uploads: bool = False,
                 room: bool = True) -> None:
        self.make_agent = make_agent
        self.link = WindowLink(room)
        self.registry = FleetRegistry()
        self.in_flight = InFlight(states())
        self.dispatcher = Dispatcher(self.link, TOPICS, self.registry, FAMILY, MODEL,  # type: ignore[arg-type]
                                     self.in_flight, seed, get_logger("coordinator"), grants_uploads=grants_uploads)

    def online(self, agent: str, revision: int) -> None:
        """``agent`` online, announcing protocol ``revision``."""
        announced = self.make_agent(agent, 10**6).capabilities
        assert announced is not None
        capabilities = replace(announced, protocol_version=revision)
        self.registry.on_status(AgentStatus(agent, "online", capabilities, time.time()))

    def round(self, number: int, tasks: dict[str, TaskPlan], carried: tuple[DispatchedTask, ...] = ()) -> Round:
        current = Round(number, tasks, [], time.time() + 60, RoundAggregate(self.in_flight.states, lambda _: 1.0, []),
                        ScreeningConfig(enabled=False), Declines(), carried=carried)  # type: ignore[arg-type]
        current.open()
        return current


@pytest.fixture
def bench(make_agent: Callable[..., AgentRecord]) -> Bench:
    return Bench(make_agent)


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tasks go out in chunks of 256 data bytes (a half-width task: several)."""
    monkeypatch.setattr(dispatch_module, "iter_chunks", functools.partial(iter_chunks, chunk_size=256))


def test_a_task_id_names_its_round_and_agent_and_is_new_each_time() -> None:
    ids = {Dispatcher.task_id(3, "dev-1") for _ in range(20)}
    assert len(ids) == 20
    assert all(re.fullmatch(r"r3-dev-1-[0-9a-f]{8}", task_id) for task_id in ids)
    list(iter_chunks(b"x", next(iter(ids))))  # usable as a transfer id


def test_the_training_seed_is_the_runs_rounds_and_agents_and_nothing_else(make_agent: Callable[..., AgentRecord]
                                                                          ) -> None:
    one, same, other_run = Bench(make_agent), Bench(make_agent), Bench(make_agent, seed=8)
    seeded = one.dispatcher.seeded(DROPOUT_PLAN, 2, "a")
    assert replace(seeded, seed=DROPOUT_PLAN.seed) == DROPOUT_PLAN  # only the seed changes
    assert 0 <= seeded.seed < 2**32
    assert same.dispatcher.seeded(TrainingPlan(), 2, "a").seed == seeded.seed  # a restarted run: the same seeds
    others = {one.dispatcher.seeded(DROPOUT_PLAN, 3, "a").seed, one.dispatcher.seeded(DROPOUT_PLAN, 2, "b").seed,
              other_run.dispatcher.seeded(DROPOUT_PLAN, 2, "a").seed}
    assert seeded.seed not in others and len(others) == 3


def test_a_sent_task_reassembles_into_its_spec_plan_and_the_weights_cut_from_the_state(bench: Bench,
                                                                                         small_chunks: None) -> None:
    bench.online("dev", PROTOCOL_REVISION)
    planned = plan_for("dev", DROPOUT_PLAN)
    deadline = time.time() + 60
    sent = bench.dispatcher.send(1, "r1-dev-abc", planned, deadline)
    assert sent == sum(len(chunk) for _, chunk in bench.link.published)
    got = received(bench.link)["r1-dev-abc"]
    assert got.topic == TOPICS.agent_task("dev") and got.chunks > 3 and got.chunk_round == 1
    assert got.version == PROTOCOL_VERSION
    task = got.task
    assert (task.round, task.agent_id, task.deadline, task.model) == (1, "dev", deadline, MODEL)
    assert task.spec == HALF.to_dict() and task.plan == bench.dispatcher.seeded(DROPOUT_PLAN, 1, "dev")
    assert not task.ask_to_upload
    expected = FAMILY.extract(bench.in_flight.states["global"], HALF, keys=FAMILY.state_keys(HALF))
    assert set(task.weights) == set(expected)
    for key, tensor in expected.items():
        assert np.array_equal(task.weights[key], tensor.numpy()), key


def test_a_task_is_cut_from_the_states_of_its_own_round(bench: Bench) -> None:
    bench.in_flight.carry([], {1: states(1.0)})  # round 1's tasks still train; the model has moved on
    bench.in_flight.states = states(2.0)
    bench.dispatcher.send(1, "r1-dev-a", plan_for("dev"), time.time() + 60)
    bench.dispatcher.send(2, "r2-dev-a", plan_for("dev"), time.time() + 60)
    tasks = received(bench.link)
    assert all(np.all(weights == 1.0) for weights in tasks["r1-dev-a"].task.weights.values())
    assert all(np.all(weights == 2.0) for weights in tasks["r2-dev-a"].task.weights.values())


def test_a_rolled_window_goes_out_as_the_sub_model_itself(bench: Bench) -> None:
    rolled = HALF.rolled(1)
    bench.dispatcher.send(1, "r1-dev-a", TaskPlan("dev", "b", rolled, TrainingPlan()), time.time() + 60)
    task = received(bench.link)["r1-dev-a"].task
    assert task.spec == HALF.to_dict()  # the agent trains it as any other
    expected = FAMILY.extract(bench.in_flight.states["global"], rolled, keys=FAMILY.state_keys(rolled))
    assert np.array_equal(task.weights["conv1.weight"], expected["conv1.weight"].numpy())
    unrolled = FAMILY.extract(bench.in_flight.states["global"], HALF, keys=["conv1.weight"])
    assert not np.array_equal(task.weights["conv1.weight"], unrolled["conv1.weight"].numpy())  # where it sits


def test_each_agent_gets_the_newest_protocol_version_both_sides_read(bench: Bench) -> None:
    for agent, revision in (("v1", 1), ("v2", 2), ("latest", PROTOCOL_REVISION)):
        bench.online(agent, revision)
    assert [bench.dispatcher.protocol_version(agent) for agent in ("v1", "v2", "latest", "unheard")] == \
        [1, 2, PROTOCOL_VERSION, 1]
    assert bench.dispatcher.revision("latest") == PROTOCOL_REVISION and bench.dispatcher.revision("unheard") == 1
    for agent in ("v1", "latest"):
        bench.dispatcher.send(1, f"r1-{agent}-a", plan_for(agent), time.time() + 60)
    tasks = received(bench.link)
    assert tasks["r1-v1-a"].version == 1 and tasks["r1-latest-a"].version == PROTOCOL_VERSION
    assert set(tasks["r1-v1-a"].task.weights) == set(tasks["r1-latest-a"].task.weights)  # the same task either way
    for key, weights in tasks["r1-v1-a"].task.weights.items():
        assert np.array_equal(weights, tasks["r1-latest-a"].task.weights[key])


def test_an_agent_before_ordered_dropout_is_sent_the_plan_without_it_and_the_run_warned(bench: Bench) -> None:
    bench.online("old", ORDERED_DROPOUT_REVISION - 1)
    bench.online("new", ORDERED_DROPOUT_REVISION)
    ladder = Adaptation("ladder", [Candidate({"width": 0.25}, DROPOUT_PLAN)])
    with structlog.testing.capture_logs() as logs:
        for agent in ("old", "new"):
            bench.dispatcher.send(1, f"r1-{agent}-a", plan_for(agent, DROPOUT_PLAN, ladder), time.time() + 60)
    tasks = {agent: received(bench.link)[f"r1-{agent}-a"].task for agent in ("old", "new")}
    old_plan, new_plan = tasks["old"].plan, tasks["new"].plan
    assert old_plan is not None and new_plan is not None
    assert new_plan.ordered_dropout and new_plan == bench.dispatcher.seeded(DROPOUT_PLAN, 1, "new")
    assert not old_plan.ordered_dropout and old_plan.widths == ()
    assert old_plan == bench.dispatcher.seeded(DROPOUT_PLAN, 1, "old").without_ordered_dropout()
    old_ladder = tasks["old"].adaptation
    assert old_ladder is not None
    assert [candidate.plan for candidate in old_ladder.candidates] == [DROPOUT_PLAN.without_ordered_dropout()]
    assert tasks["new"].adaptation == ladder
    warned = [(entry["agent"], entry["revision"]) for entry in logs if entry["event"] == "ordered_dropout_not_read"]
    assert warned == [("old", ORDERED_DROPOUT_REVISION - 1)]


def test_the_head_alone_and_the_ask_to_upload_go_only_to_agents_whose_revision_reads_them(
        make_agent: Callable[..., AgentRecord]) -> None:
    granting = Bench(make_agent, grants_uploads=True)
    for agent, revision in (("r2", HEAD_ALONE_REVISION - 1), ("r3", HEAD_ALONE_REVISION),
                            ("r5", UPLOAD_GRANT_REVISION - 1), ("r6", UPLOAD_GRANT_REVISION)):
        granting.online(agent, revision)
    depthwise = Adaptation("depthwise", min_micro_batch=4, head_alone=True)
    assert granting.dispatcher.readable(depthwise, "r3") is depthwise  # read as it is: the same object
    assert granting.dispatcher.readable(depthwise, "r2") == replace(depthwise, head_alone=False)
    assert granting.dispatcher.readable(None, "r2") is None
    for agent in ("r2", "r3", "r5", "r6"):
        granting.dispatcher.send(1, f"r1-{agent}-a", plan_for(agent, adaptation=depthwise), time.time() + 60)
    tasks = {task_id.split("-")[1]: got.task for task_id, got in received(granting.link).items()}
    head_alone = {agent: task.adaptation is not None and task.adaptation.head_alone for agent, task in tasks.items()}
    assert head_alone == {"r2": False, "r3": True, "r5": True, "r6": True}
    assert {agent: task.ask_to_upload for agent, task in tasks.items()} == \
        {"r2": False, "r3": False, "r5": False, "r6": True}
    not_granting = Bench(make_agent)  # the coordinator grants no uploads: nobody is told to ask
    not_granting.online("r6", UPLOAD_GRANT_REVISION)
    not_granting.dispatcher.send(1, "r1-r6-a", plan_for("r6"), time.time() + 60)
    assert not received(not_granting.link)["r1-r6-a"].task.ask_to_upload


def test_a_round_sends_each_of_its_own_tasks_without_an_update_once(bench: Bench,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    carried = DispatchedTask("r1-c-1", 1, plan_for("c"), time.time() + 60)
    current = bench.round(2, {"r2-a-1": plan_for("a"), "r2-b-1": plan_for("b")}, (carried,))
    current.receive(declined("r2-b-1", "b", 2), b"", "", stored=True)  # a resumed round's stored update
    marked: list[str] = []
    monkeypatch.setattr(current, "mark_sent", marked.append)
    sent = bench.dispatcher.send_round(current)
    tasks = received(bench.link)
    assert list(tasks) == ["r2-a-1"] and marked == ["r2-a-1"]  # not the answered one, not the carried one
    assert tasks["r2-a-1"].topic == TOPICS.agent_task("a")
    assert sent == sum(len(chunk) for _, chunk in bench.link.published)
    assert current.timing["dispatch"] >= 0.0
    assert len(bench.link.waits) == tasks["r2-a-1"].chunks  # paced: a wait for room before each chunk


def test_an_agent_back_online_gets_its_unanswered_tasks_again_unpaced(make_agent: Callable[..., AgentRecord],
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    bench = Bench(make_agent, room=False)  # a wait would fail: none may happen on the message thread
    carried = DispatchedTask("r1-a-0", 1, plan_for("a"), time.time() + 60)
    current = bench.round(2, {"r2-a-1": plan_for("a"), "r2-a-2": plan_for("a"), "r2-b-1": plan_for("b")},
                          (carried,))
    current.receive(declined("r2-a-1", "a", 2), b"", "", stored=True)
    marked: list[str] = []
    monkeypatch.setattr(current, "mark_sent", marked.append)
    bench.dispatcher.resend_unanswered(None, "a")  # no round in progress: nothing to send
    assert bench.link.published == []
    bench.dispatcher.resend_unanswered(current, "a")
    tasks = received(bench.link)
    assert sorted(tasks) == sorted(marked) == ["r1-a-0", "r2-a-2"]
    assert {task_id: got.chunk_round for task_id, got in tasks.items()} == {"r1-a-0": 1, "r2-a-2": 2}
    assert bench.link.waits == [] and not bench.dispatcher.unpaced
    current.close()
    del bench.link.published[:]
    bench.dispatcher.resend_unanswered(current, "a")  # the round stopped collecting
    assert bench.link.published == []


def test_carried_tasks_go_again_only_to_the_agents_back_and_as_their_own_round_cut_them(bench: Bench) -> None:
    bench.in_flight.carry([], {1: states(1.0)})
    bench.in_flight.states = states(2.0)
    carried = tuple(DispatchedTask(f"r1-{agent}-1", 1, plan_for(agent), time.time() + 60) for agent in ("b", "c"))
    current = bench.round(2, {"r2-a-1": plan_for("a")}, carried)
    sent = bench.dispatcher.resend_carried(current, {"a", "b"})  # a's task is the round's own: sent by send_round
    tasks = received(bench.link)
    assert list(tasks) == ["r1-b-1"] and tasks["r1-b-1"].topic == TOPICS.agent_task("b")
    assert tasks["r1-b-1"].task.round == tasks["r1-b-1"].chunk_round == 1
    assert all(np.all(weights == 1.0) for weights in tasks["r1-b-1"].task.weights.values())
    assert sent == sum(len(chunk) for _, chunk in bench.link.published)
    assert bench.dispatcher.resend_carried(current, set()) == 0


def test_pacing_waits_for_room_before_each_chunk_then_sends_on_while_the_broker_is_away(
        make_agent: Callable[..., AgentRecord], small_chunks: None) -> None:
    bench = Bench(make_agent)
    bench.dispatcher.send(1, "r1-dev-a", plan_for("dev"), time.time() + 60)
    chunks = len(bench.link.published)
    assert chunks > 3 and bench.link.waits == [(DISPATCH_WINDOW_BYTES, DISPATCH_WAIT_S)] * chunks
    away = Bench(make_agent, room=False)  # no PUBACK comes: the first wait is in vain
    away.link.bytes_in_flight = DISPATCH_WINDOW_BYTES
    with structlog.testing.capture_logs() as logs:
        away.dispatcher.send(1, "r1-dev-a", plan_for("dev"), time.time() + 60)
    assert len(away.link.published) == chunks and len(away.link.waits) == 1  # every chunk sent, one wait
    assert away.dispatcher.unpaced
    assert [entry["event"] for entry in logs].count("dispatch_not_paced") == 1
    away.link.bytes_in_flight = DISPATCH_WINDOW_BYTES - 1  # the broker took the backlog below the window
    away.dispatcher.pace("r1-dev-b")
    assert not away.dispatcher.unpaced and len(away.link.waits) == 1  # paced again from the next chunk on
    away.link.room = True
    away.dispatcher.pace("r1-dev-b")
    assert len(away.link.waits) == 2 and not away.dispatcher.unpaced
