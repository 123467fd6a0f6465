"""Comparisons of runs: one row per method, the paper's baselines, fleet differences said, PNG and HTML."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from coordinator.metrics import RoundResult, TaskRecord
from fedfit.sim.compare import comparison_rows, fleet_differences, method_name, write_comparison
from fedfit.sim.report import build_report


def run(algorithm: str, accuracy: float, *, width: float = 1.0, seed: int = 0) -> dict:
    rounds = [RoundResult(round=n, global_accuracy=accuracy * n / 2, level_accuracy={"a": accuracy * n / 2},
                          participants=2, selected=2, bytes_down=2_000_000, bytes_up=2_000_000, seconds=1.0,
                          tasks=[TaskRecord("sim-000", "a", "ok", "width=1", metrics={"peak_bytes": 5.0,
                                                                                      "budget_bytes": 4.0}),
                                 TaskRecord("sim-001", "a", "rejected", "width=1", reason="update rejected")],
                          trained_levels=["a"])
              for n in (1, 2)]
    settings = {"agents": 2, "dataset": "digits", "partition": "iid", "model": "cnn", "seed": seed,
                "budgets": "fair", "allocator": "compact"}
    return build_report(algorithm, "mosquitto", "2", rounds, settings,
                        run={"wall_seconds": 30.0, "config": {"fedavg": {"width": width}}, "directory": "x"})


def test_rows_of_a_comparison() -> None:
    rows = comparison_rows([run("fedepth", 0.6), run("fedavg", 0.4, width=1 / 6)])
    assert [row["method"] for row in rows] == ["fedepth", "fedavg x1/6"]
    first = rows[0]
    assert first["global"] == pytest.approx(0.6) and first["best_global"] == pytest.approx(0.6)
    assert first["levels"] == {"a": pytest.approx(0.6)}
    assert (first["trained"], first["declined"], first["rejected"], first["over_budget"]) == (2, 0, 2, 2)
    assert first["mb_per_round"] == pytest.approx(4.0) and first["wall_seconds"] == 30.0
    assert "fedavg x1/6" in first["paper_baselines"] and "heterofl" in first["paper_baselines"]


def test_method_names() -> None:
    assert method_name(run("fedavg", 0.5)) == "fedavg"
    assert method_name(run("fedavg", 0.5, width=0.125)) == "fedavg x1/8"
    assert method_name(run("heterofl", 0.5)) == "heterofl"
    adaptive = run("adaptivefl", 0.5)
    assert method_name(adaptive) == "adaptivefl"
    adaptive["run"]["config"]["adaptivefl"] = {"selection": "random"}
    assert method_name(adaptive) == "adaptivefl-random"


def test_communication_waste_in_all_and_from_the_first_rounds_to_the_last(tmp_path: Path) -> None:
    def round_with(n: int, returned: int) -> RoundResult:
        return RoundResult(round=n, global_accuracy=0.5, level_accuracy={}, participants=1, selected=1,
                           bytes_down=1, bytes_up=1, seconds=1.0,
                           tasks=[TaskRecord("sim-000", "L1", "adapted" if returned < 100 else "ok", "-",
                                             params_sent=100, params_returned=returned)])

    rounds = [round_with(n, returned) for n, returned in enumerate((20, 40, 60, 100), start=1)]
    report = build_report("adaptivefl", "mosquitto", "2", rounds, {})
    row = comparison_rows([report])[0]
    assert row["waste"] == pytest.approx(1 - 220 / 400)
    assert row["waste_first_last"] == pytest.approx([0.7, 0.2])  # rounds 1-2, then 3-4
    assert row["shrunk_first_last"] == pytest.approx([1.0, 0.5])
    text = write_comparison([report], tmp_path)["txt"].read_text()
    assert "0.450 (0.70->0.20)" in text
    assert comparison_rows([run("heterofl", 0.5)])[0]["waste_first_last"] is None  # no parameters counted


def test_runs_on_different_fleets_are_said_so(tmp_path: Path) -> None:
    reports = [run("heterofl", 0.5), run("fedepth", 0.6, seed=1)]
    assert fleet_differences(reports) == ["seed: 0 / 1"]
    paths = write_comparison(reports, tmp_path)
    assert "NOT THE SAME FLEET: seed: 0 / 1" in paths["txt"].read_text()
    assert "not on the same fleet" in paths["html"].read_text()


def test_runs_whose_devices_train_at_other_speeds_are_not_the_same_fleet() -> None:
    older, same, slowed = run("heterofl", 0.5), run("fedepth", 0.6), run("fedavg", 0.4)
    same["settings"]["speeds"] = None  # as a run without --speeds records it, and one that predates it implies
    slowed["settings"]["speeds"], slowed["settings"]["device_speeds"] = "1,10", [1.0, 10.0]
    assert "speeds" not in older["settings"]
    assert fleet_differences([older, same]) == []
    assert fleet_differences([older, same, slowed]) == ["speeds: None / None / 1,10"]
    ones, spelled = run("heterofl", 0.5), run("fedepth", 0.6)  # the same factors, said otherwise
    ones["settings"]["speeds"], ones["settings"]["device_speeds"] = "1", [1.0, 1.0]
    spelled["settings"]["speeds"], spelled["settings"]["device_speeds"] = "1,10,10", [1.0, 10.0]
    assert fleet_differences([older, ones]) == [] and fleet_differences([slowed, spelled]) == []


def test_runs_sized_for_another_budget_are_not_the_same_fleet() -> None:
    older, dip, typical = run("scalefl", 0.5), run("flexfl", 0.6), run("adaptivefl", 0.7)
    dip["settings"]["size_for"], typical["settings"]["size_for"] = "dip", "typical"
    assert fleet_differences([older, dip]) == []  # a report that predates --size-for was sized for the dip
    assert fleet_differences([older, dip, typical]) == ["size_for: dip / dip / typical"]


def test_the_comparison_files(tmp_path: Path) -> None:
    paths = write_comparison([run("heterofl", 0.5), run("fedepth", 0.6), run("fedavg", 0.4, width=1 / 6)], tmp_path)
    text = paths["txt"].read_text()
    lines = text.splitlines()
    assert lines[0] == "2 agents | digits iid | cnn | budgets fair | seed 0 | 2 rounds"
    header = next(line for line in lines if line.startswith("method"))
    assert header.split()[:4] == ["method", "global", "best", "level"]
    assert any(line.startswith("fedavg x1/6") for line in lines)
    assert "fedepth: its paper compares with fedavg x1/6" in text
    data = json.loads(paths["json"].read_text())
    assert [row["method"] for row in data["rows"]] == ["fedepth", "heterofl", "fedavg x1/6"]  # ranked
    page = paths["html"].read_text()
    assert page.startswith("<!DOCTYPE html>") and "<td>fedepth</td>" in page
    embedded = page.split('src="data:image/png;base64,')[1].split('"')[0]
    assert base64.b64decode(embedded) == paths["png"].read_bytes()  # self-contained: the plot is in the page
    assert paths["png"].read_bytes()[:4] == b"\x89PNG"


def test_a_comparison_needs_a_run(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="at least one run"):
        write_comparison([], tmp_path)


def test_a_level_nobody_trained_is_marked_and_left_out_of_the_average(tmp_path: Path) -> None:
    rounds = [RoundResult(round=1, global_accuracy=0.7, level_accuracy={"a": 0.7, "b": 0.6, "c": 0.1},
                          participants=2, selected=2, bytes_down=1, bytes_up=1, seconds=1.0,
                          tasks=[TaskRecord("sim-000", "a", "ok", "width=1"),
                                 TaskRecord("sim-001", "b", "rejected", "width=0.5", reason="update rejected")],
                          trained_levels=["a", "b"])]
    report = build_report("heterofl", "mosquitto", "2", rounds, {"agents": 2}, run={"directory": "x"})
    row = comparison_rows([report])[0]
    assert row["untrained"] == ["c"]
    assert row["level_average"] == pytest.approx((0.7 + 0.6) / 2)  # c is a slice of the others' work
    assert row["rejected_by_agent"] == {"sim-001": 1}
    paths = write_comparison([report], tmp_path)
    text, page = paths["txt"].read_text(), paths["html"].read_text()
    assert "c 0.100*" in text and "b 0.600 " in text
    for document in (text, page):
        assert "no device trained that level (or exit) itself in the last round" in document
        assert "rejected per agent: sim-001 1" in document
    # In Markdown the mark is escaped: "- * ..." would be a list in a list, the mark lost.
    assert "\n- \\* no device trained that level" in paths["md"].read_text()


def test_runs_with_other_recipes_or_model_options_are_not_the_same_fleet() -> None:
    def with_config(config: dict) -> dict:
        report = run("heterofl", 0.5)
        report["run"]["config"] = config
        return report

    same = {"recipe": {"batch_size": 32}, "model": {"options": {"hidden": [8, 16]}}}
    assert fleet_differences([with_config(same), with_config(same)]) == []
    other = {"recipe": {"batch_size": 16}, "model": {"options": {"hidden": [8, 16]}}}
    assert fleet_differences([with_config(same), with_config(other)]) == [
        'recipe: {"batch_size": 32} / {"batch_size": 16}']


def seeded(algorithm: str, accuracies: dict[int, float], **config: object) -> list[dict]:
    """One synthetic run of ``algorithm`` per seed, its final accuracy as given."""
    runs = []
    for seed, accuracy in accuracies.items():
        report = run(algorithm, accuracy, seed=seed)
        report["run"]["config"].update(config)
        runs.append(report)
    return runs


def test_methods_over_seeds_lead_with_their_mean_and_spread(tmp_path: Path) -> None:
    import statistics

    reports = seeded("heterofl", {0: 0.5, 1: 0.6, 2: 0.4}) + seeded("fedepth", {0: 0.7, 1: 0.8, 2: 0.6})
    paths = write_comparison(reports, tmp_path, {"claim": "fedepth above heterofl"})
    data = json.loads(paths["json"].read_text())
    assert data["claim"] == "fedepth above heterofl" and data["differences"] == []
    rows = {row["method"]: row for row in data["over_seeds"]}
    assert list(rows) == ["fedepth", "heterofl"] and rows["fedepth"]["seeds"] == [0, 1, 2]  # ranked by the mean
    assert rows["fedepth"]["global"]["mean"] == pytest.approx(0.7)
    assert rows["fedepth"]["global"]["spread"] == pytest.approx(statistics.stdev([0.7, 0.8, 0.6]))
    assert rows["fedepth"]["outputs"] == {"a": pytest.approx(0.7)}
    assert rows["fedepth"]["trained"] == 3 * 2 and rows["fedepth"]["over_budget"] == 3 * 2  # summed over seeds
    assert rows["fedepth"]["late_change"]["mean"] == pytest.approx(0.35)  # each run: 0.5*acc then acc
    text = paths["txt"].read_text()
    assert text.splitlines()[:2] == ["2 agents | digits iid | cnn | budgets fair | seeds 0,1,2 | 2 rounds",
                                     "claim: fedepth above heterofl"]
    fedepth_line = next(line for line in text.splitlines() if line.startswith("fedepth "))
    assert fedepth_line.split()[:4] == ["fedepth", "3", "0.7000", "±0.1000"]
    assert "heterofl (seed 2)" in text and "NOT THE SAME FLEET" not in text
    page = paths["html"].read_text()
    assert "Over the seeds" in page and "not on the same fleet" not in page and "0.7000 ±0.1000" in page
    markdown = paths["md"].read_text()
    assert "| fedepth | 3 | 0.7000 ±0.1000 |" in markdown
    assert "- fedepth: its paper compares with" in markdown  # the method notes, once each
    assert markdown.count("- heterofl: its paper compares with") == 1


def test_seeds_of_one_method_that_differ_in_a_setting_are_said_to(tmp_path: Path) -> None:
    reports = seeded("fjord", {0: 0.5}, fjord={"widths": [1, 0.5]}) + seeded("fjord", {1: 0.6},
                                                                            fjord={"widths": [1, 0.2]})
    text = write_comparison(reports, tmp_path)["txt"].read_text()
    assert "NOT THE SAME FLEET: fjord: its seeds' runs differ in fjord.widths" in text


def test_seeds_that_differ_only_in_what_is_evaluated_or_in_a_setting_added_since_are_one_fleet(tmp_path: Path) -> None:
    # seed 0 made before scalefl.kd_reduction and data.levels_every existed; seed 1 with both
    reports = seeded("scalefl", {0: 0.5}, scalefl={"beta": 0.1}, data={"bn_samples": 50}) + seeded(
        "scalefl", {1: 0.6}, scalefl={"beta": 0.1, "kd_reduction": "batchmean"},
        data={"bn_samples": 50, "levels_every": 5})
    text = write_comparison(reports, tmp_path)["txt"].read_text()
    assert "NOT THE SAME FLEET" not in text
    # a setting one run predates is read as its default now: set to something else in the other, it is a difference
    set_apart = seeded("scalefl", {0: 0.5}, scalefl={"beta": 0.1}) + seeded(
        "scalefl", {1: 0.6}, scalefl={"beta": 0.1, "kd_reduction": "mean"})
    assert "differ in scalefl.kd_reduction" in write_comparison(set_apart, tmp_path / "d")["txt"].read_text()
    other = seeded("scalefl", {0: 0.5}, scalefl={"beta": 0.1}) + seeded("scalefl", {1: 0.6}, scalefl={"beta": 0.2})
    assert "differ in scalefl.beta" in write_comparison(other, tmp_path / "b")["txt"].read_text()
    # another method's section, and whether a run was resumed, say nothing of this one's seeds
    apart = seeded("heterofl", {0: 0.5}, flexfl={"kd_reduction": "batchmean"}) + seeded(
        "heterofl", {1: 0.6}, flexfl={"kd_reduction": "mean"}, resume=True)
    assert "NOT THE SAME FLEET" not in write_comparison(apart, tmp_path / "c")["txt"].read_text()


def test_runs_of_one_method_with_one_seed_are_not_averaged_and_say_why(tmp_path: Path) -> None:
    reports = seeded("heterofl", {0: 0.5, 1: 0.6}) + seeded("heterofl", {0: 0.7})
    paths = write_comparison(reports, tmp_path)
    data = json.loads(paths["json"].read_text())
    assert data["over_seeds"] == []
    assert data["remarks"] == [("not averaged over seeds: heterofl has more than one run with seed 0 (runs of one "
                                "experiment differ in their seed)")]
    assert [row["method"] for row in data["rows"]] == ["heterofl (seed 0)", "heterofl (seed 1)", "heterofl (seed 0)"]


def test_the_baselines_by_name_and_the_fleets_memory_against_all_large(tmp_path: Path) -> None:
    large = run("fedavg", 0.9)
    large["run"]["label"] = "all-large"
    small = run("fedavg", 0.4, width=1 / 6)
    small["run"]["label"] = "all-small"
    method = run("heterofl", 0.8)
    method["settings"]["serving"] = [{"tier": "r=1/2", "budget_bytes": 2**20, "devices": 3},
                                     {"tier": "r=1", "budget_bytes": 5 * 2**20, "devices": 1}]
    large["tasks"][0]["estimated_bytes"] = 4 * 2**20
    assert [method_name(report) for report in (large, small)] == ["all-large", "all-small (fedavg x1/6)"]
    paths = write_comparison([method, large, small], tmp_path)
    text = paths["txt"].read_text()
    assert ("memory: the fleet's budgets average 2.0 MiB a device, 0.50 of what All-Large asks of every device "
            "(4.0 MiB, its estimate with the same margin)") in text
    assert "all-large: the upper bound" in text and "all-small (fedavg x1/6): the lower bound" in text
    assert "all-large: its paper" not in text


def test_the_headline_is_the_deployed_model_named_and_ranked(tmp_path: Path) -> None:
    """A run whose global model's head no device trained reports the largest level some device trained (its
    accuracy, its name), and the comparison ranks methods by that, not by the untrained head."""
    untrained_head = run("scalefl", 0.1)
    for entry in untrained_head["rounds"]:
        entry.update(global_accuracy=0.8, deployed="3", global_model_accuracy=0.1)
    untrained_head["summary"].update(final_global_accuracy=0.8, deployed="3")
    rows = comparison_rows([run("heterofl", 0.5), untrained_head])
    text = write_comparison([run("heterofl", 0.5), untrained_head], tmp_path)["txt"].read_text()
    scalefl = next(line for line in text.splitlines() if line.startswith("scalefl"))
    assert rows[1]["model"] == "3" and "0.8000 (3)" in scalefl
    assert json.loads((tmp_path / "comparison.json").read_text())["rows"][0]["method"] == "scalefl"


def test_each_curve_is_named_after_its_own_run_once_ranked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from fedfit.sim import compare

    drawn: list[tuple[str, str]] = []
    def plot(reports: list[dict], names: list[str], path: Path) -> Path:
        drawn.extend((report["algorithm"], name) for report, name in zip(reports, names))
        path.write_bytes(b"")  # (the HTML page embeds it)
        return path

    monkeypatch.setattr(compare, "plot_comparison", plot)
    write_comparison([run("heterofl", 0.5), run("fedepth", 0.7)], tmp_path)
    assert drawn == [("fedepth", "fedepth"), ("heterofl", "heterofl")]


def bounded(accuracies: dict[str, dict[int, float]]) -> list[dict]:
    """Synthetic runs per method and seed; ``all-large``/``all-small`` as FedAvg's bounds."""
    reports = []
    for method, by_seed in accuracies.items():
        algorithm = "fedavg" if method.startswith(("all-", "fedavg")) else method
        width = {"all-large": 1.0, "all-small": 1 / 16}.get(method, 1 / 6)
        for report in seeded(algorithm, by_seed, fedavg={"width": width}):
            if method.startswith("all-"):
                report["run"]["label"] = method
            reports.append(report)
    return reports


