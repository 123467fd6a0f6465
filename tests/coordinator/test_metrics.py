"""MetricsWriter: one JSON object per round, appended; a live display told the progress, its failures logged."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from coordinator.metrics import (
    MetricsWriter,
    Progress,
    RoundResult,
    TaskRecord,
    TaskStatus,
    read_metrics,
    tell_progress,
)
from protocol import UpdateStatus


def result(round_number: int) -> RoundResult:
    return RoundResult(
        round=round_number, global_accuracy=0.5 + round_number / 100, level_accuracy={"a": 0.5, "b": 0.4},
        participants=2, selected=3, bytes_down=1000, bytes_up=900, seconds=1.5,
        tasks=[TaskRecord("sim-000", "a", "ok", "width=1", metrics={"loss": 0.3}),
               TaskRecord("sim-001", "-", "skipped", "-", reason="no level fits")],
    )


def test_write_appends_one_json_line_per_round(tmp_path):
    path = tmp_path / "state" / "metrics.jsonl"
    writer = MetricsWriter(path)
    assert path.parent.is_dir()
    writer.write(result(1))
    writer.write(result(2))
    lines = path.read_text(encoding="utf-8").splitlines()
    assert len(lines) == 2
    rows = [json.loads(line) for line in lines]
    assert [row["round"] for row in rows] == [1, 2]
    assert rows[0]["global_accuracy"] == 0.51
    assert rows[0]["level_accuracy"] == {"a": 0.5, "b": 0.4}
    assert rows[0]["tasks"][0] == {"agent": "sim-000", "level": "a", "status": "ok", "spec_sent": "width=1",
                                   "spec_trained": None, "reason": None, "num_samples": 0,
                                   "metrics": {"loss": 0.3}, "screening": {}, "level_trained": None,
                                   "params_sent": 0, "params_returned": 0, "staleness": 0}
    assert rows[1]["tasks"][1]["reason"] == "no level fits"


def test_existing_metrics_are_kept(tmp_path):
    path = tmp_path / "metrics.jsonl"
    MetricsWriter(path).write(result(1))
    MetricsWriter(path).write(result(2))  # e.g. after a coordinator restart
    assert [json.loads(line)["round"] for line in path.read_text().splitlines()] == [1, 2]


def test_exit_accuracies_are_written_and_default_to_empty():
    assert result(1).to_dict()["exit_accuracy"] == {}
    with_exits = result(2)
    with_exits.exit_accuracy = {"exit1": 0.3, "exit2": 0.4, "exit3": 0.52}
    data = json.loads(json.dumps(with_exits.to_dict()))
    assert data["exit_accuracy"] == {"exit1": 0.3, "exit2": 0.4, "exit3": 0.52}
    assert data["global_accuracy"] == 0.52


def test_to_dict_round_trips_through_json():
    data = result(3).to_dict()
    assert json.loads(json.dumps(data)) == data
    assert data["selected"] == 3 and data["bytes_up"] == 900


def test_a_task_status_is_an_answer_or_what_the_coordinator_made_of_the_task():
    assert [TaskStatus.answered(status) for status in UpdateStatus] == [
        TaskStatus.OK, TaskStatus.ADAPTED, TaskStatus.DECLINED, TaskStatus.FAILED]
    assert [status for status in TaskStatus if status.trained] == [TaskStatus.OK, TaskStatus.ADAPTED]
    record = TaskRecord("sim-000", "a", "missing", "width=1")  # a string naming a status is taken as it
    assert record.status is TaskStatus.MISSING
    with pytest.raises(ValueError, match="'lost' is not a valid TaskStatus"):
        TaskRecord("sim-000", "a", "lost", "width=1")


def test_task_statuses_are_written_as_their_values(tmp_path):
    path = tmp_path / "metrics.jsonl"
    MetricsWriter(path).write(result(1))
    assert [task["status"] for task in json.loads(path.read_text())["tasks"]] == ["ok", "skipped"]


def test_the_rounds_written_are_read_back_as_they_were(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    assert read_metrics(path) == []
    writer = MetricsWriter(path)
    for number in (1, 2):
        writer.write(result(number))
    back = read_metrics(path)
    assert back == [result(1), result(2)]
    assert back[0].tasks[1].status is TaskStatus.SKIPPED
    with path.open("a") as handle:  # a crash while the third line was written
        handle.write('{"round": 3, "global_acc')
    assert read_metrics(path) == [result(1), result(2)]
    path.write_text('{"round": 1,\n' + json.dumps(result(2).to_dict()) + "\n")
    with pytest.raises(ValueError, match="line 1 is not a round's result"):
        read_metrics(path)


def test_restore_appends_the_checkpoints_record_once_and_leaves_the_file_ready_for_the_next_line(tmp_path: Path) -> None:
    """A stop between a round's checkpoint and its line: the record is appended, once. A stop that cut the last line
    short drops it; one that left a whole last line without its newline ends it; either way the next line written
    starts a line of its own."""
    one, two, three = (RoundResult(n, n / 10, {}, 1, 1, 0, 0, 1.0) for n in (1, 2, 3))
    writer = MetricsWriter(tmp_path / "metrics.jsonl")
    writer.write(one)
    assert writer.restore(2, two.to_dict()) is True
    assert writer.restore(2, two.to_dict()) is False  # recorded already
    assert [r.round for r in read_metrics(writer.path)] == [1, 2]
    with writer.path.open("a") as handle:
        handle.write('{"round": 3, "glob')  # cut short, its round recorded in no checkpoint
    assert writer.restore(2, two.to_dict()) is False
    writer.write(three)
    assert [r.round for r in read_metrics(writer.path)] == [1, 2, 3]
    writer.path.write_text(writer.path.read_text().rstrip("\n"))  # the whole line, without its newline
    assert writer.restore(3, three.to_dict()) is False
    writer.write(RoundResult(4, 0.4, {}, 1, 1, 0, 0, 1.0))
    assert [r.round for r in read_metrics(writer.path)] == [1, 2, 3, 4]


def test_a_failing_progress_display_is_logged_and_the_round_goes_on() -> None:
    seen: list[Progress] = []
    warnings: list[tuple[str, dict]] = []

    class Log:
        def warning(self, event: str, **fields: object) -> None:
            warnings.append((event, fields))

    tell_progress(seen.append, Log(), "round", 2, 3, 4)  # type: ignore[arg-type]
    tell_progress(None, Log(), "round", 2, 3, 4)  # type: ignore[arg-type]

    def broken(progress: Progress) -> None:
        raise OSError("display gone")

    tell_progress(broken, Log(), "fleet", 1, 0, 8)  # type: ignore[arg-type]
    assert seen == [Progress("round", 2, 3, 4)]
    assert warnings == [("progress_display_failed", {"error": "OSError: display gone"})]
