"""A race against Flower: the same FedAvg workload in FedFit (coordinator and agents over mosquitto) and in Flower
1.42's deployment runtime (SuperLink and SuperNodes), as separate processes on loopback, side by side.

Run: ``.venv/bin/python benchmarks/flower_race.py [--clients 4] [--rounds 3] [--shards 20] [--epochs 1]`` (10 to 25
minutes with the defaults here, 2 cores busy with other work; about 30 s more the first time, to build Flower's
virtualenv). Flags: ``--batch-size``, ``--lr``, ``--momentum``, ``--seed``, ``--torch-threads`` (each client's,
default 1), ``--eval-samples`` (test images evaluated, default all), ``--allocator`` (the FedFit agents' heap),
``--venv`` (Flower's virtualenv), ``--only fedfit|flower``, ``--flower-first`` (FedFit's side runs first
otherwise), ``--no-proxy`` (no byte counting), ``--keep`` (keep the work directory with every log), ``--timeout``
(seconds a round may take).

Flower runs in its own virtualenv (``--venv``, default ``~/.cache/fedfit/flower-venv``), built on first use with
the base interpreter of the one running this script and ``pip install flwr==1.42.0``. Torch is not installed
there: a ``.pth`` file in it appends the directory named by ``$FEDFIT_RACE_SITE`` to ``sys.path``, after Flower's
own packages, and the race sets that variable, for the Flower processes only, to the site-packages of FedFit's
``.venv`` (same torch, numpy 2.4 on both sides; flwr's own dependencies win wherever both have a package). The
Flower App is ``benchmarks/flower_app`` (``flwr run`` packs it), and the repository is on its ``PYTHONPATH``.
FedFit's ``.venv`` is only read.

The same workload on both sides:

- FedFit's ``cnn`` family at full width (HeteroFL's Conv: 64-128-256-512, static BN), built by
  ``models.get_family``; the initial weights of ``strategy.initial_states(seed)``;
- Fashion-MNIST from ``/usr/share/datasets/fashion-mnist``, the training set split by
  ``common.data.partition_indices`` (IID, ``--seed``) into ``--shards`` shards, client i holding shard i, read
  by the agent's own loader (``common.data.load_shard``); the Flower clients get the same arrays as an ``.npz``
  written before the race (``--shards`` equal to ``--clients`` uses the whole training set);
- the recipe's training plan (``coordinator.strategies.base.base_plan``: SGD, ``--lr``, ``--momentum``, weight
  decay 5e-4, clip 1.0, ``--epochs``, ``--batch-size``, plain cross-entropy), run by ``models.train``, each task
  seeded as FedFit's coordinator seeds it (``sha256(seed:round:agent_id)``), so both sides draw the same batches;
- every client every round; FedAvg weighted by sample counts (FedFit ``weighting: samples``, Flower's FedAvg by
  ``num-examples``); down goes ``family.state_keys`` of the model, up ``family.trainable_keys``;
- the global model evaluated on the server after every round by ``coordinator.evaluation.Evaluator`` (static-BN
  statistics from 5,000 training samples, then the 10,000 test images, or ``--eval-samples`` of them); Flower's
  federated evaluation is off.

Both run plaintext on loopback without logins: mosquitto open to anonymous clients (no TLS), Flower with
``--insecure`` (no TLS, no SuperNode authentication). FedFit's agents keep their defaults otherwise (pooled heap,
training forkserver started at the first task, a warm-up step before each training run).

What is measured, the same way on both sides:

- **round wall time**: FedFit: ``seconds`` of the round in ``metrics.jsonl`` (from the start of ``run_round``:
  planning, and in round 1 the wait of at least 1 s for the fleet's retained statuses to settle; to the round's
  metrics written: after aggregation, evaluation, the checkpoint and the verdicts). Flower: from the entry of the
  strategy's ``configure_train`` to the end of that round's server-side evaluation.
- **training on the critical path**: the longest training time among the round's clients, each the
  ``TrainResult.seconds`` of ``models.train`` (what a FedFit agent reports as ``seconds``, a Flower ClientApp as
  ``train-seconds``): the same function timed at the same points.
- **non-training time** of a round: its wall time minus its training on the critical path; the **non-training
  share** is the sum of that over the rounds divided by the sum of the round wall times. Since the server's
  evaluation is the same code on both sides (and most of the non-training time here), both are also shown with it
  left out (FedFit's evaluation seconds from ``metrics.jsonl``'s ``timing``, where the coordinator records them).
- **bytes moved**: the TCP payload bytes that the clients send and receive, counted by a forwarding proxy
  (``os.splice``) every client connects through (agents -> mosquitto; SuperNodes -> SuperLink), between the start
  of the first round and the end of the last; the server's own hops (coordinator <-> mosquitto, ServerApp <->
  SuperLink) are not counted. This is protocol payload: MQTT or HTTP framing, statuses, polls and heartbeats
  included, TCP/IP headers not. The proxy adds one loopback hop to every client connection on both sides
  (``--no-proxy`` leaves it out, and the byte rows with it).
- **peak memory per client**: the client's whole process tree (FedFit: the agent, its training forkserver and the
  children forked from it; Flower: the SuperNode, its SuperExec and the ClientApp process started per message),
  sampled every 0.2 s: the sum of RSS (``/proc/<pid>/statm``) and of PSS (``/proc/<pid>/smaps_rollup``, read
  whenever the RSS sum is within 10% of its peak so far). RSS counts a page shared by several processes once in
  each (a forkserver and its forked child; the torch libraries of every process); PSS divides it among them
  (across clients too). The largest client's figure is reported.
- **final accuracy**: the global model's after the last round.

Also printed: where a round's time goes along its critical client (the last to deliver its update), in phases that
add up to the round's wall time: to the client (FedFit: dispatch until the agent logs ``task_received``; Flower:
until the ClientApp's handler is entered, the ClientApp process's start and imports included), the client's work
outside training (FedFit: its decision child, its training child's warm-up, data and encoding), training, back to
the server (until the coordinator logs ``update_received``, or ``aggregate_train`` is entered), and the server's
work after the last update (aggregation, evaluation; FedFit also its checkpoint and verdicts). FedFit's figures
come from the daemons' JSON logs and the agents' task metrics, Flower's from the timestamps its ClientApp and
ServerApp record. FedFit's own per-round breakdown is printed too when ``metrics.jsonl`` has one (``timing``). The
load average is printed before and after: on a shared machine the timings are noisy, the ratios of one run less so.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from _shared import ROOT, fedfit, wait_until

from common.data import load_shard
from fedfit.sim.broker import free_port, start_mosquitto, wait_for_port
from models import SubmodelSpec, get_family

APP_DIR = Path(__file__).resolve().parent / "flower_app"
FLWR_VERSION = "1.42.0"
FEDERATION = "race"
DATASET = "fashion-mnist"
SITE_ENV = "FEDFIT_RACE_SITE"
#: The .pth line that lets Flower's processes import torch from FedFit's .venv, after everything of their own.
PTH_LINE = (f"import os, sys; p = os.environ.get({SITE_ENV!r}); "
            f"p and p not in sys.path and sys.path.append(p)\n")
SAMPLE_S = 0.2
MIB = 2**20


# ---------------------------------------------------------------------------------------------------- plumbing
def json_lines(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of a daemon's log (other lines skipped)."""
    events = []
    for line in path.read_text(errors="replace").splitlines() if path.exists() else []:
        if line.startswith("{"):
            with contextlib.suppress(ValueError):
                events.append(json.loads(line))
    return events


