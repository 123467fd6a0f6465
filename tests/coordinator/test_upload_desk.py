"""UploadDesk on its own: requests to upload answered (an ack, a grant from the window within its bytes, told
to wait), chunks handed to the intake, what comes while no round collects held and answered once one opens,
verdicts of closed rounds given again, and an agent gone offline leaving the queue. No broker: a link that
records what it publishes, a real intake and real rounds over declined updates (nothing to aggregate)."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import pytest

from coordinator import upload_desk
from coordinator.aggregation import RoundAggregate
from coordinator.config import ScreeningConfig, UploadsConfig
from coordinator.in_flight import InFlight
from coordinator.intake import UpdateIntake
from coordinator.metrics import TaskRecord, TaskStatus
from coordinator.round import DispatchedTask, Examined, Round
from coordinator.screening import Change
from coordinator.strategies import TaskPlan, TaskResult
from coordinator.upload_desk import UploadDesk
from coordinator.upload_grants import UploadGrants
from models import SubmodelSpec
from protocol import (
    Ack,
    BytesLike,
    ProtocolError,
    Topics,
    TrainingPlan,
    Update,
    UpdateStatus,
    UploadGrant,
    UploadRequest,
    UploadWait,
    decode,
    encode,
    split_payload,
)

TOPICS = Topics("desk")


class RecordingLink:
    """The link as the desk and the intake use it: every message published is kept, decoded, with its topic; a
    publish to an agent in ``failing`` raises (a link that broke)."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, object]] = []
        self.failing: set[str] = set()

    def publish(self, topic: str, payload: bytes, *, qos: int = 1, retain: bool = False) -> bool:
        if any(topic == TOPICS.agent_ack(agent) for agent in self.failing):
            raise OSError("the link is down")
        self.sent.append((topic, decode(payload)))
        return True

    def messages(self) -> list[object]:
        """What was published since the last call (each on the ack topic of the agent it names)."""
        sent, self.sent = self.sent, []
        for topic, message in sent:
            assert topic == TOPICS.agent_ack(message.agent_id)  # type: ignore[attr-defined]
        return [message for _, message in sent]


class RecordingLog:
    """A logger that keeps (level, event, fields)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, dict[str, Any]]] = []

    def _keep(self, level: str, event: str, fields: dict[str, Any]) -> None:
        self.events.append((level, event, fields))

    def debug(self, event: str, **fields: Any) -> None:
        self._keep("debug", event, fields)

    def info(self, event: str, **fields: Any) -> None:
        self._keep("info", event, fields)

    def warning(self, event: str, **fields: Any) -> None:
        self._keep("warning", event, fields)

    def error(self, event: str, **fields: Any) -> None:
        self._keep("error", event, fields)

    def exception(self, event: str, **fields: Any) -> None:
        self._keep("exception", event, fields)

    def bind(self, **fields: Any) -> RecordingLog:
        return self


class Journal:
    """The round's side of the intake for updates without weights: every update an answer without a result,
    its store recorded."""

    def __init__(self) -> None:
        self.stored: list[str] = []

    def examine(self, update: Update, task: TaskPlan) -> Examined:
        return Examined(TaskRecord(update.agent_id, task.level, TaskStatus.answered(update.status), "full"))

    def store(self, update: Update, payload: BytesLike) -> None:
        self.stored.append(update.task_id)

    def measure(self, result: TaskResult, sent_round: int) -> Change:
        raise AssertionError("nothing here is trained")

    def rebase(self, result: TaskResult, sent_round: int, round_number: int) -> TaskResult:
        raise AssertionError("nothing here is trained")

    def reload(self, task_id: str, task: TaskPlan) -> TaskResult:
        raise AssertionError("nothing here is trained")


def task_id(agent: str, round_number: int = 1) -> str:
    return f"r{round_number}-{agent}-1"


def declined(agent: str, round_number: int = 1, task: str | None = None) -> Update:
    """An agent's answer without weights: enough for the desk, whose rooms never look inside it."""
    return Update(task or task_id(agent, round_number), round_number, agent, UpdateStatus.DECLINED, None, 0,
                  [], {}, {}, "too small")


