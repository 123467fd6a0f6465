"""What the MQTT link makes of a broker's refusals, fed the callbacks paho would call (no broker): a refused
subscription is kept for start() to report, or handed to ``on_refused`` after a reconnect; a refused PUBACK names
the topic of its publish, even when the PUBACK beats publish() storing it; a connection closed between CONNACK and
the first SUBACK is the broker's refusal (RabbitMQ's way), not an outage; the bytes of QoS 1 publishes are counted
in flight until their PUBACK, which is what a sender waits on for room."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from types import SimpleNamespace

import paho.mqtt.client as mqtt

from common.mqtt_link import BrokerConfig, LinkState, MqttLink


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
    probe._handshake.subscribe_mid = 7
    probe._on_subscribe(None, None, 7, [GRANTED, REFUSED], None)
    assert probe._handshake.subscribed.is_set() and not probe.ready.is_set()
    assert probe._handshake.refusals == [("a/ack", "Not authorized")]
    assert refusals.seen == []  # start() reports it, with the sentence


def test_a_subscription_refused_after_a_reconnect_goes_to_on_refused() -> None:
    refusals = Refusals()
    probe = link(refusals)
    probe._handshake.subscribe_mid = 1
    probe._on_subscribe(None, None, 1, [GRANTED, GRANTED], None)
    assert probe.ready.is_set()
    probe._handshake.subscribe_mid = 2
    probe._on_subscribe(None, None, 2, [REFUSED, GRANTED], None)
    assert refusals.event.wait(5) and refusals.seen == [("a/task", "Not authorized")]


def test_a_refused_puback_names_its_topic_whichever_comes_first() -> None:
    refusals = Refusals()
    probe = link(refusals)
    probe._pending_topics[3] = ("a/status", 10)  # publish() stored it first
    probe._in_flight = 10
    probe._on_publish(None, None, 3, REFUSED, None)
    assert refusals.event.wait(5) and refusals.seen == [("a/status", "Not authorized")]
    probe._on_publish(None, None, 4, GRANTED, None)  # a PUBACK that beat publish(): remembered, not reported
    assert probe._early_acks[4] is None and probe.refused_publishes == 1


def accepted(probe: MqttLink, mid: int) -> None:
    """What paho's on_connect leaves behind: CONNACK accepted, the subscriptions sent as message ``mid``."""
    probe._handshake.connack_reason = "ok"
    probe._handshake.connack.set()
    probe._handshake.subscribe_mid = mid


def test_a_connection_closed_twice_before_any_suback_is_a_refusal_not_an_outage() -> None:
    probe = link(Refusals())
    accepted(probe, 1)
    probe._on_disconnect(None, None, None, Code("Unspecified error", True), None)
    # Once may be a dropped connection: paho reconnects and subscribes again.
    assert not probe._handshake.subscribed.is_set()
    accepted(probe, 2)
    probe._on_disconnect(None, None, None, Code("Unspecified error", True), None)
    assert probe._handshake.subscribed.is_set() and not probe.ready.is_set()  # start() wakes now and says why
    assert probe._handshake.closed_before_suback == "Unspecified error" and probe._uptime.down_since is None


def test_a_connection_dropped_once_before_its_suback_still_gets_ready() -> None:
    probe = link(Refusals())
    accepted(probe, 1)
    probe._on_disconnect(None, None, None, Code("Unspecified error", True), None)
    accepted(probe, 2)
    probe._on_subscribe(None, None, 2, [GRANTED, GRANTED], None)
    assert probe.ready.is_set() and probe._handshake.closed_before_suback is None
    probe._on_disconnect(None, None, None, Code("Unspecified error", True), None)  # once ready: an outage to ride out
    assert probe._handshake.closed_before_suback is None and probe._uptime.down_since is not None


def test_a_refusing_suback_then_a_close_keeps_the_refused_topics() -> None:
    probe = link(Refusals())
    accepted(probe, 1)
    probe._on_subscribe(None, None, 1, [GRANTED, REFUSED], None)
    probe._on_disconnect(None, None, None, Code("Not authorized", True), None)
    assert probe._handshake.refusals == [("a/ack", "Not authorized")] and probe._handshake.closed_before_suback is None


@dataclass
class NumberedCode(Code):
    value: int = 0


def test_a_session_taken_over_is_final_and_stop_leaves_it_so() -> None:
    taken = threading.Event()
    probe = MqttLink(client_id="probe", broker=BrokerConfig(), subscriptions=["a/task"],
                     handler=lambda topic, payload: None, on_taken_over=taken.set)
    assert probe.state is LinkState.CONNECTING
    accepted(probe, 1)
    probe._on_subscribe(None, None, 1, [GRANTED], None)
    assert probe.state is LinkState.READY and not probe.taken_over
    client = SimpleNamespace(loop_stop=lambda: None)
    probe._on_disconnect(client, None, None, NumberedCode("Session taken over", True, 142), None)
    assert taken.wait(5) and probe.taken_over and probe.state is LinkState.TAKEN_OVER
    probe.stop()
    assert probe.state is LinkState.TAKEN_OVER and probe.state.ending


class QueuingClient:
    """paho's publish as far as the link sees it: each call queued under the next message id."""

    def __init__(self) -> None:
        self.mid = 0

    def publish(self, topic: str, payload: bytes, qos: int, retain: bool) -> SimpleNamespace:
        self.mid += 1
        return SimpleNamespace(rc=mqtt.MQTT_ERR_SUCCESS, mid=self.mid)


def test_bytes_stay_in_flight_until_their_puback_and_a_sender_waits_for_room() -> None:
    probe = link(Refusals())
    probe._client = QueuingClient()  # type: ignore[assignment]
    for _ in range(3):
        assert probe.publish("a/task", b"x" * 100)
    assert probe.bytes_in_flight == 300
    assert not probe.wait_for_room(300, 0.01)  # 300 in flight: no room under 300
    answers: list[bool] = []
    waiter = threading.Thread(target=lambda: answers.append(probe.wait_for_room(250, 30)))
    waiter.start()
    probe._on_publish(None, None, 1, GRANTED, None)  # the broker took the first: 200 left
    waiter.join(30)
    assert answers == [True] and probe.bytes_in_flight == 200
    probe._on_publish(None, None, 9, GRANTED, None)  # a PUBACK that beat publish(): its bytes were never counted
    probe._client.mid = 8
    probe.publish("a/task", b"x" * 100)  # (mid 9)
    assert probe.bytes_in_flight == 200 and probe.wait_for_room(201, 0)
