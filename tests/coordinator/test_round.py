"""Round: the state machine of one round, its verdicts on updates, streaming aggregation and screening."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from coordinator.aggregation import RoundAggregate
from coordinator.config import ScreeningConfig
from coordinator.metrics import TaskRecord, round_timing
from coordinator.round import Examined, Phase, Round
from coordinator.screening import Change
from coordinator.strategies import TaskPlan, TaskResult
from models import SubmodelSpec
from protocol import TrainingPlan, Update

ROUND = 4
FULL = SubmodelSpec.full()
STATES = {"global": {"w": torch.zeros(4)}}


def task_plan(agent: str) -> TaskPlan:
    return TaskPlan(agent, "a", FULL, TrainingPlan())


def update(agent: str, task_id: str | None = None, round_number: int = ROUND, status: str = "ok",
           fill: float = 1.0, samples: int = 5) -> Update:
    return Update(task_id=task_id or f"t-{agent}", round=round_number, agent_id=agent, status=status,
                  spec_trained=None, num_samples=samples, labels=[0, 1],
                  weights={"w": np.full(4, fill, np.float32)}, metrics={"loss": 1.0})


class Harness:
    """A round over a 4-element model and its intake, whose updates' changes are their fill values (so screening
    can be steered) and whose examinations, stores and read-backs are counted."""

    def __init__(self, agents=("a0", "a1"), deadline: float | None = None, screening: ScreeningConfig | None = None,
                 bound: float | None = None, carried=(), buffer_size: int | None = None, max_staleness: int = 4) -> None:
        self.bound = bound
        self.examined: list[str] = []
        self.stored: list[str] = []
        self.kept: dict[str, Update] = {}  # what a journal would hold
        self.reloaded: list[str] = []
        self.rebased: list[tuple[int, int]] = []
        self.fail_store = False
        deadline = time.time() + 60 if deadline is None else deadline
        tasks = {f"t-{agent}": task_plan(agent) for agent in agents}
        self.aggregate = RoundAggregate(STATES, lambda result: float(result.num_samples), [])
        self.round = Round(ROUND, tasks, [], deadline, self.aggregate, screening or ScreeningConfig(min_peers=2),
                           self, carried=carried, buffer_size=buffer_size, max_staleness=max_staleness)

    def measure(self, result: TaskResult, sent_round: int) -> Change:
        norm = float(result.state["w"].double().norm())
        return Change(norm, 1, 1.0, self.bound)

    def rebase(self, result: TaskResult, sent_round: int, round_number: int) -> TaskResult:
        self.rebased.append((sent_round, round_number))
        return result

    def result_of(self, message: Update) -> TaskResult:
        tensor = torch.from_numpy(np.array(message.weights["w"]))
        return TaskResult(self.round.tasks[message.task_id].task, FULL, {"w": tensor}, {"w": (torch.arange(4),)},
                          message.num_samples, list(message.labels))

    def examine(self, message: Update, task: TaskPlan) -> Examined:
        self.examined.append(message.task_id)
        record = TaskRecord(message.agent_id, task.level, message.status, "full")
        if message.status != "ok":
            return Examined(record)
        if message.num_samples < 0:
            return Examined(record, refusal="update rejected: negative samples")
        return Examined(record, self.result_of(message))

    def store(self, message: Update, payload: bytes) -> None:
        if self.fail_store:
            raise OSError("disk full")
        self.stored.append(message.task_id)
        self.kept[message.task_id] = message

    def reload(self, task_id: str, task: TaskPlan) -> TaskResult:
        assert task is self.round.tasks[task_id].task
        self.reloaded.append(task_id)
        return self.result_of(self.kept[task_id])

    def offer(self, message: Update, digest: str = "", fail_store: bool = False):
        self.fail_store = fail_store
        return self.round.receive(message, bytes(100), digest)


def opened(**kwargs) -> Harness:
    harness = Harness(**kwargs)
    harness.round.open()
    return harness


def test_a_planned_round_takes_nothing_until_it_is_opened():
    harness = Harness()
    assert harness.round.phase is Phase.PLANNED
    assert harness.offer(update("a0")).verdict == "unknown" and harness.examined == []
    harness.round.open()
    assert harness.round.phase is Phase.COLLECTING
    assert harness.offer(update("a0")).verdict == "accepted"


def test_a_new_update_is_examined_once_stored_then_folded_and_kept_without_its_weights():
    harness = opened()
    receipt = harness.offer(update("a0", fill=2.0), "d1")
    assert (receipt.verdict, receipt.refusal) == ("accepted", None)
    assert harness.examined == ["t-a0"] and harness.stored == ["t-a0"]
    answer = harness.round.answers["t-a0"]
    assert answer.update.weights == {} and answer.size == 100 and answer.digest == "d1"
    assert answer.aggregated and answer.keys == {"w"} and answer.record.screening["norm"] == pytest.approx(4.0)
    assert harness.aggregate.updates == 1
    # The same message again is a duplicate, examined no more; another one for the task a conflict.
    assert harness.offer(update("a0", fill=2.0), "d1").verdict == "duplicate"
    conflict = harness.offer(update("a0", fill=3.0), "d2")
    assert conflict.verdict == "conflict" and "arrived first" in conflict.refusal
    assert harness.examined == ["t-a0"] and harness.aggregate.updates == 1


def test_unknown_tasks_other_agents_and_other_rounds_are_refused_unexamined():
    harness = opened()
    for message in (update("a0", task_id="t-other"), update("a1", task_id="t-a0"),
                    update("a0", round_number=ROUND - 1)):
        receipt = harness.offer(message)
        assert receipt.verdict == "unknown" and f"round {ROUND} is in progress" in receipt.refusal
    assert harness.examined == [] and harness.round.answers == {}


def test_a_refused_update_counts_as_answered_but_is_never_stored_or_folded():
    harness = opened()
    receipt = harness.offer(update("a0", samples=-1))
    assert receipt == type(receipt)("accepted", "update rejected: negative samples")
    assert harness.stored == [] and harness.aggregate.updates == 0
    assert harness.offer(update("a0", samples=-1)).refusal == "update rejected: negative samples"  # resent
    assert not harness.round.answers["t-a0"].screened


def test_an_update_that_cannot_be_stored_leaves_the_round_as_it_was():
    harness = opened()
    with pytest.raises(OSError):
        harness.offer(update("a0"), fail_store=True)
    assert harness.round.answers == {} and harness.aggregate.updates == 0
    assert harness.offer(update("a0")).verdict == "accepted"  # the resend is taken as new


def test_a_declined_update_is_an_answer_without_a_fold():
    harness = opened(agents=("a0",))
    assert harness.offer(update("a0", status="declined")).verdict == "accepted"
    assert harness.stored == ["t-a0"] and harness.aggregate.updates == 0
    assert harness.round.wait() is True


def test_an_update_beyond_its_plans_reach_is_not_folded_and_is_rejected():
    harness = opened(bound=3.0)
    harness.offer(update("a0", fill=1.0))  # norm 2: inside
    harness.offer(update("a1", fill=2.0))  # norm 4: beyond
    rejected = harness.round.answers["t-a1"]
    assert rejected.screened and not rejected.aggregated and "most its training plan" in rejected.rejection
    assert rejected.record.status == "rejected" and harness.aggregate.updates == 1


@pytest.mark.parametrize("outlier", [100.0, 1e30, 3e38])
def test_an_outlier_at_close_leaves_the_aggregate_of_the_others_rebuilt_from_the_journal(outlier):
    """Rule 2 needs the round's medians: the aggregate is built again from the updates that stay in, read back in
    task id order; a huge outlier (that swamped or overflowed the float32 sums) leaves no trace."""
    agents = ("a0", "a1", "a2", "a3")
    harness = opened(agents=agents)
    for agent, fill in zip(agents, (1.0, 2.0, 3.0, outlier)):
        harness.offer(update(agent, fill=fill, samples=1))
    assert harness.aggregate.updates == 4
    harness.round.close()
    assert harness.round.phase is Phase.AGGREGATING and harness.reloaded == ["t-a0", "t-a1", "t-a2"]
    assert "medians of the round's 3 other updates" in harness.round.answers["t-a3"].rejection
    assert [a.update.agent_id for a in harness.round.aggregated()] == ["a0", "a1", "a2"]
    states = harness.round.finish()
    assert harness.round.phase is Phase.CLOSED
    assert torch.equal(states["global"]["w"], torch.full((4,), 2.0))  # the mean of 1, 2, 3, exactly


def test_a_round_without_outliers_is_not_rebuilt():
    harness = opened()
    harness.offer(update("a0"))
    harness.offer(update("a1"))
    harness.round.close()
    assert harness.reloaded == []  # nothing read back


def test_the_aggregate_is_the_sample_weighted_mean_of_the_updates_that_stayed_in():
    harness = opened()
    harness.offer(update("a0", fill=1.0, samples=1))
    harness.offer(update("a1", fill=4.0, samples=3))
    harness.round.close()
    torch.testing.assert_close(harness.round.finish()["global"]["w"], torch.full((4,), 13.0 / 4))


def test_after_closing_updates_are_late_and_phases_go_one_way():
    harness = opened()
    harness.round.close()
    receipt = harness.offer(update("a0"))
    assert receipt.verdict == "late" and receipt.refusal == f"round {ROUND} closed before the update arrived"
    with pytest.raises(RuntimeError, match="is aggregating, not collecting"):
        harness.round.close()
    with pytest.raises(RuntimeError, match="is aggregating, not planned"):
        harness.round.open()
    harness.round.finish()
    with pytest.raises(RuntimeError, match="is closed, not aggregating"):
        harness.round.finish()


def test_unanswered_lists_an_agents_tasks_without_an_update_until_the_round_closes():
    harness = opened()
    assert [t.task_id for t in harness.round.unanswered("a0")] == ["t-a0"]
    assert harness.round.unanswered("stranger") == []
    harness.offer(update("a0"))
    assert harness.round.unanswered("a0") == [] and [t.task_id for t in harness.round.unanswered("a1")] == ["t-a1"]
    harness.round.close()
    assert harness.round.unanswered("a1") == []


def test_wait_returns_at_the_deadline_when_an_update_is_missing():
    harness = opened(deadline=time.time() + 0.2)
    harness.offer(update("a0"))
    assert harness.round.wait() is False


def test_wait_wakes_when_the_last_update_arrives_from_another_thread():
    harness = opened()
    harness.offer(update("a0"))
    thread = threading.Thread(target=lambda: harness.offer(update("a1")))
    thread.start()
    assert harness.round.wait() is True  # the deadline is a minute away: woken by the update
    thread.join()


def test_wait_moves_its_deadline_by_the_extension_as_it_grows():
    harness = opened(agents=("a0",), deadline=time.time() + 0.1)
    arrived = threading.Event()

    def late_answer() -> None:
        arrived.wait(10)
        harness.offer(update("a0"))

    thread = threading.Thread(target=late_answer)
    thread.start()
    outage = [5.0]  # a broker outage pushes the deadline past the answer
    arrived.set()
    assert harness.round.wait(lambda: outage[0]) is True
    thread.join()


def test_interrupt_ends_wait():
    harness = opened()
    threading.Timer(0.05, harness.round.interrupt).start()
    assert harness.round.wait() is False


def test_device_times_read_the_metrics_and_the_transfer_is_what_the_device_did_not_report():
    harness = opened()
    sent = time.monotonic()
    harness.round.mark_sent("t-a0")
    message = update("a0")
    message.metrics.update({"seconds_decision": 0.5, "seconds": 2.0, "seconds_task": 0.0})
    harness.offer(message)
    received = time.monotonic()
    harness.offer(update("a1"))  # never marked sent, reports nothing
    first, second = harness.round.device_times()
    assert (first["decision"], first["training"]) == (0.5, 2.0)
    assert 0.0 <= first["transfer"] <= received - sent
    assert second == {}


def test_a_slowed_devices_hold_back_is_its_own_phase_and_not_transfer():
    harness = opened()
    sent = time.monotonic()
    harness.round.mark_sent("t-a0")
    message = update("a0")  # trained 0.01 s, then held back 0.02 s (slowdown 3), which it counts as its own time
    message.metrics.update({"seconds": 0.01, "seconds_slowdown": 0.02, "seconds_task": 0.035})
    harness.offer(message)
    received = time.monotonic()
    [times] = harness.round.device_times()
    assert (times["training"], times["slowdown"]) == (0.01, 0.02)
    assert 0.0 <= times["transfer"] <= max(0.0, received - sent - 0.035)
    assert list(round_timing({}, [times])) == ["training", "slowdown", "transfer"]  # DEVICE_PHASES' order


def taking_slowly(harness: Harness, message: Update) -> tuple[threading.Thread, threading.Event]:
    """``message`` offered on a thread of its own, held in its examination (outside the round's lock) until the
    event returned is set."""
    examining, release = threading.Event(), threading.Event()
    examine = harness.examine

    def slow_examine(message: Update, task: TaskPlan) -> Examined:
        examining.set()
        release.wait(30)
        return examine(message, task)

    harness.examine = slow_examine  # type: ignore[method-assign]
    taker = threading.Thread(target=lambda: harness.offer(message))
    taker.start()
    assert examining.wait(30)
    return taker, release


def test_the_round_thread_is_not_held_up_by_an_update_being_taken_and_close_waits_for_it():
    harness = opened()
    taker, release = taking_slowly(harness, update("a0"))
    harness.round.mark_sent("t-a1")  # the round's own thread gets the lock meanwhile
    assert [t.task_id for t in harness.round.unanswered("a1")] == ["t-a1"]
    seen_at_close: list[str] = []

    def close() -> None:
        harness.round.close()
        seen_at_close.extend(harness.round.answers)

    closer = threading.Thread(target=close)
    closer.start()
    deadline = time.monotonic() + 30
    while harness.round.phase is not Phase.AGGREGATING and time.monotonic() < deadline:
        time.sleep(0.01)  # until close() has begun (it then waits for the update being taken)
    assert seen_at_close == []
    release.set()
    closer.join(30)
    taker.join(30)
    assert seen_at_close == ["t-a0"]  # close returned only once the update was in
    assert [a.update.agent_id for a in harness.round.aggregated()] == ["a0"]


def test_an_update_that_cannot_be_folded_after_it_was_stored_is_refused_not_left_unanswered():
    harness = opened()
    message = update("a0")
    message.weights = {"w": np.ones(3, np.float32)}  # examined fine by this harness, but not the model's shape

    def examine(message: Update, task: TaskPlan) -> Examined:
        tensor = torch.from_numpy(np.array(message.weights["w"]))
        return Examined(TaskRecord(message.agent_id, task.level, message.status, "full"),
                        TaskResult(task, FULL, {"w": tensor}, {"w": (torch.arange(4),)}, 1, [0]))

    harness.examine = examine  # type: ignore[method-assign]
    receipt = harness.round.receive(message, bytes(10), "")
    assert receipt.verdict == "accepted" and receipt.refusal.startswith("update rejected: ")
    answer = harness.round.answers["t-a0"]
    assert answer.record.status == "rejected" and not answer.screened and harness.aggregate.updates == 0


def test_an_update_read_back_from_the_journal_is_taken_without_being_stored_again():
    harness = opened()
    receipt = harness.round.receive(update("a0", fill=2.0), bytes(40), "d0", stored=True)
    assert receipt.verdict == "accepted" and receipt.refusal is None
    assert harness.stored == [] and harness.examined == ["t-a0"] and harness.aggregate.updates == 1
    assert harness.round.answers["t-a0"].size == 40


def test_a_buffered_round_takes_its_carried_tasks_updates_rebased_and_records_their_staleness():
    """Round 4 carries a task of round 2: its update names round 2, is measured against round 2's states and
    rebased (2 rounds stale); the round's own tasks are fresh."""
    from coordinator.round import DispatchedTask

    old = DispatchedTask("t-old", ROUND - 2, task_plan("b0"), time.time() + 60)
    harness = opened(carried=[old], buffer_size=2)
    assert set(harness.round.tasks) == {"t-a0", "t-a1", "t-old"}
    assert harness.offer(update("b0", task_id="t-old", round_number=ROUND)).verdict == "unknown"  # not its round
    assert harness.offer(update("b0", task_id="t-old", round_number=ROUND - 2)).verdict == "accepted"
    assert harness.offer(update("a0")).verdict == "accepted"
    assert harness.rebased == [(ROUND - 2, ROUND), (ROUND, ROUND)]
    assert harness.round.answers["t-old"].record.staleness == 2
    assert harness.round.answers["t-a0"].record.staleness == 0
    assert harness.round.wait() is True  # two answers: the buffer is full, a1 still training


def test_a_buffered_round_carries_what_is_still_training_and_defers_its_updates_meanwhile():
    from coordinator.round import DispatchedTask

    stale = DispatchedTask("t-stale", ROUND - 3, task_plan("b0"), time.time() + 60)
    expired = DispatchedTask("t-expired", ROUND - 1, task_plan("b1"), time.time() - 1)
    harness = opened(agents=("a0", "a1", "a2"), carried=[stale, expired], buffer_size=2, max_staleness=3)
    harness.offer(update("a0"))
    harness.offer(update("a1"))
    assert harness.round.wait() is True
    assert harness.round.carried_over() == []  # decided when it closes
    harness.round.close()
    late = harness.offer(update("a2"))
    assert (late.verdict, late.refusal) == ("deferred", None)  # not answered: sent again, to the next round
    assert "t-a2" not in harness.round.answers and harness.stored == ["t-a0", "t-a1"]
    asked = harness.round.receipt_before_upload("t-a2", ROUND, "a2", "")
    assert asked is not None and (asked.verdict, asked.refusal) == ("deferred", None)  # asking: no answer yet
    for task_id, agent, round_number in (("t-expired", "b1", ROUND - 1), ("t-stale", "b0", ROUND - 3)):
        refused = harness.offer(update(agent, task_id=task_id, round_number=round_number))
        assert refused.verdict == "late" and "closed before" in refused.refusal
    # t-stale would be 4 rounds old in the next round, t-expired is past its deadline: neither is carried.
    assert [task.task_id for task in harness.round.carried_over()] == ["t-a2"]


def test_an_update_asked_for_while_close_waits_for_another_being_taken_is_deferred_not_late():
    """Found by the buffered soak: close() waits for the update being taken (its lock released), and the message
    thread that took it may answer the next request before close() has woken to decide the carry. Here the request
    is answered while close() waits (before the update is in, from another thread: the same undecided moment). It is
    for a task the next round carries: deferred, as it is once close() has decided, never refused as late."""
    harness = opened(agents=("a0", "a1", "a2"), buffer_size=1)
    taker, release = taking_slowly(harness, update("a0"))
    closer = threading.Thread(target=harness.round.close)
    closer.start()
    deadline = time.monotonic() + 30
    while harness.round.phase is not Phase.AGGREGATING and time.monotonic() < deadline:
        time.sleep(0.01)  # until close() has begun and waits for the update being taken
    asked = harness.round.receipt_before_upload("t-a1", ROUND, "a1", "")
    assert asked is not None and asked.verdict == "deferred"
    release.set()
    taker.join(30)
    closer.join(30)
    assert harness.round.carried_over() and [t.task_id for t in harness.round.carried_over()] == ["t-a1", "t-a2"]
    again = harness.round.receipt_before_upload("t-a1", ROUND, "a1", "")
    assert again is not None and again.verdict == "deferred"


def test_a_synchronous_round_refuses_late_updates_and_carries_nothing():
    harness = opened(deadline=time.time() + 60)
    harness.offer(update("a0"))
    harness.round.close()
    receipt = harness.offer(update("a1"))
    assert receipt.verdict == "late" and receipt.refusal.startswith(f"round {ROUND} closed")
    assert harness.round.carried_over() == []


def test_an_upload_asked_for_is_answered_at_once_when_the_round_would_not_take_it():
    harness = opened()
    assert harness.round.receipt_before_upload("t-a0", ROUND, "a0", "d1") is None  # expected: granted
    harness.offer(update("a0"), "d1")
    for digest in ("d1", ""):  # the same update, or one whose digest is not said: its ack again
        stored = harness.round.receipt_before_upload("t-a0", ROUND, "a0", digest)
        assert stored is not None and (stored.verdict, stored.refusal) == ("duplicate", None)
    other = harness.round.receipt_before_upload("t-a0", ROUND, "a0", "d2")
    assert other is not None and other.verdict == "conflict" and "arrived first" in other.refusal
    unknown = harness.round.receipt_before_upload("t-x", ROUND, "a0", "")
    assert unknown is not None and unknown.verdict == "unknown" and "unknown task" in unknown.refusal
    harness.round.close()
    late = harness.round.receipt_before_upload("t-a1", ROUND, "a1", "")
    assert late is not None and late.verdict == "late"
    assert harness.examined == ["t-a0"]  # nothing examined for a question


def test_declines_fill_no_buffer():
    """Half of the tasks that may still train: a decline frees its device but brings no update."""
    harness = opened(agents=("a0", "a1", "a2", "a3"), buffer_size=0, deadline=time.time() - 1)  # wait(): no waiting
    harness.offer(update("a0", status="declined"))
    assert harness.round.wait() is False  # 0 trained of the 2 that half of the other three make
    harness.offer(update("a1"))
    assert harness.round.wait() is False
    harness.offer(update("a2"))
    assert harness.round.wait() is True


def test_updates_of_a_round_whose_aggregate_fails_at_the_end_are_rejected_with_its_reason():
    # A secure round that could not be unmasked keeps its states: none of its updates counts as aggregated.
    class Unmaskable(RoundAggregate):
        def result(self, noise_std=0.0, generator=None):
            self.failure = "its secure round could not be unmasked: too few shares"
            return dict(self.states)

    harness = opened()
    harness.round._aggregate = Unmaskable(STATES, lambda result: 1.0, [])
    harness.offer(update("a0"))
    harness.offer(update("a1"))
    harness.round.close()
    assert harness.round.finish() == STATES
    assert list(harness.round.aggregated()) == []
    assert {answer.record.status for answer in harness.round.answers.values()} == {"rejected"}
    assert {answer.rejection for answer in harness.round.answers.values()} == {
        "its secure round could not be unmasked: too few shares"}


def test_an_update_its_aggregate_left_out_at_the_end_is_rejected_with_the_reason_and_the_others_stay():
    class LeavesOneOut(RoundAggregate):
        def result(self, noise_std=0.0, generator=None):
            self.left_out = {"a0": "secure aggregation: left out"}
            return dict(self.states)

    harness = opened()
    harness.round._aggregate = LeavesOneOut(STATES, lambda result: 1.0, [])
    harness.offer(update("a0"))
    harness.offer(update("a1"))
    harness.round.close()
    harness.round.finish()
    assert [answer.update.agent_id for answer in harness.round.aggregated()] == ["a1"]
    assert harness.round.answers["t-a0"].rejection == "secure aggregation: left out"
