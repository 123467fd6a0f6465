"""Idle memory of an edge agent: RSS and PSS of the ``fedfit agent`` process and of each process it started (its
training forkserver), measured after start-up, after it served one round, and after it refused tasks.

The agent reads its data from an ``.npz`` file, as a device does (``data.path``; a shard of ``--dataset``). After the
round, the script acts as the coordinator (its login) and sends the agent tasks it must refuse: ``--refusals``
tasks of a ``--big-model`` over ``limits.max_epochs`` (received, decoded, declined by the decision child) and as
many transfers over ``limits.max_task_bytes`` (declined at their first chunk), acking every answer; then it measures
again, to show whether the agent's memory returned to where it was.

The training forkserver is also shown by part at each measurement (``benchmarks/forkserver_anatomy.py``: anonymous
memory and the file pages of torch's, the CUDA and the other libraries; *anon*: what exists only in memory),
and first by cause: a fresh process prepared step by step as the server was before issue 21 and as it is now
(``--no-anatomy`` skips that).

Run: ``.venv/bin/python benchmarks/footprint.py [--forkserver start-up]`` (about a minute). PSS shares each page
among the processes mapping it, so the PSS column adds up to what the agent costs the device; RSS counts shared
pages in every process. The issue's target: the agent process itself below 100 MB RSS.
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

import numpy as np
import psutil
import yaml
from forkserver_anatomy import anatomy, by_part, print_anatomy, print_parts

from common.data import load_dataset, parse_partition, partition_indices
from common.mqtt_link import MqttLink
from fedfit.sim.broker import Broker, start_mosquitto
from protocol import (
    Ack,
    ModelRef,
    Reassembler,
    Task,
    Topics,
    TrainingPlan,
    Update,
    decode,
    encode,
    split_payload,
)

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
    for role, pid, _, _ in rows:
        if role == "forkserver":
            try:
                print_parts(by_part(pid))
            except OSError:  # it ended meanwhile
                pass


def wait_for(log: Path, event: str, timeout: float, also: str = "") -> None:
    """Wait for a log line of ``event`` (that also holds ``also``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if log.exists() and any(f'"event": "{event}"' in line and also in line
                                for line in log.read_text().splitlines()):
            return
        time.sleep(0.2)
    raise TimeoutError(f"no {event} in {log} within {timeout:.0f} s:\n{log.read_text()[-2000:]}")


class RefusingCoordinator:
    """Plays the coordinator for the refusal step: sends the agent tasks it must refuse and acks its answers."""

    def __init__(self, broker: Broker, agent_id: str) -> None:
        self.topics = Topics("footprint")
        self.agent_id = agent_id
        self.answers: list[Update] = []
        self._reassembler = Reassembler()
        self.link = MqttLink(client_id="fedfit-footprint-coordinator", broker=broker.coordinator_config(),
                             subscriptions=[self.topics.agent_update(agent_id)], handler=self._on_update)
        self.link.start(30)

    def _on_update(self, topic: str, payload: bytes) -> None:
        complete = self._reassembler.feed(payload)
        if complete is None:
            return
        update = decode(complete, expected=Update)
        assert isinstance(update, Update)
        self.answers.append(update)
        self.link.publish(self.topics.agent_ack(self.agent_id), encode(Ack(update.task_id, update.round,
                                                                                update.agent_id)))

    def send(self, task_id: str, round_number: int, payload: bytes) -> None:
        for chunk in split_payload(payload, task_id, round_number=round_number):
            self.link.publish(self.topics.agent_task(self.agent_id), chunk)

    def wait_for_answers(self, count: int, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while len(self.answers) < count and time.monotonic() < deadline:
            time.sleep(0.1)
        if len(self.answers) < count:
            raise TimeoutError(f"{len(self.answers)} of {count} refused tasks answered within {timeout:.0f} s")

    def stop(self) -> None:
        self.link.stop()


def endless_task(task_id: str, hidden: list[int], in_channels: int, classes: int) -> bytes:
    """A valid task of a CNN with ``hidden`` channels that asks for 10^6 epochs (over any sane limit)."""
    from models import SubmodelSpec, get_family

    family = get_family("cnn", classes, in_channels, hidden=tuple(hidden))
    state = family.build().state_dict()
    weights = {key: state[key].numpy() for key in family.state_keys(SubmodelSpec())}
    return encode(Task(task_id, 2, "pi", time.time() + 600, ModelRef("cnn", classes, in_channels, {"hidden": hidden}),
                       {}, None, weights, plan=TrainingPlan(epochs=1_000_000, batch_size=32)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settle-s", type=float, default=5.0, help="idle seconds before each measurement")
    parser.add_argument("--forkserver", choices=("first-task", "start-up"), default="first-task",
                        help="when the agent starts its training forkserver")
    parser.add_argument("--dataset", default="digits", help="the dataset the agent's .npz holds a shard of")
    parser.add_argument("--shards", type=int, default=1, help="the agent holds one IID shard of this many")
    parser.add_argument("--refusals", type=int, default=3, help="refused tasks of each kind (0: skip the step)")
    parser.add_argument("--big-model", default="256,512,1024",
                        help="hidden channels of the CNN of the tasks refused for their epochs (default: about 24 MB)")
    parser.add_argument("--anatomy", action=argparse.BooleanOptionalAction, default=True,
                        help="first show the forkserver's preparation step by step, as it was and as it is")
    args = parser.parse_args()
    if args.anatomy:
        print_anatomy(anatomy())
    workdir = Path(tempfile.mkdtemp(prefix="fedfit-footprint-"))
    dataset = load_dataset(args.dataset)
    shard = partition_indices(dataset.y_train, args.shards, parse_partition("iid"), 0)[0]
    data_file = workdir / "pi.npz"
    np.savez(data_file, x=dataset.x_train[shard], y=dataset.y_train[shard])
    max_task_bytes = 32 * MIB
    broker = start_mosquitto(federation="footprint")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    agent_yaml = workdir / "agent.yaml"
    agent_yaml.write_text(yaml.safe_dump({
        "agent_id": "pi", "federation": "footprint", "broker": asdict(broker.client_config("pi")),
        "data": {"path": str(data_file)}, "torch_threads": 1, "state_dir": str(workdir / "agent"),
        "forkserver": args.forkserver, "limits": {"max_task_bytes": max_task_bytes}}))
    coordinator_yaml = workdir / "coordinator.yaml"
    coordinator_yaml.write_text(yaml.safe_dump({
        "federation": "footprint", "broker": asdict(broker.coordinator_config()), "algorithm": "fedavg",
        "model": {"family": "cnn", "options": {"hidden": [16, 32, 64]}}, "data": {"dataset": args.dataset},
        "recipe": {"epochs": 1, "batch_size": 32}, "rounds": 1, "min_agents": 1,
        # the agent at rest after one round's training, as measured before models were delivered
        "deployment": {"deliver": False}, "state_dir": str(workdir / "coordinator")}))
    agent_log, coordinator_log = workdir / "agent.log", workdir / "coordinator.log"
    print(f"agent: {len(shard)} samples of {args.dataset} from {data_file.name} "
          f"({data_file.stat().st_size / MIB:.1f} MiB), forkserver: {args.forkserver}")
    agent = subprocess.Popen([sys.executable, "-m", "fedfit.cli", "agent", "--config", str(agent_yaml)],
                             stdout=agent_log.open("wb"), stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    refusing = None
    try:
        wait_for(agent_log, "mqtt_ready", 120, also='"client_id": "fedfit-agent-pi"')
        time.sleep(args.settle_s)
        show("idle after start-up", footprint(agent.pid))
        coordinator = subprocess.run([sys.executable, "-m", "fedfit.cli", "coordinator", "--config",
                                      str(coordinator_yaml)], stdout=coordinator_log.open("wb"),
                                     stderr=subprocess.STDOUT, cwd=ROOT, env=env, timeout=600, check=False)
        if coordinator.returncode != 0:
            raise RuntimeError(coordinator_log.read_text()[-2000:])
        wait_for(agent_log, "update_acked", 60)
        time.sleep(args.settle_s)
        after_round = footprint(agent.pid)
        show("idle after serving one round", after_round)
        rounds = [json.loads(line) for line in (workdir / "coordinator" / "metrics.jsonl").read_text().splitlines()]
        print(f"\nround 1: {rounds[0]['tasks'][0]['status']}, global accuracy {rounds[0]['global_accuracy']:.4f}")
        if args.refusals:
            refusing = RefusingCoordinator(broker, "pi")
            hidden = [int(width) for width in args.big_model.split(",")]
            for index in range(args.refusals):
                payload = endless_task(f"r2-pi-endless-{index}", hidden, int(dataset.x_train.shape[1]),
                                       dataset.num_classes)
                refusing.send(f"r2-pi-endless-{index}", 2, payload)
                refusing.send(f"r2-pi-oversize-{index}", 2, bytes(max_task_bytes + MIB))
            refusing.wait_for_answers(2 * args.refusals)
            time.sleep(args.settle_s)
            after_refusals = footprint(agent.pid)
            show(f"idle after refusing {args.refusals} tasks of {len(payload) / MIB:.1f} MiB over limits.max_epochs "
                 f"and {args.refusals} transfers of {(max_task_bytes + MIB) / MIB:.0f} MiB over "
                 f"limits.max_task_bytes", after_refusals)
            for update in refusing.answers[:2]:
                print(f"  answered {update.status}: {update.reason}")
            before, after = after_round[0][2], after_refusals[0][2]
            print(f"\nagent process RSS: {before / MIB:.1f} MiB after the round, {after / MIB:.1f} MiB after the "
                  f"refusals ({(after - before) / MIB:+.1f} MiB)")
    finally:
        if refusing is not None:
            refusing.stop()
        agent.terminate()
        agent.wait(30)
        broker.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
