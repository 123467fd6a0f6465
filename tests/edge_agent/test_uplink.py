"""Uplink: updates go out as chunks and are resent until acked or abandoned."""

from __future__ import annotations

import hashlib
import threading
import time

import msgpack
import numpy as np
import pytest

from edge_agent.uplink import Uplink
from protocol import Reassembler, Update, UploadRequest, decode, encode, payload_version

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
    assert payload == encode(u, version=1)  # the task's version unknown: the one every coordinator reads
    assert msgpack.unpackb(chunk)["v"] == 1
    decoded = decode(payload, expected=Update)
    assert decoded.task_id == u.task_id and decoded.weights["w"].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert uplink.on_ack(u.task_id) is True
    assert wait_until(lambda: uplink.delivered == [u.task_id])
    assert uplink.abandoned == []


def test_an_update_goes_out_in_the_version_of_its_task(make_uplink):
    uplink, publish = make_uplink(ack_timeout_s=5.0, attempts=3)
    u = update(size=3000)
    uplink.send(u, version=2)
    assert wait_until(lambda: publish.count() >= 1)
    _, chunk = publish.calls[0]
    assert msgpack.unpackb(chunk)["v"] == 2  # chunks in the payload's version
    payload = Reassembler().feed(chunk, source="a")
    assert payload is not None and payload_version(payload) == 2 and payload == encode(u, version=2)
    decoded = decode(payload, expected=Update)
    assert isinstance(decoded, Update) and decoded.weights["w"].tolist() == list(range(3000))
    uplink.on_ack(u.task_id)
    declined = Update(u.task_id + "x", 1, "a", "declined", None, 3, [0], {}, {}, "nothing fits")
    uplink.send(declined, version=2)  # no tensors: version 1 whatever is asked, which every reader reads
    assert wait_until(lambda: publish.count() >= 2)
    assert msgpack.unpackb(publish.calls[1][1])["v"] == 1


def test_large_update_is_split_into_several_chunks(make_uplink):
    uplink, publish = make_uplink(ack_timeout_s=5.0, attempts=1)
    u = update(size=400_000)  # 1.6 MB of float32: two chunks of at most 1 MiB
    uplink.send(u)
    assert wait_until(lambda: publish.count() >= 2)
    reassembler = Reassembler()
    results = [reassembler.feed(chunk, source="a") for _, chunk in publish.calls[:2]]
    assert results[0] is None and results[1] == encode(u, version=1)
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


# ------------------------------------------------------------------------------------ the outbox on disk
def spooled_uplink(tmp_path, connected=lambda: True, attempts: int = 3, ack_timeout_s: float = 5.0):
    from edge_agent.spool import UpdateSpool

    publish = FakePublish()
    uplink = Uplink("a", TOPIC, publish, ack_timeout_s=ack_timeout_s, attempts=attempts, connected=connected,
                    spool=UpdateSpool(tmp_path / "outbox", max_bytes=10**7))
    return uplink, publish


def test_an_update_stays_on_disk_until_acked_and_a_new_process_sends_it_first(tmp_path):
    uplink, publish = spooled_uplink(tmp_path, connected=lambda: False)  # the broker is away
    uplink.start()
    u = update("r1-a-7")
    uplink.send(u)
    assert (tmp_path / "outbox" / "r1-a-7.update").exists()  # on disk before any send
    time.sleep(0.2)
    assert publish.count() == 0  # nothing published into a dead connection
    uplink.stop(timeout=2.0)  # the restart: the update was never acked
    restarted, publish = spooled_uplink(tmp_path)
    restarted.start()
    try:
        assert restarted.restored == ["r1-a-7"] and restarted.pending("r1-a-7")
        assert wait_until(lambda: publish.count() >= 1)
        assert Reassembler().feed(publish.calls[0][1], source="a") == encode(u, version=1)
        assert restarted.on_ack("r1-a-7")
        assert wait_until(lambda: restarted.delivered == ["r1-a-7"])
        assert not (tmp_path / "outbox" / "r1-a-7.update").exists() and not restarted.pending("r1-a-7")
    finally:
        restarted.stop(timeout=2.0)


def test_an_outage_uses_up_no_attempts(tmp_path):
    up = {"now": False}
    uplink, publish = spooled_uplink(tmp_path, connected=lambda: up["now"], attempts=2, ack_timeout_s=0.05)
    uplink.start()
    try:
        uplink.send(update("r1-a-8"))
        time.sleep(0.5)  # ten ack timeouts' worth of outage
        assert publish.count() == 0 and uplink.abandoned == []
        up["now"] = True
        assert wait_until(lambda: uplink.abandoned == ["r1-a-8"])
        assert publish.count() == 2  # both attempts were made once the broker was back
    finally:
        uplink.stop(timeout=2.0)


