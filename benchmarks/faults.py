"""Fault injection on a whole federation over a secured mosquitto (TLS, a login per device, the ACL).

The coordinator and every agent run as their own ``fedfit`` processes, as on real machines; this script is the
attacker, the power cut and the operator. It runs the federation once clean and once under faults, then prints,
for each fault, what happened, the updates acked / lost / counted twice in the rounds it touched, and the rounds
completed, and compares the final accuracy with the clean run's:

- attacks: an anonymous client, a device publishing on another's topics, a stolen device login answering that
  device's task first with its weights times -50, garbage on every topic from stolen logins;
- kill -9 of 30% of the agents mid-round (restarted 2 s later, as systemd would);
- a broker restart mid-round;
- kill -9 of the coordinator ``--coordinator-kills`` times (default 10) at random moments, each restarted with
  ``resume: true``.

Updates are counted by task id (``_ledger``, right for buffered rounds too, whose carried tasks are aggregated in a
later round than their own): acked when its agent logged ``update_acked`` or heard its verdict, or the coordinator
acked it; lost when acked and trained but aggregated in no recorded round and not rejected with a reason; counted
twice when aggregated in two records (two rounds, or a round recorded twice); left when still in its agent's outbox
at the end. A fault's figures are those of the tasks planned or aggregated in the rounds it touched.
``--round-mode buffered`` runs the coordinator's buffered rounds. Run: ``.venv/bin/python benchmarks/faults.py``
(about 5 minutes on 2 cores).

``--soak SECONDS`` runs the soak instead (``soak.py``: federations one after another under random kills of agents,
the coordinator and the broker for that long, with the figures per fault kind and ``--json OUT``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import paho.mqtt.client as mqtt
import yaml
from _ledger import figures, read_ledger, summary
from _shared import ROOT, fedfit, wait_until
from paho.mqtt.enums import CallbackAPIVersion

from fedfit.sim.broker import Broker, start_mosquitto
from loadrig.raw_client import RawClient
from protocol import ProtocolError, Reassembler, Task, Topics, Update, decode, encode, split_payload


@dataclass
class Fault:
    """One line of the printout."""

    name: str
    happened: str = ""
    rounds: tuple[int, int] | None = None  # first and last round it touched


@dataclass
class Run:
    """A federation's processes and files."""

    workdir: Path
    broker: Broker
    federation: str
    agents: list[str]
    coordinator_config: Path
    agent_configs: dict[str, Path]
    coordinator: subprocess.Popen[bytes] | None = None
    agent_processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def state_dir(self) -> Path:
        return self.workdir / "coordinator"

    def start_coordinator(self) -> None:
        self.coordinator = _daemon("coordinator", self.coordinator_config, self.workdir / "coordinator.log")

    def start_agent(self, name: str) -> None:
        self.agent_processes[name] = _daemon("agent", self.agent_configs[name], self.workdir / f"{name}.log")

    def rounds_done(self) -> list[dict[str, Any]]:
        path = self.state_dir / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def round_in_flight(self) -> int | None:
        """The round the coordinator's journal holds (None between rounds)."""
        try:
            return int(json.loads((self.state_dir / "round" / "round.json").read_text())["round"])
        except (OSError, ValueError, KeyError):
            return None

    def stop(self) -> None:
        for process in [self.coordinator, *self.agent_processes.values()]:
            if process is not None and process.poll() is None:
                process.terminate()
        for process in [self.coordinator, *self.agent_processes.values()]:
            if process is not None:
                try:
                    process.wait(20)
                except subprocess.TimeoutExpired:
                    process.kill()


def _daemon(kind: str, config: Path, log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(fedfit(kind, "--config", str(config)),
                            stdout=log.open("ab"), stderr=subprocess.STDOUT, cwd=ROOT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})


