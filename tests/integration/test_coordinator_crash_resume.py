"""A coordinator killed with SIGKILL while a round's updates come in, started again with ``resume: true``:
it finishes that same round with the updates it had acked (none lost, none counted twice) and the ones the
agents send again, and numbers every round once. The coordinator runs as ``fedfit coordinator`` processes, the
agents in this process, all over mosquitto."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import pytest
import yaml

from common.data import load_dataset, parse_partition, partition_indices
from edge_agent.config import AgentConfig, AgentDataConfig
from edge_agent.daemon import EdgeAgent
from edge_agent.data_source import to_local_data
from fedfit.sim.broker import Broker

from .conftest import SecuredBroker

pytestmark = [pytest.mark.broker, pytest.mark.slow]

AGENTS = ("crash-a", "crash-b", "crash-c")


def coordinator_yaml(path: Path, broker: Broker, state_dir: Path, **settings: object) -> Path:
    config = {
        "federation": "crash", "broker": asdict(broker.coordinator_config()), "algorithm": "fedavg",
        "model": {"family": "cnn", "options": {"hidden": [16, 32, 64]}},
        "data": {"dataset": "digits", "bn_samples": 300}, "recipe": {"epochs": 2, "batch_size": 16, "lr": 0.05},
        "rounds": 2, "min_agents": len(AGENTS), "wait_for_agents_s": 60, "round_timeout_s": 120,
        "state_dir": str(state_dir), "resume": True, **settings,
    }
    path.write_text(yaml.safe_dump(config))
    return path


def start_coordinator(config: Path, log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "fedfit.cli", "coordinator", "--config", str(config)],
                            stdout=log.open("ab"), stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def unequal_fleet(mosquitto: Broker) -> list[EdgeAgent]:
    """The agents of :data:`AGENTS`, with unequal data: their updates come in one after another, so a kill falls
    between two of them."""
    dataset = load_dataset("digits")
    shards = partition_indices(dataset.y_train, len(AGENTS), parse_partition("iid"), 0)
    agents = []
    for index, (name, idx) in enumerate(zip(AGENTS, shards)):
        agent_config = AgentConfig(agent_id=name, federation="crash", data=AgentDataConfig(dataset="digits"),
                                   ack_timeout_s=2.0, update_attempts=100, torch_threads=1,
                                   broker=mosquitto.client_config(name))
        agents.append(EdgeAgent(agent_config, to_local_data(dataset.x_train[idx][: 150 * (index + 1)],
                                                            dataset.y_train[idx][: 150 * (index + 1)])))
    return agents


def test_a_killed_coordinator_finishes_the_round_it_was_in_with_every_acked_update(secured_mosquitto: SecuredBroker,
                                                                                  tmp_path: Path) -> None:
    mosquitto = secured_mosquitto("crash")
    state_dir = tmp_path / "coordinator"
    config = coordinator_yaml(tmp_path / "coordinator.yaml", mosquitto, state_dir)
    log = tmp_path / "coordinator.log"
    agents = unequal_fleet(mosquitto)
    coordinator = start_coordinator(config, log)
    try:
        for agent in agents:
            agent.start()
        deadline = time.monotonic() + 120
        while not any(agent.uplink.delivered for agent in agents) and time.monotonic() < deadline:
            time.sleep(0.02)
        acked_before = {agent.agent_id: list(agent.uplink.delivered) for agent in agents}
        assert any(acked_before.values()), "no update was acked before the kill"
        coordinator.send_signal(signal.SIGKILL)
        coordinator.wait(10)
        assert (state_dir / "round" / "round.json").exists()  # the journal of round 1 survived the kill
        coordinator = start_coordinator(config, log)
        assert coordinator.wait(240) == 0, log.read_text()[-3000:]
    finally:
        if coordinator.poll() is None:
            coordinator.kill()
        for agent in agents:
            agent.stop()

    rows = [json.loads(line) for line in (state_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["round"] for row in rows] == [1, 2]  # each round once
    first = rows[0]
    assert first["participants"] == len(AGENTS), first["tasks"]
    trained = {task["agent"] for task in first["tasks"] if task["status"] == "ok"}
    acked = {name for name, tasks in acked_before.items() if any(t.startswith("r1-") for t in tasks)}
    assert acked and acked <= trained  # the updates acked before the kill were aggregated in their round
    assert not (state_dir / "round").exists()  # the journal goes once the round is checkpointed
    assert all(agent.uplink.refused == [] and agent.uplink.abandoned == [] for agent in agents)


def test_a_buffered_run_killed_mid_round_and_resumed_loses_no_update_and_counts_none_twice(
        secured_mosquitto: SecuredBroker, tmp_path: Path) -> None:
    """Buffered rounds (two answers a round, the third device's task carried): the coordinator is killed in round 2,
    once an update of that round was acked, and started again. Every update an agent saw acked is aggregated exactly
    once (in its own round or a later one, with its staleness), the rounds are numbered once, and nothing is left
    in an outbox or carried when the run ends."""
    mosquitto = secured_mosquitto("crash")
    state_dir = tmp_path / "coordinator"
    config = coordinator_yaml(tmp_path / "coordinator.yaml", mosquitto, state_dir, rounds=4, round_mode="buffered",
                              buffered={"size": 2})
    log = tmp_path / "coordinator.log"
    agents = unequal_fleet(mosquitto)
    coordinator = start_coordinator(config, log)
    try:
        for agent in agents:
            agent.start()
        deadline = time.monotonic() + 120
        while (not any(task.startswith("r2-") for agent in agents for task in agent.uplink.delivered)
               and time.monotonic() < deadline):
            time.sleep(0.02)
        assert any(task.startswith("r2-") for agent in agents for task in agent.uplink.delivered), "round 2 acked none"
        coordinator.send_signal(signal.SIGKILL)
        coordinator.wait(10)
        coordinator = start_coordinator(config, log)
        assert coordinator.wait(240) == 0, log.read_text()[-3000:]
        deadline = time.monotonic() + 30
        while any(agent.unsettled() for agent in agents) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert [agent.unsettled() for agent in agents] == [[]] * len(AGENTS)  # no outbox holds anything
    finally:
        if coordinator.poll() is None:
            coordinator.kill()
        for agent in agents:
            agent.stop()

    rows = [json.loads(line) for line in (state_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["round"] for row in rows] == [1, 2, 3, 4]  # each round once
    aggregated = sorted((task["agent"], row["round"] - task["staleness"]) for row in rows for task in row["tasks"]
                        if task["status"] == "ok")
    # (a task id is "r<round>-<agent>-<random>")
    acked = sorted((task.split("-", 1)[1].rsplit("-", 1)[0], int(task.split("-")[0][1:]))
                   for agent in agents for task in agent.uplink.delivered)
    assert acked == aggregated  # every acked update aggregated, once
    assert all(agent.uplink.refused == [] and agent.uplink.abandoned == [] for agent in agents)
