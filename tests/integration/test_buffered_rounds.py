"""Buffered rounds over a real, secured mosquitto: a round aggregates at its buffer's size, a device still training
is carried into the next round (and gets no new task meanwhile), its update comes back stale and is aggregated
once, with its staleness recorded; nothing an agent saw acked is left out. The agents ask before they upload
(revision 6), through a window that grants one update at a time."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from common.data import load_dataset
from coordinator.config import BufferedConfig, UploadsConfig
from coordinator.daemon import Coordinator
from edge_agent.daemon import EdgeAgent
from protocol import Task

from .conftest import SecuredBroker, digits_fleet, on_broker, tiny_config

pytestmark = [pytest.mark.broker, pytest.mark.slow]

WAIT_S = 120.0


def wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.02)


def gate(agent: EdgeAgent, hold: Callable[[Task], None]) -> None:
    """Run ``hold(task)`` on the agent's worker thread before it trains each task."""
    run = agent.runner.run

    def held(task: Task, payload: Any = None) -> Any:
        hold(task)
        return run(task, payload)

    agent.runner.run = held  # type: ignore[method-assign]


def round_of(task_id: str) -> int:
    return int(task_id.split("-")[0][1:])


def test_a_buffered_round_aggregates_at_its_size_and_a_straggler_counts_stale(secured_mosquitto: SecuredBroker,
                                                                               tmp_path: Path) -> None:
    dataset = load_dataset("digits")
    broker = secured_mosquitto("buffered")
    config = on_broker(tiny_config(federation="buffered", rounds=3, min_agents=3, state_dir=str(tmp_path / "state"),
                                   algorithm="fedavg", round_mode="buffered", buffered=BufferedConfig(size=2),
                                   uploads=UploadsConfig(window_mib=0.001)), broker)
    fast_a, fast_b, slow = digits_fleet(dataset, ["a", "b", "slow"], config, broker)
    second_round = threading.Event()  # a has a task of round 2: the straggler may go on

    def hold_fast(task: Task) -> None:
        if task.round == 2:
            second_round.set()
            # Until the straggler's round-1 update is in (acked): it arrives in round 2, one round stale.
            wait_for(lambda: bool(slow.uplink.delivered), "the straggler's update acked")

    def hold_slow(task: Task) -> None:
        if task.round == 1:
            assert second_round.wait(WAIT_S), "round 2 never began"

    gate(fast_a, hold_fast)
    gate(fast_b, hold_fast)
    gate(slow, hold_slow)
    coordinator = Coordinator(config, dataset=dataset)
    results: list[Any] = []
    runner = threading.Thread(target=lambda: results.extend(coordinator.run()), daemon=True)
    try:
        for agent in (fast_a, fast_b, slow):
            agent.start()
        coordinator.start()
        runner.start()
        runner.join(WAIT_S * 3)
        assert not runner.is_alive(), "the run did not end"
    finally:
        coordinator.stop()
        for agent in (fast_a, fast_b, slow):
            agent.stop()
    assert [r.round for r in results] == [1, 2, 3]
    first, second, _ = results
    # Round 1 aggregated its two fast answers; the straggler's task was carried, not counted missing.
    assert first.participants == 2 and {t.agent for t in first.tasks} == {"a", "b"}
    # Round 2 sent tasks to the fast devices only (the straggler still trained), and took its update, 1 round stale.
    stale = [t for t in second.tasks if t.agent == "slow"]
    assert len(stale) == 1 and stale[0].status == "ok" and stale[0].staleness == 1
    aggregated = [(r.round, t) for r in results for t in r.tasks if t.status == "ok"]
    assert sum(r.participants for r in results) == len(aggregated)
    # Every update the agents saw acked was aggregated, once.
    acked = [task_id for agent in (fast_a, fast_b, slow) for task_id in agent.uplink.delivered]
    assert len(acked) == len(set(acked)) == len(aggregated)
    assert not any(task_id.startswith("r2-slow-") for task_id in acked)  # busy in round 2: no task of its own
    # A record's staleness is the rounds between its task's and the one that aggregated it.
    by_agent_round = sorted((t.agent, round_number - t.staleness) for round_number, t in aggregated)
    assert by_agent_round == sorted((task_id.split("-")[1], round_of(task_id)) for task_id in acked)
    # Uploads went one at a time through the window (every update is larger than it).
    update_bytes = first.bytes_up / 2
    assert coordinator.grants is not None and coordinator.grants.granted_total >= len(acked)
    assert update_bytes * 0.9 < coordinator.grants.peak_in_flight < update_bytes * 1.5


