"""``fedfit status`` over a real, secured mosquitto: a coordinator in a round, two agents that answer and one that
never does; what the command shows during the round (and the coordinator's Prometheus endpoint), after it, when an
agent leaves, and through a device's login. Then an agent of an older revision joins, and the statuses go back to
what it reads."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from common.config import to_mapping
from common.data import load_dataset
from common.mqtt_link import MqttLink
from coordinator.daemon import Coordinator
from fedfit.cli import main
from protocol import AgentStatus, Capabilities, CoordinatorStatus, Topics, decode, encode

from .conftest import SecuredBroker, digits_fleet, on_broker, tiny_config

pytestmark = [pytest.mark.broker, pytest.mark.slow]

WAIT_S = 120.0


def status_of(config: Path, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    capsys.readouterr()
    assert main(["status", "--config", str(config), "--json", "--wait", "0.5"]) == 0
    # (the daemons in this process log to stdout too: their loggers were made before the command's configuration)
    [line] = [line for line in capsys.readouterr().out.splitlines() if line.startswith('{"agents"')]
    return json.loads(line)


def until(config: Path, capsys: pytest.CaptureFixture[str], check: Callable[[dict[str, Any]], bool],
          what: str) -> dict[str, Any]:
    """``fedfit status --json`` again and again until ``check`` holds of what it prints."""
    deadline = time.monotonic() + WAIT_S
    while True:
        fleet = status_of(config, capsys)
        if check(fleet):
            return fleet
        assert time.monotonic() < deadline, f"{what}: never seen; last: {fleet}"


def agents(fleet: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {agent["agent_id"]: agent for agent in fleet["agents"]}


def test_fedfit_status_shows_the_fleet_and_the_round(secured_mosquitto: SecuredBroker, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    dataset = load_dataset("digits")
    broker = secured_mosquitto("watch")
    config = on_broker(tiny_config(federation="watch", rounds=1, min_agents=3, state_dir=str(tmp_path / "state"),
                                   algorithm="fedavg", round_timeout_s=600.0, metrics_port=0,
                                   metrics_linger_s=0.0), broker)  # (no wait for a last scrape at the stop)
    fleet_config = tmp_path / "coordinator.yaml"
    fleet_config.write_text(yaml.safe_dump({"federation": "watch", "broker": to_mapping(config.broker)}))
    device_config = tmp_path / "agent.yaml"  # the login of device b: the ACL shows it only its own status
    agents_ = digits_fleet(dataset, ["a", "b"], config, broker)
    device_config.write_text(yaml.safe_dump({"federation": "watch", "broker": to_mapping(agents_[1].config.broker)}))
    topics = Topics("watch")
    broker.add_logins(["mute"])
    mute = MqttLink(client_id="fedfit-agent-mute", broker=broker.client_config("mute"),
                    subscriptions=[topics.agent_task("mute")],
                    handler=lambda topic, payload: None)

    def announce_mute(revision: int) -> None:  # online with a shard, never answers a task
        capabilities = Capabilities("simulated", 2**31, 2**30, None, 100, list(range(10)), (1, 8, 8), revision)
        mute.publish(topics.agent_status("mute"), encode(AgentStatus("mute", "online", capabilities, time.time(),
                                                                     "m")), retain=True)

    coordinator = Coordinator(config, dataset=dataset)
    outcome: list[Any] = []
    runner = threading.Thread(target=lambda: outcome.append(coordinator.run()), daemon=True)
    try:
        mute.start(timeout=10)
        announce_mute(5)
        for agent in agents_:
            agent.start()
        coordinator.start()
        runner.start()

        # The round: a and b answered, the mute one keeps it open.
        fleet = until(fleet_config, capsys, lambda f: (f["coordinator"] or {}).get("progress") is not None
                      and f["coordinator"]["progress"]["received"] == 2, "two of three answers")
        progress = fleet["coordinator"]["progress"]
        assert progress["round"] == 1 and progress["expected"] == 3
        # The same round on the Prometheus endpoint.
        with urllib.request.urlopen(f"http://127.0.0.1:{coordinator.metrics_port}/metrics", timeout=10) as response:
            scraped = response.read().decode()
        for line in ("fedfit_round 1.0", "fedfit_round_expected_answers 3.0", "fedfit_round_received_answers 2.0",
                     'fedfit_updates_received_total{verdict="accepted"} 2.0', "fedfit_agents_online 3.0"):
            assert line in scraped.splitlines(), line
        assert progress["started_at"] <= fleet["now"] < progress["deadline"]
        seen = agents(until(fleet_config, capsys, lambda f: all(
            agents(f).get(name, {}).get("last_status") == "ok" for name in "ab"), "a and b's answers"))
        for name in "ab":
            row = seen[name]
            assert row["state"] == "online" and row["reports"] and row["last_round"] == 1, row
            assert row["last_task"] and row["last_trained"] and row["task"] == "", row
            assert row["memory_total"] > 0 and row["revision"] >= 5 and row["since"] > 0, row
        assert seen["mute"]["state"] == "online" and not seen["mute"]["reports"]
        capsys.readouterr()
        assert main(["status", "--config", str(fleet_config), "--wait", "0.5"]) == 0
        text = capsys.readouterr().out
        assert "round 1: 2/3 answers" in text and "agents: 3 known, 3 online" in text, text

        # A device's login sees itself and the coordinator only.
        own = status_of(device_config, capsys)
        assert [row["agent_id"] for row in own["agents"]] == ["b"] and own["coordinator"]["progress"] is not None

        # b leaves: offline, as its status says.
        agents_[1].stop()
        until(fleet_config, capsys, lambda f: agents(f)["b"]["state"] == "offline", "b offline")

        # An agent of revision 4 joins: the coordinator's status goes back to what it reads, and a stops reporting.
        announce_mute(4)
        fleet = until(fleet_config, capsys, lambda f: f["coordinator"]["progress"] is None
                      and not agents(f)["a"]["reports"], "statuses an older agent reads")
        retained: list[bytes] = []
        probe = MqttLink(client_id="fedfit-agent-a-probe", broker=agents_[0].config.broker,
                         subscriptions=[topics.coordinator_status()], handler=lambda t, p: retained.append(p))
        probe.start(timeout=10)
        deadline = time.monotonic() + WAIT_S
        while not retained and time.monotonic() < deadline:
            time.sleep(0.05)
        probe.stop()
        status = decode(retained[-1], expected=CoordinatorStatus)
        assert isinstance(status, CoordinatorStatus) and status.revision == 0 and status.progress is None
    finally:
        current = coordinator.in_flight.current()
        if current is not None:
            current.interrupt()  # the mute agent never answers: end the round
        runner.join(timeout=WAIT_S)
        for agent in agents_:
            agent.stop()
        coordinator.stop()
        mute.stop()