def setup(workdir: Path, federation: str, agents: int, rounds: int, algorithm: str, seed: int,
          overrides: dict[str, Any] | None = None) -> Run:
    """A secured broker, the coordinator's and every agent's configuration (nothing started but the broker);
    ``overrides``: coordinator settings that replace these (``round_mode``, ``recipe``, ...)."""
    broker = start_mosquitto(federation=federation)
    names = [f"dev-{i:02d}" for i in range(agents)]
    broker.add_logins(names)
    coordinator = {
        "federation": federation, "broker": asdict(broker.coordinator_config()), "algorithm": algorithm,
        "model": {"family": "cnn", "options": {"hidden": [16, 32, 64]}},
        "data": {"dataset": "digits", "bn_samples": 300}, "recipe": {"epochs": 2, "batch_size": 16, "lr": 0.05},
        "levels": [1.0, 0.5, 0.25], "rounds": rounds, "min_agents": agents, "wait_for_agents_s": 180,
        "round_timeout_s": 180, "state_dir": str(workdir / "coordinator"), "resume": True, "seed": seed,
        **(overrides or {}),
    }
    coordinator_config = workdir / "coordinator.yaml"
    coordinator_config.write_text(yaml.safe_dump(coordinator))
    agent_configs = {}
    for index, name in enumerate(names):
        config = {"agent_id": name, "federation": federation, "broker": asdict(broker.client_config(name)),
                  "data": {"dataset": "digits", "partition": "iid", "num_shards": agents, "shard": index,
                           "seed": seed},
                  "torch_threads": 1, "ack_timeout_s": 3, "update_attempts": 200, "status_interval_s": 5,
                  "state_dir": str(workdir / "agents" / name)}
        agent_configs[name] = workdir / f"{name}.yaml"
        agent_configs[name].write_text(yaml.safe_dump(config))
    return Run(workdir, broker, federation, names, coordinator_config, agent_configs)


def events(log: Path, *names: str) -> list[dict[str, Any]]:
    """The JSON log lines of ``log`` whose event is one of ``names``."""
    found = []
    if not log.exists():
        return found
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if entry.get("event") in names:
                found.append(entry)
    return found


def wait_mid_round(run: Run, rng: random.Random, after_round: int, timeout: float = 300) -> int:
    """Wait for a round later than ``after_round`` to be in flight, then a random moment into it; its number."""
    wait_until(lambda: (run.round_in_flight() or 0) > after_round, timeout, f"a round after {after_round}")
    time.sleep(rng.uniform(0.5, 4.0))
    return run.round_in_flight() or after_round + 1