def test_an_update_that_comes_just_after_a_round_stops_collecting_counts_in_the_next_round(
        secured_mosquitto: SecuredBroker, tmp_path: Path) -> None:
    """The late device asks to upload while no round collects (round 1 closed with the two fast answers): its
    request is held and granted as soon as round 2 opens, however long the agent would wait before asking again
    (an hour here), and round 2 aggregates it one round stale. The last round drains: nothing is left anywhere."""
    dataset = load_dataset("digits")
    broker = secured_mosquitto("justafter")
    config = on_broker(tiny_config(federation="justafter", rounds=3, min_agents=3, state_dir=str(tmp_path / "state"),
                                   algorithm="fedavg", round_mode="buffered", buffered=BufferedConfig(size=2),
                                   uploads=UploadsConfig(window_mib=0.001)), broker)
    fast_a, fast_b, late = digits_fleet(dataset, ["a", "b", "late"], config, broker)
    late.config.ack_timeout_s = 3600.0  # asked again only after an hour: the coordinator must answer it itself
    late.uplink._ack_timeout_s = 3600.0
    coordinator: Coordinator | None = None

    def late_task_held() -> bool:
        assert coordinator is not None
        return any(agent == "late" for agent, _ in coordinator.uploads.held())

    def hold_late(task: Task) -> None:
        if task.round == 1:  # trains once round 1 is over (its result is being reported)
            wait_for(lambda: coordinator is not None and coordinator.completed_rounds >= 1, "round 1 closed")

    def hold_fast(task: Task) -> None:
        if task.round == 2:  # round 2 must not fill its buffer before the late update can come
            wait_for(lambda: bool(late.uplink.delivered), "the late update acked")

    def between_rounds(result: Any) -> None:
        if result.round == 1:  # no round collects until the late device asked, and was held
            wait_for(late_task_held, "the late request held")

    gate(fast_a, hold_fast)
    gate(fast_b, hold_fast)
    gate(late, hold_late)
    coordinator = Coordinator(config, dataset=dataset, on_round=between_rounds)
    results: list[Any] = []
    runner = threading.Thread(target=lambda: results.extend(coordinator.run()), daemon=True)
    agents = (fast_a, fast_b, late)
    try:
        for agent in agents:
            agent.start()
        coordinator.start()
        runner.start()
        runner.join(WAIT_S * 3)
        assert not runner.is_alive(), "the run did not end"
        wait_for(lambda: all(agent.unsettled() == [] for agent in agents), "every outbox empty")
    finally:
        coordinator.stop()
        for agent in agents:
            agent.stop()
    first, second, last = results
    assert {t.agent for t in first.tasks if t.status == "ok"} == {"a", "b"}
    late_in_second = [t for t in second.tasks if t.agent == "late"]
    assert len(late_in_second) == 1 and late_in_second[0].status == "ok" and late_in_second[0].staleness == 1
    assert last.participants == last.selected + last.carried and coordinator.left_behind() == []  # drained
    aggregated = sorted((t.agent, r.round - t.staleness) for r in results for t in r.tasks if t.status == "ok")
    acked = sorted((task_id.split("-")[1], round_of(task_id)) for agent in agents for task_id in agent.uplink.delivered)
    assert acked == aggregated  # every acked update aggregated, once
    assert coordinator.uploads.held_total >= 1 and late.uplink.abandoned == []
