"""What the MQTT link makes of a broker's refusals, fed the callbacks paho would call (no broker): a refused
subscription is kept for start() to report, or handed to ``on_refused`` after a reconnect; a refused PUBACK names
the topic of its publish, even when the PUBACK beats publish() storing it; a connection closed between CONNACK and
the first SUBACK is the broker's refusal (RabbitMQ's way), not an outage."""

from __future__ import annotations

import threading
from dataclasses import dataclass

from common.mqtt_link import BrokerConfig, MqttLink


@dataclass
class Code:
    name: str
    is_failure: bool

    def __str__(self) -> str:
        return self.name


GRANTED, REFUSED = Code("Granted QoS 1", False), Code("Not authorized", True)


class Refusals:
    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []
        self.event = threading.Event()

    def __call__(self, topic: str, reason: str) -> None:
        self.seen.append((topic, reason))
        self.event.set()


def link(on_refused: Refusals) -> MqttLink:
    return MqttLink(client_id="probe", broker=BrokerConfig(), subscriptions=["a/task", "a/ack"],
                    handler=lambda topic, payload: None, on_refused=on_refused)


def test_a_refused_subscription_is_kept_for_start_and_not_taken_for_ready() -> None:
    refusals = Refusals()
    probe = link(refusals)
    probe._subscribe_mid = 7
    probe._on_subscribe(None, None, 7, [GRANTED, REFUSED], None)
    assert probe._subscribed.is_set() and not probe.ready.is_set()
    assert probe._subscription_refusals == [("a/ack", "Not authorized")]
    assert refusals.seen == []  # start() reports it, with the sentence


def test_a_subscription_refused_after_a_reconnect_goes_to_on_refused() -> None:
    refusals = Refusals()
    probe = link(refusals)
    probe._subscribe_mid = 1
    probe._on_subscribe(None, None, 1, [GRANTED, GRANTED], None)
    assert probe.ready.is_set()
    probe._subscribe_mid = 2
    probe._on_subscribe(None, None, 2, [REFUSED, GRANTED], None)
    assert refusals.event.wait(5) and refusals.seen == [("a/task", "Not authorized")]


def test_a_refused_puback_names_its_topic_whichever_comes_first() -> None:
    refusals = Refusals()
    probe = link(refusals)
    probe._pending_topics[3] = "a/status"  # publish() stored it first
    probe._on_publish(None, None, 3, REFUSED, None)
    assert refusals.event.wait(5) and refusals.seen == [("a/status", "Not authorized")]
    probe._on_publish(None, None, 4, GRANTED, None)  # a PUBACK that beat publish(): remembered, not reported
    assert probe._early_acks[4] is None and probe.refused_publishes == 1


def test_a_connection_closed_before_the_first_suback_is_a_refusal_not_an_outage() -> None:
    probe = link(Refusals())
    probe._connack_reason = "ok"  # accepted: CONNACK came, the subscriptions went out
    probe._connack.set()
    probe._on_disconnect(None, None, None, Code("Unspecified error", True), None)
    assert probe._subscribed.is_set() and not probe.ready.is_set()  # start() wakes now and says why
    assert probe._closed_before_suback == "Unspecified error" and probe._down_since is None
    ready = link(Refusals())  # once subscribed, a closed connection is an outage to ride out
    ready._connack_reason = "ok"
    ready._connack.set()
    ready._subscribe_mid = 1
    ready._on_subscribe(None, None, 1, [GRANTED, GRANTED], None)
    ready._on_disconnect(None, None, None, Code("Unspecified error", True), None)
    assert ready._closed_before_suback is None and ready._down_since is not None