# ------------------------------------------------------------------------------------------------- attackers
def garbage(rng: random.Random) -> list[bytes]:
    """Payloads no daemon should accept: random bytes, a truncated message, a future version, a lying chunk."""
    valid = encode(Update("r1-x-0000", 1, "x", "ok", {"width": 1.0}, 1, [0], {}, {}, None))
    return [b"", bytes(rng.getrandbits(8) for _ in range(256)), valid[: len(valid) // 2],
            msgpack.packb({"v": 99, "type": "ack", "task_id": "a", "round": 1, "agent_id": "x"}),
            msgpack.packb({"v": 1, "type": "chunk", "transfer": "t", "seq": 0, "count": 1, "total": 3,
                           "sha256": "0" * 64, "data": b"abc"}),
            *split_payload(b"\xc1" * 64, f"junk-{rng.getrandbits(32)}")]


class Thief:
    """Holds ``victim``'s stolen login and answers its next task first, with the weights sent times -50."""

    def __init__(self, run: Run, victim: str) -> None:
        self.victim = victim
        self.forged: list[str] = []
        self.topics = Topics(run.federation)
        self._reassembler = Reassembler()
        self.client = RawClient.for_config(run.broker.client_config(victim), f"{victim}-thief",
                                           on_message=self._on_task)
        self.client.subscribe(self.topics.agent_task(victim))

    def _on_task(self, _topic: str, message: bytes) -> None:
        try:
            payload = self._reassembler.feed(message, "coordinator")
            task = decode(payload, expected=Task) if payload is not None and not self.forged else None
        except ProtocolError:
            return  # the garbage the other attackers send on this topic
        if not isinstance(task, Task):
            return
        update = Update(task.task_id, task.round, self.victim, "ok", task.spec, 500, list(range(10)),
                        {key: value * -50 for key, value in task.weights.items()}, {}, None)
        for chunk in split_payload(encode(update), f"forged-{task.task_id}"):
            self.client.publish(self.topics.agent_update(self.victim), chunk, wait=False)  # paho's thread: no PUBACK
        self.forged.append(task.task_id)

    def close(self) -> None:
        self.client.close()


def attack(run: Run, rng: random.Random, faults: list[Fault], stop: threading.Event, thief: Thief) -> None:
    """Every attack in one round: anonymous, cross-device, a forged update from a stolen login, garbage."""
    topics = Topics(run.federation)
    broker = run.broker
    ca_file = str(broker.directory.ca_file) if broker.directory else None
    anonymous = RawClient(broker.host, broker.port, "stranger", ca_file=ca_file)
    anonymous.close()
    plain = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="stranger-plain", protocol=mqtt.MQTTv311)
    try:
        plain.connect(broker.host, broker.port)
        plain.loop_start()
        time.sleep(1.0)
        plain_outcome = "connected" if plain.is_connected() else "connection closed by the broker (it speaks TLS only)"
        plain.loop_stop()
    except OSError as exc:
        plain_outcome = f"refused ({exc})"
    faults.append(Fault("anonymous client", f"TLS without login: {anonymous.connack}; plain TCP: {plain_outcome}"))

    a, b = run.agents[0], run.agents[1]
    device = RawClient.for_config(broker.client_config(a), f"{a}-rogue")
    answers = [device.publish(topic, b"forged") for topic in
               (topics.agent_update(b), topics.agent_status(b), topics.agent_task(b), topics.agent_ack(b),
                topics.coordinator_status())]
    faults.append(Fault(f"{a} publishes on {b}'s and the coordinator's topics",
                        f"broker answered {', '.join(sorted(set(answers)))} to {len(answers)} publishes"))

    senders = [RawClient.for_config(broker.coordinator_config(), "stolen-coordinator"),
               *(RawClient.for_config(broker.client_config(name), f"{name}-stolen") for name in run.agents)]
    targets = [topics.coordinator_status()] + [getattr(topics, f"agent_{kind}")(name) for name in run.agents
                                                for kind in ("task", "ack", "update", "status")]
    sent = refused = 0
    while not stop.is_set():
        for payload in garbage(rng):
            for topic in targets:
                for sender in senders:
                    if stop.is_set():
                        break
                    answer = sender.publish(topic, payload)
                    sent += 1
                    refused += answer == "Not authorized"
        stop.wait(0.5)
    for client in [*senders, device]:
        client.close()
    thief.close()
    victim = thief.victim
    rejected = events(run.workdir / "coordinator.log", "update_rejected")
    screened = [e for e in rejected if e.get("agent") == victim]
    faults.append(Fault(f"stolen login of {victim} answers its task first, weights x -50",
                        f"forged {len(thief.forged)} update(s); coordinator: "
                        + ("; ".join(e["reason"] for e in screened) if screened else "NOT REJECTED")))
    coordinator_rejects = len(events(run.workdir / "coordinator.log", "message_rejected"))
    agent_rejects = sum(len(events(run.workdir / f"{name}.log", "message_rejected")) for name in run.agents)
    crashes = sum(len(events(run.workdir / f"{name}.log", "message_handler_failed")) for name in run.agents) + len(
        events(run.workdir / "coordinator.log", "message_handler_failed"))
    faults.append(Fault("garbage on every topic from stolen logins",
                        f"{sent} publishes, {refused} refused by the ACL; the rest rejected with a reason by the "
                        f"coordinator ({coordinator_rejects}) and the agents ({agent_rejects}); {crashes} handler "
                        f"crashes"))


# ---------------------------------------------------------------------------------------------- accounting
def account(run: Run, first: int, last: int) -> str:
    """Acked, lost, double-counted, rejected, refused and left updates of the tasks planned or aggregated in rounds
    ``first``..``last`` (by task id: ``_ledger``, right for buffered rounds too), and the rounds recorded."""
    ledger = read_ledger(run.workdir, run.agents)
    tasks = ledger.of_rounds(range(first, last + 1))
    refused = [entry.refused for entry in tasks if entry.refused and not entry.acked]
    odd = {"recorded twice": [r for r in ledger.rounds_twice if first <= r <= last],
           "participants off their records": [r for r in ledger.participants_off if first <= r <= last]}
    return (summary(figures(tasks)) + "".join(f" ({reason[:60]}...)" for reason in refused[:2])
            + f"; rounds {first}-{last} recorded {[r for r in ledger.rounds if first <= r <= last]}"
            + "".join(f"; {what}: {rounds}" for what, rounds in odd.items() if rounds))


