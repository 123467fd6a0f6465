"""A mosquitto run from the files `fedfit broker init` and `add-device` write, with real clients: strangers,
wrong passwords and wrong certificates are refused with one sentence, every device is pinned to its own topics by
the broker, a removed device is refused after a reload, and a task or an update under the wrong id that a login
may publish is still rejected by the daemon that reads it."""

from __future__ import annotations

import os
import pwd
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import structlog
import torch

from common.data import load_dataset
from common.mqtt_link import BrokerConfig, BrokerUnavailable, MqttLink
from coordinator.daemon import Coordinator
from edge_agent.config import AgentConfig, AgentDataConfig
from edge_agent.daemon import EdgeAgent
from edge_agent.runner import LocalData
from fedfit.cli import main
from fedfit.secure_broker import BrokerDirectory
from fedfit.sim.broker import find_mosquitto, free_port, wait_for_login, wait_for_port
from loadrig.raw_client import RawClient
from protocol import ModelRef, Recipe, Task, Topics, Update, encode, split_payload

from .conftest import SecuredBroker, on_broker, tiny_config

pytestmark = [pytest.mark.broker]

TOPICS = Topics("lab")


def connected(config: BrokerConfig, client_id: str) -> RawClient:
    """A raw MQTT 5 client logging in as ``config`` says, connected."""
    client = RawClient.for_config(config, client_id)
    assert client.connack == "Success", client.connack
    return client


def refusal(config: BrokerConfig) -> str:
    """The sentence MqttLink fails with when it cannot log in as ``config`` says."""
    link = MqttLink(client_id="probe", broker=config, subscriptions=["x"], handler=lambda _t, _p: None)
    with pytest.raises(BrokerUnavailable) as raised:
        link.start(timeout=3)
    link.stop()
    return str(raised.value)


@pytest.fixture
def broker_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> Iterator[tuple[BrokerDirectory, int]]:
    """`fedfit broker init` + `add-device pi-01`, `pi-02`, and mosquitto started from the files they wrote."""
    binary = find_mosquitto()
    if binary is None:
        pytest.fail("mosquitto is not installed: run `make test` (it installs it) or apt-get install mosquitto")
    port = free_port()
    root = tmp_path / "broker"
    user = pwd.getpwuid(os.geteuid()).pw_name  # run as root, mosquitto would switch to its own user
    assert main(["broker", "init", str(root), "--federation", "lab", "--port", str(port), "--bind", "127.0.0.1",
                 "--no-persistence", "--user", user]) == 0
    for name in ("pi-01", "pi-02"):
        assert main(["broker", "add-device", str(root), name]) == 0
    capsys.readouterr()
    directory = BrokerDirectory.open(root)
    log = (tmp_path / "mosquitto.log").open("wb")
    process = subprocess.Popen([binary, "-c", str(directory.conf)], stdout=log, stderr=subprocess.STDOUT)
    try:
        assert wait_for_port("127.0.0.1", port, 10), (tmp_path / "mosquitto.log").read_text()
        yield directory, process.pid
    finally:
        process.terminate()
        process.wait(10)
        log.close()


def test_strangers_wrong_passwords_and_wrong_certificates_are_refused(broker_dir, tmp_path: Path) -> None:
    directory, _ = broker_dir
    device = directory.client_config("pi-01", host="127.0.0.1")
    wait_for_login(device, timeout=5)  # the device itself gets in
    anonymous = BrokerConfig(host="127.0.0.1", port=device.port, tls=True, ca_file=device.ca_file)
    assert "refused client 'probe' (user None): Not authorized" in refusal(anonymous)
    wrong = replace(device, password_file=None, password="guess")
    assert "refused client 'probe' (user 'pi-01'): Not authorized; check the username and password" in refusal(wrong)
    other_ca = tmp_path / "other"
    other_ca.mkdir()
    assert main(["broker", "init", str(other_ca), "--federation", "lab"]) == 0
    forged_trust = replace(device, ca_file=str(other_ca / "ca.crt"))
    assert "TLS handshake with the MQTT broker at 127.0.0.1:" in refusal(forged_trust)
    assert "CERTIFICATE_VERIFY_FAILED" in refusal(forged_trust)
    plain = replace(device, tls=False, ca_file=None)
    assert "if the broker takes only TLS there, set broker.tls: true" in refusal(plain)


