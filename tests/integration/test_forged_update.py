"""An outsider who reads a device's task and answers first with its weights times -50: the coordinator screens the
update out with a reason, and the global model trains on as without it. End to end over mosquitto."""

from __future__ import annotations

import threading

import paho.mqtt.client as mqtt
import pytest
import structlog
from paho.mqtt.enums import CallbackAPIVersion

from common.data import load_dataset
from coordinator.daemon import Coordinator
from fedfit.sim.broker import Broker
from protocol import Reassembler, Task, Topics, Update, decode, encode, split_payload

from .conftest import digits_fleet, tiny_config

pytestmark = [pytest.mark.broker, pytest.mark.slow]

AGENTS = ("dev-a", "dev-b", "victim")


def forge(task: Task) -> Update:
    """The victim's task answered with every weight it sent times -50."""
    return Update(task.task_id, task.round, task.agent_id, "ok", task.spec, 500, list(range(10)),
                  {key: value * -50 for key, value in task.weights.items()}, {}, None)


def test_a_forged_update_is_screened_out_and_the_federation_trains_on(mosquitto: Broker, tmp_path) -> None:
    dataset = load_dataset("digits")
    topics = Topics("forged")
    config = tiny_config(federation="forged", rounds=2, min_agents=len(AGENTS), state_dir=str(tmp_path),
                         algorithm="fedavg")
    config.broker.host, config.broker.port = mosquitto.host, mosquitto.port
    forged: list[str] = []
    reassembler = Reassembler()
    attacker = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="attacker")

    def on_message(_client, _userdata, message) -> None:
        payload = reassembler.feed(message.payload, message.topic)
        if payload is None:
            return
        task = decode(payload, expected=Task)
        assert isinstance(task, Task)
        for chunk in split_payload(encode(forge(task)), f"forged-{task.task_id}"):
            attacker.publish(topics.agent_update("victim"), chunk, qos=1)
        forged.append(task.task_id)

    attacker.on_message = on_message
    with structlog.testing.capture_logs() as logs:
        coordinator = Coordinator(config, dataset=dataset)
        agents = digits_fleet(dataset, AGENTS, config)
        subscribed = threading.Event()
        attacker.on_subscribe = lambda *_args: subscribed.set()
        attacker.connect(mosquitto.host, mosquitto.port)
        attacker.subscribe(topics.agent_task("victim"), qos=1)
        attacker.loop_start()
        assert subscribed.wait(10)
        try:
            coordinator.start()
            for agent in agents:
                agent.start()
            results = coordinator.run()
        finally:
            attacker.loop_stop()
            attacker.disconnect()
            for agent in agents:
                agent.stop()
            coordinator.stop()

    assert len(forged) == 2  # the outsider answered the victim's task in both rounds
    for result in results:
        victim = next(t for t in result.tasks if t.agent == "victim")
        assert victim.status == "rejected", victim
        assert victim.reason.startswith("update rejected: its change (rms "), victim.reason
        assert result.participants == 2
    rejected = [entry for entry in logs if entry["event"] == "update_rejected"]
    assert len(rejected) == 2 and all("times the median" in entry["reason"] for entry in rejected)
    assert results[-1].global_accuracy > 0.8, [r.global_accuracy for r in results]
