"""Idle memory of an edge agent: RSS and PSS of the ``fedfit agent`` process and of each process it started (its
training forkserver), measured after start-up and again after it served one round.

Run: ``.venv/bin/python benchmarks/footprint.py`` (about a minute). PSS shares each page among the processes
mapping it, so the PSS column adds up to what the agent costs the device; RSS counts shared pages in every
process. The issue's target: the agent process itself below 100 MB RSS.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import psutil
import yaml

from fedfit.sim.broker import start_mosquitto

ROOT = Path(__file__).resolve().parent.parent
MIB = 2**20


def footprint(pid: int) -> list[tuple[str, int, int, int]]:
    """(role, pid, RSS, PSS) of the agent process and every process under it."""
    agent = psutil.Process(pid)
    rows = []
    for index, process in enumerate([agent, *agent.children(recursive=True)]):
        try:
            info = process.memory_full_info()
            cmdline = " ".join(process.cmdline())
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        role = "agent" if index == 0 else ("forkserver" if "forkserver" in cmdline else
                                           "resource tracker" if "resource_tracker" in cmdline else "child")
        rows.append((role, process.pid, info.rss, getattr(info, "pss", 0)))
    return rows


def show(title: str, rows: list[tuple[str, int, int, int]]) -> None:
    print(f"\n{title}")
    print(f"{'process':<18} {'pid':>7} {'RSS MiB':>9} {'PSS MiB':>9}")
    for role, pid, rss, pss in rows:
        print(f"{role:<18} {pid:>7} {rss / MIB:>9.1f} {pss / MIB:>9.1f}")
    print(f"{'total':<18} {'':>7} {sum(r[2] for r in rows) / MIB:>9.1f} {sum(r[3] for r in rows) / MIB:>9.1f}")


def wait_for(log: Path, event: str, timeout: float, also: str = "") -> None:
    """Wait for a log line of ``event`` (that also holds ``also``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if log.exists() and any(f'"event": "{event}"' in line and also in line
                                for line in log.read_text().splitlines()):
            return
        time.sleep(0.2)
    raise TimeoutError(f"no {event} in {log} within {timeout:.0f} s:\n{log.read_text()[-2000:]}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settle-s", type=float, default=5.0, help="idle seconds before each measurement")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="fedfit-footprint-"))
    broker = start_mosquitto(federation="footprint")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    agent_yaml = workdir / "agent.yaml"
    agent_yaml.write_text(yaml.safe_dump({
        "agent_id": "pi", "federation": "footprint", "broker": asdict(broker.client_config("pi")),
        "data": {"dataset": "digits"}, "torch_threads": 1, "state_dir": str(workdir / "agent")}))
    coordinator_yaml = workdir / "coordinator.yaml"
    coordinator_yaml.write_text(yaml.safe_dump({
        "federation": "footprint", "broker": asdict(broker.coordinator_config()), "algorithm": "fedavg",
        "model": {"family": "cnn", "options": {"hidden": [16, 32, 64]}}, "data": {"dataset": "digits"},
        "recipe": {"epochs": 1, "batch_size": 32}, "rounds": 1, "min_agents": 1,
        "state_dir": str(workdir / "coordinator")}))
    agent_log, coordinator_log = workdir / "agent.log", workdir / "coordinator.log"
    agent = subprocess.Popen([sys.executable, "-m", "fedfit.cli", "agent", "--config", str(agent_yaml)],
                             stdout=agent_log.open("wb"), stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    try:
        wait_for(agent_log, "mqtt_ready", 120, also='"client_id": "fedfit-agent-pi"')
        time.sleep(args.settle_s)
        show("idle after start-up", footprint(agent.pid))
        coordinator = subprocess.run([sys.executable, "-m", "fedfit.cli", "coordinator", "--config",
                                      str(coordinator_yaml)], stdout=coordinator_log.open("wb"),
                                     stderr=subprocess.STDOUT, cwd=ROOT, env=env, timeout=300, check=False)
        if coordinator.returncode != 0:
            raise RuntimeError(coordinator_log.read_text()[-2000:])
        wait_for(agent_log, "update_acked", 60)
        time.sleep(args.settle_s)
        show("idle after serving one round", footprint(agent.pid))
        rounds = [json.loads(line) for line in (workdir / "coordinator" / "metrics.jsonl").read_text().splitlines()]
        print(f"\nround 1: {rounds[0]['tasks'][0]['status']}, global accuracy {rounds[0]['global_accuracy']:.4f}")
    finally:
        agent.terminate()
        agent.wait(30)
        broker.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
