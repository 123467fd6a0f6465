"""Two processes with one agent_id: the newer one refuses to start with one sentence, and an agent whose MQTT
session is taken over stops instead of knocking the other off in turn. Over mosquitto."""

from __future__ import annotations

import threading
import time

import paho.mqtt.client as mqtt
import pytest
import torch
from paho.mqtt.enums import CallbackAPIVersion

from edge_agent.config import AgentConfig, AgentDataConfig
from edge_agent.daemon import EdgeAgent
from edge_agent.id_probe import AgentIdInUse
from edge_agent.runner import LocalData
from fedfit.sim.broker import Broker

from .conftest import SecuredBroker

pytestmark = [pytest.mark.broker]


def make_agent(broker: Broker, federation: str, tmp_path, name: str, status_interval_s: float = 30.0) -> EdgeAgent:
    config = AgentConfig(agent_id="twin", federation=federation, data=AgentDataConfig(dataset="digits"),
                         state_dir=str(tmp_path / name), broker=broker.client_config("twin"),
                         status_interval_s=status_interval_s)
    return EdgeAgent(config, LocalData(torch.zeros(4, 1, 8, 8), torch.tensor([0, 1, 0, 1])))


@pytest.mark.parametrize(("running_interval", "newcomer_interval"), [(30.0, 0.3), (0.3, 30.0)])
def test_a_second_process_with_the_same_agent_id_refuses_to_start_whatever_the_intervals(
        secured_mosquitto: SecuredBroker, tmp_path, running_interval: float, newcomer_interval: float) -> None:
    mosquitto = secured_mosquitto("twins")
    first = make_agent(mosquitto, "twins", tmp_path, "first", running_interval)
    second = make_agent(mosquitto, "twins", tmp_path, "second", newcomer_interval)
    first.start()
    try:
        with pytest.raises(AgentIdInUse, match=r"^agent 'twin' of federation 'twins' is running already \(process "
                                               rf"{first.instance} answered\): another process uses this agent_id"):
            second.start()
        assert not second.link.connected  # it never connected as the agent
        time.sleep(1.0)
        assert first.link.connected and not first.taken_over and first.fatal is None  # the first one keeps working
    finally:
        first.stop()
    # Once the first one has said 'offline', the id is free again.
    third = make_agent(mosquitto, "twins", tmp_path, "third")
    third.start()
    third.stop()


def test_a_status_left_by_a_process_that_is_gone_does_not_block_the_id(secured_mosquitto: SecuredBroker,
                                                                       tmp_path) -> None:
    mosquitto = secured_mosquitto("ghost")
    # A retained 'online' status of a process that is gone (e.g. the broker lost its Last Will in a restart).
    from protocol import AgentStatus, Topics, encode

    twin = mosquitto.client_config("twin")
    ghost = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="ghost", protocol=mqtt.MQTTv5)
    ghost.username_pw_set(*twin.login())
    ghost.tls_set(ca_certs=twin.ca_file)
    ghost.connect(mosquitto.host, mosquitto.port)
    ghost.loop_start()
    try:
        ghost.publish(Topics("ghost").agent_status("twin"),
                      encode(AgentStatus("twin", "online", None, time.time(), "gone")), qos=1,
                      retain=True).wait_for_publish(5)
    finally:
        ghost.disconnect()
        ghost.loop_stop()
    agent = make_agent(mosquitto, "ghost", tmp_path, "agent")
    import structlog

    with structlog.testing.capture_logs() as logs:
        agent.start()  # no answer from 'gone' within the probe's wait: it starts
    try:
        assert agent.link.connected
        assert [entry["instance"] for entry in logs if entry["event"] == "stale_status_replaced"] == ["gone"]
    finally:
        agent.stop()


@pytest.mark.slow
def test_an_agent_whose_session_is_taken_over_stops_instead_of_fighting(secured_mosquitto: SecuredBroker,
                                                                          tmp_path) -> None:
    mosquitto = secured_mosquitto("takeover")
    agent = make_agent(mosquitto, "takeover", tmp_path, "agent")
    agent.start()
    # A clone of the device (its login and its agent_id, e.g. a copied SD card) connects with the same client id.
    intruder = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="fedfit-agent-twin", protocol=mqtt.MQTTv5)
    twin = mosquitto.client_config("twin")
    intruder.username_pw_set(*twin.login())
    intruder.tls_set(ca_certs=twin.ca_file)
    kicked = threading.Event()
    intruder.on_disconnect = lambda *_args: kicked.set()
    try:
        intruder.connect(mosquitto.host, mosquitto.port)
        intruder.loop_start()
        deadline = time.monotonic() + 10
        while not agent.taken_over and time.monotonic() < deadline:
            time.sleep(0.05)
        assert agent.taken_over  # after a few rounds of knocking each other off (Mosquitto 2.0 sends no reason)
        assert agent._stop.wait(5)  # it stopped itself
        assert "give every device its own agent_id" in agent.taken_over_message()
        time.sleep(2.0)  # the intruder's reconnect after the agent's last turn
        kicked.clear()
        assert not kicked.wait(4.0)  # the agent no longer reconnects to knock the intruder off
        assert intruder.is_connected()
    finally:
        intruder.loop_stop()
        intruder.disconnect()
        agent.stop()
