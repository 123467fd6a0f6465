"""Updates held back by the agent's ``slowdown``: released once their time has passed, on a thread of their own,
and cancelled at once by ``close`` (the agent's stop)."""

from __future__ import annotations

import threading
import time

import pytest

from edge_agent.holdback import HoldBack, hold_seconds


@pytest.mark.parametrize(("slowdown", "training", "held"), [(1.0, 5.0, 0.0), (3.0, 2.0, 4.0), (10.0, 0.5, 4.5),
                                                             (4.0, 0.0, 0.0), (4.0, -1.0, 0.0)])
def test_an_update_is_held_back_slowdown_minus_one_times_its_training_seconds(slowdown, training, held) -> None:
    assert hold_seconds(slowdown, training) == pytest.approx(held)


def test_a_held_call_is_made_once_its_time_has_passed_on_a_thread_of_its_own() -> None:
    holdback = HoldBack("pi-01")
    released = threading.Event()
    caller: list[str] = []
    started = time.monotonic()

    def release() -> None:
        caller.append(threading.current_thread().name)
        released.set()

    assert holdback.hold("r1-pi-01-a", 0.05, release)
    assert not holdback.hold("r1-pi-01-a", 0.05, release)  # one wait per key
    assert released.wait(30)
    assert time.monotonic() - started >= 0.05  # never before its time (the monotonic clock)
    assert caller == ["pi-01-holdback"]
    assert holdback.held() == []


def test_close_cancels_every_wait_at_once_and_refuses_new_ones() -> None:
    holdback = HoldBack("pi-02")
    released = threading.Event()
    assert holdback.hold("r1-pi-01-a", 10_000.0, released.set)  # far beyond any test: only close ends it
    assert holdback.held() == ["r1-pi-01-a"]
    [waiter] = [thread for thread in threading.enumerate() if thread.name == "pi-02-holdback"]
    assert holdback.close() == ["r1-pi-01-a"]
    waiter.join(30)
    assert not waiter.is_alive() and not released.is_set()  # it ended without releasing
    assert not holdback.hold("r1-pi-01-b", 0.0, released.set) and not released.is_set()
    assert holdback.held() == []


def test_busy_for_is_the_time_to_the_last_call_due_and_zero_once_none_is_held() -> None:
    holdback = HoldBack("pi-03")
    assert holdback.busy_for() == 0.0
    released = threading.Event()
    assert holdback.hold("short", 0.01, lambda: None)
    assert holdback.hold("long", 3600.0, released.set)
    assert 3500.0 < holdback.busy_for() <= 3600.0  # the last one due, not the first
    holdback.close()
    assert holdback.busy_for() == 0.0 and not released.is_set()
