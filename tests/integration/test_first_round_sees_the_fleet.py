"""The first round after a coordinator starts sees the whole fleet whose retained statuses are on the broker,
not only the agents heard first (min_agents 1, five agents online before it). End to end over mosquitto."""

from __future__ import annotations

import time

import pytest

from common.data import load_dataset
from coordinator.daemon import Coordinator

from .conftest import SecuredBroker, digits_fleet, on_broker, tiny_config

pytestmark = [pytest.mark.broker, pytest.mark.slow]


def test_the_first_round_gives_a_task_to_every_agent_already_online(secured_mosquitto: SecuredBroker, tmp_path) -> None:
    dataset = load_dataset("digits")
    names = [f"early-{i}" for i in range(5)]
    broker = secured_mosquitto("settle")
    config = on_broker(tiny_config(federation="settle", rounds=1, min_agents=1, state_dir=str(tmp_path),
                                   algorithm="fedavg"), broker)
    agents = digits_fleet(dataset, names, config, broker)
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
