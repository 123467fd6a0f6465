"""The upload window: grants in the order asked, within the bytes in transfer, taken back when in or idle."""

from __future__ import annotations

import pytest

from coordinator.upload_grants import UploadGrants
from protocol import UploadGrant


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def granted(grants: list[UploadGrant]) -> list[tuple[str, str]]:
    return [(grant.agent_id, grant.task_id) for grant in grants]


def test_grants_go_in_the_order_asked_while_the_bytes_fit_the_window() -> None:
    window = UploadGrants(10, idle_s=30, clock=Clock())
    assert granted(window.ask("a", "ta", 1, 4)) == [("a", "ta")]
    assert granted(window.ask("b", "tb", 1, 4)) == [("b", "tb")]
    assert window.ask("c", "tc", 1, 4) == []  # 12 > 10
    assert window.ask("d", "td", 1, 1) == []  # it fits, but c asked first
    assert (window.in_flight, window.waiting) == (8, 2)
    assert granted(window.finished("a", "ta")) == [("c", "tc"), ("d", "td")]
    assert window.in_flight == 9 and window.peak_in_flight == 9
    assert window.finished("a", "ta") == [] and window.in_flight == 9  # twice: nothing more to give back


def test_an_upload_larger_than_the_window_goes_alone() -> None:
    window = UploadGrants(10, idle_s=30, clock=Clock())
    assert granted(window.ask("a", "ta", 1, 50)) == [("a", "ta")]
    assert window.ask("b", "tb", 1, 1) == []
    assert granted(window.finished("a", "ta")) == [("b", "tb")]


def test_asking_again_keeps_the_place_and_a_granted_one_is_granted_again() -> None:
    window = UploadGrants(8, idle_s=30, clock=Clock())
    window.ask("a", "ta", 1, 8)
    window.ask("b", "tb", 1, 8)
    window.ask("c", "tc", 1, 8)
    assert window.ask("c", "tc", 1, 8) == [] and window.ask("b", "tb", 1, 8) == []
    assert granted(window.ask("a", "ta", 1, 8)) == [("a", "ta")]  # its grant may have been lost
    assert window.in_flight == 8  # not counted twice
    assert granted(window.finished("a", "ta")) == [("b", "tb")]  # b asked before c, whatever asked last


def test_a_grant_without_chunks_for_idle_s_is_taken_back_and_chunks_keep_it_alive() -> None:
    clock = Clock()
    window = UploadGrants(8, idle_s=30, clock=clock)
    window.ask("a", "ta", 1, 8)
    window.ask("b", "tb", 1, 8)
    clock.now += 20
    assert window.chunk_from("a") == []
    clock.now += 20  # 40 s since the grant, 20 since a's last chunk
    assert window.ask("c", "tc", 1, 8) == []
    clock.now += 15  # a idle for 35 s
    assert granted(window.chunk_from("c")) == [("b", "tb")]  # any message looks (at most once a second)
    assert window.expired_total == 1 and window.in_flight == 8


def test_an_agent_gone_offline_leaves_the_queue_and_the_window() -> None:
    window = UploadGrants(8, idle_s=30, clock=Clock())
    window.ask("a", "ta", 1, 8)
    window.ask("b", "tb", 1, 8)
    window.ask("c", "tc", 1, 8)
    assert window.forget("b") == []
    assert granted(window.forget("a")) == [("c", "tc")]
    assert (window.in_flight, window.waiting) == (8, 0)


def test_a_malformed_upload_gives_back_every_grant_of_its_agent() -> None:
    window = UploadGrants(8, idle_s=30, clock=Clock())
    window.ask("a", "ta", 1, 8)
    window.ask("b", "tb", 1, 8)
    assert granted(window.finished("a")) == [("b", "tb")]


def test_a_window_needs_bytes_and_idle_seconds() -> None:
    with pytest.raises(ValueError, match="positive"):
        UploadGrants(0, idle_s=30)
    with pytest.raises(ValueError, match="positive"):
        UploadGrants(10, idle_s=0)


def test_a_request_no_longer_wanted_is_dropped_at_its_turn() -> None:
    unwanted = {("b", "tb")}
    window = UploadGrants(8, idle_s=30, clock=Clock(), wanted=lambda agent, task, round_number: (agent, task)
                          not in unwanted)
    window.ask("a", "ta", 1, 8)
    window.ask("b", "tb", 1, 8)
    window.ask("c", "tc", 1, 8)
    assert granted(window.finished("a", "ta")) == [("c", "tc")]  # b's round closed meanwhile: dropped
    assert window.dropped_total == 1 and window.waiting == 0


def test_a_refused_transfer_gives_back_its_own_grant_only() -> None:
    window = UploadGrants(16, idle_s=30, clock=Clock())
    window.ask("a", "t1", 1, 8)
    window.ask("a", "t2", 1, 8)
    assert window.in_flight == 16
    window.finished("a", "t1")
    assert window.in_flight == 8
