"""Integration fixtures: a real mosquitto on a free loopback port (secured as `fedfit broker init` makes it, or
open to anonymous clients for the MQTT link's own tests), and a tiny fast configuration."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace

import pytest

from common.data import Dataset, parse_partition, partition_indices
from coordinator.config import CoordinatorConfig, DataConfig, DeploymentConfig, ModelConfig, RecipeConfig
from edge_agent.config import AgentConfig, AgentDataConfig
from edge_agent.daemon import EdgeAgent
from edge_agent.data_source import to_local_data
from fedfit.sim.broker import Broker, find_mosquitto, start_mosquitto


def _require_mosquitto() -> None:
    """Missing mosquitto fails loudly (CI installs it) unless allowed to skip."""
    if find_mosquitto() is None:
        if os.environ.get("FEDFIT_ALLOW_NO_MOSQUITTO") == "1":
            pytest.skip("mosquitto is not installed")
        pytest.fail("mosquitto is not installed: run `make test` (it installs it) or apt-get install mosquitto")


@pytest.fixture
def mosquitto() -> Iterator[Broker]:
    """A fresh mosquitto per test that lets anonymous clients do anything: for the MQTT link's own tests."""
    _require_mosquitto()
    broker = start_mosquitto()
    try:
        yield broker
    finally:
        broker.stop()


@pytest.fixture
def mosquitto_installed() -> None:
    """For tests whose simulator starts its own mosquitto: fail loudly (or skip) when there is none."""
    _require_mosquitto()


SecuredBroker = Callable[[str], Broker]


@pytest.fixture
def secured_mosquitto() -> Iterator[SecuredBroker]:
    """Starts, for a federation, a fresh mosquitto secured as `fedfit broker init` makes it: TLS only, no anonymous
    clients, a login per client (``broker.client_config(name)`` adds one) and the ACL."""
    _require_mosquitto()
    started: list[Broker] = []

    def start(federation: str) -> Broker:
        started.append(start_mosquitto(federation=federation))
        return started[-1]

    try:
        yield start
    finally:
        for broker in started:
            broker.stop()


def tiny_config(**overrides: object) -> CoordinatorConfig:
    """A small, quick federation on sklearn's digits (8x8 images)."""
    config = CoordinatorConfig(
        model=ModelConfig(family="cnn", options={"hidden": [16, 32, 64]}),
        data=DataConfig(dataset="digits", bn_samples=500),
        recipe=RecipeConfig(epochs=2, batch_size=16, lr=0.05),
        levels=[1.0, 0.5, 0.25],
        # A round ends as soon as every update is in; the deadline only bounds a task that never answers, and must
        # not cut off an honest one on a loaded machine (a CI runner, two CPU burners beside the tests).
        round_timeout_s=600.0,
        wait_for_agents_s=30.0,
        # The models are written and delivered at a federation's end only where a test asks (the export's own).
        deployment=DeploymentConfig(deliver=False),
    )
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def on_broker(config: CoordinatorConfig, broker: Broker) -> CoordinatorConfig:
    """``config`` logging in to ``broker`` as the coordinator."""
    return replace(config, broker=broker.coordinator_config())


def digits_fleet(dataset: Dataset, names: Sequence[str], config: CoordinatorConfig, broker: Broker,
                 state_dir: str | None = None) -> list[EdgeAgent]:
    """Agents named ``names`` of ``config``'s federation, each with its own login to ``broker`` and an IID shard of
    ``dataset`` (and their state under ``state_dir``, where given). Each trains on one thread: the fleet shares this
    machine's cores (a device's default, all the cores it has, makes several agents training at once oversubscribe
    them: a 3 s task took 24 s)."""
    shards = partition_indices(dataset.y_train, len(names), parse_partition("iid"), 0)
    broker.add_logins(names)
    return [EdgeAgent(AgentConfig(agent_id=name, federation=config.federation, broker=broker.client_config(name),
                                  data=AgentDataConfig(dataset="digits"), torch_threads=1, state_dir=state_dir),
                      to_local_data(dataset.x_train[idx], dataset.y_train[idx]))
            for name, idx in zip(names, shards)]
