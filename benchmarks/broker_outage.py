"""A broker outage in the middle of a round, with an agent restarted while its update waits for the ack: how many
trained updates are lost (the goal: none), and whether the other agents stayed up.

Everything runs as separate processes over a secured mosquitto made by ``fedfit broker init`` and the bundles of
``fedfit broker add-device``, as in the walkthrough of docs/deployment.md: ``--agents`` agents on digits shards, a coordinator of
``--rounds`` HeteroFL rounds. When every agent has its first task, mosquitto is stopped; once the agents have
trained (their updates now wait for the ack), one agent is stopped (SIGTERM) and started again the way systemd's
``Restart=on-failure`` would (again and again while the broker is away, since an agent cannot start without it).
After ``--down-s`` seconds (default 300) mosquitto starts again on the same port. The coordinator must then finish
its rounds with every update of the first one.

Run: ``.venv/bin/python benchmarks/broker_outage.py [--down-s 300] [--agents 3]`` (the outage plus about a minute).
Measured here with the defaults: 3 of 3 trained updates of round 1 aggregated (0 lost), both other agents up
throughout, the restarted one started 10 times while the broker was away, its update sent from disk, its task not
trained again.
"""

from __future__ import annotations

import argparse
import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from _shared import ROOT, fedfit, wait_until

from fedfit.sim.broker import find_mosquitto, free_port, wait_for_port


def count(log: Path, event: str) -> int:
    return log.read_text(errors="replace").count(f'"event": "{event}"') if log.exists() else 0


class Supervised:
    """An agent process restarted after a failed exit, as systemd's Restart=on-failure (RestartSec=5) does."""

    def __init__(self, config: Path, log: Path, env: dict[str, str]) -> None:
        self.config, self.log, self.env = config, log, env
        self.starts = 0
        self.process = self._start()

    def _start(self) -> subprocess.Popen[bytes]:
        self.starts += 1
        with self.log.open("ab") as out:
            return subprocess.Popen(fedfit("agent", "--config", str(self.config)), stdout=out,
                                    stderr=subprocess.STDOUT, cwd=ROOT, env=self.env)

    def poll(self) -> None:
        """Start it again if it exited with a failure (5 s after, as RestartSec=5)."""
        code = self.process.poll()
        if code is not None and code != 0:
            time.sleep(5)
            self.process = self._start()

    def restart(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:  # systemd would kill it after TimeoutStopSec too
            self.process.kill()
            self.process.wait(10)
        self.process = self._start()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--down-s", type=float, default=300.0, help="how long the broker stays down (default 300)")
    parser.add_argument("--agents", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--keep", action="store_true", help="keep the work directory (logs) and print its path")
    args = parser.parse_args()
    mosquitto = find_mosquitto()
    if mosquitto is None:
        print("mosquitto is not installed", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="fedfit-outage-"))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    port = free_port()
    broker_dir = work / "broker"
    names = [f"pi-{index}" for index in range(args.agents)]
    subprocess.run(fedfit("broker", "init", str(broker_dir), "--federation", "outage", "--port", str(port),
                          "--host", "127.0.0.1", "--user", pwd.getpwuid(os.geteuid()).pw_name, "--dataset", "digits",
                          "--rounds", str(args.rounds), "--min-agents", str(args.agents)),
                   check=True, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
    for index, name in enumerate(names):
        subprocess.run(fedfit("broker", "add-device", str(broker_dir), name, "--dataset", "digits", "--num-shards",
                              str(args.agents), "--shard", str(index)),
                       check=True, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
    coordinator_yaml = broker_dir / "coordinator.yaml"
    config = yaml.safe_load(coordinator_yaml.read_text())
    config.update(state_dir=str(work / "coordinator"), round_timeout_s=3 * args.down_s + 600)
    coordinator_yaml.write_text(yaml.safe_dump(config))

    def start_broker() -> subprocess.Popen[bytes]:
        with (work / "mosquitto.log").open("ab") as out:
            process = subprocess.Popen([mosquitto, "-c", str(broker_dir / "mosquitto.conf")], stdout=out,
                                       stderr=subprocess.STDOUT)
        if not wait_for_port("127.0.0.1", port, 10):
            raise RuntimeError("mosquitto did not start")
        return process

    broker = start_broker()
    logs = {name: work / f"{name}.log" for name in names}
    agents = {name: Supervised(broker_dir / "devices" / name / "agent.yaml", logs[name], env) for name in names}
    first_pids = {name: agent.process.pid for name, agent in agents.items()}
    coordinator_log = work / "coordinator.log"
    with coordinator_log.open("wb") as out:
        coordinator = subprocess.Popen(fedfit("coordinator", "--config", str(coordinator_yaml)), stdout=out,
                                       stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    restarted = names[0]
    try:
        wait_until(lambda: all(count(log, "task_received") >= 1 for log in logs.values()), 300, "every first task")
        broker.send_signal(signal.SIGTERM)
        broker.wait(10)
        down_at = time.monotonic()
        print(f"broker stopped: every agent has its round-1 task; down for {args.down_s:.0f} s")
        wait_until(lambda: all(count(log, "task_done") >= 1 for log in logs.values()), 300, "training")
        waiting = {name: count(log, "update_acked") == 0 for name, log in logs.items()}
        print(f"trained; updates waiting for their ack: {sum(waiting.values())} of {len(names)}")
        if not waiting[restarted]:
            print(f"{restarted}'s update was acked before the broker went down: the run tests nothing; run again",
                  file=sys.stderr)
            return 1
        agents[restarted].restart()
        print(f"{restarted} restarted (SIGTERM, then started again as systemd would) while its update waits")
        while time.monotonic() - down_at < args.down_s:
            for agent in agents.values():
                agent.poll()
            time.sleep(1)
        broker = start_broker()
        print(f"broker back after {time.monotonic() - down_at:.0f} s")
        while coordinator.poll() is None:
            for agent in agents.values():
                agent.poll()
            time.sleep(1)
        rounds = [json.loads(line) for line in (work / "coordinator" / "metrics.jsonl").read_text().splitlines()]
        first = rounds[0]
        aggregated = sum(task["status"] in ("ok", "adapted") for task in first["tasks"])
        stayed_up = [name for name in names if name != restarted and agents[name].process.pid == first_pids[name]
                     and agents[name].process.poll() is None]
        restored = count(logs[restarted], "spooled_updates_restored")
        print(f"coordinator exit code {coordinator.returncode}; rounds completed {len(rounds)}")
        print(f"round 1: {aggregated} of {len(first['tasks'])} trained updates aggregated "
              f"(lost: {len(names) - aggregated}), global accuracy {first['global_accuracy']:.4f}")
        print(f"agents that stayed up through the outage: {len(stayed_up)} of {len(names) - 1} "
              f"(same process, never restarted)")
        print(f"{restarted}: started {agents[restarted].starts} times (1 + the restart + the failed starts while "
              f"the broker was down); restored its update from disk: {'yes' if restored else 'no'}; tasks trained "
              f"by its processes together: {count(logs[restarted], 'task_done')} for {len(rounds)} rounds (round "
              f"1's is not trained again)")
        return 0 if aggregated == len(names) and coordinator.returncode == 0 else 1
    finally:
        coordinator.kill() if coordinator.poll() is None else None
        for agent in agents.values():
            agent.stop()
        broker.terminate()
        broker.wait(10)
        if args.keep:
            print(f"logs in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
