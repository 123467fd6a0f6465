"""edge_agent.secure_round: what the agent does with a secure task's update besides the exchange itself (which
tests/coordinator/test_secure_exchange.py runs against the coordinator's side): a task past its deadline let go, a
roster it cannot serve answered as failed, acks after the masked update left to the uplink."""

from __future__ import annotations

import threading
import time

import numpy as np

from common.logs import get_logger
from edge_agent.secure_round import SecureTasks
from protocol import (
    Ack,
    Message,
    ModelRef,
    SecureAdvert,
    SecurePeer,
    SecureRelay,
    SecureRoster,
    SecureUnmask,
    Task,
    TrainingPlan,
    Update,
    UpdateStatus,
)

LOG = get_logger("test")


def held(deadline: float) -> tuple[SecureTasks, list[Message], list[Update], threading.Event, Task]:
    published: list[Message] = []
    sent: list[Update] = []
    done = threading.Event()
    room = SecureTasks("pi-1", "fed", published.append,
                       lambda update, *, version, ask: sent.append(update), LOG)
    task = Task("r2-pi-1", 2, "pi-1", deadline, ModelRef("cnn", 10, 1, {}), {}, None, {}, plan=TrainingPlan(),
                secure=True)
    update = Update("r2-pi-1", 2, "pi-1", UpdateStatus.OK, None, 50, [0, 1], {"w": np.ones((4, 3), np.float32)}, {})
    room.advertise(task, update, 2, lambda _answer: done.set())
    return room, published, sent, done, task


def test_it_advertises_keys_and_what_it_trained_never_the_update() -> None:
    room, published, sent, done, _ = held(time.time() + 60)
    [advert] = published
    assert isinstance(advert, SecureAdvert) and advert.labels == [0, 1] and advert.spec_trained is None
    assert len(advert.cipher) == len(advert.mask) == 32 and advert.cipher != advert.mask
    assert sent == [] and not done.is_set() and room.holding() == 1


def test_a_task_past_its_deadline_is_let_go_without_an_answer() -> None:
    room, _, sent, done, _ = held(time.time())
    assert done.wait(10)
    assert sent == [] and room.holding() == 0


def test_a_roster_naming_a_tensor_its_update_lacks_is_answered_as_failed() -> None:
    room, _, sent, done, task = held(time.time() + 60)
    peers = [SecurePeer(f"r2-pi-{n}", bytes([n]) * 32, bytes([n + 1]) * 32, n, {"global/w": [[0, 4], [0, 3]]})
             for n in (2, 3)]
    roster = SecureRoster(task.task_id, 2, "pi-1", "global", 1, 2, {"global/v": [[0, 4], [0, 3]]},
                          {"global/v": [[0, 4], [0, 3]]}, {"global/v": [4, 3], "global/w": [4, 3]}, peers)
    assert room.take(roster)
    # (shares go out with the roster; the relay is where it masks)
    assert room.take(SecureRelay(task.task_id, 2, "pi-1", {}, {"global/v": b"\xff\xf0"}))
    [update] = sent
    assert update.status is UpdateStatus.FAILED and update.weights == {}
    assert "which its update does not hold" in (update.reason or "") and done.is_set() and room.holding() == 0


def test_a_refusal_before_the_upload_fails_the_task_and_later_acks_go_to_the_uplink() -> None:
    room, _, sent, done, task = held(time.time() + 60)
    assert room.take(Ack(task.task_id, 2, "pi-1", reason="secure aggregation: 2 device(s) trained"))
    [update] = sent
    assert update.status is UpdateStatus.FAILED and update.reason == "secure aggregation: 2 device(s) trained"
    assert done.is_set()
    assert not room.take(Ack(task.task_id, 2, "pi-1"))  # nothing held for it now: the uplink's
    # A second refusal of a step (told twice) is not one of the failed update it sent: never the uplink's.
    assert room.take(Ack(task.task_id, 2, "pi-1", reason="secure aggregation: it did not share its keys in time"))
    assert room.take(SecureUnmask(task.task_id, 2, "pi-1", [task.task_id], []))  # ignored, and said so


def test_a_message_resent_by_the_broker_changes_nothing_and_refusals_of_done_steps_are_not_the_updates() -> None:
    room, published, sent, done, task = held(time.time() + 60)
    peers = [SecurePeer(f"r2-pi-{n}", bytes([n]) * 32, bytes([n + 1]) * 32, n, {"global/w": [[0, 4], [0, 3]]})
             for n in (2, 3)]
    roster = SecureRoster(task.task_id, 2, "pi-1", "global", 1, 2, {"global/w": [[0, 4], [0, 3]]},
                          {"global/w": [[0, 4], [0, 3]]}, {"global/w": [4, 3]}, peers)
    assert room.take(roster) and room.take(roster)
    assert len([message for message in published if not isinstance(message, SecureAdvert)]) == 1  # shared once
    # Asked for its shares before its masked update went: it cannot serve that, and says so.
    assert room.take(SecureUnmask(task.task_id, 2, "pi-1", [task.task_id, "r2-pi-2", "r2-pi-3"], []))
    [update] = sent
    assert update.status is UpdateStatus.FAILED and "before its masked update went" in (update.reason or "")
    assert room.holding() == 0 and done.is_set()


def test_after_its_masked_update_a_refusal_of_a_step_is_ignored_and_one_of_the_update_is_the_uplinks() -> None:
    from edge_agent.secure_round import REFUSAL, _Held

    room, _, _, _, task = held(time.time() + 60)
    with room._lock:  # (as after a relay: its masked update went)
        entry: _Held = room._held[task.task_id]
        entry.sent = True
    assert room.take(Ack(task.task_id, 2, "pi-1", reason=REFUSAL + "its shares came after round 2's were relayed"))
    assert not room.take(Ack(task.task_id, 2, "pi-1", reason="update rejected: tensor 'w' has shape (3,)"))
    room.close()  # the agent stops: its secrets forgotten, its timers cancelled
    assert room.holding() == 0 and entry.timer is not None and entry.timer.finished.is_set()


def test_positions_that_are_not_as_many_as_the_slice_fail_the_task() -> None:
    room, _, sent, _, task = held(time.time() + 60)
    peers = [SecurePeer(f"r2-pi-{n}", bytes([n]) * 32, bytes([n + 1]) * 32, n, {"global/w": [[0, 4], [0, 3]]})
             for n in (2, 3)]
    room.take(SecureRoster(task.task_id, 2, "pi-1", "global", 1, 2, {"global/w": [[0, 4], [0, 3]]},
                           {"global/w": [[0, 1], [0, 3]]}, {"global/w": [4, 3]}, peers))
    room.take(SecureRelay(task.task_id, 2, "pi-1", {}, {"global/w": b"\xff\xf0"}))
    [update] = sent
    assert update.status is UpdateStatus.FAILED and "not as many as its slice's" in (update.reason or "")
