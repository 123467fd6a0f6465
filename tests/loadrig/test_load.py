"""The load mode: synthetic updates of the right shape inside the plan's reach, agents spread over brokers, and a
real run of a small synthetic fleet against a real coordinator over mosquitto."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from coordinator.config import RecipeConfig
from coordinator.screening import change_of
from coordinator.strategies.base import base_plan
from fedfit.sim.broker import find_mosquitto
from loadrig.agents import WorkerResult
from loadrig.load import LoadOptions, agent_name, broker_for, format_outcome, run_load
from loadrig.synthetic import SYNTHETIC_NOTICE, UpdateMaker, synthetic_change
from models import SubmodelSpec, get_family
from protocol import ModelRef, Task, decode, encode

HIDDEN = [8, 16, 16, 16]


def _task(spec: SubmodelSpec) -> Task:
    family = get_family("cnn", 10, 1, hidden=HIDDEN)
    state = {key: value.detach() for key, value in family.build(track_bn_stats=False).state_dict().items()}
    weights = family.extract(state, spec, keys=family.state_keys(spec))
    return Task("r1-load-0000-abc", 1, "load-0000", 0.0, ModelRef("cnn", 10, 1, {"hidden": HIDDEN}),
                spec.to_dict(), None, {key: value.numpy() for key, value in weights.items()},
                plan=base_plan(RecipeConfig()))


@pytest.mark.parametrize("width", [1.0, 0.5])
def test_a_synthetic_update_has_the_specs_trainable_tensors_and_moves_them_inside_the_plans_reach(width: float):
    spec = SubmodelSpec.uniform(width)
    task = _task(spec)
    update = UpdateMaker(seed=3).make(task, "load-0000", 60, list(range(10)), factor=1.5)
    family = get_family("cnn", 10, 1, hidden=HIDDEN)
    assert update.status == "ok" and update.spec_trained == task.spec
    assert set(update.weights) == set(family.trainable_keys(spec))
    assert all(update.weights[key].shape == task.weights[key].shape for key in update.weights)
    trained = {key: torch.from_numpy(value) for key, value in update.weights.items()}
    sent = {key: torch.from_numpy(task.weights[key]) for key in update.weights}
    change = change_of(trained, sent, task.training_plan(), [1])  # one step: the least reach a plan has
    assert change.bound is not None and 0 < change.norm < change.bound
    assert math.isclose(change.norm, 1.5 * synthetic_change(task.training_plan()), rel_tol=1e-3)
    decoded = decode(encode(update))  # it is a valid message
    assert set(decoded.weights) == set(update.weights)  # type: ignore[union-attr]


def test_a_task_missing_a_trained_tensor_gets_a_failed_update_with_the_reason():
    task = _task(SubmodelSpec.uniform(1.0))
    del task.weights["conv1.weight"]
    update = UpdateMaker().make(task, "load-0000", 60, [0, 1], factor=1.0)
    assert update.status == "failed" and update.weights == {} and "conv1.weight" in (update.reason or "")


def test_agents_are_spread_over_the_brokers_in_turn():
    brokers = ["a:1", "b:2", "c:3"]
    assert [broker_for(i, brokers) for i in range(7)] == ["a:1", "b:2", "c:3", "a:1", "b:2", "c:3", "a:1"]
    assert agent_name(7) == "load-0007"


def test_malformed_options_are_refused():
    with pytest.raises(ValueError, match="HOST:PORT"):
        LoadOptions(brokers=["nowhere"]).validate()
    with pytest.raises(ValueError, match="protocol"):
        LoadOptions(protocol="4").validate()


@pytest.mark.slow
@pytest.mark.broker
@pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto is not installed")
def test_a_synthetic_fleet_drives_a_real_coordinator_through_mosquitto(tmp_path):
    """Its agents ask before they upload; the window (three updates and a half) holds what is granted at once."""
    agents, rounds = 20, 2
    parameters = get_family("cnn", 10, 1, hidden=HIDDEN).param_count()
    window = 3.5 * 4 * parameters / 2**20  # in MiB: three and a half updates' float32 weights
    options = LoadOptions(agents=agents, rounds=rounds, workers=2, dataset="digits", model_options={"hidden": HIDDEN},
                          run_dir=str(tmp_path / "run"), profile=True, settings={"uploads": {"window_mib": window}})
    outcome = run_load(options, progress=None)
    assert outcome.complete
    assert [r.round for r in outcome.rounds] == list(range(1, rounds + 1))
    for r in outcome.rounds:
        assert r.participants == r.selected == agents
        assert r.bytes_up >= agents * outcome.parameters * 4  # every update carries every float32 parameter
        assert r.dispatched is not None and r.updates_in is not None
        assert 0 <= r.dispatched <= r.seconds and 0 <= r.updates_in <= r.seconds
    seen = outcome.agents
    assert seen["online"] == agents
    assert seen["tasks"] == seen["updates"] == seen["acked"] == seen["aggregated"] == agents * rounds
    assert seen["refused"] == seen["rejected"] == seen["protocol_errors"] == seen["abandoned"] == 0
    assert seen["asks"] >= seen["grants"] == agents * rounds  # one grant per upload (every first send acked)
    coordinator = outcome.coordinator
    uploads = coordinator["uploads"]
    assert uploads["granted"] == agents * rounds and uploads["expired"] == 0
    update_bytes = outcome.rounds[0].bytes_up / agents
    assert update_bytes <= uploads["peak_in_flight"] <= uploads["window_bytes"] < 4 * update_bytes
    assert 0 < coordinator["ready_rss"] and 0 < coordinator["idle_rss"] <= coordinator["peak_rss"]
    assert outcome.profile is not None and "main (round loop)" in outcome.profile["threads"]
    text = format_outcome(outcome)
    assert text.count(SYNTHETIC_NOTICE) == 2  # heads and closes the printout
    written = json.loads((tmp_path / "run" / "load-outcome.json").read_text())
    assert written["agents"]["aggregated"] == agents * rounds
    results = [WorkerResult.from_json(path.read_text()) for path in sorted((tmp_path / "run").glob("*-result.json"))]
    assert sum(r.agents for r in results) == agents and len(results) == 2
    assert all(np.isfinite(r.cpu_seconds) and r.cpu_seconds > 0 for r in results)
