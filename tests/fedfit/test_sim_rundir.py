"""A run's directory: fresh for every run, refused when it holds one, and the files read from the report."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from coordinator.metrics import RoundResult, TaskRecord
from fedfit.sim.report import build_report, read_report
from fedfit.sim.rundir import (
    claim_run_dir,
    metrics_rows,
    new_run_dir,
    refuse_used_dir,
    summary_text,
    write_run_outputs,
)

PNG = b"\x89PNG\r\n\x1a\n"


def report() -> dict:
    rounds = [RoundResult(round=n, global_accuracy=0.5 + n / 10, level_accuracy={"a": 0.5, "b": 0.4},
                          participants=2, selected=2, bytes_down=3_000_000, bytes_up=1_000_000, seconds=2.0,
                          tasks=[TaskRecord("sim-000", "a", "ok", "width=1"),
                                 TaskRecord("sim-001", "b", "declined", "width=0.5", reason="too big")],
                          trained_levels=["a"] if n == 1 else ["a", "b"], exit_accuracy={"exit1": 0.3, "exit2": 0.6},
                          trained_exits=["exit2"])
              for n in (1, 2)]
    return build_report("scalefl", "mosquitto", "2", rounds, {"agents": 2, "dataset": "digits", "model": "cnn"},
                        run={"version": "fedfit 0.1.0", "wall_seconds": 75.0}, tiers={"sim-000": "r=1"})


def test_new_run_dirs_never_collide(tmp_path: Path) -> None:
    first = new_run_dir(tmp_path, "heterofl", now=0.0)
    second = new_run_dir(tmp_path, "heterofl", now=0.0)
    assert first.is_dir() and second.is_dir() and first != second
    assert first.name.endswith("-heterofl") and second.name == first.name + "-2"


def test_a_directory_holding_anything_is_refused(tmp_path: Path) -> None:
    assert claim_run_dir(tmp_path / "fresh").is_dir()
    assert claim_run_dir(tmp_path / "fresh") == tmp_path / "fresh"  # empty: fine
    (tmp_path / "fresh" / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(ValueError, match="holds a run already \\(metrics.jsonl\\): give a new or empty"):
        claim_run_dir(tmp_path / "fresh")
    (tmp_path / "interrupted" / "agents").mkdir(parents=True)  # calibrations of a run stopped early
    with pytest.raises(ValueError, match="holds files already \\(agents\\)"):
        claim_run_dir(tmp_path / "interrupted")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is a file, not a directory"):
        claim_run_dir(tmp_path / "file")
    with pytest.raises(ValueError, match="cannot use .*file/sub for a run"):
        claim_run_dir(tmp_path / "file" / "sub")


def test_outputs_of_a_run(tmp_path: Path) -> None:
    written = write_run_outputs(report(), tmp_path)
    assert sorted(path.name for path in written) == ["accuracy.png", "metrics.csv", "report.json", "summary.txt",
                                                    "traffic.png"]
    assert read_report(tmp_path / "report.json") == report()
    for name in ("accuracy.png", "traffic.png"):
        assert (tmp_path / name).read_bytes()[:8] == PNG
    with (tmp_path / "metrics.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert [row["round"] for row in rows] == ["1", "2"]
    assert rows[0]["untrained"] == "b exit1" and rows[1]["untrained"] == "exit1"
    assert set(rows[0]) >= {"global_accuracy", "level_a", "level_b", "exit1", "exit2", "bytes_down", "seconds"}


def test_metrics_rows_and_summary() -> None:
    rows = metrics_rows(report())
    assert rows[1]["global_accuracy"] == pytest.approx(0.7) and rows[1]["level_b"] == 0.4
    text = summary_text(report())
    assert text.startswith("scalefl | 2 agents | digits")
    assert ("global accuracy (the model a user would deploy: the global model): final 0.7000, best 0.7000 (round 2)"
            in text)
    assert "tasks: 2 ok, 2 declined; 0 peaked over their budget" in text
    assert "traffic: 6.0 MB down, 2.0 MB up (4.00 MB a round)" in text
    assert "time: 2.0 s a round, 1 min 15 s in all" in text
    assert "refused or failed, per agent: sim-001 (-): 2 declined" in text
    assert "* no device trained this level" in text


def test_a_used_directory_is_refused_without_making_anything(tmp_path: Path) -> None:
    refuse_used_dir(tmp_path / "new" / "run")  # usable: nothing made yet
    assert not (tmp_path / "new").exists()
    (tmp_path / "new").mkdir()
    (tmp_path / "new" / "checkpoint.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="holds a run already"):
        refuse_used_dir(tmp_path / "new")


def test_the_models_line_counts_only_the_agents_that_hold_one() -> None:
    from fedfit.sim.rundir import models_text

    held = "b@" + "0" * 64
    line = models_text({"sim-000": held, "sim-001": f"did not say it holds {held} within 1 s"})
    assert line == f"models held at the end: 1 of 2 agents; b: sim-000; sim-001 none (did not say it holds {held} " \
                   f"within 1 s)"
