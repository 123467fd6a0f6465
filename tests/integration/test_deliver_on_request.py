"""End to end over a secured mosquitto: `fedfit deliver` hands the models of a finished federation to the agents
online, one that joined after its end included, each the largest trained model its budget runs."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import yaml

from common.config import to_mapping
from common.data import load_dataset
from common.model_package import read_manifest
from coordinator.config import DeploymentConfig
from coordinator.daemon import Coordinator
from fedfit.cli import main

from .conftest import SecuredBroker, digits_fleet, on_broker, tiny_config

pytestmark = [pytest.mark.broker, pytest.mark.slow]


def test_a_device_that_joined_after_the_end_gets_its_model_on_request(secured_mosquitto: SecuredBroker,
                                                                      tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    dataset = load_dataset("digits")
    broker = secured_mosquitto("late")
    # A long wait for the agents' reports: a refusal is reported too, so the command does not wait it out.
    config = on_broker(tiny_config(federation="late", rounds=1, min_agents=2, state_dir=str(tmp_path / "state"),
                                   deployment=DeploymentConfig(deliver=False, wait_s=600.0)), broker)
    first, late = digits_fleet(dataset, ["a", "c"], config, broker, state_dir=str(tmp_path / "agents"))
    (stateless,) = digits_fleet(dataset, ["b"], config, broker)  # keeps no state: refuses a model
    agents = []
    try:
        for agent in (first, stateless):
            agent.start()
            agents.append(agent)
        coordinator = Coordinator(config, dataset=dataset)
        coordinator.start()
        try:
            assert [r.round for r in coordinator.run()] == [1]
        finally:
            coordinator.stop()
        assert not (tmp_path / "state" / "models").exists()  # deliver: false
        late.start()
        agents.append(late)
        path = tmp_path / "coordinator.yaml"
        mapping = to_mapping(config)
        mapping["deployment"]["deliver"] = True
        path.write_text(yaml.safe_dump(mapping))
        started = time.monotonic()
        assert main(["deliver", "--config", str(path), "--agents", "3", "--wait", "60"]) == 1  # b holds none
        assert time.monotonic() - started < 300  # b's refusal was heard: its 600 s were not waited out
        out = capsys.readouterr().out
        assert "2 of 3 agents online hold a model of this run" in out, out
        assert "b: none: refused global@" in out and "keeps no state" in out, out
        manifest = read_manifest(tmp_path / "state" / "models")
        for agent in (first, late):
            held = read_manifest(tmp_path / "agents" / agent.agent_id / "model").models[0]
            assert agent.models.held == f"{held.name}@{held.onnx.sha256}"
            assert held == manifest.model(held.name) and f"{agent.agent_id}: holds {held.name}" in out
    finally:
        for agent in agents:
            agent.stop()


def test_deliver_refuses_a_state_dir_without_a_finished_round(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "coordinator.yaml"
    path.write_text(yaml.safe_dump({"state_dir": str(tmp_path / "empty")}))
    assert main(["deliver", "--config", str(path)]) == 2
    assert "holds no finished round" in capsys.readouterr().err