def plan(agent: str) -> TaskPlan:
    return TaskPlan(agent, "a", SubmodelSpec.full(), TrainingPlan())


def dispatched(agent: str, round_number: int = 1) -> DispatchedTask:
    """A task of ``round_number`` still training, for a later round to carry."""
    return DispatchedTask(task_id(agent, round_number), round_number, plan(agent), time.time() + 60)


class Desk:
    """An UploadDesk with its intake, rounds and link: ``window`` bytes (``grant`` off: no window), agents of
    protocol revision 7 unless ``revisions`` says otherwise."""

    def __init__(self, *, window: int = 1000, grant: bool = True,
                 revisions: dict[str, int] | None = None) -> None:
        self.link = RecordingLink()
        self.log = RecordingLog()
        self.journal = Journal()
        self.in_flight = InFlight({})
        link: Any = self.link  # an MqttLink as far as its users can tell
        unused: Any = None  # the family, strategy and journal: the desk's uses of the intake never reach them
        self.intake = UpdateIntake(unused, unused, unused, 10, self.in_flight, link, TOPICS, self.log)
        revisions = revisions or {}
        uploads = UploadsConfig(grant=grant, window_mib=window / 2**20)  # window_bytes: exactly ``window``
        self.desk = UploadDesk(self.intake, uploads, link, TOPICS, self.in_flight,
                               lambda agent: revisions.get(agent, 7), self.log)
        self._transfers = 0

    @property
    def grants(self) -> UploadGrants:
        assert self.desk.grants is not None
        return self.desk.grants

    def open_round(self, number: int, agents: Sequence[str], carried: Sequence[DispatchedTask] = ()) -> Round:
        """Make a round of a task per agent (and the ``carried`` ones) the one in progress, collecting."""
        tasks = {task_id(agent, number): plan(agent) for agent in agents}
        current = Round(number, tasks, [], time.time() + 60, RoundAggregate({}, lambda result: 1.0, []),
                        ScreeningConfig(enabled=False), self.journal, carried=carried)
        self.in_flight.install(current)
        return current

    def between_rounds(self, carried: Sequence[DispatchedTask]) -> None:
        """No round in progress; the next one carries ``carried``."""
        self.in_flight.finished()
        self.in_flight.carry(carried, {})

    def ask(self, agent: str, size: int = 10, *, round_number: int = 1, task: str | None = None,
            sha256: str = "") -> None:
        request = UploadRequest(task or task_id(agent, round_number), round_number, agent, size, sha256)
        self.desk.on_message(agent, encode(request))

    def upload(self, update: Update, topic_of: str | None = None) -> None:
        """Each chunk of ``update`` on the update topic of its agent (or ``topic_of``'s): one new transfer."""
        self._transfers += 1
        for chunk in split_payload(encode(update), f"{update.task_id}.{self._transfers}"):
            self.desk.on_message(topic_of or update.agent_id, chunk)


def grant(agent: str, round_number: int = 1) -> UploadGrant:
    return UploadGrant(task_id(agent, round_number), round_number, agent)


def ack(agent: str, round_number: int = 1) -> Ack:
    return Ack(task_id(agent, round_number), round_number, agent)


# ------------------------------------------------------------------------------------------ a round collects
def test_a_request_is_granted_while_the_window_has_room_and_beyond_it_waits_told_so_from_revision_7() -> None:
    here = Desk(window=1000, revisions={"old": 6})
    here.open_round(1, ["a", "b", "c", "old"])
    here.ask("a", 600)
    here.ask("b", 400)
    assert here.link.messages() == [grant("a"), grant("b")]  # 1000 bytes: the window, exactly
    here.ask("c", 1)
    here.ask("old", 1)
    waits = here.link.messages()
    assert len(waits) == 1 and isinstance(waits[0], UploadWait) and waits[0].agent_id == "c"
    assert "upload window" in waits[0].reason
    assert here.desk.window() == (1000, 2) and here.desk.held() == []


