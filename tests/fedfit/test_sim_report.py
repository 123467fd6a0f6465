from __future__ import annotations

import json
from pathlib import Path

from coordinator.metrics import RoundResult, TaskRecord
from fedfit.sim.report import build_report, format_table, write_report


def sample_rounds() -> list[RoundResult]:
    return [RoundResult(round=1, global_accuracy=0.8125, level_accuracy={"a": 0.8125, "b": 0.75}, participants=2,
                        selected=3, bytes_down=2_000_000, bytes_up=1_500_000, seconds=4.25,
                        tasks=[TaskRecord("sim-000", "a", "ok", "width=1"),
                               TaskRecord("sim-001", "b", "declined", "width=0.5", reason="too big")])]


def test_report_has_the_documented_shape(tmp_path: Path) -> None:
    report = build_report("heterofl", "mosquitto", "2.0.11", sample_rounds(), {"agents": 3}, secured=True)
    assert report["algorithm"] == "heterofl"
    assert report["broker"] == {"kind": "mosquitto", "version": "2.0.11", "secured": True}
    assert report["rounds"] == [{"round": 1, "global_accuracy": 0.8125, "level_accuracy": {"a": 0.8125, "b": 0.75},
                                 "exit_accuracy": {}, "participants": 2, "bytes_down": 2_000_000,
                                 "bytes_up": 1_500_000, "seconds": 4.25}]
    assert [t["status"] for t in report["tasks"]] == ["ok", "declined"]
    path = tmp_path / "out" / "r.json"
    write_report(report, path)
    assert json.loads(path.read_text()) == report


def test_table_lists_levels_and_traffic() -> None:
    table = format_table(sample_rounds())
    header, rule, row = table.splitlines()
    assert header.split() == ["round", "global", "lvl", "a", "lvl", "b", "agents", "MB", "down", "MB", "up",
                              "seconds"]
    assert set(rule.replace(" ", "")) == {"-"}
    assert row.split() == ["1", "0.8125", "0.8125", "0.7500", "2/3", "2.00", "1.50", "4.2"]


def test_report_and_table_show_every_exit_in_depth_order() -> None:
    rounds = [RoundResult(round=1, global_accuracy=0.9, level_accuracy={"1": 0.5, "2": 0.9}, participants=2,
                          selected=2, bytes_down=10, bytes_up=10, seconds=1.0,
                          exit_accuracy={"exit1": 0.5, "exit2": 0.7, "exit10": 0.9})]
    report = build_report("scalefl", "mosquitto", "2.0.11", rounds, {})
    assert report["rounds"][0]["exit_accuracy"] == {"exit1": 0.5, "exit2": 0.7, "exit10": 0.9}
    header = format_table(rounds).splitlines()[0].split()
    assert header[header.index("exit1"):header.index("exit10") + 1] == ["exit1", "exit2", "exit10"]


def test_report_shows_each_depth_wise_stage_peak_and_the_copies_trained() -> None:
    depthwise = TaskRecord("sim-002", "full", "adapted", "width=1", "width=1 segments=3:5,5:9",
                           "trained depth-wise, blocks 3-4 | 5-8 (skipped 0, 1, 2), to fit 12.9 MiB", 10,
                           {"peak_bytes": 12.0e6, "stage_peak_bytes.0": 11.5e6, "stage_peak_bytes.1": 12.0e6})
    mutual = TaskRecord("sim-003", "full", "ok", "width=1", "width=1", "trained 2 of up to 2 copies", 10,
                        {"peak_bytes": 40.0e6, "copies": 2.0})
    rounds = [RoundResult(round=1, global_accuracy=0.5, level_accuracy={}, participants=2, selected=2,
                          bytes_down=1, bytes_up=1, seconds=1.0, tasks=[depthwise, mutual])]
    first, second = build_report("fedepth", "mosquitto", "2", rounds, {})["tasks"]
    assert first["stage_peak_bytes"] == [11_500_000, 12_000_000] and first["copies"] == 1
    assert "skipped 0, 1, 2" in first["reason"] and first["spec_trained"] == "width=1 segments=3:5,5:9"
    assert second["stage_peak_bytes"] == [] and second["copies"] == 2