def stamp(event: dict[str, Any]) -> float:
    """A structlog ISO timestamp as Unix time."""
    return datetime.fromisoformat(str(event["timestamp"]).replace("Z", "+00:00")).timestamp()


def log_tail(path: Path, lines: int = 15) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else "(no log)"


def children_of() -> dict[int, list[int]]:
    """Parent pid -> child pids of every process now running (one pass over /proc)."""
    tree: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as handle:
                parent = int(handle.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        tree.setdefault(parent, []).append(int(name))
    return tree


def descendants(root: int, tree: dict[int, list[int]]) -> list[int]:
    """``root`` and every process below it."""
    found, stack = [], [root]
    while stack:
        pid = stack.pop()
        found.append(pid)
        stack.extend(tree.get(pid, []))
    return found


def started_at(pid: int) -> int | None:
    """A process's start time (clock ticks since boot), None when it is gone: a pid with another start time is
    another process."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return int(handle.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def stop_tree(process: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    """SIGTERM a process this script started, wait, then SIGKILL what is left of its descendants (each checked by
    its start time, so that a pid used again meanwhile is left alone)."""
    below = [(pid, started_at(pid)) for pid in descendants(process.pid, children_of())[1:]]
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)
    time.sleep(0.5)
    for pid, started in below:  # started (indirectly) by this script: the forkserver, a SuperExec, a ClientApp
        if started is not None and started_at(pid) == started:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)


# ------------------------------------------------------------------------------------------------ measurement
class CountingProxy:
    """Forwards every TCP connection made to its loopback port to ``target_port``, counting the bytes of each
    direction (``up``: client -> server). Data moves with ``os.splice`` through a pipe, never through Python."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.up = 0
        self.down = 0
        self.connections = 0
        self._lock = threading.Lock()
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(128)
        self.port = int(self._listener.getsockname()[1])
        self._closed = False
        threading.Thread(target=self._accept, name="proxy-accept", daemon=True).start()

    def counts(self) -> tuple[int, int]:
        with self._lock:
            return self.up, self.down

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(("127.0.0.1", self.target_port))
            except OSError:
                client.close()
                continue
            for sock in (client, server):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self.connections += 1
            ends = [2]
            for source, sink, up in ((client, server, True), (server, client, False)):
                threading.Thread(target=self._pump, args=(source, sink, up, ends, (client, server)),
                                 name="proxy-pump", daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, up: bool, ends: list[int],
              pair: tuple[socket.socket, socket.socket]) -> None:
        read_end, write_end = os.pipe()
        with contextlib.suppress(OSError):
            fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, MIB)
        try:
            while True:
                moved = os.splice(source.fileno(), write_end, MIB)
                if moved == 0:
                    break
                with self._lock:
                    if up:
                        self.up += moved
                    else:
                        self.down += moved
                while moved:
                    moved -= os.splice(read_end, sink.fileno(), moved)
        except OSError:
            pass
        finally:
            os.close(read_end)
            os.close(write_end)
            with contextlib.suppress(OSError):
                sink.shutdown(socket.SHUT_WR)
            with self._lock:
                ends[0] -= 1
                last = ends[0] == 0
            if last:
                for sock in pair:
                    sock.close()


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _pss(pid: int) -> int:
    with open(f"/proc/{pid}/smaps_rollup") as handle:
        for line in handle:
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    return 0


