"""The first round after a coordinator starts sees the whole fleet whose retained statuses are on the broker,
not only the agents heard first (min_agents 1, five agents online before it). End to end over mosquitto."""

from __future__ import annotations

import time

import pytest

from common.data import load_dataset
from coordinator.daemon import Coordinator
from fedfit.sim.broker import Broker

from .conftest import digits_fleet, tiny_config

pytestmark = [pytest.mark.broker, pytest.mark.slow]


def test_the_first_round_gives_a_task_to_every_agent_already_online(mosquitto: Broker, tmp_path) -> None:
    dataset = load_dataset("digits")
    names = [f"early-{i}" for i in range(5)]
    config = tiny_config(federation="settle", rounds=1, min_agents=1, state_dir=str(tmp_path), algorithm="fedavg")
    config.broker.host, config.broker.port = mosquitto.host, mosquitto.port
    agents = digits_fleet(dataset, names, config)
    coordinator = Coordinator(config, dataset=dataset)
    try:
        for agent in agents:
            agent.start()
        time.sleep(2)  # every agent's retained status is on the broker before the coordinator subscribes
        coordinator.start()
        [result] = coordinator.run()
    finally:
        for agent in agents:
            agent.stop()
        coordinator.stop()
    assert result.selected == 5 and sorted(t.agent for t in result.tasks) == names, result.tasks
