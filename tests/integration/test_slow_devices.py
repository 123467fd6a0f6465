"""Devices of different training speeds over a real, secured mosquitto (``slowdown``, ``fedfit sim --speeds``): a
slowed agent's update arrives only after f times its training, and the hold-back is the device's own time (its own
phase of the round's timing, not transfer). The agents share one training slot, as the simulator's do (that the
hold-back leaves it free: ``tests/edge_agent/test_daemon.py``)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from common.data import load_dataset, parse_partition, partition_indices
from coordinator.daemon import Coordinator
from edge_agent.config import AgentConfig, AgentDataConfig
from edge_agent.daemon import EdgeAgent
from edge_agent.data_source import to_local_data

from .conftest import SecuredBroker, on_broker, tiny_config

pytestmark = [pytest.mark.broker, pytest.mark.slow]

WAIT_S = 300.0
SLOWDOWN = 4.0


def test_a_slowed_agents_update_arrives_after_its_factor_times_its_training(secured_mosquitto: SecuredBroker,
                                                                            tmp_path: Path) -> None:
    dataset = load_dataset("digits")
    broker = secured_mosquitto("speeds")
    config = on_broker(tiny_config(federation="speeds", rounds=1, min_agents=2, algorithm="fedavg",
                                   state_dir=str(tmp_path / "state")), broker)
    names = {"fast": 1.0, "slow": SLOWDOWN}
    broker.add_logins(list(names))
    shards = partition_indices(dataset.y_train, len(names), parse_partition("iid"), 0)
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shared-train")  # one slot for both, as fedfit sim
    agents = [EdgeAgent(AgentConfig(agent_id=name, federation="speeds", broker=broker.client_config(name),
                                    data=AgentDataConfig(dataset="digits"), torch_threads=1,
                                    state_dir=str(tmp_path / "agents"), slowdown=slowdown),
                        to_local_data(dataset.x_train[shard], dataset.y_train[shard]), executor=pool)
              for (name, slowdown), shard in zip(names.items(), shards)]
    coordinator = Coordinator(config, dataset=dataset)
    results: list[Any] = []
    runner = threading.Thread(target=lambda: results.extend(coordinator.run()), daemon=True)
    try:
        for agent in agents:
            agent.start()
        coordinator.start()
        runner.start()
        runner.join(WAIT_S)
        assert not runner.is_alive(), "the round did not end"
    finally:
        coordinator.stop()
        for agent in agents:
            agent.stop()
        pool.shutdown(wait=True)
    [result] = results
    records = {task.agent: task for task in result.tasks}
    assert {name: record.status for name, record in records.items()} == {"fast": "ok", "slow": "ok"}
    fast, slow = records["fast"].metrics, records["slow"].metrics
    # The fast agent sent at once; the slow one held its update back (f - 1) x its task's seconds, as measured (then
    # counted in them: f x in all).
    assert "seconds_slowdown" not in fast
    assert slow["seconds_slowdown"] == pytest.approx((SLOWDOWN - 1) / SLOWDOWN * slow["seconds_task"], rel=1e-9)
    # It counts that as its own time (not the transfer's), and its update came no sooner than all of it: the round,
    # which waited for it, lasted at least f times its training.
    assert slow["seconds_task"] >= slow["seconds"] + slow["seconds_slowdown"]
    assert result.seconds + 0.001 >= slow["seconds_task"] >= SLOWDOWN * slow["seconds"]  # (seconds: 3 decimals)
    assert result.timing["slowdown"] == pytest.approx(slow["seconds_slowdown"], abs=1e-4)  # the slowest's phase
    assert result.timing["training"] >= slow["seconds"] - 1e-4
    assert all(agent.holdback.held() == [] for agent in agents)  # nothing left held back