def test_the_learning_goal_is_read_from_the_best_method_and_both_bounds() -> None:
    from fedfit.sim.compare import learning_goal

    # synthetic curves end at the accuracy given and rose from half of it: every one climbs
    goal = learning_goal(bounded({"all-large": {0: 0.88}, "fedepth": {0: 0.875}, "heterofl": {0: 0.70},
                                  "all-small": {0: 0.68}, "fedavg": {0: 0.99}}))  # FedAvg is no method
    assert goal is not None and goal.startswith("learning goal (seed 0): the best method, fedepth (0.8750), is "
                                                 "0.50 points below all-large (0.8800; goal: within 1)")
    assert "19.50 above all-small (fedavg x1/16) (0.6800; goal: more than half their gap, 10.00): met" in goal
    assert "not yet flat (last-5 change in points): fedepth " in goal
    exactly = learning_goal(bounded({"all-large": {0: 0.877}, "fedepth": {0: 0.867}, "all-small": {0: 0.679}}))
    assert "1.00 points below" in exactly and ": met" in exactly  # one point is within one point
    above = learning_goal(bounded({"all-large": {0: 0.86}, "fedepth": {0: 0.87}, "all-small": {0: 0.68}}))
    assert "0.01 points above all-large" not in above and "1.00 points above all-large" in above
    assert "not met" in learning_goal(bounded({"all-large": {0: 0.88}, "fedepth": {0: 0.86}, "all-small": {0: 0.68}}))
    assert "not met" in learning_goal(bounded({"all-large": {0: 0.88}, "fedepth": {0: 0.875}, "all-small": {0: 0.87}}))
    assert learning_goal(bounded({"all-large": {0: 0.88}, "fedepth": {0: 0.86}})) is None  # no lower bound
    assert learning_goal(bounded({"all-large": {0: 0.88}, "all-small": {0: 0.68}})) is None  # no method


