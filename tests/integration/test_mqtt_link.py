"""The MQTT link against real brokers: MQTT 5 on mosquitto, 3.1.1 fallback on amqtt, Last Will, errors."""

from __future__ import annotations

import threading
import time

import pytest

from common.mqtt_link import BrokerConfig, BrokerUnavailable, MqttLink, Will
from fedfit.sim.broker import Broker, free_port, start_amqtt

pytestmark = pytest.mark.broker


def wait_until(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def exchange(broker: Broker) -> tuple[str, list[tuple[str, bytes]]]:
    received: list[tuple[str, bytes]] = []
    address = BrokerConfig(broker.host, broker.port)
    listener = MqttLink(client_id="listener", broker=address, subscriptions=["t/#"],
                        handler=lambda topic, payload: received.append((topic, payload)))
    speaker = MqttLink(client_id="speaker", broker=address, subscriptions=["unused"], handler=lambda t, p: None,
                       will=Will("t/will", b"gone"))
    listener.start(20)
    speaker.start(20)
    try:
        big = bytes(range(256)) * 4000  # 1 MB in one message
        assert speaker.publish("t/big", big)
        assert wait_until(lambda: any(topic == "t/big" for topic, _ in received))
        assert [p for t, p in received if t == "t/big"] == [big]
        speaker._client._sock.close()  # type: ignore[union-attr]  # an unclean drop: the broker sends the will
        assert wait_until(lambda: ("t/will", b"gone") in received, 15)
        return speaker.protocol_name, received
    finally:
        speaker.stop()
        listener.stop()


def test_mosquitto_speaks_mqtt5_and_delivers_last_will(mosquitto: Broker) -> None:
    protocol, _ = exchange(mosquitto)
    assert protocol == "MQTT 5"


def test_embedded_broker_falls_back_to_mqtt311() -> None:
    broker = start_amqtt()
    try:
        protocol, _ = exchange(broker)
    finally:
        broker.stop()
    assert protocol == "MQTT 3.1.1"


def test_unreachable_broker_is_one_clear_error() -> None:
    link = MqttLink(client_id="lonely", broker=BrokerConfig("127.0.0.1", free_port()), subscriptions=["x"],
                    handler=lambda t, p: None)
    with pytest.raises(BrokerUnavailable, match="cannot reach the MQTT broker at 127.0.0.1:.*running"):
        link.start(timeout=1.5)


def test_handler_exceptions_do_not_stop_dispatch(mosquitto: Broker) -> None:
    seen: list[bytes] = []
    done = threading.Event()

    def handler(topic: str, payload: bytes) -> None:
        if payload == b"boom":
            raise RuntimeError("handler bug")
        seen.append(payload)
        done.set()

    address = BrokerConfig(mosquitto.host, mosquitto.port)
    link = MqttLink(client_id="robust", broker=address, subscriptions=["r"], handler=handler)
    link.start(20)
    try:
        link.publish("r", b"boom")
        link.publish("r", b"fine")
        assert done.wait(10)
        assert seen == [b"fine"]
    finally:
        link.stop()
