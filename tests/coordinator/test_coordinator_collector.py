"""RoundCollector: verdicts on offered updates and waiting for the round to complete."""

from __future__ import annotations

import threading
import time

import numpy as np

from coordinator.collector import DispatchedTask, RoundCollector
from coordinator.strategies import TaskPlan
from models import SubmodelSpec
from protocol import TrainingPlan, Update

ROUND = 4


def make_collector(agents=("a0", "a1"), deadline: float | None = None) -> RoundCollector:
    deadline = time.time() + 60 if deadline is None else deadline
    tasks = {
        f"t-{agent}": DispatchedTask(f"t-{agent}", ROUND, TaskPlan(agent, "a", SubmodelSpec.full(), TrainingPlan()),
                                     deadline)
        for agent in agents
    }
    return RoundCollector(ROUND, tasks)


def update(agent: str, task_id: str | None = None, round_number: int = ROUND, status: str = "ok") -> Update:
    return Update(task_id=task_id or f"t-{agent}", round=round_number, agent_id=agent, status=status,
                  spec_trained={}, num_samples=5, labels=[0, 1], weights={"w": np.zeros(2, np.float32)},
                  metrics={"loss": 1.0})


def test_dispatched_task_carries_the_strategy_task_plan():
    collector = make_collector()
    task = collector.tasks["t-a1"].task
    assert isinstance(task, TaskPlan) and task.agent_id == "a1" and task.group == "global"


def test_accepts_and_records_update_and_size():
    collector = make_collector()
    u = update("a0")
    assert collector.offer(u, 123) == "accepted"
    assert collector.updates == {"t-a0": u}
    assert collector.update_bytes == {"t-a0": 123}


def test_second_copy_is_a_duplicate_and_keeps_the_first():
    collector = make_collector()
    first = update("a0")
    assert collector.offer(first, 10) == "accepted"
    assert collector.offer(update("a0", status="failed"), 99) == "duplicate"
    assert collector.updates["t-a0"] is first and collector.update_bytes["t-a0"] == 10


def test_a_resend_is_a_duplicate_a_different_second_update_a_conflict():
    collector = make_collector()
    first = update("a0")
    assert collector.offer(first, 10, "d1") == "accepted"
    assert collector.offer(update("a0"), 10, "d1") == "duplicate"  # the same message again
    assert collector.offer(update("a0", status="failed"), 10, "d2") == "conflict"  # another one for the task
    assert collector.updates["t-a0"] is first


def test_unknown_task_wrong_agent_or_wrong_round():
    collector = make_collector()
    assert collector.offer(update("a0", task_id="t-other"), 1) == "unknown"
    assert collector.offer(update("a1", task_id="t-a0"), 1) == "unknown"  # someone else's task
    assert collector.offer(update("a0", round_number=ROUND - 1), 1) == "unknown"
    assert collector.updates == {} and collector.update_bytes == {}


def test_update_after_close_is_late():
    collector = make_collector()
    assert collector.wait(time.time() - 1) is False
    assert collector.offer(update("a0"), 1) == "late"
    assert collector.updates == {}


def test_declined_update_still_counts_as_in():
    collector = make_collector(agents=("a0",))
    assert collector.offer(update("a0", status="declined"), 1) == "accepted"
    assert collector.wait(time.time() + 5) is True


def test_wait_returns_true_immediately_when_all_in():
    collector = make_collector()
    collector.offer(update("a0"), 1)
    collector.offer(update("a1"), 1)
    started = time.monotonic()
    assert collector.wait(time.time() + 30) is True
    assert time.monotonic() - started < 0.5


def test_wait_returns_false_at_deadline():
    collector = make_collector()
    collector.offer(update("a0"), 1)
    started = time.monotonic()
    assert collector.wait(time.time() + 0.2) is False
    assert 0.15 <= time.monotonic() - started < 2.0
    assert collector.offer(update("a1"), 1) == "late"


def test_wait_wakes_up_when_last_update_arrives_from_another_thread():
    collector = make_collector()
    collector.offer(update("a0"), 1)
    timer = threading.Timer(0.05, lambda: collector.offer(update("a1"), 1))
    timer.start()
    try:
        started = time.monotonic()
        complete = collector.wait(time.time() + 30)
        elapsed = time.monotonic() - started
    finally:
        timer.join()
    assert complete is True
    assert elapsed < 0.8  # notified, not the 1 s polling interval


def test_empty_round_is_complete():
    collector = RoundCollector(1, {})
    assert collector.wait(time.time() + 10) is True


def test_unanswered_lists_an_agents_tasks_without_an_update_until_the_round_closes():
    collector = make_collector(agents=("a0", "a1"))
    assert [t.task_id for t in collector.unanswered("a0")] == ["t-a0"]
    assert collector.unanswered("stranger") == []
    collector.offer(update("a0"), 10)
    assert collector.unanswered("a0") == [] and [t.task_id for t in collector.unanswered("a1")] == ["t-a1"]
    collector.wait(time.time())  # closes
    assert collector.unanswered("a1") == []


def test_wait_moves_its_deadline_by_the_extension_as_it_grows():
    collector = make_collector(agents=("a0",))
    outage = [0.0]

    def late_answer() -> None:
        time.sleep(0.3)
        collector.offer(update("a0"), 10)

    threading.Thread(target=late_answer, daemon=True).start()
    outage[0] = 5.0  # a broker outage pushes the deadline (now + 0.1 s) past the answer
    assert collector.wait(time.time() + 0.1, lambda: outage[0]) is True
    assert make_collector(agents=("a1",)).wait(time.time() + 0.1, lambda: 0.0) is False
