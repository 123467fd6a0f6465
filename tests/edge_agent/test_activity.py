"""AgentActivity: the tasks an agent serves, those it has seen, its answers."""

from __future__ import annotations

from types import SimpleNamespace

from edge_agent.activity import REPORT_TEXT, AgentActivity


def task(task_id: str, round_number: int = 1) -> SimpleNamespace:
    return SimpleNamespace(task_id=task_id, round=round_number)


def test_a_task_is_taken_once_and_not_when_its_update_is_out_already() -> None:
    activity = AgentActivity(seen_tasks=2)
    assert not activity.busy
    assert activity.take(task("r1-a-1"))  # type: ignore[arg-type]
    assert not activity.take(task("r1-a-1"))  # type: ignore[arg-type]  # sent again: not trained twice
    assert not activity.take(task("r2-a-1", 2), answered_already=True)  # type: ignore[arg-type]
    assert activity.busy and activity.training() == ["r1-a-1"] and activity.last_round == 1
    assert activity.first_sight("r3-a-1") and activity.seen() == ["r2-a-1", "r3-a-1"]  # the last two only
    activity.over("r1-a-1")
    assert not activity.busy and activity.training() == []


def test_the_report_says_the_task_in_training_and_the_last_answer() -> None:
    activity = AgentActivity()
    activity.take(task("r4-a-1", 4))  # type: ignore[arg-type]
    report = activity.report(outbox=1, outbox_bytes=10)
    assert (report.task, report.task_round, report.outbox, report.outbox_bytes) == ("r4-a-1", 4, 1, 10)
    update = SimpleNamespace(spec_trained={"width": 0.5}, status="adapted", reason="x" * (REPORT_TEXT + 5))
    activity.answered(task("r4-a-1", 4), update)  # type: ignore[arg-type]
    activity.over("r4-a-1")
    report = activity.report(0, 0)
    assert activity.tasks_done == 1 and report.task == "" and report.last_task == "r4-a-1"
    assert report.last_trained == "width=0.5" and report.last_status == "adapted"
    assert len(report.last_reason) == REPORT_TEXT
