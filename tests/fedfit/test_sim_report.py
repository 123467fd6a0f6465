"""The simulator's report: its shape, the summary and per-agent counts, the table (untrained levels marked), and
reading a report back."""

from __future__ import annotations

from pathlib import Path

import pytest

from coordinator.metrics import RoundResult, TaskRecord
from fedfit.sim.report import (
    build_report,
    communication,
    format_table,
    format_timing,
    level_average,
    levels_round,
    read_report,
    summarize,
    write_report,
)


def sample_rounds() -> list[RoundResult]:
    return [RoundResult(round=1, global_accuracy=0.8125, level_accuracy={"a": 0.8125, "b": 0.75}, participants=2,
                        selected=3, bytes_down=2_000_000, bytes_up=1_500_000, seconds=4.25,
                        tasks=[TaskRecord("sim-000", "a", "ok", "width=1", num_samples=10,
                                          metrics={"loss": 0.5, "steps": 3.0, "seconds": 1.5, "peak_bytes": 90.0,
                                                   "budget_bytes": 100.0, "estimated_bytes": 95.0},
                                          screening={"norm": 1.0, "bound": 2.0}, params_sent=100,
                                          params_returned=100),
                               TaskRecord("sim-001", "b", "declined", "width=0.5", reason="too big",
                                          params_sent=50)],
                        trained_levels=["a"], timing={"planning": 0.25, "collecting": 3.5, "training": 1.5}),
            RoundResult(round=2, global_accuracy=0.875, level_accuracy={"a": 0.875, "b": 0.8}, participants=2,
                        selected=2, bytes_down=2_000_000, bytes_up=1_000_000, seconds=3.75,
                        tasks=[TaskRecord("sim-000", "a", "ok", "width=1",
                                          metrics={"peak_bytes": 120.0, "budget_bytes": 100.0}),
                               TaskRecord("sim-001", "b", "rejected", "width=0.5", reason="update rejected: ...")],
                        trained_levels=["a", "b"])]


def test_report_has_the_documented_shape(tmp_path: Path) -> None:
    run = {"version": "fedfit 0.1.0", "wall_seconds": 12.5, "config": {"algorithm": "heterofl"}}
    report = build_report("heterofl", "mosquitto", "2.0.11", sample_rounds(), {"agents": 2}, secured=True, run=run,
                          tiers={"sim-000": "r=1", "sim-001": "r=1/2"})
    assert list(report) == ["algorithm", "broker", "run", "summary", "rounds", "tasks", "agents", "tiers", "settings"]
    assert report["broker"] == {"kind": "mosquitto", "version": "2.0.11", "secured": True}
    assert report["run"] == run
    assert report["rounds"][0] == {"round": 1, "global_accuracy": 0.8125, "deployed": "global",
                                   "global_model_accuracy": 0.8125, "level_accuracy": {"a": 0.8125, "b": 0.75},
                                   "exit_accuracy": {}, "trained_levels": ["a"], "trained_exits": [],
                                   "participants": 2, "selected": 3, "bytes_down": 2_000_000, "bytes_up": 1_500_000,
                                   "seconds": 4.25, "waste": pytest.approx(1 / 3), "shrunk": 0.5,
                                   "timing": {"planning": 0.25, "collecting": 3.5, "training": 1.5}}
    assert report["rounds"][1]["waste"] is None  # a report of a run that counted no parameters
    first = report["tasks"][0]
    assert (first["loss"], first["steps"], first["seconds"]) == (0.5, 3, 1.5)
    assert first["over_budget"] is False and first["screening"] == {"norm": 1.0, "bound": 2.0}
    assert report["tasks"][1]["over_budget"] is None  # declined: no peak
    assert report["tasks"][2]["over_budget"] is True
    assert report["agents"]["sim-001"] == {"tier": "r=1/2", "ok": 0, "adapted": 0, "declined": 1, "failed": 0,
                                           "rejected": 1, "skipped": 0, "missing": 0, "over_budget": 0}
    assert report["summary"]["devices_served"] == [1, 2]  # sim-001 never trained
    assert [(t["tier"], t["devices"], t["served"], t["declined"]) for t in report["tiers"]] == [
        ("r=1", 1, 1, 0), ("r=1/2", 1, 0, 1)]
    assert report["agents"]["sim-000"]["ok"] == 2 and report["agents"]["sim-000"]["over_budget"] == 1
    path = tmp_path / "out" / "r.json"
    write_report(report, path)
    assert read_report(path) == report


def test_summary_of_a_run() -> None:
    report = build_report("heterofl", "mosquitto", "2", sample_rounds(), {}, run={"wall_seconds": 9.0})
    summary = report["summary"]
    assert summary["final_global_accuracy"] == 0.875 and summary["best_global_accuracy"] == 0.875
    assert summary["best_round"] == 2 and summary["final_level_average"] == pytest.approx((0.875 + 0.8) / 2)
    assert summary["tasks"]["ok"] == 2 and summary["tasks"]["rejected"] == 1 and summary["trained"] == 2
    assert summary["over_budget"] == 1
    assert summary["bytes_down"] == 4_000_000 and summary["bytes_per_round"] == pytest.approx(3_250_000)
    assert summary["round_seconds"] == pytest.approx(4.0) and summary["wall_seconds"] == 9.0
    assert summary["communication_waste"] == pytest.approx(1 / 3) and summary["shrunk_share"] == 0.5
    assert summarize([], []) == {"rounds": 0}