def test_every_device_is_pinned_to_its_own_topics(broker_dir) -> None:
    directory, pid = broker_dir
    coordinator = connected(directory.client_config("coordinator", host="127.0.0.1"), "coordinator")
    alice = connected(directory.client_config("pi-01", host="127.0.0.1"), "pi-01")
    try:
        assert coordinator.subscribe(TOPICS.all_agent_updates(), TOPICS.all_agent_status())
        assert alice.subscribe(TOPICS.agent_task("pi-01"), TOPICS.agent_task("pi-02"), TOPICS.agent_ack("pi-02"),
                        TOPICS.all_agent_updates())
        # What a device may publish: its own status and update. Not another's, not a task, not the coordinator's.
        assert alice.publish(TOPICS.agent_update("pi-01"), b"mine") == "Success"
        assert alice.publish(TOPICS.agent_status("pi-01"), b"my status") == "Success"
        for topic in (TOPICS.agent_update("pi-02"), TOPICS.agent_status("pi-02"), TOPICS.agent_task("pi-02"),
                      TOPICS.agent_ack("pi-02"), TOPICS.coordinator_status(), "fedfit/v1/other/agents/pi-01/update"):
            assert alice.publish(topic, b"forged") == "Not authorized", topic
        # The coordinator sends tasks and acks, but never speaks for a device.
        assert coordinator.publish(TOPICS.agent_task("pi-01"), b"task for pi-01") == "Success"
        assert coordinator.publish(TOPICS.agent_task("pi-02"), b"task for pi-02") == "Success"
        assert coordinator.publish(TOPICS.agent_ack("pi-02"), b"ack for pi-02") == "Success"
        for topic in (TOPICS.agent_update("pi-02"), TOPICS.agent_status("pi-02")):
            assert coordinator.publish(topic, b"forged") == "Not authorized", topic
        time.sleep(0.5)
        # What a device reads: its own tasks; nothing of pi-02's, not even its updates through a wildcard.
        assert alice.received and {payload for _, payload in alice.received} == {b"task for pi-01"}
        assert sorted(coordinator.received) == [(TOPICS.agent_status("pi-01"), b"my status"),
                                                (TOPICS.agent_update("pi-01"), b"mine")]
    finally:
        alice.close()
        coordinator.close()
    # A device taken off the broker is refused after the broker's reload.
    assert main(["broker", "remove-device", str(directory.path), "pi-02"]) == 0
    bob = BrokerConfig(host="127.0.0.1", port=directory.settings.port, username="pi-02", password="x", tls=True,
                       ca_file=str(directory.ca_file))
    os.kill(pid, signal.SIGHUP)
    time.sleep(0.5)
    assert "Not authorized" in refusal(bob)


def test_a_task_or_update_under_the_wrong_id_is_rejected(secured_mosquitto: SecuredBroker, tmp_path: Path) -> None:
    """What the ACL lets through (a login publishing on its own topics) is still checked against the topic."""
    broker = secured_mosquitto("lab")
    config = on_broker(tiny_config(federation="lab", state_dir=str(tmp_path / "coordinator")), broker)
    agent = EdgeAgent(AgentConfig(agent_id="pi-01", federation="lab", broker=broker.client_config("pi-01"),
                                  data=AgentDataConfig(dataset="digits"), state_dir=str(tmp_path / "agent")),
                      LocalData(torch.zeros(4, 1, 8, 8), torch.tensor([0, 1, 0, 1])))
    broker.add_logins(["pi-02"])
    with structlog.testing.capture_logs() as logs:
        coordinator = Coordinator(config, dataset=load_dataset("digits"))
        coordinator.start()
        agent.start()
        stolen_device = connected(broker.client_config("pi-01"), "thief-device")
        stolen_coordinator = connected(broker.coordinator_config(), "thief-coordinator")
        try:
            update = Update("r1-pi-02-0000", 1, "pi-02", "ok", {"width": 1.0}, 5, [0],
                            {"w": np.zeros(2, dtype=np.float32)}, {}, None)
            for chunk in split_payload(encode(update), "wrong-update"):
                assert stolen_device.publish(TOPICS.agent_update("pi-01"), chunk) == "Success"
            task = Task("r1-pi-02-0000", 1, "pi-02", time.time() + 60, ModelRef("cnn", 10, 1, {}), {"width": 1.0},
                        Recipe(1, 8, 0.1, 0.0, 0.0, None, False, 0), {"w": np.zeros(3, dtype=np.float32)})
            for chunk in split_payload(encode(task), "wrong-task"):
                assert stolen_coordinator.publish(TOPICS.agent_task("pi-01"), chunk) == "Success"
            deadline = time.monotonic() + 10
            while (coordinator.rejected_messages < 1 or agent.rejected_messages < 1) and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            stolen_device.close()
            stolen_coordinator.close()
            agent.stop()
            coordinator.stop()
    reasons = [entry["reason"] for entry in logs if entry["event"] == "message_rejected"]
    assert "update from agent 'pi-02' published on the topic of 'pi-01'" in reasons, reasons
    assert "task addressed to 'pi-02' arrived at 'pi-01'" in reasons, reasons
    assert agent.tasks_done == 0


def test_a_broker_started_here_restarts_on_its_port_with_its_logins(secured_mosquitto: SecuredBroker) -> None:
    broker = secured_mosquitto("lab")
    device = broker.client_config("pi-01")
    broker.restart(down_s=0.5)
    wait_for_login(device, timeout=10)  # same port, same files: the device logs in again
    assert "Not authorized" in refusal(replace(device, username="pi-02"))
