"""Nothing trained is lost to a restart: an update waiting for its ack when the broker goes down is on disk, and
the agent process that replaces the stopped one sends it (and does not train the task again) once the broker is
back. Over a secured mosquitto that is really stopped and started again."""

from __future__ import annotations

import threading
import time

import pytest

from common.data import load_dataset
from coordinator.daemon import Coordinator
from coordinator.metrics import RoundResult
from edge_agent.config import AgentConfig, AgentDataConfig
from edge_agent.daemon import EdgeAgent
from edge_agent.data_source import to_local_data
from protocol import BytesLike, Task, Update

from .conftest import SecuredBroker, on_broker, tiny_config

pytestmark = [pytest.mark.broker, pytest.mark.slow]


def wait_for(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_an_update_waiting_for_its_ack_survives_a_broker_outage_and_an_agent_restart(
        secured_mosquitto: SecuredBroker, tmp_path) -> None:
    mosquitto = secured_mosquitto("outbox")
    dataset = load_dataset("digits")
    config = on_broker(tiny_config(federation="outbox", rounds=1, min_agents=1,
                                   state_dir=str(tmp_path / "coordinator")), mosquitto)
    agent_config = AgentConfig(agent_id="keeper", federation="outbox", broker=mosquitto.client_config("keeper"),
                               data=AgentDataConfig(dataset="digits"), state_dir=str(tmp_path / "agent"),
                               ack_timeout_s=2.0)
    data = to_local_data(dataset.x_train[:120], dataset.y_train[:120])
    first = EdgeAgent(agent_config, data)
    trained, release = threading.Event(), threading.Event()
    train = first.runner.run

    def held(task: Task, payload: BytesLike | None = None) -> Update:  # made, then held until the broker is down
        update = train(task, payload)
        trained.set()
        release.wait(120)
        return update

    first.runner.run = held  # type: ignore[method-assign]
    first.start()
    coordinator = Coordinator(config, dataset=dataset)
    coordinator.start()
    results: list[RoundResult] = []
    rounds = threading.Thread(target=lambda: results.extend(coordinator.run()), daemon=True)
    rounds.start()
    second: EdgeAgent | None = None
    try:
        assert trained.wait(180)
        # Down long enough for the update to be spooled and the agent stopped while it is (seconds, even loaded).
        outage = threading.Thread(target=mosquitto.restart, args=(10.0,), daemon=True)
        outage.start()
        assert wait_for(lambda: not first.link.connected, 10)
        release.set()
        assert first.spool is not None
        assert wait_for(lambda: len(first.spool.task_ids()) == 1, 10)  # on disk, not yet sent
        (task_id,) = first.spool.task_ids()
        first.stop()  # the restart: the trained update exists only on disk now
        second = EdgeAgent(agent_config, data)
        retrained: list[str] = []
        second.runner.run = lambda task, payload=None: retrained.append(task.task_id)  # type: ignore[method-assign,assignment,return-value]
        second.start()  # connects once the broker is back
        outage.join(30)
        rounds.join(180)
        assert not rounds.is_alive() and len(results) == 1
        (record,) = results[0].tasks
        assert record.agent == "keeper" and record.status == "ok" and results[0].participants == 1
        assert second.uplink.restored == [task_id]
        assert wait_for(lambda: second.uplink.delivered == [task_id], 10)
        assert second.spool is not None and second.spool.task_ids() == []
        assert retrained == []  # the task, sent again when the agent came back, was not trained twice
    finally:
        release.set()
        coordinator.stop()
        first.stop()
        if second is not None:
            second.stop()