def test_the_learning_goal_pairs_a_method_with_the_bounds_on_the_seeds_they_share(tmp_path: Path) -> None:
    # seed 1 of the method not run yet: the goal is read on seed 0 alone, not its mean against two seeds' bounds
    reports = bounded({"fedepth": {0: 0.80}, "all-large": {0: 0.85, 1: 0.70}, "all-small": {0: 0.50, 1: 0.40}})
    remarks = json.loads(write_comparison(reports, tmp_path)["json"].read_text())["remarks"]
    goal = next(remark for remark in remarks if remark.startswith("learning goal"))
    assert goal.startswith("learning goal (seed 0): the best method, fedepth (0.8000), is 5.00 points below "
                           "all-large (0.8500")


def test_a_private_run_has_its_epsilon_in_a_column_of_its_own(tmp_path: Path) -> None:
    plain = write_comparison([run("heterofl", 0.5)], tmp_path / "plain")["txt"].read_text()
    assert "epsilon" not in plain
    private = run("fedepth", 0.6)
    private["summary"].update(epsilon=4.125, delta=1e-5)
    row = comparison_rows([private])[0]
    assert (row["epsilon"], row["delta"]) == (4.125, 1e-5)
    text = write_comparison([run("heterofl", 0.5), private], tmp_path / "private")["md"].read_text()
    header = next(line for line in text.splitlines() if line.startswith("| method"))
    assert header.rstrip(" |").endswith("epsilon")
    rows = {line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("| ")}
    assert rows["fedepth"].rstrip(" |").endswith("4.12 (delta 1e-05)")
    assert rows["heterofl"].rstrip(" |").endswith("| -")  # not private: no epsilon