def test_an_update_whose_attempts_run_out_is_parked_and_sent_again_when_asked(tmp_path):
    uplink, publish = spooled_uplink(tmp_path, attempts=1, ack_timeout_s=0.05)
    uplink.start()
    try:
        uplink.send(update("r1-a-9"))
        assert wait_until(lambda: uplink.abandoned == ["r1-a-9"])
        assert uplink.pending("r1-a-9") and (tmp_path / "outbox" / "r1-a-9.update").exists()  # parked, on disk
        assert uplink.resend_parked() == 1  # the coordinator is back
        assert wait_until(lambda: publish.count() == 2)
        assert uplink.on_ack("r1-a-9")
        assert wait_until(lambda: uplink.delivered == ["r1-a-9"])
        assert not uplink.pending("r1-a-9") and uplink.resend_parked() == 0
    finally:
        uplink.stop(timeout=2.0)


def test_a_late_answer_about_a_parked_update_settles_it(tmp_path):
    uplink, _ = spooled_uplink(tmp_path, attempts=1, ack_timeout_s=0.05)
    uplink.start()
    try:
        uplink.send(update("r1-a-10"))
        assert wait_until(lambda: uplink.abandoned == ["r1-a-10"])
        assert uplink.on_ack("r1-a-10", "round 1 closed before the update arrived")  # e.g. the verdict
        assert not uplink.pending("r1-a-10") and uplink.resend_parked() == 0
    finally:
        uplink.stop(timeout=2.0)


def test_the_wait_for_an_ack_doubles_with_every_send_up_to_a_cap_and_is_spread():
    from edge_agent.uplink import MAX_BACKOFF, Uplink

    uplink = Uplink("pi", "topic", lambda topic, chunk: True, ack_timeout_s=10.0, attempts=30)
    assert uplink.ack_wait(1) == 10.0  # the first send waits exactly ack_timeout_s
    for attempt in range(2, 12):
        nominal = 10.0 * min(2 ** (attempt - 1), MAX_BACKOFF)
        waits = {uplink.ack_wait(attempt) for _ in range(20)}
        assert all(0.9 * nominal <= wait <= 1.1 * nominal for wait in waits)
        assert len(waits) > 1  # spread: a fleet's resends do not line up


def test_the_backlog_counts_what_is_not_yet_acknowledged_queued_or_parked(tmp_path):
    uplink, _ = spooled_uplink(tmp_path, attempts=1, ack_timeout_s=0.05)
    assert uplink.backlog() == (0, 0)
    uplink.start()
    try:
        uplink.send(update("r1-a-11"))
        size = len(encode(update("r1-a-11"), version=1))  # (sent in version 1: its task's is not known here)
        assert uplink.backlog() == (1, size)  # queued or in delivery
        assert wait_until(lambda: uplink.abandoned == ["r1-a-11"])
        assert uplink.backlog() == (1, size)  # parked, on disk
        uplink.send(update("r1-a-12", size=40))
        assert uplink.backlog()[0] == 2
        assert uplink.on_ack("r1-a-11") and uplink.on_ack("r1-a-12")
        assert wait_until(lambda: uplink.backlog() == (0, 0))
    finally:
        uplink.stop(timeout=2.0)


def _kinds(publish: FakePublish) -> list[str]:
    with publish.lock:
        return [msgpack.unpackb(payload)["type"] for _, payload in publish.calls]


def test_an_update_whose_task_says_ask_waits_for_its_grant_before_any_chunk(make_uplink):
    """Revision 6: one request (with the update's size), no chunk until the grant, then the chunks."""
    uplink, publish = make_uplink(ack_timeout_s=5.0, attempts=3)
    u = update(size=3000)
    uplink.send(u, version=2, ask=True)
    assert wait_until(lambda: publish.count() >= 1)
    request = decode(publish.calls[0][1], expected=UploadRequest)
    assert (request.task_id, request.round, request.agent_id) == (u.task_id, 1, "a")
    assert request.size == len(encode(u, version=2))
    time.sleep(0.2)  # (a wrong uplink would send its chunks now; nothing to wait on but time)
    assert _kinds(publish) == ["upload_request"]
    assert uplink.on_grant("r9-other") is False  # a grant for nothing it asked about
    assert uplink.on_grant(u.task_id) is True
    assert wait_until(lambda: "chunk" in _kinds(publish))
    chunks = [payload for _, payload in publish.calls[1:]]
    reassembler = Reassembler()
    assert [reassembler.feed(chunk, source="a") for chunk in chunks][-1] == encode(u, version=2)
    uplink.on_ack(u.task_id)
    assert wait_until(lambda: uplink.delivered == [u.task_id])
    assert uplink.on_grant(u.task_id) is False  # settled: a late grant is ignored


def test_no_grant_within_the_wait_counts_as_an_attempt_and_it_asks_again(make_uplink):
    uplink, publish = make_uplink(ack_timeout_s=0.1, attempts=2)
    u = update()
    uplink.send(u, ask=True)
    assert wait_until(lambda: uplink.abandoned == [u.task_id])
    assert _kinds(publish) == ["upload_request", "upload_request"]  # asked twice, never sent


