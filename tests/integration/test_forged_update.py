"""A compromised device (its own login, from a second connection) reads its task and answers first with the
weights times -50: the coordinator screens the update out with a reason, and the global model trains on as without
it. End to end over a secured mosquitto."""

from __future__ import annotations

import threading
import time

import paho.mqtt.client as mqtt
import pytest
import structlog
from paho.mqtt.enums import CallbackAPIVersion

from common.data import load_dataset
from coordinator.daemon import Coordinator
from protocol import Reassembler, Task, Topics, Update, decode, encode, split_payload

from .conftest import SecuredBroker, digits_fleet, on_broker, tiny_config

pytestmark = [pytest.mark.broker, pytest.mark.slow]

AGENTS = ("dev-a", "dev-b", "victim")


def forge(task: Task) -> Update:
    """The victim's task answered with every weight it sent times -50."""
    return Update(task.task_id, task.round, task.agent_id, "ok", task.spec, 500, list(range(10)),
                  {key: value * -50 for key, value in task.weights.items()}, {}, None)


def test_a_forged_update_is_screened_out_and_the_federation_trains_on(secured_mosquitto: SecuredBroker,
                                                                       tmp_path) -> None:
    dataset = load_dataset("digits")
    topics = Topics("forged")
    broker = secured_mosquitto("forged")
    config = on_broker(tiny_config(federation="forged", rounds=2, min_agents=len(AGENTS), state_dir=str(tmp_path),
                                   algorithm="fedavg"), broker)
    forged: list[str] = []
    reassembler = Reassembler()
    stolen = broker.client_config("victim")  # the victim's own login, copied off the device
    attacker = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="attacker")
    attacker.username_pw_set(*stolen.login())
    attacker.tls_set(ca_certs=stolen.ca_file)

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
        agents = digits_fleet(dataset, AGENTS, config, broker)
        subscribed = threading.Event()
        attacker.on_subscribe = lambda *_args: subscribed.set()
        attacker.connect(broker.host, broker.port)
        attacker.subscribe(topics.agent_task("victim"), qos=1)
        attacker.loop_start()
        assert subscribed.wait(10)
        try:
            coordinator.start()
            for agent in agents:
                agent.start()
            results = coordinator.run()
            victim_agent = next(agent for agent in agents if agent.agent_id == "victim")
            deadline = time.monotonic() + 30  # the last round's verdict is on its way
            while len(victim_agent.rejected_updates) < len(forged) and time.monotonic() < deadline:
                time.sleep(0.05)
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
        assert victim.reason.startswith("update rejected: its change (norm "), victim.reason
        assert result.participants == 2, [(t.agent, t.status, t.reason) for t in result.tasks]
    rejected = [entry for entry in logs if entry["event"] == "update_rejected"]
    assert len(rejected) == 2 and all("the most its training plan can move the weights" in entry["reason"]
                                      for entry in rejected)
    # The verdict reached the device whose task it answered (the ack after screening carries it).
    assert set(victim_agent.rejected_updates) == set(forged)
    told = [e for e in logs if e["event"] == "update_rejected_by_coordinator" and e.get("agent") == "victim"]
    assert len(told) == 2 and all("the most its training plan" in e["reason"] for e in told)
    assert results[-1].global_accuracy > 0.8, [r.global_accuracy for r in results]
