"""A training child killed with SIGKILL mid-task becomes a `failed` update; the agent stays online and serves
its next task, and a kill by hand (no OOM kill counted) teaches the calibration nothing. End to end over
mosquitto."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from common.data import load_dataset
from coordinator.daemon import Coordinator
from edge_agent.config import AgentConfig, AgentDataConfig
from edge_agent.daemon import EdgeAgent
from edge_agent.data_source import to_local_data

from .conftest import SecuredBroker, on_broker, tiny_config

pytestmark = [pytest.mark.broker, pytest.mark.slow]


def test_sigkilled_child_is_a_failed_task_and_the_agent_carries_on(secured_mosquitto: SecuredBroker,
                                                                  tmp_path: Path) -> None:
    dataset = load_dataset("digits")
    broker = secured_mosquitto("kill")
    config = on_broker(tiny_config(federation="kill", rounds=2, min_agents=1, state_dir=str(tmp_path / "coordinator")),
                       broker)
    coordinator = Coordinator(config, dataset=dataset)
    agent = EdgeAgent(AgentConfig(agent_id="victim", federation="kill", broker=broker.client_config("victim"),
                                  data=AgentDataConfig(dataset="digits"), torch_threads=1,
                                  state_dir=str(tmp_path / "agent")),
                      to_local_data(dataset.x_train, dataset.y_train))
    killed: list[int] = []

    def kill_first_child() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not killed:
            pid = agent.runner.child_pid
            if pid is not None:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
                return
            time.sleep(0.005)

    killer = threading.Thread(target=kill_first_child, daemon=True)
    try:
        coordinator.start()
        agent.start()
        killer.start()
        first, second = coordinator.run()
        record = coordinator.registry.get("victim")
    finally:
        agent.stop()
        coordinator.stop()

    assert killed, "no training child was ever seen"
    [failed] = first.tasks
    assert failed.status == "failed" and "SIGKILL, not for memory" in (failed.reason or ""), failed
    assert first.participants == 0
    [served] = second.tasks
    assert served.status in ("ok", "adapted"), served
    assert second.participants == 1
    assert agent.runner.calibration.floor == 0  # a kill by hand is no OOM kill: the estimates stay as they were
    assert record is not None and record.state in ("online", "busy")  # still online after the kill
