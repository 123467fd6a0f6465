"""The MQTT link measures how long it was without the broker (a restart of mosquitto on the same port), which
the coordinator adds to a round's deadline."""

from __future__ import annotations

import subprocess
import time

import pytest

from common.mqtt_link import BrokerConfig, MqttLink
from fedfit.sim.broker import find_mosquitto, free_port, wait_for_port

pytestmark = [pytest.mark.broker, pytest.mark.slow]


def run_mosquitto(binary: str, port: int, tmp_path) -> subprocess.Popen[bytes]:
    conf = tmp_path / "mosquitto.conf"
    conf.write_text(f"listener {port} 127.0.0.1\nallow_anonymous true\npersistence false\n")
    process = subprocess.Popen([binary, "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    assert wait_for_port("127.0.0.1", port, 10.0)
    return process


def test_outage_seconds_count_a_broker_restart(tmp_path) -> None:
    binary = find_mosquitto()
    if binary is None:
        pytest.skip("mosquitto is not installed")
    port = free_port()
    broker = run_mosquitto(binary, port, tmp_path)
    link = MqttLink(client_id="outage-probe", broker=BrokerConfig(host="127.0.0.1", port=port),
                    subscriptions=["fedfit/v1/outage/#"], handler=lambda topic, payload: None)
    try:
        link.start(10)
        assert link.outage_seconds() == 0.0
        broker.terminate()
        broker.wait(5)
        time.sleep(2.0)
        during = link.outage_seconds()
        assert during >= 1.5 and not link.connected  # the current outage counts while it lasts
        broker = run_mosquitto(binary, port, tmp_path)
        deadline = time.monotonic() + 40
        while not link.connected and time.monotonic() < deadline:
            time.sleep(0.1)
        assert link.connected
        total = link.outage_seconds()
        assert total >= during
        time.sleep(0.5)
        assert link.outage_seconds() == total  # back: it stops growing
    finally:
        link.stop()
        broker.terminate()
        broker.wait(5)