class Sampler:
    """Every :data:`SAMPLE_S` seconds: each tracked client's process-tree RSS and PSS sums (peaks kept), and the
    proxy's byte counters (a time series)."""

    def __init__(self, proxy: CountingProxy | None) -> None:
        self.proxy = proxy
        self.roots: dict[str, int] = {}
        self.peak_rss: dict[str, int] = {}
        self.peak_pss: dict[str, int] = {}
        self.traffic: list[tuple[float, int, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sampler", daemon=True)
        self._thread.start()

    def track(self, name: str, pid: int) -> None:
        self.roots[name] = pid

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def bytes_between(self, start: float, end: float) -> tuple[int, int]:
        """(up, down) counted between two Unix times (to the sampling step)."""
        def at(moment: float) -> tuple[int, int]:
            before = [(up, down) for when, up, down in self.traffic if when <= moment]
            return before[-1] if before else (0, 0)
        (up0, down0), (up1, down1) = at(start), at(end)
        return up1 - up0, down1 - down0

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            if self.proxy is not None:
                self.traffic.append((time.time(), *self.proxy.counts()))
            if not self.roots:
                continue
            tree = children_of()
            for name, root in list(self.roots.items()):
                pids = descendants(root, tree)
                rss = 0
                for pid in pids:
                    with contextlib.suppress(OSError, ValueError, IndexError):
                        rss += _rss(pid)
                self.peak_rss[name] = max(self.peak_rss.get(name, 0), rss)
                if rss >= 0.9 * self.peak_rss[name]:
                    pss = 0
                    for pid in pids:
                        with contextlib.suppress(OSError, ValueError):
                            pss += _pss(pid)
                    self.peak_pss[name] = max(self.peak_pss.get(name, 0), pss)


# ----------------------------------------------------------------------------------------------------- results
@dataclass
class RoundTiming:
    """One round as both sides are compared: wall time, the training on its critical path, and the phases along
    its critical client (seconds; they add up to ``wall``)."""

    round: int
    start: float
    end: float
    train: float
    phases: dict[str, float] = field(default_factory=dict)

    @property
    def wall(self) -> float:
        return self.end - self.start

    @property
    def non_training(self) -> float:
        return self.wall - self.train

    @property
    def evaluation(self) -> float | None:
        """The server's evaluation of the global model (the same code on both sides), when known."""
        return self.phases.get(EVALUATION)


@dataclass
class SystemResult:
    name: str
    rounds: list[RoundTiming]
    accuracy: float
    bytes_up: int | None
    bytes_down: int | None
    peak_rss: int
    peak_pss: int
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def share(self) -> float:
        return sum(r.non_training for r in self.rounds) / sum(r.wall for r in self.rounds)

    @property
    def share_without_evaluation(self) -> float | None:
        """The non-training share with the server's evaluation taken out of both the non-training time and the
        wall time (None when the evaluation's time is not known)."""
        evaluations = [r.evaluation for r in self.rounds]
        if any(e is None for e in evaluations):
            return None
        spent = sum(e for e in evaluations if e is not None)
        return (sum(r.non_training for r in self.rounds) - spent) / (sum(r.wall for r in self.rounds) - spent)


PHASES = ("to the client", "client, not training", "training", "back to the server", "server, after the last update")
EVALUATION = "server, after the last update/evaluation"


# -------------------------------------------------------------------------------------------------- workload
def workload(args: argparse.Namespace) -> dict[str, Any]:
    """The coordinator configuration both sides run (FedFit's YAML adds the broker and the state directory)."""
    return {
        "federation": FEDERATION,
        "algorithm": "fedavg",
        "model": {"family": "cnn", "options": {}},
        "data": {"dataset": DATASET, "root": None, "bn_samples": 5000, "eval_samples": args.eval_samples},
        "recipe": {"epochs": args.epochs, "batch_size": args.batch_size, "lr": args.lr, "momentum": args.momentum,
                   "weight_decay": 5e-4, "clip_norm": 1.0, "masked_ce": False},
        "fedavg": {"width": 1.0},
        "rounds": args.rounds,
        "fraction": 1.0,
        "min_agents": args.clients,
        "wait_for_agents_s": 300,
        "round_timeout_s": args.timeout,
        "weighting": "samples",
        "resume": False,
        "seed": args.seed,
    }


def agent_ids(clients: int) -> list[str]:
    return [f"race-{index:03d}" for index in range(clients)]


# ---------------------------------------------------------------------------------------------------- FedFit
def run_fedfit(args: argparse.Namespace, work: Path) -> SystemResult:
    """Mosquitto, ``--clients`` agents (``fedfit agent``) and a coordinator (``fedfit coordinator``), each its own
    process; the agents reach the broker through the counting proxy."""
    work.mkdir(parents=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    broker = start_mosquitto()
    proxy = None if args.no_proxy else CountingProxy(broker.port)
    sampler = Sampler(proxy)
    ids = agent_ids(args.clients)
    agents: dict[str, subprocess.Popen[bytes]] = {}
    coordinator: subprocess.Popen[bytes] | None = None
    logs = {agent: work / f"{agent}.log" for agent in ids}
    try:
        for index, agent in enumerate(ids):
            config = {"agent_id": agent, "federation": FEDERATION,
                      "broker": {"host": "127.0.0.1", "port": proxy.port if proxy else broker.port},
                      "data": {"dataset": DATASET, "partition": "iid", "num_shards": args.shards, "shard": index,
                               "seed": args.seed},
                      "device": "cpu", "budget_bytes": None, "torch_threads": args.torch_threads,
                      "allocator": args.allocator,
                      "state_dir": str(work / "agents"), "log_level": "info"}
            path = work / f"{agent}.yaml"
            path.write_text(yaml.safe_dump(config))
            with logs[agent].open("wb") as out:
                agents[agent] = subprocess.Popen(fedfit("agent", "--config", str(path)), stdout=out,
                                                 stderr=subprocess.STDOUT, cwd=ROOT, env=env)

        def dead_agent() -> str | None:
            for agent, process in agents.items():
                if process.poll() is not None:
                    return f"agent {agent} exited ({process.returncode}): {log_tail(logs[agent])}"
            return None

        wait_until(lambda: all(any(e.get("event") == "mqtt_ready" for e in json_lines(log))
                               for log in logs.values()), 300, "every agent connected", dead_agent)
        for agent, process in agents.items():
            sampler.track(agent, process.pid)
        state_dir = work / "coordinator"
        config = {**workload(args), "broker": {"host": "127.0.0.1", "port": broker.port},
                  "state_dir": str(state_dir)}
        coordinator_yaml = work / "coordinator.yaml"
        coordinator_yaml.write_text(yaml.safe_dump(config))
        coordinator_log = work / "coordinator.log"
        print(f"fedfit: {args.clients} agents connected; coordinator started", flush=True)
        with coordinator_log.open("wb") as out:
            coordinator = subprocess.Popen(fedfit("coordinator", "--config", str(coordinator_yaml)), stdout=out,
                                           stderr=subprocess.STDOUT, cwd=ROOT, env=env)
        try:
            coordinator.wait(args.timeout * (args.rounds + 1))
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"the FedFit coordinator did not finish: {log_tail(coordinator_log)}") from None
        if coordinator.returncode != 0:
            raise RuntimeError(f"the FedFit coordinator failed ({coordinator.returncode}): {log_tail(coordinator_log)}")
        rounds = [json.loads(line) for line in (state_dir / "metrics.jsonl").read_text().splitlines()]
        timings = fedfit_timings(rounds, json_lines(coordinator_log), {a: json_lines(log) for a, log in logs.items()})
    finally:
        for process in agents.values():
            stop_tree(process)
        if coordinator is not None and coordinator.poll() is None:
            stop_tree(coordinator)
        sampler.stop()
        broker.stop()
        if proxy is not None:
            proxy.close()
    up, down = sampler.bytes_between(timings[0].start, timings[-1].end) if proxy else (None, None)
    extra: dict[str, Any] = {"payload_down": sum(r["bytes_down"] for r in rounds),
                             "payload_up": sum(r["bytes_up"] for r in rounds)}
    own = [r["timing"] for r in rounds if isinstance(r.get("timing"), dict)]
    if own:
        extra["timing"] = own
    return SystemResult("FedFit", timings, float(rounds[-1]["global_accuracy"]), up, down,
                        max(sampler.peak_rss.values()), max(sampler.peak_pss.values()), extra)


def fedfit_timings(rounds: list[dict[str, Any]], coordinator: list[dict[str, Any]],
                   agents: dict[str, list[dict[str, Any]]]) -> list[RoundTiming]:
    """Each round's timing from ``metrics.jsonl`` and the daemons' logs (task_received / task_done on the agents,
    update_received / round_done on the coordinator)."""
    done = {int(e["round"]): stamp(e) for e in coordinator if e.get("event") == "round_done"}
    received = {(int(e["round"]), str(e["agent"])): stamp(e) for e in coordinator
                if e.get("event") == "update_received" and e.get("verdict") == "accepted"}
    task_in: dict[tuple[int, str], float] = {}
    task_out: dict[tuple[int, str], float] = {}
    for agent, events in agents.items():
        round_of: dict[str, int] = {}
        for event in events:
            if event.get("event") == "task_received":
                round_of[str(event["task"])] = int(event["round"])
                task_in.setdefault((int(event["round"]), agent), stamp(event))
            elif event.get("event") == "task_done" and str(event.get("task")) in round_of:
                task_out.setdefault((round_of[str(event["task"])], agent), stamp(event))
    timings = []
    for row in rounds:
        number = int(row["round"])
        end = done[number]
        start = end - float(row["seconds"])
        seconds = {task["agent"]: float(task["metrics"]["seconds"]) for task in row["tasks"]
                   if task["status"] in ("ok", "adapted") and "seconds" in task.get("metrics", {})}
        if len(seconds) != len(row["tasks"]):
            failed = {task["agent"]: task.get("reason") for task in row["tasks"] if task["agent"] not in seconds}
            raise RuntimeError(f"FedFit round {number}: not every client trained: {failed}")
        last = max(seconds, key=lambda agent: received.get((number, agent), 0.0))
        key = (number, last)
        phases = {
            "to the client": task_in[key] - start,
            "client, not training": task_out[key] - task_in[key] - seconds[last],
            "training": seconds[last],
            "back to the server": received[key] - task_out[key],
            "server, after the last update": end - received[key],
        }
        metrics = next(task["metrics"] for task in row["tasks"] if task["agent"] == last)
        if "seconds_decision" in metrics:
            phases["client, not training/the decision child"] = float(metrics["seconds_decision"])
        if "seconds_child" in metrics:
            phases["client, not training/the training child, outside training"] = (
                float(metrics["seconds_child"]) - seconds[last])
        if isinstance(row.get("timing"), dict) and "evaluation" in row["timing"]:
            phases[EVALUATION] = float(row["timing"]["evaluation"])
        timings.append(RoundTiming(number, start, end, max(seconds.values()), phases))
    return timings


# ---------------------------------------------------------------------------------------------------- Flower
def ensure_flower_venv(venv: Path) -> Path:
    """Flower's own virtualenv with flwr==1.42.0 (built when missing) and the .pth that can reach FedFit's torch;
    returns its ``bin`` directory."""
    python = venv / "bin" / "python"
    if python.exists():
        found = subprocess.run([str(python), "-c", "import flwr; print(flwr.__version__)"], check=False,
                               capture_output=True, text=True, env={k: v for k, v in os.environ.items() if k != SITE_ENV})
        if found.returncode == 0 and found.stdout.strip() == FLWR_VERSION:
            _write_pth(python)
            return venv / "bin"
        if (venv / "pyvenv.cfg").exists():
            print(f"flower: {venv} holds no flwr {FLWR_VERSION}; rebuilding it", flush=True)
            shutil.rmtree(venv)
        else:
            raise RuntimeError(f"{venv} exists and is not a virtualenv; pass another --venv")
    print(f"flower: building {venv} (pip install flwr=={FLWR_VERSION})", flush=True)
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", str(venv)], check=True)
    installed = subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                                f"flwr=={FLWR_VERSION}"], check=False, capture_output=True, text=True)
    if installed.returncode != 0:
        shutil.rmtree(venv, ignore_errors=True)
        raise RuntimeError(f"pip install flwr=={FLWR_VERSION} failed: {installed.stdout[-2000:]}"
                           f"{installed.stderr[-2000:]}")
    _write_pth(python)
    return venv / "bin"


