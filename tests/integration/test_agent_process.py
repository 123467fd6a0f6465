"""A real ``fedfit agent`` process holds no torch: it serves a round over the secured broker while torch lives only
in its training forkserver, which starts at the first task or, configured so, at start-up."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import psutil
import pytest
import yaml

from common.data import load_dataset
from coordinator.daemon import Coordinator

from .conftest import SecuredBroker, on_broker, tiny_config

pytestmark = [pytest.mark.broker, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


def maps_torch(pid: int) -> bool:
    """Whether process ``pid`` has libtorch mapped."""
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def forkservers(pid: int) -> list[psutil.Process]:
    """The multiprocessing forkservers among the children of ``pid``."""
    found = []
    for process in psutil.Process(pid).children(recursive=True):
        try:
            if "forkserver" in " ".join(process.cmdline()):
                found.append(process)
        except psutil.NoSuchProcess:
            continue
    return found


def wait_for_log(log: Path, event: str, also: str, timeout: float = 60.0) -> None:
    """Wait for a log line of ``event`` that also holds ``also``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if log.exists() and any(f'"event": "{event}"' in line and also in line for line in log.read_text().splitlines()):
            return
        time.sleep(0.1)
    raise AssertionError(f"no {event} within {timeout:.0f} s:\n{log.read_text()[-3000:]}")


@pytest.mark.parametrize("when", ["first-task", "start-up"])
def test_a_real_agent_trains_with_torch_only_in_its_forkserver(secured_mosquitto: SecuredBroker, tmp_path: Path,
                                                              when: str) -> None:
    dataset = load_dataset("digits")
    broker = secured_mosquitto("lean")
    np.savez(tmp_path / "data.npz", x=dataset.x_train[:300], y=dataset.y_train[:300])
    agent_yaml = tmp_path / "agent.yaml"
    agent_yaml.write_text(yaml.safe_dump({
        "agent_id": "pi", "federation": "lean", "broker": asdict(broker.client_config("pi")),
        "data": {"path": str(tmp_path / "data.npz")}, "torch_threads": 1, "state_dir": str(tmp_path / "agent"),
        "forkserver": when}))
    log = tmp_path / "agent.log"
    agent = subprocess.Popen([sys.executable, "-m", "fedfit.cli", "agent", "--config", str(agent_yaml)],
                             stdout=log.open("wb"), stderr=subprocess.STDOUT, cwd=ROOT,
                             env={**os.environ, "PYTHONUNBUFFERED": "1"})
    coordinator = Coordinator(on_broker(tiny_config(federation="lean", rounds=1, min_agents=1,
                                                    state_dir=str(tmp_path / "coordinator")), broker),
                              dataset=dataset)
    try:
        wait_for_log(log, "mqtt_ready", '"client_id": "fedfit-agent-pi"')  # connected (not its start probe)
        assert not maps_torch(agent.pid)
        assert len(forkservers(agent.pid)) == (1 if when == "start-up" else 0)
        coordinator.start()
        [result] = coordinator.run()
        assert [task.status for task in result.tasks] == ["ok"], result.tasks
        assert result.participants == 1
        # The agent process trained a task (decision and training in children) and still holds no torch.
        assert not maps_torch(agent.pid)
        [server] = forkservers(agent.pid)
        assert maps_torch(server.pid)
        assert agent.poll() is None
        wait_for_log(log, "update_acked", '"component": "uplink"')  # the ack is on its way when the round ends
    finally:
        coordinator.stop()
        agent.terminate()
        agent.wait(30)
    events = [json.loads(line)["event"] for line in log.read_text().splitlines() if line.startswith("{")]
    assert "task_done" in events and "update_acked" in events