def test_grants_in_flight_never_exceed_the_window_and_go_in_the_order_asked() -> None:
    sizes = {"a0": 400, "a1": 300, "a2": 500, "a3": 200, "a4": 600, "a5": 100}
    here = Desk(window=1000)
    here.open_round(1, [*sizes, "big", "small"])
    granted: list[str] = []
    for agent, size in sizes.items():
        here.ask(agent, size)
        granted += [m.agent_id for m in here.link.messages() if isinstance(m, UploadGrant)]
    uploaded: list[str] = []
    while len(uploaded) < len(granted):
        out = sum(sizes[agent] for agent in granted if agent not in uploaded)  # granted, not in yet
        assert here.grants.in_flight == out <= 1000
        here.upload(declined(granted[len(uploaded)]))
        uploaded.append(granted[len(uploaded)])
        heard = here.link.messages()
        assert heard[0] == ack(uploaded[-1])  # stored, then the grants its bytes made room for
        granted += [m.agent_id for m in heard[1:] if isinstance(m, UploadGrant)]
    assert granted == list(sizes) and here.grants.peak_in_flight <= 1000 and here.grants.in_flight == 0
    # One upload larger than the window goes alone, and nothing goes beside it.
    here.ask("big", 5000)
    here.ask("small", 1)
    assert [type(message) for message in here.link.messages()] == [UploadGrant, UploadWait]
    here.upload(declined("big"))
    assert here.link.messages() == [ack("big"), grant("small")]


def test_a_request_for_an_update_in_already_is_answered_with_its_ack_and_one_no_round_knows_refused() -> None:
    here = Desk()
    here.open_round(1, ["a"])
    here.upload(declined("a"))  # sent without asking
    assert here.link.messages() == [ack("a")]
    here.ask("a", 10)  # its ack was lost
    assert here.link.messages() == [ack("a")]
    here.ask("x", 10, round_number=9)
    (refused,) = here.link.messages()
    assert isinstance(refused, Ack) and "unknown task" in (refused.reason or "")
    assert here.desk.window() == (0, 0)  # neither granted nor waiting
    with pytest.raises(ProtocolError, match="published on the topic of"):
        here.desk.on_message("b", encode(UploadRequest(task_id("a"), 1, "a", 10)))
    assert here.link.messages() == []


def test_a_waiting_request_whose_update_came_meanwhile_is_answered_and_never_granted() -> None:
    here = Desk(window=1000)
    current = here.open_round(1, ["a", "b"])
    here.ask("a", 1000)
    here.ask("b", 1000)
    assert [type(message) for message in here.link.messages()] == [UploadGrant, UploadWait]
    here.upload(declined("b"))  # b sent it anyway (restored from its outbox, say)
    assert here.link.messages() == [ack("b"), ack("b")]  # the intake's ack; its request's, no longer wanted
    assert here.grants.waiting == 0 and here.grants.dropped_total == 1
    here.upload(declined("a"))
    assert here.link.messages() == [ack("a")]  # no grant left to give
    assert sorted(current.answers) == [task_id("a"), task_id("b")]


def test_a_malformed_upload_gives_its_grant_back_and_the_next_request_is_granted() -> None:
    here = Desk(window=1000)
    here.open_round(1, ["a", "b"])
    here.ask("a", 1000)
    here.ask("b", 1000)
    here.link.messages()
    with pytest.raises(ProtocolError, match="published on the topic of"):
        here.upload(declined("x", task=task_id("a")), topic_of="a")  # another agent's update on a's topic
    assert here.link.messages() == [grant("b")]
    assert here.grants.in_flight == 1000  # b's bytes only


def test_wanted_is_true_only_for_an_update_the_round_in_progress_would_take() -> None:
    here = Desk()
    here.open_round(1, ["a", "b"])
    assert here.desk.wanted("a", task_id("a"), 1) and here.desk.wanted("b", task_id("b"), 1)
    assert not here.desk.wanted("b", task_id("a"), 1)  # another agent's task
    assert not here.desk.wanted("a", task_id("a"), 2)  # another round's
    here.upload(declined("a"))
    assert not here.desk.wanted("a", task_id("a"), 1)  # in already
    here.between_rounds([dispatched("b")])
    assert not here.desk.wanted("b", task_id("b"), 1)  # carried: held for the next round, not taken now
    assert not here.desk.wanted("a", task_id("a"), 1)