def _write_pth(python: Path) -> None:
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    pth = Path(purelib) / "fedfit_race_site.pth"
    if not pth.exists() or pth.read_text() != PTH_LINE:
        pth.write_text(PTH_LINE)


def run_flower(args: argparse.Namespace, work: Path) -> SystemResult:
    """A SuperLink, ``--clients`` SuperNodes (each its shard in node config) and ``flwr run`` of the race's app;
    the SuperNodes reach the SuperLink through the counting proxy."""
    work.mkdir(parents=True)
    bin_dir = ensure_flower_venv(Path(args.venv).expanduser())
    home = work / "flwr-home"
    home.mkdir()
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", "PYTHONPATH": str(ROOT),
           SITE_ENV: sysconfig.get_paths()["purelib"], "FLWR_HOME": str(home), "FLWR_TELEMETRY_ENABLED": "0",
           "FLWR_DISABLE_UPDATE_CHECK": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("VIRTUAL_ENV", None)
    ids = agent_ids(args.clients)
    data_files = []
    for index, agent in enumerate(ids):  # the agent's own loader, same partition: the same arrays
        x, y = load_shard(DATASET, None, args.shards, "iid", index, args.seed)
        path = work / f"{agent}.npz"
        np.savez(path, x=np.asarray(x, dtype=np.float32), y=np.asarray(y, dtype=np.int64))
        data_files.append(path)
    workload_file, out_file = work / "workload.json", work / "out.json"
    workload_file.write_text(json.dumps({"coordinator": workload(args), "clients": args.clients}))
    port = free_port()
    (home / "config.toml").write_text(f'[superlink]\ndefault = "race"\n\n[superlink.race]\n'
                                      f'address = "127.0.0.1:{port}"\ninsecure = true\n')
    superlink_log = work / "superlink.log"
    with superlink_log.open("wb") as out:
        superlink = subprocess.Popen([str(bin_dir / "flower-superlink"), "--insecure", "--host", "127.0.0.1",
                                      "--port", str(port), "--disable-runtime-dependency-installation"],
                                     stdout=out, stderr=subprocess.STDOUT, cwd=work, env=env)
    proxy: CountingProxy | None = None
    sampler: Sampler | None = None
    nodes: dict[str, subprocess.Popen[bytes]] = {}
    logs = {agent: work / f"{agent}.log" for agent in ids}
    try:
        if not wait_for_port("127.0.0.1", port, 60):
            raise RuntimeError(f"the SuperLink did not listen: {log_tail(superlink_log)}")
        proxy = None if args.no_proxy else CountingProxy(port)
        sampler = Sampler(proxy)
        for index, agent in enumerate(ids):
            node_config = (f'agent-id="{agent}" shard={index} data-file="{data_files[index]}" '
                           f'torch-threads={args.torch_threads}')
            with logs[agent].open("wb") as out:
                nodes[agent] = subprocess.Popen(
                    [str(bin_dir / "flower-supernode"), "--insecure", "--superlink",
                     f"127.0.0.1:{proxy.port if proxy else port}", "--port", str(free_port()), "--node-config",
                     node_config], stdout=out, stderr=subprocess.STDOUT, cwd=work, env=env)

        def dead() -> str | None:
            if superlink.poll() is not None:
                return f"the SuperLink exited ({superlink.returncode}): {log_tail(superlink_log)}"
            for agent, process in nodes.items():
                if process.poll() is not None:
                    return f"SuperNode {agent} exited ({process.returncode}): {log_tail(logs[agent])}"
            return None

        wait_until(lambda: all("SuperNode ID:" in log.read_text(errors="replace") for log in logs.values()), 300,
                   "every SuperNode registered", dead)
        for agent, process in nodes.items():
            sampler.track(agent, process.pid)
        print(f"flower: {args.clients} SuperNodes registered; flwr run", flush=True)
        submitted = subprocess.run([str(bin_dir / "flwr"), "run", str(APP_DIR), "race", "--run-config",
                                    f'workload-file="{workload_file}" out-file="{out_file}"'],
                                   check=False, capture_output=True, text=True, cwd=work, env=env, timeout=300)
        (work / "flwr-run.log").write_text(submitted.stdout + submitted.stderr)
        if submitted.returncode != 0:
            raise RuntimeError(f"flwr run failed ({submitted.returncode}): {submitted.stdout}{submitted.stderr}")
        wait_until(out_file.exists, args.timeout * (args.rounds + 1), "the Flower run's end", dead)
    finally:
        for process in nodes.values():
            stop_tree(process)
        stop_tree(superlink)
        if sampler is not None:
            sampler.stop()
        if proxy is not None:
            proxy.close()
    rounds = json.loads(out_file.read_text())["rounds"]
    timings = flower_timings(rounds)
    up, down = sampler.bytes_between(timings[0].start, timings[-1].end) if proxy else (None, None)
    return SystemResult("Flower", timings, float(rounds[-1]["global_accuracy"]), up, down,
                        max(sampler.peak_rss.values()), max(sampler.peak_pss.values()))


