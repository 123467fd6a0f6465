"""End to end: a federation over a real mosquitto, then `fedfit export` on its run directory and `fedfit predict` on
what it wrote: every exported model answers the run's test images, through onnxruntime, as the run reported."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from common.data import load_dataset
from common.inference import open_model
from common.model_package import read_manifest
from coordinator.config import DeploymentConfig
from fedfit.cli import main
from fedfit.sim.harness import SimOptions, run_simulation

from .conftest import tiny_config

pytestmark = [pytest.mark.broker, pytest.mark.slow]


def test_every_exported_level_answers_as_the_run_reported(mosquitto_installed: None, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = tmp_path / "scalefl"
    base = tiny_config(deployment=DeploymentConfig(deliver=True))
    options = SimOptions(algorithm="scalefl", agents=4, rounds=2, dataset="digits", partition="iid", seed=1,
                         federation="e2e-export", base=base, budgets="fair", state_dir=str(run_dir))
    report = run_simulation(options, progress=None).report
    last = report["rounds"][-1]
    # Every agent holds the largest trained model its budget runs, delivered over the secured broker.
    budgets = {entry["tier"]: entry["budget_bytes"] for entry in report["settings"]["serving"]}
    delivered = read_manifest(run_dir / "models")
    for agent, held in report["run"]["models"].items():
        kept = read_manifest(run_dir / "agents" / agent / "model")
        entry = kept.models[0]
        assert held == f"{entry.name}@{entry.onnx.sha256}", (agent, held)
        budget = budgets[report["agents"][agent]["tier"]]
        assert entry.inference_bytes <= budget
        assert entry == delivered.for_budget(budget)
    assert "models held at the end: 4 of 4 agents" in (run_dir / "summary.txt").read_text()
    # The folder the coordinator wrote at the end: every level some round trained, each once (the top level is the
    # global model: one of its names), each answering the run's test images through onnxruntime as the run reported.
    digits = load_dataset("digits")  # tiny_config evaluates on the whole test set
    x, y = digits.x_test, digits.y_test
    exported = {name for entry in delivered.models for name in (entry.name, *entry.aliases)}
    assert exported - {"global"} == {name for r in report["rounds"] for name in r["trained_levels"]}
    assert delivered.deployed().name == last["deployed"] or last["deployed"] in delivered.deployed().aliases

    def reported(name: str) -> float:
        return float(last["global_accuracy"] if name == "global" else last["level_accuracy"][name])

    for entry in delivered.models:
        runner = open_model(run_dir / "models", delivered, entry, "onnxruntime")
        accuracy = float((runner.logits(x).argmax(1) == y).mean())
        assert abs(accuracy - reported(entry.name)) <= 1e-4, (entry.name, accuracy, reported(entry.name))
    # The run's devices would run the deployable model from raw pixels: `fedfit predict` normalises them itself.
    deployed = delivered.deployed()
    mean, std = digits.normalization
    np.savez(tmp_path / "test.npz", x=(x * std + mean).astype(np.float32), y=y)
    capsys.readouterr()  # (what the run printed)
    assert main(["predict", "--model", str(run_dir / "models"), str(tmp_path / "test.npz"), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)["summary"]
    assert summary["model"] == deployed.name and summary["images"] == len(y)
    # Pixels restored from the normalised set differ from the originals by a rounding: an image or two may flip.
    assert abs(summary["accuracy"] - deployed.accuracy) <= 2 / len(y)
    held = read_manifest(run_dir / "agents" / "sim-000" / "model").models[0]
    assert main(["predict", "--model", str(run_dir / "agents" / "sim-000" / "model"), str(tmp_path / "test.npz"),
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["summary"]["model"] == held.name
    with_exits = next(entry for entry in delivered.models if entry.has_exits)
    assert main(["predict", "--model", str(run_dir / "models"), "--level", with_exits.name, "--exit-threshold", "0",
                 str(tmp_path / "test.npz"), "--json"]) == 0
    answered = json.loads(capsys.readouterr().out)["summary"]
    assert answered["exits"]["1"] == len(y) and answered["mean_macs"] == with_exits.exit_macs[0]
    # `fedfit export` writes the folder again from the checkpoint (here one level: the same writer made the rest),
    # replacing the coordinator's, and checks it through onnxruntime against the report, as checked here.
    (run_dir / "models" / "marker").write_text("written at the federation's end")
    assert main(["export", str(run_dir), "--level", deployed.name]) == 0
    printed = capsys.readouterr().out
    manifest = read_manifest(run_dir / "models")
    assert not (run_dir / "models" / "marker").exists() and [e.name for e in manifest.models] == [deployed.name]
    (entry,) = manifest.models
    assert entry.onnx.sha256 and entry.exit_accuracy == deployed.exit_accuracy
    accuracy = float((open_model(run_dir / "models", manifest, entry, "onnxruntime").logits(x).argmax(1) == y).mean())
    assert abs(accuracy - reported(entry.name)) <= 1e-4 and f"{reported(entry.name):.4f}" in printed


def test_what_cannot_be_exported_or_predicted_is_said_in_one_sentence(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["export", str(tmp_path)]) == 2
    assert "holds no finished round" in capsys.readouterr().err
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "notes.txt").write_text("mine")
    assert main(["export", str(tmp_path), "--out", str(tmp_path / "elsewhere")]) == 2
    assert "holds files that are not a model folder" in capsys.readouterr().err
    assert (tmp_path / "elsewhere" / "notes.txt").read_text() == "mine"
    assert main(["export", str(tmp_path), "--budget", "0"]) == 2
    assert "--budget must be a positive number of MiB" in capsys.readouterr().err
    assert main(["predict", "--model", str(tmp_path), str(tmp_path / "x.npz")]) == 2
    assert "holds no manifest.json" in capsys.readouterr().err
