"""A bare MQTT 5 client that records the broker's answers, for tests and benchmarks that play strangers, stolen
logins and thieves against a broker (the daemons use ``common.mqtt_link``)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion

from common.mqtt_link import BrokerConfig

#: Seconds to wait for the broker's CONNACK, SUBACK or PUBACK.
ANSWER_WAIT_S = 5.0


class RawClient:
    """Connects (a login or none, TLS when ``ca_file`` is given) and records the CONNACK reason (``connack``; empty
    when none came), the PUBACK reason of each publish and, without an ``on_message`` handler, what it receives."""

    def __init__(self, host: str, port: int, client_id: str, *, login: tuple[str, str | None] | None = None,
                 ca_file: str | None = None, on_message: Callable[[str, bytes], None] | None = None) -> None:
        self.connack = ""
        self.acks: dict[int, str] = {}
        self.received: list[tuple[str, bytes]] = []
        self._connected = threading.Event()
        self._subscribed = threading.Event()
        handle = on_message or (lambda topic, payload: self.received.append((topic, payload)))
        self.client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv5)
        if login is not None:
            self.client.username_pw_set(*login)
        if ca_file is not None:
            self.client.tls_set(ca_certs=ca_file)
        self.client.on_connect = self._on_connect
        self.client.on_subscribe = lambda *_args: self._subscribed.set()
        self.client.on_message = lambda _c, _u, message: handle(message.topic, bytes(message.payload))
        self.client.on_publish = lambda _c, _u, mid, reason, _p: self.acks.__setitem__(mid, str(reason))
        self.client.connect(host, port)
        self.client.loop_start()
        self._connected.wait(ANSWER_WAIT_S)

    @classmethod
    def for_config(cls, config: BrokerConfig, client_id: str, **kwargs: Any) -> RawClient:
        """A client logging in as a ``broker`` section says (its login, its TLS settings)."""
        return cls(config.host, config.port, client_id, login=config.login(),
                   ca_file=config.ca_file if config.tls else None, **kwargs)

    def _on_connect(self, client: Any, userdata: Any, flags: Any, reason: Any, properties: Any) -> None:
        self.connack = str(reason)
        self._connected.set()

    def subscribe(self, *topics: str) -> bool:
        """Subscribe at QoS 1; whether the broker answered."""
        self._subscribed.clear()
        self.client.subscribe([(topic, 1) for topic in topics])
        return self._subscribed.wait(ANSWER_WAIT_S)

    def publish(self, topic: str, payload: bytes, wait: bool = True) -> str:
        """Publish at QoS 1; the broker's PUBACK reason ("Success", "Not authorized", or "no PUBACK" when none
        came in time). ``wait=False`` (from inside ``on_message``, where the answer cannot arrive) returns ""."""
        info = self.client.publish(topic, payload, qos=1)
        if not wait:
            return ""
        deadline = time.monotonic() + ANSWER_WAIT_S
        while info.mid not in self.acks and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.acks.get(info.mid, "no PUBACK")

    def close(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()
