"""End to end: whole federations over a real mosquitto, through the simulator and the command line. The simulator
starts its own mosquitto, secured as `fedfit broker init` makes it (TLS, a login per agent, the ACL)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from common.cores import available_cores
from coordinator.config import FeDepthConfig
from fedfit.sim.harness import SimOptions, run_simulation

from .conftest import tiny_config

pytestmark = [pytest.mark.broker, pytest.mark.slow]


def simulate(tmp_path: Path, algorithm: str, partition: str = "iid", agents: int = 5, rounds: int = 2,
             budgets: str = "tiers"):
    options = SimOptions(algorithm=algorithm, agents=agents, rounds=rounds, dataset="digits", partition=partition,
                         seed=1, federation=f"e2e-{algorithm}", base=tiny_config(), budgets=budgets,
                         state_dir=str(tmp_path / algorithm))
    outcome = run_simulation(options, progress=None)
    assert outcome.report["broker"]["kind"] == "mosquitto" and outcome.report["broker"]["secured"]
    return outcome


@pytest.mark.parametrize("name", ["heterofl", "fedavg", "decoupled"])
def test_heterofl_fedavg_decoupled_complete_and_heterofl_sends_less(name: str, mosquitto_installed: None,
                                                                    tmp_path: Path) -> None:
    # Width tiers: each device can train the model of its width, and no more (the budgets say exactly that).
    outcome = simulate(tmp_path, name, budgets="widths:1,1/2,1/4")
    rounds = outcome.report["rounds"]
    assert [r["round"] for r in rounds] == [1, 2]
    assert all(r["bytes_down"] > 0 and r["bytes_up"] > 0 for r in rounds)
    assert (tmp_path / name / "checkpoint.safetensors").exists()
    assert len((tmp_path / name / "metrics.jsonl").read_text().splitlines()) == 2
    for output in ("report.json", "metrics.csv", "summary.txt", "accuracy.png", "traffic.png"):
        assert (tmp_path / name / output).exists(), output
    assert list((tmp_path / name / "agents").glob("sim-*/local-data.npz"))  # the agents' state is the run's
    # Every device of every tier trains what its tier names (HeteroFL and Decoupled: the level of its width,
    # masked cross-entropy or not; FedAvg ignores memory), on any CPU: the budget is that model's own need.
    tasks = outcome.report["tasks"]
    assert {task["status"] for task in tasks} == {"ok"}, tasks
    assert all(r["participants"] == 5 for r in rounds)
    # (Whether a peak stays under its budget is not asked of these sub-MB tasks: a CPU peak moves by about
    # 0.3 MB between identical runs, more than their whole margin.)
    if name != "decoupled":
        # 10 classes: chance is 0.1; two short rounds on digits already do far better.
        assert rounds[-1]["global_accuracy"] > 0.4, rounds
    first = [task for task in tasks if task["round"] == 1]
    full = max(task["params_sent"] for task in first)
    if name == "fedavg":  # the full model to every device
        assert all(task["params_sent"] == full for task in first)
    else:
        tiers = {agent: entry["tier"] for agent, entry in outcome.report["agents"].items()}
        width_of = {"r=1": "a", "r=1/2": "b", "r=1/4": "c"}
        assert all(t["level"] == width_of[tiers[t["agent"]]] for t in tasks), tasks
        assert set(rounds[0]["level_accuracy"]) == {"a", "b", "c"}
        # Less than FedAvg sends, the full model to each of the 5: the narrower tiers get their slices.
        assert sum(task["params_sent"] for task in first) < len(first) * full
    if name == "heterofl":
        assert rounds[0]["trained_levels"] == ["a", "b", "c"]


def test_fedrolex_rolls_every_narrowed_window_one_channel_a_round(mosquitto_installed: None, tmp_path: Path) -> None:
    outcome = simulate(tmp_path, "fedrolex", budgets="widths:1,1/2,1/4")
    tasks, rounds = outcome.report["tasks"], outcome.report["rounds"]
    assert {task["status"] for task in tasks} == {"ok"} and all(r["participants"] == 5 for r in rounds)
    # Round 1's windows are the leading channels (HeteroFL's slices), round 2's start one channel later. The agents
    # trained their widths as sent: nothing was adapted.
    for task in tasks:
        width = task["spec_sent"].split()[0]
        assert task["spec_sent"] == (f"{width} roll=1" if task["round"] == 2 else width), task
        assert task["spec_trained"] == task["spec_sent"] and task["level_trained"] == task["level"], task
    assert list(rounds[-1]["level_accuracy"]) == [] or set(rounds[-1]["level_accuracy"]) <= {"global"}
    assert rounds[-1]["global_accuracy"] > 0.4, rounds  # 10 digits: chance is 0.1


def test_depthfl_trains_each_tier_to_the_depth_it_affords_with_a_classifier_per_stage(
        mosquitto_installed: None, tmp_path: Path) -> None:
    # The CNN's three blocks are its stages: levels 1, 2 and 3 (1, 2 and 3 classifiers); the tiers' budgets (of
    # the full model's plain training memory) afford level 3 (with its exits and distillation: more than the plain
    # full model), 2 and 1.
    outcome = simulate(tmp_path, "depthfl", budgets="fractions:1.5,0.8,0.5")
    tasks, rounds = outcome.report["tasks"], outcome.report["rounds"]
    tiers = {agent: entry["tier"] for agent, entry in outcome.report["agents"].items()}
    level_of = {"3/2 of full": "3", "0.8 of full": "2", "1/2 of full": "1"}
    assert {task["status"] for task in tasks} == {"ok"}, tasks
    assert all(task["level"] == level_of[tiers[task["agent"]]] for task in tasks), tasks
    assert {task["spec_trained"] for task in tasks} == {"width=1 exits=0,1", "width=1 depth=2 exits=0,1",
                                                         "width=1 depth=1 exits=0"}
    last = rounds[-1]
    assert set(last["level_accuracy"]) == set(last["trained_levels"]) == {"1", "2", "3", "ensemble"}
    assert set(last["exit_accuracy"]) == {"exit1", "exit2", "exit3"} == set(last["trained_exits"])
    assert last["global_model_accuracy"] == last["exit_accuracy"]["exit3"]
    # The headline: the ensemble of the classifiers trained (here all three), DepthFL's paper's.
    assert last["deployed"] == "ensemble" and last["global_accuracy"] == last["level_accuracy"]["ensemble"]
    assert max(last["exit_accuracy"].values()) > 0.4, last  # 10 digits: chance is 0.1


def test_fjord_serves_each_tier_its_widest_width_and_evaluates_every_width(mosquitto_installed: None,
                                                                          tmp_path: Path) -> None:
    # Each tier affords the model of its width (ordered dropout and D-KD included): its p_max on FjORD's grid.
    outcome = simulate(tmp_path, "fjord", budgets="widths:1,0.6,0.2")
    tasks, rounds = outcome.report["tasks"], outcome.report["rounds"]
    tiers = {agent: entry["tier"] for agent, entry in outcome.report["agents"].items()}
    assert {task["status"] for task in tasks} == {"ok"}, tasks
    assert all(task["level"] == {"r=1": "a", "r=0.6": "c", "r=0.2": "e"}[tiers[task["agent"]]] for task in tasks)
    assert all(task["spec_trained"] == task["spec_sent"] for task in tasks)
    # Ordered dropout trains every width up to a device's p_max: each is trained, each evaluated.
    assert set(rounds[-1]["level_accuracy"]) == set(rounds[-1]["trained_levels"]) == {"a", "b", "c", "d", "e"}
    assert rounds[-1]["global_accuracy"] > 0.4, rounds  # 10 digits: chance is 0.1


def test_non_iid_shards_use_masked_cross_entropy(mosquitto_installed: None, tmp_path: Path) -> None:
    outcome = simulate(tmp_path, "heterofl", partition="shards:2", agents=5, rounds=2)
    assert outcome.report["settings"]["masked_ce"] is True  # HeteroFL's default (recipe.masked_ce unset)
    rounds = outcome.report["rounds"]
    assert len(rounds) == 2 and all(r["participants"] == 5 for r in rounds)
    assert 0.0 <= rounds[-1]["global_accuracy"] <= 1.0
    assert set(rounds[-1]["level_accuracy"]) == {"a", "b", "c"}
    assert all(t["status"] == "ok" for t in outcome.report["tasks"])


def test_devices_of_a_slower_tier_hold_their_updates_back_by_their_factor(mosquitto_installed: None,
                                                                          tmp_path: Path) -> None:
    import io

    from fedfit.sim.speeds import device_speeds

    options = SimOptions(algorithm="heterofl", agents=4, rounds=1, dataset="digits", seed=1, federation="e2e-speeds",
                         base=tiny_config(), budgets="widths:1/2,1", speeds="3,1", state_dir=str(tmp_path / "run"))
    said = io.StringIO()
    settings = run_simulation(options, progress=said).report["settings"]
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert (settings["speeds"], settings["device_speeds"]) == ("3,1", device_speeds((3.0, 1.0), 4, "widths:1/2,1", 1))
    # one factor per tier, in the scenario's order: the half-width tier three times slower
    assert [{"r=1/2": 3.0, "r=1": 1.0}[tier] for tier in settings["device_tiers"]] == settings["device_speeds"]
    assert "training speeds (a device of factor f takes f times this machine's time for a task): x1: 2 devices (r=1), " \
           "x3: 2 devices (r=1/2)" in said.getvalue()
    factors = dict(zip(report["agents"], settings["device_speeds"]))
    tasks = report["tasks"]
    assert len(tasks) == 4 and all(task["status"] in ("ok", "adapted") for task in tasks)
    for task in tasks:  # held back (f - 1) x its task's seconds, as measured; not at all at this machine's speed
        held = task["seconds_slowdown"]
        assert held is None if factors[task["agent"]] == 1.0 else held >= 2 * task["seconds"]
    assert report["rounds"][0]["timing"]["slowdown"] == pytest.approx(
        max(task["seconds_slowdown"] or 0.0 for task in tasks), abs=1e-4)
    assert "| budgets widths:1/2,1 | speeds 3,1 | seed 1" in (tmp_path / "run" / "summary.txt").read_text()


def test_command_line_sim_runs_what_its_config_names_and_writes_its_run_directory(mosquitto_installed: None,
                                                                                   tmp_path: Path) -> None:
    config = tmp_path / "scalefl.yaml"
    config.write_text("algorithm: scalefl\nrounds: 2\nseed: 7\n"
                      "model: {family: resnet20, options: {hidden: [8, 16, 32], exit_convs: 1}}\n"
                      "data: {bn_samples: 300}\nrecipe: {epochs: 1, batch_size: 16}\n"
                      "scalefl: {cost: params}\ndeployment: {deliver: false}\n")  # levels by parameters: no memory
    # search, and no models delivered at the end (both tested elsewhere)
    report = tmp_path / "r.json"
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "fedfit.cli", "sim", "--config", str(config), "--agents", "3", "--dataset", "digits",
         "--federation", "cli-test", "--report", str(report), "--budgets", "fractions:1.5", "--allocator", "default",
         "--run-dir", str(run_dir)],
        capture_output=True, text=True, timeout=1200, check=False)  # a limit, not a wait: loaded CI machines are slow
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("scalefl | 3 agents | digits iid | resnet20 | budgets fractions:1.5 | broker ")
    assert "(TLS, logins, ACL)" in result.stdout and "exit1" in result.stdout
    assert f"run directory: {run_dir}" in result.stderr and "round 2/2: global" in result.stderr
    data = json.loads(report.read_text())
    assert data == json.loads((run_dir / "report.json").read_text())
    assert data["algorithm"] == "scalefl" and len(data["rounds"]) == 2
    assert (data["settings"]["model"], data["settings"]["seed"], data["settings"]["rounds"]) == ("resnet20", 7, 2)
    assert data["run"]["config"]["algorithm"] == "scalefl" and data["run"]["config"]["rounds"] == 2
    assert data["run"]["config"]["scalefl"]["cost"] == "params"
    assert sorted(data["run"]["overrides"]) == sorted(["--agents 3", "--dataset digits", "--federation cli-test",
                                                       "--run-dir " + str(run_dir), "--budgets fractions:1.5",
                                                       "--allocator default"])
    assert data["run"]["version"].startswith("fedfit ") and data["run"]["wall_seconds"] > 0
    # Every update a device sent was aggregated or refused with a reason: nothing left, and the table says so.
    assert data["run"]["left"] == [] and "left at the end: nothing" in result.stdout
    # No --workers: as many training processes at once as the cores this process may use, one thread each.
    cores = available_cores()
    assert (data["run"]["cores"], data["run"]["workers"], data["run"]["torch_threads"]) == (cores, cores, 1)
    assert f"training on {cores} core" in result.stderr
    assert data["broker"]["kind"] == "mosquitto" and data["broker"]["secured"] is True
    first = data["rounds"][0]
    assert set(first) >= {"round", "global_accuracy", "level_accuracy", "exit_accuracy", "trained_levels",
                          "participants", "bytes_down", "bytes_up", "seconds"}
    assert first["participants"] == 3
    # The agents ran glibc's default heap, and their budgets are relative to the full model's need under it.
    assert data["settings"]["allocator"] == "default"
    assert {t["status"] for t in data["tasks"]} <= {"ok", "adapted"}
    assert all(t["loss"] is not None for t in data["tasks"])
    for output in ("metrics.csv", "summary.txt", "accuracy.png", "traffic.png", "daemons.log"):
        assert (run_dir / output).exists(), output
    # A second run into the same directory is refused: nothing of the first is lost.
    again = subprocess.run([sys.executable, "-m", "fedfit.cli", "sim", "--config", str(config), "--run-dir",
                            str(run_dir)], capture_output=True, text=True, timeout=120, check=False)
    assert again.returncode == 2 and "holds a run already" in again.stderr


def test_scalefl_levels_exits_and_self_distillation_end_to_end(mosquitto_installed: None, tmp_path: Path) -> None:
    # The top level (the full model with every exit, distilling) costs more than the plain full model that
    # budgets are shares of: a third of the fleet gets room for it.
    outcome = simulate(tmp_path, "scalefl", agents=6, rounds=2, budgets="fractions:0.4,0.7,1.5")
    report = outcome.report
    levels = report["settings"]["levels"]
    assert levels == ["3", "2", "1"]  # ratios auto: a level for each tier below the top, and the top
    for entry in report["rounds"]:
        assert set(entry["level_accuracy"]) == set(levels)
        # The global model has an exit per level below the top and its final head.
        assert list(entry["exit_accuracy"]) == [f"exit{i}" for i in range(1, len(entry["exit_accuracy"]) + 1)]
        assert len(entry["exit_accuracy"]) >= 2
        assert entry["exit_accuracy"][list(entry["exit_accuracy"])[-1]] == entry["global_accuracy"]
        assert entry["participants"] >= 1
    trained = [t for t in report["tasks"] if t["status"] in ("ok", "adapted")]
    assert trained and all(t["status"] in ("ok", "adapted", "skipped", "declined") for t in report["tasks"])
    # Devices of different tiers train different levels: at least two levels take part.
    assert len({t["level"] for t in trained}) >= 2, report["tasks"]
    assert any("exits=" in (t["spec_trained"] or "") for t in trained)
    assert all("3" in entry["trained_levels"] for entry in report["rounds"]), report["tasks"]
    assert report["summary"]["devices_served"] == [6, 6]
    assert report["rounds"][-1]["global_accuracy"] > 0.4, report["rounds"]


def test_fedepth_depth_wise_partial_and_mutual_copies_end_to_end(mosquitto_installed: None, tmp_path: Path) -> None:
    # Budgets as shares of the full CNN's training memory: 1% leaves a few KB beside the runtime, less than any
    # block's activations even in micro-batches; 70% cannot train the whole model (the agent asks 110% of it) and
    # trains it depth-wise; 300% holds two copies (m-FeDepth: two copies cost less than twice one).
    options = SimOptions(algorithm="fedepth", agents=6, rounds=2, dataset="digits", partition="iid", seed=1,
                         federation="e2e-fedepth", base=tiny_config(),
                         state_dir=str(tmp_path / "fedepth"), budgets="fractions:0.01,0.7,3")
    report = run_simulation(options, progress=None).report
    tasks = report["tasks"]
    tiers = {agent: entry["tier"] for agent, entry in report["agents"].items()}
    assert len(tasks) == 12 and all(t["spec_sent"] == "width=1" for t in tasks)
    by_tier = {tier: [t for t in tasks if tiers[t["agent"]] == tier]
               for tier in ("0.01 of full", "0.7 of full", "3 of full")}
    assert all(len(group) == 4 for group in by_tier.values()), tiers
    for task in by_tier["0.01 of full"]:
        assert task["status"] == "declined" and "no block fits alone" in task["reason"], task
        assert "in micro-batches of 8" in task["reason"]  # even the smallest micro-batch was tried
    for task in by_tier["0.7 of full"]:
        assert task["status"] == "adapted" and task["reason"].startswith("trained depth-wise, blocks "), task
        segments = [tuple(map(int, part.split(":"))) for part in task["spec_trained"].partition("segments=")[2].split(",")]
        bounds = [bound for segment in segments for bound in segment]
        assert bounds[0] == 0 and bounds[-1] == 3 and bounds[1:-1:2] == bounds[2:-1:2], task  # every block, in order
        assert len(task["stage_peak_bytes"]) == len(segments) and task["peak_bytes"] == max(task["stage_peak_bytes"])
        # Two epochs a stage: the reason says whether each later stage buffers its frozen blocks' outputs or runs
        # them every batch.
        if len(segments) > 1:
            assert ("frozen blocks' outputs buffered in stage" in task["reason"]
                    or "frozen blocks recomputed every batch in stage" in task["reason"]), task
    for task in by_tier["3 of full"]:
        assert task["status"] == "ok" and task["copies"] == 2, task
        assert "trained 2 of up to 2 copies" in task["reason"], task
    # Each rich device keeps its own auxiliary copy between rounds; nobody else has one.
    kept = sorted(path.parent.parent.name for path in (tmp_path / "fedepth" / "agents").glob("*/copies/*.safetensors"))
    assert kept == sorted({t["agent"] for t in by_tier["3 of full"]})
    assert report["rounds"][-1]["participants"] == 4
    assert report["rounds"][-1]["global_accuracy"] > 0.4, report["rounds"]


def test_fedepth_through_auxiliary_classifiers_end_to_end(mosquitto_installed: None, tmp_path: Path) -> None:
    # 70% of the full CNN's training memory trains depth-wise, each segment through the auxiliary classifier
    # after it; 150% trains the whole model through its own head (one copy: m-FeDepth off).
    base = tiny_config()
    base.fedepth = FeDepthConfig(max_copies=1, route="exit")
    options = SimOptions(algorithm="fedepth", agents=4, rounds=2, dataset="digits", partition="iid", seed=2,
                         federation="e2e-fedepth-exits", base=base,
                         state_dir=str(tmp_path / "fedepth-exits"), budgets="fractions:0.7,1.5")
    report = run_simulation(options, progress=None).report
    tasks = report["tasks"]
    assert len(tasks) == 8 and all(t["spec_sent"] == "width=1 exits=0,1" for t in tasks), tasks
    depthwise = [t for t in tasks if t["status"] == "adapted"]
    whole = [t for t in tasks if t["status"] == "ok"]
    assert len(depthwise) == len(whole) == 4, tasks
    for task in depthwise:
        assert "segments=" in task["spec_trained"] and "exits=" in task["spec_trained"], task
        assert "via auxiliary classifiers" in task["reason"], task
    assert all(t["spec_trained"] == "width=1" for t in whole)  # no classifier trained whole
    last = report["rounds"][-1]
    assert last["participants"] == 4 and set(last["exit_accuracy"]) == {"exit1", "exit2", "exit3"}, last
    assert last["global_accuracy"] > 0.4, report["rounds"]


def test_adaptivefl_selects_by_its_tables_and_devices_prune_down_the_nested_pool(mosquitto_installed: None,
                                                                                tmp_path: Path) -> None:
    from coordinator.checkpoint import load_checkpoint

    outcome = simulate(tmp_path, "adaptivefl", agents=5, rounds=3, budgets="tiers-fluctuating")
    report = outcome.report
    pool = set(report["settings"]["levels"])
    assert pool == {"L1", "M1", "M2", "S1", "S2"}  # a 3-layer CNN: I in {2, 1}, p = 2
    assert all(set(entry["level_accuracy"]) == pool for entry in report["rounds"])
    dispatched = [t for t in report["tasks"] if t["status"] != "skipped"]
    assert dispatched and all(t["level"] in pool and t["params_sent"] > 0 for t in dispatched)
    for task in dispatched:
        if task["status"] == "ok":
            assert task["level_trained"] == task["level"] and task["waste"] == 0
        elif task["status"] == "adapted":  # pruned on the device to a smaller pool model nested in the one sent
            assert task["level_trained"] in pool and 0 < task["params_returned"] < task["params_sent"]
            assert 0 < task["waste"] < 1
    for entry in report["rounds"]:
        shown = [t for t in dispatched if t["round"] == entry["round"]]
        sent = sum(t["params_sent"] for t in shown)
        assert entry["waste"] == pytest.approx(1 - sum(t["params_returned"] for t in shown) / sent)
    assert report["summary"]["communication_waste"] is not None
    # The tables the selection learnt are in the checkpoint: every agent that was given a task has its row.
    _, meta = load_checkpoint(tmp_path / "adaptivefl" / "checkpoint.safetensors")
    tables = meta["strategy"]["tables"]
    assert {t["agent"] for t in dispatched} <= set(tables["resource"])
    assert any(score != 1.0 for row in tables["resource"].values() for score in row.values())
