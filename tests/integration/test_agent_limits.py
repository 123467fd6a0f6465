"""Agents bound what they accept, end to end over the secured mosquitto: a task larger than ``max_task_bytes`` is
declined at its first chunk, one training more epochs than ``max_epochs`` before anything is trained; the
coordinator hears both reasons (the tasks end declined, not timed out at the round's deadline)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from common.data import load_dataset
from coordinator.daemon import Coordinator
from edge_agent.config import TaskLimits

from .conftest import SecuredBroker, digits_fleet, on_broker, tiny_config

pytestmark = [pytest.mark.broker, pytest.mark.slow]


def test_tasks_over_an_agents_limits_are_declined_with_the_reason(secured_mosquitto: SecuredBroker,
                                                                 tmp_path: Path) -> None:
    dataset = load_dataset("digits")
    broker = secured_mosquitto("bounds")
    config = on_broker(tiny_config(federation="bounds", rounds=1, min_agents=2, round_timeout_s=120.0,
                                   state_dir=str(tmp_path / "coordinator")), broker)
    small, brief = digits_fleet(dataset, ["small", "brief"], config, broker)
    for agent, limits in ((small, TaskLimits(max_task_bytes=10_000)), (brief, TaskLimits(max_epochs=1))):
        agent.config = replace(agent.config, limits=limits)
        agent.reassembler.max_total_bytes = limits.max_task_bytes
        agent.runner.limits = limits
    coordinator = Coordinator(config, dataset=dataset)
    try:
        coordinator.start()
        for agent in (small, brief):
            agent.start()
        [result] = coordinator.run()
    finally:
        for agent in (small, brief):
            agent.stop()
        coordinator.stop()

    outcomes = {task.agent: task for task in result.tasks}
    assert outcomes["small"].status == "declined"
    assert (outcomes["small"].reason or "").startswith("task refused at its first chunk: it is "), outcomes["small"]
    assert "KiB, more than limits.max_task_bytes 9.8 KiB" in (outcomes["small"].reason or "")
    assert outcomes["brief"].status == "declined"
    assert outcomes["brief"].reason == "task refused: it trains 2 epochs, more than limits.max_epochs 1"
    assert result.participants == 0
    assert small.runner.child_pid is None and small.tasks_done == 0  # nothing reached the small agent's runner
