"""``fedfit compare`` through a real mosquitto on digits: seeds with their means and spreads, the baselines, an
experiment file, and a comparison stopped part-way and resumed."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import pytest

from fedfit.cli import main
from fedfit.sim.progress import ProgressPrinter

pytestmark = [pytest.mark.broker, pytest.mark.slow]

#: A small, quick federation on digits (the coordinator's part of an experiment file).
TINY = {"model": {"family": "cnn", "options": {"hidden": [16, 32, 64]}},
        "data": {"dataset": "digits", "bn_samples": 300},
        "recipe": {"epochs": 1, "batch_size": 16, "lr": 0.05}, "levels": [1.0, 0.5, 0.25],
        "deployment": {"deliver": False}}  # (the models' delivery has its own end-to-end test)


def write_experiment(path: Path, rounds: int, **experiment: Any) -> Path:
    path.write_text(json.dumps({**TINY, "rounds": rounds, "experiment": experiment}))  # JSON is YAML
    return path


def reports(directory: Path) -> dict[str, dict[str, Any]]:
    return {f"{path.parent.parent.name}/{path.parent.name}": json.loads(path.read_text())
            for path in sorted(directory.glob("seed-*/*/report.json"))}


def test_seeds_and_baselines_give_each_method_its_mean_and_spread(mosquitto_installed: None, tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    config = write_experiment(tmp_path / "x.yaml", 1, claim="HeteroFL stays close to All-Large",
                              paper="Table 1: 0.99 vs 0.99", agents=3, budgets="fair")
    out = tmp_path / "cmp"
    code = main(["compare", "--config", str(config), "--algorithms", "heterofl", "--baseline", "all-large,all-small",
                 "--seeds", "3,4", "--insecure-broker", "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    runs = reports(out)
    assert sorted(runs) == [f"seed-{seed}/{label}" for seed in (3, 4) for label in ("all-large", "all-small",
                                                                                     "heterofl")]
    for name, report in runs.items():
        assert report["settings"]["seed"] == int(name[5]) and report["settings"]["agents"] == 3
        assert report["run"]["label"] == name.split("/")[1]
        assert {task["status"] for task in report["tasks"]} == {"ok"}
    # All-Large trains the full model on every device, all-small the width the smallest tier affords: FedAvg both.
    large, small = runs["seed-3/all-large"], runs["seed-3/all-small"]
    assert large["algorithm"] == small["algorithm"] == "fedavg"
    assert large["run"]["config"]["fedavg"]["width"] == 1.0 > small["run"]["config"]["fedavg"]["width"]
    assert {task["spec_sent"] for task in large["tasks"]} != {task["spec_sent"] for task in small["tasks"]}
    # The seeds' table: each column's mean and sample spread over the two runs of each method.
    comparison = json.loads((out / "comparison.json").read_text())
    assert comparison["claim"] == "HeteroFL stays close to All-Large"
    rows = {row["method"]: row for row in comparison["over_seeds"]}
    assert set(rows) == {"heterofl", "all-large", next(name for name in rows if name.startswith("all-small ("))}
    finals = [runs[f"seed-{seed}/heterofl"]["summary"]["final_global_accuracy"] for seed in (3, 4)]
    assert rows["heterofl"]["seeds"] == [3, 4]
    assert rows["heterofl"]["global"]["mean"] == pytest.approx(statistics.mean(finals))
    assert rows["heterofl"]["global"]["spread"] == pytest.approx(statistics.stdev(finals))
    assert rows["heterofl"]["trained"] == sum(r["summary"]["trained"] for n, r in runs.items() if "heterofl" in n)
    text = (out / "comparison.txt").read_text()
    assert "seeds 3,4" in text and "claim: HeteroFL stays close to All-Large" in text and "over the seeds:" in text
    assert "heterofl (seed 4)" in text and "all-large: the upper bound" in text
    assert (out / "comparison.md").read_text().count("| heterofl |") == 1
    for seed in (3, 4):  # each seed's own comparison
        assert json.loads((out / f"seed-{seed}" / "comparison.json").read_text())["over_seeds"] == []
    # The whole directory can be read again as it is.
    again = tmp_path / "again"
    assert main(["compare", str(out), "--out", str(again)]) == 0
    read_again = json.loads((again / "comparison.json").read_text())["over_seeds"]
    assert sorted(read_again, key=lambda row: row["method"]) == sorted(comparison["over_seeds"],
                                                                        key=lambda row: row["method"])


def test_a_comparison_stopped_part_way_goes_on_where_it_stopped(mosquitto_installed: None, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    config = write_experiment(tmp_path / "x.yaml", 3, algorithms=["heterofl", "fedavg"], seeds=[0], agents=2,
                              budgets="fair", partition="iid")
    out = tmp_path / "cmp"
    said = capsys.readouterr()
    on_round = ProgressPrinter.on_round

    def stop_fedavg_after_round_2(self: ProgressPrinter, result: Any) -> None:
        on_round(self, result)
        if self.label == "fedavg: " and result.round == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(ProgressPrinter, "on_round", stop_fedavg_after_round_2)
    assert main(["compare", "--config", str(config), "--insecure-broker", "--out", str(out)]) == 130
    said = capsys.readouterr()
    assert f"compare --resume {out}" in said.err
    assert (out / "seed-0" / "heterofl" / "report.json").exists()
    assert not (out / "seed-0" / "fedavg" / "report.json").exists()
    first_part = (out / "seed-0" / "heterofl" / "report.json").read_bytes()
    monkeypatch.setattr(ProgressPrinter, "on_round", on_round)
    config.write_text("not: what the comparison started with\n")  # the comparison's own copy is what counts

    assert main(["compare", "--resume", str(out), "--agents", "3"]) == 2  # it goes on as it started
    assert main(["compare", "--resume", str(out)]) == 0, capsys.readouterr().err
    said = capsys.readouterr()
    assert "heterofl (seed 0): finished already" in said.err and "fedavg (seed 0): going on" in said.err
    assert "resumed after round 2 of 3" in said.err
    assert (out / "seed-0" / "heterofl" / "report.json").read_bytes() == first_part
    fedavg = json.loads((out / "seed-0" / "fedavg" / "report.json").read_text())
    assert [r["round"] for r in fedavg["rounds"]] == [1, 2, 3]
    assert fedavg["run"]["resumed_after_round"] == 2 and fedavg["settings"]["rounds"] == 3
    lines = (out / "seed-0" / "fedavg" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["round"] for line in lines] == [1, 2, 3]  # no round run twice
    assert [task["round"] for task in fedavg["tasks"]] == [1, 1, 2, 2, 3, 3]
    rows = json.loads((out / "comparison.json").read_text())["rows"]
    assert [row["method"] for row in rows] == ["heterofl", "fedavg x1/6"]

    # A finished comparison whose curves still climb is carried on to more rounds, never cut back.
    assert main(["compare", "--resume", str(out), "--rounds", "2"]) == 2
    assert "cannot cut its runs back to 2" in capsys.readouterr().err
    assert main(["compare", "--resume", str(out), "--rounds", "4"]) == 0, capsys.readouterr().err
    said = capsys.readouterr()
    assert said.err.count("resumed after round 3 of 4") == 2
    for label in ("heterofl", "fedavg"):
        report = json.loads((out / "seed-0" / label / "report.json").read_text())
        assert [r["round"] for r in report["rounds"]] == [1, 2, 3, 4] and report["settings"]["rounds"] == 4
        assert report["run"]["resumed_after_round"] == 3
        lines = (out / "seed-0" / label / "metrics.jsonl").read_text().splitlines()
        assert [json.loads(line)["round"] for line in lines] == [1, 2, 3, 4]
    assert json.loads((out / "compare.json").read_text())["arguments"]["rounds"] == 4  # later resumes keep it
    kept = json.loads((out / "at-round-3" / "comparison.json").read_text())  # the comparison before, as it stood
    assert kept["heading"].endswith("| 3 rounds") and kept["rows"][0]["method"] == "heterofl"
    assert json.loads((out / "comparison.json").read_text())["heading"].endswith("| 4 rounds")
    assert main(["compare", "--resume", str(out)]) == 0
    assert capsys.readouterr().err.count("finished already") == 2


def test_a_run_stopped_in_its_first_round_goes_on_with_that_round(mosquitto_installed: None, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    from coordinator.round import Round

    config = write_experiment(tmp_path / "x.yaml", 2, algorithms=["heterofl"], agents=2, budgets="fair")
    out = tmp_path / "cmp"
    wait = Round.wait

    def stopped_while_collecting(self: Round, *args: Any, **kwargs: Any) -> None:
        raise KeyboardInterrupt  # the round's tasks are planned, journaled and sent: then the process stops

    monkeypatch.setattr(Round, "wait", stopped_while_collecting)
    assert main(["compare", "--config", str(config), "--insecure-broker", "--out", str(out)]) == 130
    run_dir = out / "heterofl"
    assert (run_dir / "round").exists() and not (run_dir / "checkpoint.safetensors").exists()
    monkeypatch.setattr(Round, "wait", wait)
    capsys.readouterr()
    assert main(["compare", "--resume", str(out)]) == 0, capsys.readouterr().err
    report = json.loads((run_dir / "report.json").read_text())
    assert [r["round"] for r in report["rounds"]] == [1, 2]
    assert {task["status"] for task in report["tasks"]} == {"ok"} and len(report["tasks"]) == 4
    assert "resumed_after_round" not in report["run"]  # nothing was finished: round 1 went on from its journal
