"""FleetRegistry and AgentRecord: status bookkeeping, budgets, offline agents, waiting for the fleet."""

from __future__ import annotations

import threading
import time

import pytest

from coordinator.registry import AgentRecord, FleetRegistry
from protocol import AgentStatus, Capabilities


def caps(available: int = 1_000_000, budget: int | None = None) -> Capabilities:
    return Capabilities(device_kind="generic-x86_64", memory_total=2_000_000, memory_available=available,
                        budget_bytes=budget, num_samples=10, labels=[0, 1])


def status(agent_id: str, state: str = "online", capabilities: Capabilities | None = None) -> AgentStatus:
    if capabilities is None and state != "offline":
        capabilities = caps()
    return AgentStatus(agent_id=agent_id, state=state, capabilities=capabilities, sent_at=0.0)


# ---------------------------------------------------------------------------------------------- AgentRecord
def test_budget_is_min_of_available_and_budget():
    record = AgentRecord("a", "online", caps(available=800, budget=500), 0.0)
    assert record.budget() == 500
    record = AgentRecord("a", "online", caps(available=300, budget=500), 0.0)
    assert record.budget() == 300


def test_budget_without_configured_budget_is_available_memory():
    assert AgentRecord("a", "online", caps(available=1234, budget=None), 0.0).budget() == 1234


def test_budget_none_without_capabilities():
    assert AgentRecord("a", "offline", None, 0.0).budget() is None


@pytest.mark.parametrize(
    ("state", "has_caps", "expected"),
    [("online", True, True), ("busy", True, True), ("offline", True, False), ("online", False, False)],
)
def test_record_online_needs_connected_state_and_capabilities(state, has_caps, expected):
    record = AgentRecord("a", state, caps() if has_caps else None, 0.0)
    assert record.online is expected


# ---------------------------------------------------------------------------------------------- registry
def test_on_status_records_latest_status_and_time():
    registry = FleetRegistry()
    registry.on_status(status("a", capabilities=caps(available=10)), now=5.0)
    registry.on_status(status("a", capabilities=caps(available=20)), now=7.0)
    record = registry.get("a")
    assert record is not None
    assert record.capabilities is not None and record.capabilities.memory_available == 20
    assert record.last_seen == 7.0
    assert registry.get("nobody") is None


def test_online_is_sorted_and_excludes_offline():
    registry = FleetRegistry()
    for agent_id in ("c", "a", "b"):
        registry.on_status(status(agent_id))
    registry.on_status(status("b", state="busy"))
    registry.on_status(status("c", state="offline", capabilities=None))
    assert [r.agent_id for r in registry.online()] == ["a", "b"]


def test_last_will_offline_status_takes_agent_out():
    registry = FleetRegistry()
    registry.on_status(status("a"))
    assert [r.agent_id for r in registry.online()] == ["a"]
    registry.on_status(AgentStatus(agent_id="a", state="offline", capabilities=None, sent_at=1.0))
    record = registry.get("a")
    assert record is not None and record.state == "offline" and not record.online
    assert record.budget() is None
    assert registry.online() == []


def test_wait_for_returns_immediately_when_enough_online():
    registry = FleetRegistry()
    registry.on_status(status("a"))
    registry.on_status(status("b"))
    started = time.monotonic()
    online = registry.wait_for(2, timeout=5.0)
    assert [r.agent_id for r in online] == ["a", "b"]
    assert time.monotonic() - started < 1.0


def test_wait_for_times_out_with_those_online():
    registry = FleetRegistry()
    registry.on_status(status("a"))
    started = time.monotonic()
    online = registry.wait_for(3, timeout=0.2)
    elapsed = time.monotonic() - started
    assert [r.agent_id for r in online] == ["a"]
    assert 0.15 <= elapsed < 2.0


def test_wait_for_wakes_up_when_another_thread_reports():
    registry = FleetRegistry()
    timer = threading.Timer(0.05, lambda: registry.on_status(status("late")))
    timer.start()
    try:
        started = time.monotonic()
        online = registry.wait_for(1, timeout=10.0)
        elapsed = time.monotonic() - started
    finally:
        timer.cancel()
        timer.join()
    assert [r.agent_id for r in online] == ["late"]
    assert elapsed < 5.0  # woken by the notification, not by the timeout


def test_wait_for_ignores_offline_statuses_while_waiting():
    registry = FleetRegistry()

    def feed() -> None:
        time.sleep(0.05)
        registry.on_status(status("x", state="offline", capabilities=None))
        time.sleep(0.05)
        registry.on_status(status("y"))

    thread = threading.Thread(target=feed)
    thread.start()
    online = registry.wait_for(1, timeout=10.0)
    thread.join()
    assert [r.agent_id for r in online] == ["y"]


def test_wait_settled_waits_for_a_quiet_moment_after_the_last_status():
    registry = FleetRegistry()
    registry.on_status(status("a"))

    def burst() -> None:  # retained statuses trickling in after the first
        for name in ("b", "c"):
            time.sleep(0.1)
            registry.on_status(status(name))

    thread = threading.Thread(target=burst)
    thread.start()
    started = time.monotonic()
    counts: list[int] = []
    online = registry.wait_settled(1, quiet=0.3, timeout=10.0, on_change=counts.append)
    elapsed = time.monotonic() - started
    thread.join()
    assert [r.agent_id for r in online] == ["a", "b", "c"]  # not just the first one heard
    assert 0.3 <= elapsed < 5.0  # at least the quiet period after "c"
    # Said at the start and when the number online changed (a busy machine may wake once for two statuses).
    assert counts[0] == 1 and counts[-1] == 3 and counts == sorted(set(counts))


def test_wait_settled_times_out_with_those_online():
    registry = FleetRegistry()
    registry.on_status(status("a"))
    started = time.monotonic()
    online = registry.wait_settled(2, quiet=0.05, timeout=0.2)
    assert [r.agent_id for r in online] == ["a"] and time.monotonic() - started >= 0.2


def test_heartbeats_of_agents_online_all_along_do_not_keep_the_fleet_unsettled():
    """A large fleet's periodic statuses never leave a second without one: only a change of the fleet (an agent
    new, gone, back or restarted) restarts the quiet that wait_settled waits for."""
    registry = FleetRegistry()
    registry.on_status(status("a"))
    registry.on_status(status("b"))
    settled_since = registry._last_change
    for _ in range(3):  # heartbeats, unchanged
        registry.on_status(status("a"))
        registry.on_status(status("b"))
    assert registry._last_change == settled_since
    registry.on_status(status("b", state="offline"))  # gone: a change
    assert registry._last_change > settled_since
    back = registry._last_change
    registry.on_status(status("b"))  # back: a change
    assert registry._last_change > back


def test_the_oldest_revision_online():
    from dataclasses import replace

    registry = FleetRegistry()
    assert registry.oldest_revision() is None
    registry.on_status(status("new", capabilities=replace(caps(), protocol_version=5)))
    registry.on_status(status("old", capabilities=replace(caps(), protocol_version=4)))
    assert registry.oldest_revision() == 4
    registry.on_status(status("old", "offline"))  # gone: its revision no longer counts
    assert registry.oldest_revision() == 5
    registry.on_status(status("older"))  # announces none: revision 1
    assert registry.oldest_revision() == 1
