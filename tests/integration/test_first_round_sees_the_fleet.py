"""The first round after a coordinator starts sees the whole fleet whose retained statuses are on the broker,
not only the agents heard first (min_agents 1, five agents online before it). End to end over mosquitto."""

from __future__ import annotations

import time

import pytest

from common.data import load_dataset, parse_partition, partition_indices
from coordinator.daemon import Coordinator
from edge_agent.config import AgentConfig, AgentDataConfig
from edge_agent.daemon import EdgeAgent
from edge_agent.data_source import to_local_data
from fedfit.sim.broker import Broker

from .conftest import tiny_config

pytestmark = [pytest.mark.broker, pytest.mark.slow]


def test_the_first_round_gives_a_task_to_every_agent_already_online(mosquitto: Broker, tmp_path) -> None:
    dataset = load_dataset("digits")
    names = [f"early-{i}" for i in range(5)]
    shards = partition_indices(dataset.y_train, len(names), parse_partition("iid"), 0)
    config = tiny_config(federation="settle", rounds=1, min_agents=1, state_dir=str(tmp_path), algorithm="fedavg")
    config.broker.host, config.broker.port = mosquitto.host, mosquitto.port
    agents = [EdgeAgent(AgentConfig(agent_id=name, federation="settle", broker=config.broker,
                                    data=AgentDataConfig(dataset="digits")),
                        to_local_data(dataset.x_train[idx], dataset.y_train[idx]))
              for name, idx in zip(names, shards)]
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