def test_communication_waste_counts_what_came_back_of_what_was_sent() -> None:
    tasks = [TaskRecord("a", "L1", "ok", "-", params_sent=100, params_returned=100),
             TaskRecord("b", "L1", "adapted", "-", params_sent=100, params_returned=40),
             TaskRecord("c", "M1", "failed", "-", params_sent=60),
             TaskRecord("d", "-", "skipped", "-")]  # nothing sent: not a dispatched task
    assert tasks[1].waste == pytest.approx(0.6) and tasks[3].waste is None
    report = build_report("adaptivefl", "mosquitto", "2", [RoundResult(
        round=1, global_accuracy=0.5, level_accuracy={}, participants=2, selected=4, bytes_down=1, bytes_up=1,
        seconds=1.0, tasks=tasks)], {})
    assert [task["waste"] for task in report["tasks"]] == [0.0, pytest.approx(0.6), 1.0, None]
    measured = communication(report["tasks"])
    assert report["rounds"][0]["waste"] == measured["waste"] == report["summary"]["communication_waste"]
    assert measured["waste"] == pytest.approx(1 - 140 / 260)
    assert measured["shrunk"] == pytest.approx(1 / 3)  # adapted (or declined) of the three dispatched
    assert communication([]) == {"waste": None, "shrunk": None}


def test_table_lists_levels_and_traffic_and_marks_levels_nobody_trained() -> None:
    report = build_report("heterofl", "mosquitto", "2", sample_rounds(), {})
    lines = format_table(report["rounds"]).splitlines()
    header, rule, first, second, note = lines
    assert header.split() == ["round", "global", "lvl", "a", "lvl", "b", "agents", "waste", "MB", "down", "MB",
                              "up", "seconds"]
    assert set(rule.replace(" ", "")) == {"-"}
    assert first.split() == ["1", "0.8125", "0.8125", "0.7500*", "2/3", "0.333", "2.00", "1.50", "4.2"]
    assert second.split() == ["2", "0.8750", "0.8750", "0.8000", "2/2", "-", "2.00", "1.00", "3.8"]
    assert note.startswith("* no device trained this level")


def test_the_headline_is_the_deployed_model_named_in_the_report_table_and_summary() -> None:
    """A round whose global model no device trained: its report's global figure is the deployed level's, named, the
    global model's kept beside it; the table names the model in a column of its own."""
    rounds = sample_rounds()
    rounds[0].trained_levels, rounds[0].deployed, rounds[0].deployed_accuracy = ["b"], "b", 0.75
    report = build_report("heterofl", "mosquitto", "2", rounds, {})
    first = report["rounds"][0]
    assert (first["global_accuracy"], first["deployed"], first["global_model_accuracy"]) == (0.75, "b", 0.8125)
    assert report["summary"]["deployed"] == "global" and report["summary"]["best_global_accuracy"] == 0.875
    lines = format_table(report["rounds"]).splitlines()
    assert lines[0].split()[:3] == ["round", "global", "model"]
    assert lines[2].split()[:5] == ["1", "0.7500", "b", "0.8125*", "0.7500"]
    assert lines[3].split()[:3] == ["2", "0.8750", "global"]
    assert any(line.startswith("global: the accuracy of the model a user would deploy") for line in lines)


def test_report_and_table_show_every_exit_in_depth_order() -> None:
    rounds = [RoundResult(round=1, global_accuracy=0.9, level_accuracy={"1": 0.5, "2": 0.9}, participants=2,
                          selected=2, bytes_down=10, bytes_up=10, seconds=1.0,
                          exit_accuracy={"exit1": 0.5, "exit2": 0.7, "exit10": 0.9}, trained_levels=["1", "2"],
                          trained_exits=["exit1", "exit2", "exit10"])]
    report = build_report("scalefl", "mosquitto", "2.0.11", rounds, {})
    assert report["rounds"][0]["exit_accuracy"] == {"exit1": 0.5, "exit2": 0.7, "exit10": 0.9}
    table = format_table(report["rounds"])
    header = table.splitlines()[0].split()
    assert header[header.index("exit1"):header.index("exit10") + 1] == ["exit1", "exit2", "exit10"]
    assert "*" not in table  # everything was trained


