"""Integration fixtures: a real mosquitto on a free loopback port, and a tiny fast configuration."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from coordinator.config import CoordinatorConfig, DataConfig, ModelConfig, RecipeConfig
from fedfit.sim.broker import Broker, find_mosquitto, start_mosquitto


@pytest.fixture
def mosquitto() -> Iterator[Broker]:
    """A fresh mosquitto per test; missing mosquitto fails loudly (CI installs it) unless allowed to skip."""
    if find_mosquitto() is None:
        if os.environ.get("FEDFIT_ALLOW_NO_MOSQUITTO") == "1":
            pytest.skip("mosquitto is not installed")
        pytest.fail("mosquitto is not installed: run `make test` (it installs it) or apt-get install mosquitto")
    broker = start_mosquitto()
    try:
        yield broker
    finally:
        broker.stop()


def tiny_config(**overrides: object) -> CoordinatorConfig:
    """A small, quick federation on sklearn's digits (8x8 images)."""
    config = CoordinatorConfig(
        model=ModelConfig(family="cnn", options={"hidden": [16, 32, 64]}),
        data=DataConfig(dataset="digits", bn_samples=500),
        recipe=RecipeConfig(epochs=2, batch_size=16, lr=0.05),
        levels=[1.0, 0.5, 0.25],
        round_timeout_s=60.0,
        wait_for_agents_s=30.0,
    )
    for key, value in overrides.items():
        setattr(config, key, value)
    return config