# -------------------------------------------------------------------------------------------- between rounds
def test_between_rounds_a_request_for_a_carried_task_is_held_and_granted_when_the_next_round_opens() -> None:
    here = Desk(window=1000, revisions={"old": 6})
    here.between_rounds([dispatched("a"), dispatched("old")])
    here.ask("a", 10)
    here.ask("old", 20)
    (wait,) = here.link.messages()  # the older agent hears nothing yet
    assert isinstance(wait, UploadWait) and wait.agent_id == "a" and "no round is collecting" in wait.reason
    here.ask("a", 10)  # asking again: told again, held once
    assert [type(message) for message in here.link.messages()] == [UploadWait]
    assert here.desk.held() == [("a", task_id("a")), ("old", task_id("old"))]
    assert here.desk.window() == (0, 2) and here.desk.held_total == 2
    here.ask("b", 10)  # a task the next round does not carry
    (refused,) = here.link.messages()
    assert isinstance(refused, Ack) and "no round is in progress" in (refused.reason or "")
    here.open_round(2, ["c"], carried=here.in_flight.carried)
    here.desk.round_opened()
    assert here.link.messages() == [grant("a"), grant("old")]
    assert here.desk.held() == [] and here.desk.window() == (30, 0)


def test_between_rounds_a_whole_update_for_a_carried_task_is_held_unanswered_then_taken_when_a_round_opens(
) -> None:
    here = Desk()
    here.between_rounds([dispatched("a")])
    here.upload(declined("a"))  # sent without asking
    assert here.link.messages() == [] and here.journal.stored == []
    assert here.desk.held() == [("a", task_id("a"))] and here.desk.window() == (0, 0)
    current = here.open_round(2, [], carried=here.in_flight.carried)
    here.desk.round_opened()
    assert here.link.messages() == [ack("a")]
    assert here.journal.stored == [task_id("a")] and list(current.answers) == [task_id("a")]
    assert here.desk.held() == []