def test_report_shows_each_depth_wise_stage_peak_micro_batches_and_the_copies_trained() -> None:
    depthwise = TaskRecord("sim-002", "full", "adapted", "width=1", "width=1 segments=3:5,5:9",
                           "trained depth-wise, blocks 3-4 | 5-8 (skipped 0, 1, 2), to fit 12.9 MiB", 10,
                           {"peak_bytes": 12.0e6, "stage_peak_bytes.0": 11.5e6, "stage_peak_bytes.1": 12.0e6,
                            "micro_batched_stages": 1.0, "skipped_blocks": 3.0})
    mutual = TaskRecord("sim-003", "full", "ok", "width=1", "width=1", "trained 2 of up to 2 copies", 10,
                        {"peak_bytes": 40.0e6, "copies": 2.0})
    rounds = [RoundResult(round=1, global_accuracy=0.5, level_accuracy={}, participants=2, selected=2,
                          bytes_down=1, bytes_up=1, seconds=1.0, tasks=[depthwise, mutual])]
    report = build_report("fedepth", "mosquitto", "2", rounds, {})
    first, second = report["tasks"]
    assert first["stage_peak_bytes"] == [11_500_000, 12_000_000] and first["copies"] == 1
    assert first["micro_batched_stages"] == 1 and first["skipped_blocks"] == 3
    assert "skipped 0, 1, 2" in first["reason"] and first["spec_trained"] == "width=1 segments=3:5,5:9"
    assert second["stage_peak_bytes"] == [] and second["copies"] == 2
    assert report["summary"]["micro_batched"] == 1 and report["summary"]["partial"] == 1


@pytest.mark.parametrize(("content", "said"), [(None, "does not exist"), ("not json", "is not a FedFit report"),
                                               ('{"rounds": []}', "lacks algorithm, rounds or tasks")])
def test_reading_something_else_is_one_sentence(tmp_path: Path, content: str | None, said: str) -> None:
    path = tmp_path / "report.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=said):
        read_report(path)


def test_the_summary_counts_what_adapted_devices_fell_to() -> None:
    def record(agent: str, status: str, sent: str, trained: str | None) -> TaskRecord:
        return TaskRecord(agent, sent, status, "width=1", level_trained=trained)

    tasks = [record("a", "adapted", "M3", "M3'"), record("b", "adapted", "M3", "M3'"), record("c", "adapted", "M2", "M1"),
             record("d", "ok", "M2", "M2"), record("e", "adapted", "full", None)]
    rounds = [RoundResult(round=1, global_accuracy=0.5, level_accuracy={}, participants=5, selected=5, bytes_down=1,
                          bytes_up=1, seconds=1.0, tasks=tasks)]
    report = build_report("flexfl", "mosquitto", "2", rounds, {})
    assert report["summary"]["adaptations"] == {"M2->M1": 1, "M3->M3'": 2}
    assert [task["level_trained"] for task in report["tasks"]] == ["M3'", "M3'", "M1", "M2", None]


def test_the_timing_table_lists_the_phases_any_round_went_through_in_order() -> None:
    report = build_report("heterofl", "mosquitto", "2.0.11", sample_rounds(), {}, secured=True)
    lines = format_timing(report["rounds"]).splitlines()
    assert lines[0].startswith("where the time went (seconds)")
    assert lines[1].split() == ["round", "seconds", "planning", "collecting", "training"]
    assert lines[3].split() == ["1", "4.25", "0.250", "3.500", "1.500"]
    assert lines[4].split() == ["2", "3.75", "-", "-", "-"]  # a round without timing (an older report)
    assert format_timing([{**r, "timing": {}} for r in report["rounds"]]) == ""


def test_a_round_that_did_not_evaluate_its_levels_has_no_level_average_and_the_summary_reads_the_last_that_did(
) -> None:
    rounds = sample_rounds()
    rounds.append(RoundResult(round=3, global_accuracy=0.9, level_accuracy={"a": 0.9}, participants=1, selected=1,
                              bytes_down=0, bytes_up=0, seconds=1.0, trained_levels=["a", "b"],
                              levels_evaluated=False))  # data.levels_every: only the deployable level
    report = build_report("heterofl", "mosquitto", "2", rounds, {})
    assert level_average(report["rounds"][-1]) is None
    assert levels_round(report["rounds"])["round"] == 2
    summary = report["summary"]
    assert summary["final_global_accuracy"] == 0.9  # the headline is every round's
    assert summary["final_level_average"] == pytest.approx((0.875 + 0.8) / 2)  # round 2's levels, not a's alone
    assert "levels_evaluated" not in report["rounds"][1]  # a round that evaluated them all, as reports before it
    assert level_average(report["rounds"][1]) == pytest.approx((0.875 + 0.8) / 2)


def test_a_private_run_shows_the_epsilon_spent_each_round_in_its_report_table_and_summary() -> None:
    rounds = sample_rounds()
    assert "epsilon" not in format_table(build_report("heterofl", "mosquitto", "2", rounds, {})["rounds"])
    for number, result in enumerate(rounds, start=1):
        result.privacy = {"epsilon": 1.25 * number, "delta": 1e-5, "clip": 1.0}
    report = build_report("heterofl", "mosquitto", "2", rounds, {})
    assert report["rounds"][1]["privacy"]["epsilon"] == 2.5
    assert (report["summary"]["epsilon"], report["summary"]["delta"]) == (2.5, 1e-5)
    lines = format_table(report["rounds"]).splitlines()
    assert lines[0].split()[-1] == "epsilon" and lines[2].split()[-1] == "1.25" and lines[3].split()[-1] == "2.5"
    assert "epsilon: the privacy spent after the round, at delta 1e-05 (docs/privacy.md)" in lines