def flower_timings(rounds: list[dict[str, Any]]) -> list[RoundTiming]:
    """Each round's timing from what the ServerApp and the ClientApps recorded."""
    timings = []
    for row in rounds:
        if row.get("errors"):
            raise RuntimeError(f"Flower round {row['round']} had failed clients: {row['errors']}")
        clients = row["clients"]
        last = max(clients, key=lambda c: c["reply-ready"])
        start, end = float(row["start"]), float(row["evaluated"])
        phases = {
            "to the client": last["handler-start"] - start,
            "client, not training": last["reply-ready"] - last["handler-start"] - last["train-seconds"],
            "training": last["train-seconds"],
            "back to the server": row["replies_in"] - last["reply-ready"],
            "server, after the last update": end - row["replies_in"],
            "to the client/the ClientApp process: its start -> its handler": (
                last["handler-start"] - last["process-start"]),
            EVALUATION: end - row["eval_start"],
        }
        timings.append(RoundTiming(int(row["round"]), start, end, max(c["train-seconds"] for c in clients), phases))
    return timings


# ----------------------------------------------------------------------------------------------------- report
def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}" if a is not None and b else "-"


def table(rows: Iterable[Sequence[str]]) -> str:
    rows = list(rows)
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(widths[0]) if i == 0 else cell.rjust(widths[i])
                               for i, cell in enumerate(row)).rstrip() for row in rows)