def test_whole_updates_held_between_rounds_take_at_most_the_windows_bytes_but_always_one() -> None:
    size = len(encode(declined("a")))
    here = Desk(window=size + size // 2)  # one fits, not two
    here.between_rounds([dispatched("a"), dispatched("b")])
    here.upload(declined("a"))
    here.upload(declined("b"))
    assert here.desk.held() == [("a", task_id("a"))]
    assert (here.desk.held_total, here.desk.not_held_total) == (1, 1) and here.link.messages() == []
    small = Desk(window=size // 2)  # an update larger than the window is held all the same, alone
    small.between_rounds([dispatched("a"), dispatched("b")])
    small.upload(declined("a"))
    small.upload(declined("b"))
    assert small.desk.held() == [("a", task_id("a"))] and small.desk.not_held_total == 1


def test_an_update_held_again_counts_once_and_a_copy_without_room_leaves_the_one_held() -> None:
    size = len(encode(declined("a")))
    here = Desk(window=2 * size + size // 2)  # two fit, not three
    here.between_rounds([dispatched("a"), dispatched("b")])
    here.upload(declined("a"))
    here.upload(declined("a"))  # the same update again: held once, counted once
    assert here.desk.held() == [("a", task_id("a"))] and here.desk.held_total == 1
    here.upload(declined("b"))
    larger = replace(declined("b"), reason="too small" * size)  # b again, with no room beside a's
    here.upload(larger)
    assert here.desk.held() == [("a", task_id("a")), ("b", task_id("b"))] and here.desk.not_held_total == 1
    current = here.open_round(2, [], carried=here.in_flight.carried)
    here.desk.round_opened()
    assert sorted(current.answers) == [task_id("a"), task_id("b")]
    assert current.answers[task_id("b")].update.reason == "too small"  # the copy held, not lost


def test_a_held_request_that_cannot_be_answered_leaves_the_others_answered() -> None:
    here = Desk(revisions={"bad": 6, "good": 6})
    here.between_rounds([dispatched("bad"), dispatched("good")])
    here.ask("bad")
    here.ask("good")
    here.link.failing.add("bad")
    here.open_round(2, [], carried=here.in_flight.carried)
    here.desk.round_opened()
    assert here.link.messages() == [grant("good")]
    assert [(level, fields["agent"]) for level, event, fields in here.log.events
            if event == "held_upload_failed"] == [("error", "bad")]
    assert here.desk.held() == []


def test_without_grants_a_request_is_granted_at_once_and_the_window_counts_held_requests_only() -> None:
    here = Desk(grant=False)
    assert here.desk.grants is None
    here.open_round(1, ["a", "b", "c"])
    for agent in ("a", "b", "c"):
        here.ask(agent, 10**9)  # far beyond any window: there is none
    assert here.link.messages() == [grant("a"), grant("b"), grant("c")]
    here.upload(declined("a"))
    assert here.link.messages() == [ack("a")]
    here.between_rounds([dispatched("d", 2)])
    here.ask("d", round_number=2)
    assert [type(message) for message in here.link.messages()] == [UploadWait]
    assert here.desk.window() == (0.0, 1.0) and here.desk.held() == [("d", task_id("d", 2))]


# ----------------------------------------------------------------------------------------- verdicts, offline
def test_an_upload_judged_in_a_closed_round_hears_its_verdict_again_and_is_not_taken_again() -> None:
    here = Desk()
    update = declined("a")
    digest = hashlib.sha256(encode(update)).hexdigest()
    verdict = Ack(task_id("a"), 1, "a", None, "aggregated")
    here.desk.remember([(verdict, digest)])
    current = here.open_round(2, ["b"])  # round 1 is gone
    for asked in ("", digest):  # a request without its digest is taken as for the same update
        here.ask("a", 10, sha256=asked)
        assert here.link.messages() == [verdict]
    here.upload(update)
    assert here.link.messages() == [verdict]
    assert current.answers == {} and here.journal.stored == [] and here.desk.window() == (0, 0)
    here.ask("a", 10, sha256="0" * 64)  # another update than the one judged: no verdict for it
    (refused,) = here.link.messages()
    assert isinstance(refused, Ack) and refused.verdict is None and "unknown task" in (refused.reason or "")


def test_only_the_latest_verdicts_are_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(upload_desk, "VERDICTS_KEPT", 2)
    here = Desk()
    verdicts = {agent: Ack(task_id(agent), 1, agent, None, "aggregated") for agent in ("a", "b", "c")}
    here.desk.remember([(verdicts["a"], ""), (verdicts["b"], "")])
    here.desk.remember([(verdicts["a"], "")])  # kept again: the latest now
    here.desk.remember([(verdicts["c"], "")])  # b, the oldest, goes
    for agent in ("a", "c"):
        here.ask(agent)
        assert here.link.messages() == [verdicts[agent]]
    here.ask("b")
    (refused,) = here.link.messages()
    assert isinstance(refused, Ack) and refused.verdict is None and "unknown task" in (refused.reason or "")


def test_an_agent_gone_offline_leaves_the_window_the_queue_and_the_desk() -> None:
    here = Desk(window=1000)
    here.open_round(1, ["a", "b", "c"])
    here.ask("a", 1000)
    here.ask("b", 1000)
    here.ask("c", 1000)
    here.link.messages()
    here.desk.forget("b")  # waiting: it leaves the queue
    here.desk.forget("a")  # granted: its bytes leave the window, and the next in the queue is granted
    assert here.link.messages() == [grant("c")] and here.desk.window() == (1000, 0)
    here.between_rounds([dispatched("d")])
    here.ask("d")
    here.link.messages()
    here.desk.forget("d")  # held for the next round: it leaves the desk
    assert here.desk.held() == [] and here.desk.window()[1] == 0
    here.open_round(2, [], carried=here.in_flight.carried)
    here.desk.round_opened()
    assert here.link.messages() == []