@pytest.mark.parametrize("grant_too", [False, True])
def test_an_ack_while_waiting_for_a_grant_settles_the_update(make_uplink, grant_too):
    """The coordinator had it already (an earlier send): its ack ends the wait, even when a grant crosses it, and
    nothing is sent."""
    uplink, publish = make_uplink(ack_timeout_s=30.0, attempts=3)
    u = update()
    uplink.send(u, ask=True)
    assert wait_until(lambda: publish.count() >= 1)
    uplink.on_ack(u.task_id)
    if grant_too:
        uplink.on_grant(u.task_id)
    assert wait_until(lambda: uplink.delivered == [u.task_id])
    assert _kinds(publish) == ["upload_request"]


def test_a_send_without_ack_asks_again_before_resending(make_uplink):
    """Each send is asked for first: a chunk only ever follows a request (however late this thread's grants)."""
    uplink, publish = make_uplink(ack_timeout_s=0.3, attempts=10)
    u = update()
    uplink.send(u, ask=True)

    def grant_whatever_it_asks() -> bool:
        uplink.on_grant(u.task_id)  # (False while it is not asking)
        return _kinds(publish).count("chunk") >= 2

    assert wait_until(grant_whatever_it_asks, timeout=30.0)
    uplink.on_ack(u.task_id)
    assert wait_until(lambda: uplink.delivered == [u.task_id])
    kinds = _kinds(publish)
    assert kinds.count("chunk") >= 2 and kinds[0] == "upload_request"
    assert all(kinds[i - 1] == "upload_request" for i, kind in enumerate(kinds) if kind == "chunk")


def test_an_update_parked_after_asking_asks_again_when_sent_again(tmp_path):
    """Parked while it waited for grants: sent again when the coordinator is back, it asks first again."""
    from edge_agent.spool import UpdateSpool

    publish = FakePublish()
    uplink = Uplink("a", TOPIC, publish, ack_timeout_s=0.5, attempts=1,
                    spool=UpdateSpool(tmp_path / "outbox", max_bytes=10**7))
    uplink.start()
    try:
        u = update()
        uplink.send(u, ask=True)
        assert wait_until(lambda: uplink.abandoned == [u.task_id])
        uplink._ack_timeout_s = 30.0  # the grant below comes within the wait, however loaded the machine
        assert uplink.resend_parked() == 1
        assert wait_until(lambda: _kinds(publish) == ["upload_request", "upload_request"])
        again = decode(publish.calls[1][1], expected=UploadRequest)
        assert again.round == 1 and again.sha256 == hashlib.sha256(encode(u, version=1)).hexdigest()
        assert uplink.on_grant(u.task_id) or wait_until(lambda: uplink.on_grant(u.task_id))
        assert wait_until(lambda: "chunk" in _kinds(publish))
    finally:
        uplink.stop(timeout=2.0)



def test_an_update_told_to_wait_asks_again_without_spending_its_attempts():
    """Revision 7: every ask answered with "wait your turn" costs no attempt (one attempt would end after one
    unanswered ask); it asks again every ack_timeout_s, and sends once the grant comes."""
    u = update()

    class Coordinator(FakePublish):
        """Answers each ask as it is published: wait, four times; then the grant."""

        def __call__(self, topic: str, payload: bytes) -> bool:
            super().__call__(topic, payload)
            if msgpack.unpackb(payload)["type"] == "upload_request":
                if _kinds(self).count("upload_request") < 5:
                    assert uplink.on_wait(u.task_id, "the window is full")
                else:
                    assert uplink.on_grant(u.task_id)
            return True

    publish = Coordinator()
    uplink = Uplink("a", TOPIC, publish, ack_timeout_s=0.05, attempts=1)
    uplink.start()
    try:
        uplink.send(u, ask=True)
        assert wait_until(lambda: "chunk" in _kinds(publish), timeout=30.0)
        assert uplink.abandoned == [] and _kinds(publish)[:5] == ["upload_request"] * 5
        assert uplink.on_wait("r9-other", "full") is False  # about nothing it asks for
        uplink.on_ack(u.task_id)
        assert wait_until(lambda: uplink.delivered == [u.task_id])
    finally:
        uplink.stop(timeout=2.0)


def test_the_backlog_is_reported_whenever_it_changes(tmp_path):
    """Queued, then acked: each change calls on_backlog (an agent republishes its status then)."""
    seen: list[tuple[int, int]] = []
    uplink = Uplink("a", TOPIC, FakePublish(), ack_timeout_s=30.0, attempts=3,
                    on_backlog=lambda: seen.append(uplink.backlog()))
    uplink.start()
    try:
        uplink.send(update())
        assert seen and seen[0][0] == 1 and uplink.unacked() == [update().task_id]
        uplink.on_ack(update().task_id)
        assert wait_until(lambda: seen[-1] == (0, 0)) and uplink.unacked() == []
    finally:
        uplink.stop(timeout=2.0)