def run_federation(run: Run, inject: Callable[[Run], list[Fault]] | None, rounds: int,
                   timeout: float) -> tuple[list[Fault], list[dict[str, Any]]]:
    """Start the coordinator and the agents, inject the faults, wait for the last round; faults and rounds."""
    run.start_coordinator()
    for name in run.agents:
        run.start_agent(name)
    faults = inject(run) if inject is not None else []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if run.coordinator is not None and run.coordinator.poll() is not None:
            break
        time.sleep(0.5)
    code = run.coordinator.poll() if run.coordinator is not None else None
    rows = run.rounds_done()
    if code != 0:
        tail = (run.workdir / "coordinator.log").read_text(errors="replace")[-2000:]
        raise RuntimeError(f"the federation did not complete (coordinator exit {code}, rounds "
                           f"{[row['round'] for row in rows]}):\n{tail}")
    if [row["round"] for row in rows] != list(range(1, rounds + 1)):
        print(f"THE RECORDS ARE WRONG: the coordinator ended, metrics.jsonl holds rounds {[row['round'] for row in rows]}"
              f" (a round missing: its coordinator killed after the checkpoint, before the record?)", flush=True)
    return faults, rows


def injector(rng: random.Random, kills: int, agent_share: float, total_rounds: int) -> Callable[[Run], list[Fault]]:
    """The faults, one after another: attacks in round 1, then agent kills, a broker restart, coordinator kills."""

    def inject(run: Run) -> list[Fault]:
        faults: list[Fault] = []
        # 1. Attacks, through round 1 (the thief listens before the first task goes out).
        thief = Thief(run, run.agents[2])
        stop = threading.Event()
        wait_until(lambda: run.round_in_flight() == 1, 300, "round 1")
        attacker = threading.Thread(target=attack, args=(run, rng, faults, stop, thief), daemon=True)
        attacker.start()
        wait_until(lambda: len(run.rounds_done()) >= 1, 300, "round 1 to end")
        stop.set()
        attacker.join(60)
        faults[-1].rounds = (1, 1)  # the attacks' accounting, printed once under the last of them

        # 2. kill -9 of 30% of the agents mid-round; systemd would restart them.
        round_number = wait_mid_round(run, rng, 1)
        victims = rng.sample(run.agents, max(1, round(agent_share * len(run.agents))))
        for name in victims:
            run.agent_processes[name].send_signal(signal.SIGKILL)
        time.sleep(2.0)
        for name in victims:
            run.agent_processes[name].wait(10)
            run.start_agent(name)
        wait_until(lambda: len(run.rounds_done()) >= round_number, 300, f"round {round_number} to end")
        resent = len([e for e in events(run.workdir / "coordinator.log", "task_resent")
                      if e.get("round") == round_number])
        faults.append(Fault(f"kill -9 of {len(victims)} of {len(run.agents)} agents ({', '.join(victims)})",
                            f"in round {round_number}, restarted 2 s later; {resent} task(s) re-sent to them",
                            (round_number, round_number)))

        # 3. Broker restart mid-round.
        round_number = wait_mid_round(run, rng, round_number)
        down = rng.uniform(1.0, 4.0)
        run.broker.restart(down)
        wait_until(lambda: len(run.rounds_done()) >= round_number, 300, f"round {round_number} to end")
        faults.append(Fault("broker restart", f"in round {round_number}, down {down:.1f} s",
                            (round_number, round_number)))

        # 4. kill -9 of the coordinator, again and again, at random moments; each restart resumes.
        first = round_number + 1
        moments: list[int | None] = []
        for _ in range(kills):
            time.sleep(rng.uniform(2.0, 10.0))
            if len(run.rounds_done()) >= total_rounds:
                break  # the federation is over: no more moments to kill it at
            moments.append(run.round_in_flight())
            assert run.coordinator is not None
            run.coordinator.send_signal(signal.SIGKILL)
            run.coordinator.wait(10)
            time.sleep(rng.uniform(0.0, 2.0))
            run.start_coordinator()
        faults.append(Fault(f"kill -9 of the coordinator x{len(moments)}",
                            "rounds in flight at the kills: " + ", ".join("between rounds" if m is None else str(m)
                                                                          for m in moments),
                            (first, -1)))
        return faults

    return inject


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=None, help="rounds (default 16; a soak's federations 40)")
    parser.add_argument("--algorithm", default="heterofl")
    parser.add_argument("--coordinator-kills", type=int, default=10)
    parser.add_argument("--agent-share", type=float, default=0.3, help="share of the agents killed mid-round")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-clean", action="store_true", help="no clean run to compare accuracy with")
    parser.add_argument("--workdir", default=None, help="keep logs and state here (default: a temp dir)")
    parser.add_argument("--round-mode", choices=("sync", "buffered"), default="sync",
                        help="the coordinator's round_mode (synchronous or buffered rounds)")
    soak_flags = parser.add_argument_group("soak (benchmarks/soak.py)")
    soak_flags.add_argument("--soak", type=float, default=None, metavar="SECONDS",
                            help="keep federations going this long under random faults instead (no attacks)")
    soak_flags.add_argument("--kinds", default="agents,coordinator,broker", help="the faults drawn from")
    soak_flags.add_argument("--fault-every", default="20,60", metavar="MIN,MAX", help="seconds between faults")
    soak_flags.add_argument("--restart-after", type=float, default=2.0, help="seconds a killed daemon stays down")
    soak_flags.add_argument("--epochs", type=int, default=1, help="local epochs a task")
    soak_flags.add_argument("--round-timeout", type=float, default=120.0, help="the coordinator's round_timeout_s")
    soak_flags.add_argument("--drain", type=float, default=15.0,
                            help="seconds a finished federation's agents may take their last acks")
    soak_flags.add_argument("--stall", type=float, default=600.0, help="seconds without a round: stuck")
    soak_flags.add_argument("--json", default=None, metavar="OUT", help="write the soak's figures here")
    args = parser.parse_args()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="fedfit-faults-"))
    workdir.mkdir(parents=True, exist_ok=True)
    if args.soak is not None:
        from soak import soak  # (here: it imports this module's pieces)

        args.rounds = args.rounds or 40
        args.command = " ".join(["benchmarks/faults.py", *sys.argv[1:]])
        return soak(args, workdir)
    args.rounds = args.rounds or 16
    overrides = {"round_mode": args.round_mode}
    timeout = 120.0 * args.rounds + 60.0 * args.coordinator_kills
    clean_accuracy = None
    if not args.skip_clean:
        (workdir / "clean").mkdir(exist_ok=True)
        run = setup(workdir / "clean", "faults-clean", args.agents, args.rounds, args.algorithm, args.seed,
                    overrides)
        started = time.monotonic()
        try:
            _, rows = run_federation(run, None, args.rounds, timeout)
        finally:
            run.stop()
            run.broker.stop()
        clean_accuracy = [row["global_accuracy"] for row in rows]
        print(f"clean run: {args.rounds} rounds in {time.monotonic() - started:.0f} s, global accuracy "
              + " ".join(f"{a:.4f}" for a in clean_accuracy), flush=True)
    (workdir / "faults").mkdir(exist_ok=True)
    run = setup(workdir / "faults", "faults", args.agents, args.rounds, args.algorithm, args.seed, overrides)
    started = time.monotonic()
    try:
        faults, rows = run_federation(run, injector(random.Random(args.seed), args.coordinator_kills,
                                                     args.agent_share, args.rounds), args.rounds, timeout)
    finally:
        run.stop()
        run.broker.stop()
    print(f"faults run: {args.rounds} rounds in {time.monotonic() - started:.0f} s, logs in {workdir / 'faults'}")
    print(f"{'fault':<58} what happened / updates / rounds")
    for fault in faults:
        print(f"{fault.name:<58} {fault.happened}")
        if fault.rounds is not None:
            last = args.rounds if fault.rounds[1] == -1 else fault.rounds[1]
            print(f"{'':<58} {account(run, fault.rounds[0], last)}")
    print(f"{'whole federation':<58} {account(run, 1, args.rounds)}; completed: "
          f"{[row['round'] for row in rows] == list(range(1, args.rounds + 1))}")
    accuracy = [row["global_accuracy"] for row in rows]
    print("global accuracy under faults: " + " ".join(f"{a:.4f}" for a in accuracy))
    if clean_accuracy is not None:
        print(f"final accuracy: clean {clean_accuracy[-1]:.4f}, under faults {accuracy[-1]:.4f} "
              f"(difference {accuracy[-1] - clean_accuracy[-1]:+.4f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