def mean(values: Iterable[float]) -> float:
    values = list(values)
    return sum(values) / len(values)


def report(args: argparse.Namespace, results: list[SystemResult]) -> None:
    names = [r.name for r in results]
    both = len(results) == 2
    header = ["", *names, *(["FedFit/Flower"] if both else [])]

    def row(label: str, values: list[float | None], fmt: Callable[[float], str]) -> list[str]:
        cells = [fmt(v) if v is not None else "-" for v in values]
        return [label, *cells, *([ratio(values[0], values[1])] if both else [])]

    rows = [header]
    rows.append(row("round wall time, mean (s)", [mean(t.wall for t in r.rounds) for r in results], "{:.2f}".format))
    for index in range(args.rounds):
        rows.append(row(f"  round {index + 1} (s)", [r.rounds[index].wall for r in results], "{:.2f}".format))
    rows.append(row("training on the critical path, mean (s)", [mean(t.train for t in r.rounds) for r in results],
                    "{:.2f}".format))
    rows.append(row("non-training time per round, mean (s)", [mean(t.non_training for t in r.rounds)
                                                               for r in results], "{:.2f}".format))
    for index in range(args.rounds):
        rows.append(row(f"  round {index + 1} (s)", [r.rounds[index].non_training for r in results], "{:.2f}".format))
    rows.append(row("  the server's evaluation left out (s)",
                    [None if any(t.evaluation is None for t in r.rounds)
                     else mean(t.non_training - (t.evaluation or 0.0) for t in r.rounds) for r in results],
                    "{:.2f}".format))
    rows.append(row("non-training share of a round", [r.share for r in results], "{:.1%}".format))
    if args.rounds > 1:
        rows.append(row("  rounds 2.. only", [sum(t.non_training for t in r.rounds[1:]) / sum(t.wall for t in r.rounds[1:])
                                              for r in results], "{:.1%}".format))
    rows.append(row("  the server's evaluation left out", [r.share_without_evaluation for r in results],
                    "{:.1%}".format))
    if not args.no_proxy:
        rows.append(row("bytes down per round, clients' sockets (MB)",
                        [r.bytes_down / args.rounds / 1e6 if r.bytes_down is not None else None for r in results],
                        "{:.2f}".format))
        rows.append(row("bytes up per round, clients' sockets (MB)",
                        [r.bytes_up / args.rounds / 1e6 if r.bytes_up is not None else None for r in results],
                        "{:.2f}".format))
    rows.append(row("peak RSS per client, process tree (MiB)", [r.peak_rss / MIB for r in results], "{:.0f}".format))
    rows.append(row("peak PSS per client, process tree (MiB)", [r.peak_pss / MIB for r in results], "{:.0f}".format))
    rows.append(row("final global accuracy", [r.accuracy for r in results], "{:.4f}".format))
    print()
    print(table(rows))
    fedfit = next((r for r in results if r.name == "FedFit"), None)
    if fedfit is not None and "payload_down" in fedfit.extra:
        print(f"(FedFit's own payload figures, metrics.jsonl: {fedfit.extra['payload_down'] / args.rounds / 1e6:.2f} MB "
              f"down and {fedfit.extra['payload_up'] / args.rounds / 1e6:.2f} MB up per round, chunk headers "
              f"included, MQTT framing not)")
    print()
    print("Where a round's time goes along its critical client (the last to deliver), mean over the rounds (s):")
    every = [k for r in results for t in r.rounds for k in t.phases]
    phase_rows = [["", *names]]
    for phase in PHASES:
        for label in [phase, *sorted({k for k in every if k.startswith(f"{phase}/")})]:
            shown = f"  of which {label.split('/', 1)[1]}" if "/" in label else label
            phase_rows.append([shown, *(f"{mean(t.phases[label] for t in r.rounds):.2f}"
                                        if label in r.rounds[0].phases else "-" for r in results)])
    print(table(phase_rows))
    if fedfit is not None and "timing" in fedfit.extra:
        own = fedfit.extra["timing"]
        keys = sorted({k for t in own for k, v in t.items() if isinstance(v, (int, float))})
        print("FedFit's own breakdown (metrics.jsonl 'timing'), mean over the rounds: "
              + ", ".join(f"{k} {mean(float(t.get(k, 0.0)) for t in own):.3f}" for k in keys))
    if both:
        ours, theirs = results
        verdict = "met" if ours.share <= theirs.share else "NOT met"
        seconds = [mean(t.non_training for t in r.rounds) for r in results]
        print(f"\ngoal (issue 21): FedFit's non-training share of a round <= Flower's: {ours.share:.1%} vs "
              f"{theirs.share:.1%}: {verdict}; in seconds a round {seconds[0]:.2f} vs {seconds[1]:.2f} "
              f"({'less' if seconds[0] <= seconds[1] else 'more'})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--shards", type=int, default=20,
                        help="IID shards the training set is split into; client i holds shard i (default 20: "
                             "3,000 samples each; --shards equal to --clients uses the whole set)")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.02)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-samples", type=int, default=None,
                        help="test images the global model is evaluated on (default: all 10,000)")
    parser.add_argument("--torch-threads", type=int, default=1, help="torch threads of each client's training")
    parser.add_argument("--allocator", choices=("pooled", "compact", "default"), default="pooled",
                        help="the FedFit agents' training heap (default pooled, the agents' default)")
    parser.add_argument("--venv", default="~/.cache/fedfit/flower-venv", help="Flower's virtualenv (built if missing)")
    parser.add_argument("--only", choices=("fedfit", "flower"), help="run one side only")
    parser.add_argument("--flower-first", action="store_true", help="run Flower's side first (default: FedFit's)")
    parser.add_argument("--no-proxy", action="store_true", help="no counting proxy (and no byte figures)")
    parser.add_argument("--timeout", type=int, default=3600, help="seconds a round may take (default 3600)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (logs) and print its path")
    args = parser.parse_args()
    if not 1 <= args.clients <= args.shards:
        parser.error("--clients must be between 1 and --shards")
    for flag, value, least in (("--rounds", args.rounds, 1), ("--epochs", args.epochs, 1),
                               ("--batch-size", args.batch_size, 2), ("--torch-threads", args.torch_threads, 1),
                               ("--eval-samples", args.eval_samples or 1, 1), ("--timeout", args.timeout, 1)):
        if value < least:
            parser.error(f"{flag} must be at least {least}" + (" (static BN normalises with batch statistics)"
                                                                if flag == "--batch-size" else ""))
    if not args.lr > 0 or not 0 <= args.momentum < 1:
        parser.error("--lr must be above 0 and --momentum in [0, 1)")
    family = get_family("cnn", 10, 1)
    params = family.param_count(SubmodelSpec.full())
    print(f"FedFit vs Flower {FLWR_VERSION}: FedAvg, cnn at full width ({params:,} parameters, "
          f"{params * 4 / 1e6:.2f} MB as float32), {DATASET} IID, {args.clients} clients holding shards "
          f"0..{args.clients - 1} of {args.shards}, {args.rounds} rounds, {args.epochs} epoch(s), batch "
          f"{args.batch_size}, SGD lr {args.lr} momentum {args.momentum}, seed {args.seed}, "
          f"{args.torch_threads} torch thread(s) per client; plaintext on loopback (no TLS, no logins) on both sides")
    print(f"load average before: {' '.join(f'{v:.2f}' for v in os.getloadavg())} ({os.cpu_count()} cores)",
          flush=True)
    work = Path(tempfile.mkdtemp(prefix="fedfit-flower-race-"))
    results = []
    runs = [("fedfit", run_fedfit), ("flower", run_flower)]
    try:
        for name, run in reversed(runs) if args.flower_first else runs:
            if args.only in (None, name):
                results.append(run(args, work / name))
    except (RuntimeError, TimeoutError, OSError) as exc:  # a side that could not run: its one sentence, no traceback
        print(f"flower_race.py: error: {exc}", file=sys.stderr)
        return 1
    finally:
        if args.keep:
            print(f"logs in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    report(args, sorted(results, key=lambda result: result.name != "FedFit"))
    print(f"load average after: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
