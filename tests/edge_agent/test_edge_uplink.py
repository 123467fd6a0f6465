"""Uplink: updates go out as chunks and are resent until acked or abandoned."""

from __future__ import annotations

import threading
import time

import msgpack
import numpy as np
import pytest

from edge_agent.uplink import Uplink
from protocol import Reassembler, Update, decode, encode

TOPIC = "fedfit/v1/test/agents/a/update"


class FakePublish:
    """Records every publish; thread-safe."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, bytes]] = []
        self.lock = threading.Lock()

    def __call__(self, topic: str, payload: bytes) -> bool:
        with self.lock:
            self.calls.append((topic, payload))
        return True

    def count(self) -> int:
        with self.lock:
            return len(self.calls)


def update(task_id: str = "r1-a-0001", size: int = 4) -> Update:
    return Update(task_id=task_id, round=1, agent_id="a", status="ok", spec_trained={"width": 0.5}, num_samples=3,
                  labels=[0, 1], weights={"w": np.arange(size, dtype=np.float32)}, metrics={"loss": 0.5})


def wait_until(predicate, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.005)
    return predicate()


@pytest.fixture
def make_uplink():
    started: list[Uplink] = []

    def factory(ack_timeout_s: float, attempts: int) -> tuple[Uplink, FakePublish]:
        publish = FakePublish()
        uplink = Uplink("a", TOPIC, publish, ack_timeout_s=ack_timeout_s, attempts=attempts)
        uplink.start()
        started.append(uplink)
        return uplink, publish

    yield factory
    for uplink in started:
        uplink.stop(timeout=2.0)


def test_update_is_published_as_chunks_that_reassemble_to_it(make_uplink):
    uplink, publish = make_uplink(ack_timeout_s=5.0, attempts=3)
    u = update()
    uplink.send(u)
    assert wait_until(lambda: publish.count() >= 1)
    topic, chunk = publish.calls[0]
    assert topic == TOPIC
    assert msgpack.unpackb(chunk)["type"] == "chunk"
    payload = Reassembler().feed(chunk, source="a")
    assert payload == encode(u)
    decoded = decode(payload, expected=Update)
    assert decoded.task_id == u.task_id and decoded.weights["w"].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert uplink.on_ack(u.task_id) is True
    assert wait_until(lambda: uplink.delivered == [u.task_id])
    assert uplink.abandoned == []


def test_large_update_is_split_into_several_chunks(make_uplink):
    uplink, publish = make_uplink(ack_timeout_s=5.0, attempts=1)
    u = update(size=400_000)  # 1.6 MB of float32: two chunks of at most 1 MiB
    uplink.send(u)
    assert wait_until(lambda: publish.count() >= 2)
    reassembler = Reassembler()
    results = [reassembler.feed(chunk, source="a") for _, chunk in publish.calls[:2]]
    assert results[0] is None and results[1] == encode(u)
    assert uplink.on_ack(u.task_id) is True
    assert wait_until(lambda: uplink.delivered == [u.task_id])


def test_update_is_resent_after_ack_timeout_until_acked(make_uplink):
    uplink, publish = make_uplink(ack_timeout_s=0.05, attempts=50)
    u = update()
    uplink.send(u)
    assert wait_until(lambda: publish.count() >= 3)
    transfers = [msgpack.unpackb(chunk)["transfer"] for _, chunk in publish.calls[:3]]
    assert transfers == [f"{u.task_id}.1", f"{u.task_id}.2", f"{u.task_id}.3"]  # a fresh transfer per attempt
    assert uplink.on_ack(u.task_id) is True
    assert wait_until(lambda: uplink.delivered == [u.task_id])
    sent = publish.count()
    time.sleep(0.2)
    assert publish.count() == sent  # no more resends once acked
    assert uplink.idle()


def test_update_is_abandoned_after_the_attempts(make_uplink):
    uplink, publish = make_uplink(ack_timeout_s=0.02, attempts=3)
    u = update()
    uplink.send(u)
    assert wait_until(lambda: uplink.abandoned == [u.task_id])
    assert publish.count() == 3
    assert uplink.delivered == []
    assert uplink.on_ack(u.task_id) is False  # too late: nothing outstanding any more
    assert wait_until(uplink.idle)


def test_ack_for_unknown_task_returns_false(make_uplink):
    uplink, publish = make_uplink(ack_timeout_s=0.05, attempts=2)
    assert uplink.on_ack("never-sent") is False
    assert publish.count() == 0 and uplink.idle()


def test_updates_are_delivered_one_after_another(make_uplink):
    uplink, publish = make_uplink(ack_timeout_s=5.0, attempts=3)
    first, second = update("t-1"), update("t-2")
    uplink.send(first)
    uplink.send(second)
    assert wait_until(lambda: publish.count() == 1)
    time.sleep(0.05)
    assert publish.count() == 1  # the second waits until the first is acked
    assert uplink.on_ack("t-1") is True
    assert wait_until(lambda: publish.count() == 2)
    assert decode(Reassembler().feed(publish.calls[1][1]), expected=Update).task_id == "t-2"
    assert uplink.on_ack("t-2") is True
    assert wait_until(lambda: uplink.delivered == ["t-1", "t-2"])


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_sending_same_update_twice_does_not_break_the_uplink(make_uplink):
    uplink, publish = make_uplink(ack_timeout_s=0.05, attempts=3)
    u = update("t-dup")
    uplink.send(u)
    uplink.send(u)
    assert wait_until(lambda: publish.count() >= 1)
    uplink.on_ack("t-dup")
    assert wait_until(lambda: "t-dup" in uplink.delivered)
    time.sleep(0.1)
    uplink.send(update("t-next"))
    assert wait_until(lambda: any(b"t-next" in chunk for _, chunk in publish.calls), timeout=1.0)


def test_a_refusal_stops_the_resends_and_is_recorded_apart_from_deliveries(make_uplink):
    uplink, publish = make_uplink(ack_timeout_s=0.05, attempts=50)
    u = update()
    uplink.send(u)
    assert wait_until(lambda: publish.count() >= 2)
    assert uplink.on_ack(u.task_id, "round 1 closed before the update arrived") is True
    assert wait_until(lambda: uplink.refused == [u.task_id])
    sent = publish.count()
    time.sleep(0.2)
    assert publish.count() == sent and uplink.delivered == [] and uplink.abandoned == []
