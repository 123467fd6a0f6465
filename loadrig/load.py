"""Load mode: one real coordinator driven by a fleet of SYNTHETIC agents (no training) through real brokers.

:func:`run_load` starts (unless brokers are given) an anonymous mosquitto on a free loopback port, the coordinator
in a process of its own (:mod:`loadrig.coordinator_process`: its RSS and CPU are its own) and ``workers``
processes of synthetic agents (:mod:`loadrig.agents`), each its own MQTT client and agent id; agent ``i``
connects to ``brokers[i % len(brokers)]`` (a broker cluster's nodes, say), the coordinator to
``coordinator_broker`` (default: the first). It watches every process's RSS and CPU while the rounds run, and
returns a :class:`LoadOutcome`: per round its time, traffic, where the time went (as the coordinator's progress
and, when it reports one, its own breakdown say), the CPU each party spent; the coordinator's idle and peak RSS;
what the agents saw. :func:`format_outcome` prints it, headed by :data:`SYNTHETIC_NOTICE`: the agents answer every
task with the weights they were sent plus a little noise, so the model's accuracy means nothing.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

import psutil
import yaml

from common.cores import available_cores
from common.data import load_dataset
from fedfit.sim.broker import Broker, start_mosquitto
from fedfit.sim.rundir import claim_run_dir, new_run_dir
from loadrig.agents import AgentSlot, WorkerResult, WorkerSpec
from loadrig.synthetic import SYNTHETIC_NOTICE
from protocol import PROTOCOL_REVISION

__all__ = ["SYNTHETIC_NOTICE", "LoadError", "LoadOptions", "LoadOutcome", "LoadRound", "agent_name", "broker_for",
           "format_outcome", "run_load"]

_ROOT = Path(__file__).resolve().parents[1]
#: The ~1M-parameter model of the load runs: HeteroFL's CNN with a last block of 256 channels (963,722 parameters
#: at 10 classes and one input channel).
DEFAULT_MODEL_OPTIONS: dict[str, Any] = {"hidden": [64, 128, 256, 256]}


class LoadError(RuntimeError):
    """The load run could not run (a process did not start, the fleet did not come online); the message says why."""


@dataclass
class LoadOptions:
    """What a load run drives. ``brokers``: ``HOST:PORT`` of brokers that let anonymous clients in (agent ``i``
    uses ``brokers[i % len(brokers)]``); empty: an anonymous mosquitto is started here. ``coordinator_broker``:
    where the coordinator connects (default: the first broker). ``protocol``: the agents' MQTT version, ``3.1.1``
    (what RabbitMQ speaks) or ``5`` (the coordinator tries 5 and falls back by itself). ``settings``: further
    coordinator settings, a mapping merged into its configuration (e.g. ``{"screening": {"enabled": False}}``).
    ``samples_per_agent``: the local data size each agent reports (its update's weight, its plan's reach).
    ``ack_timeout_s``: how long an agent waits for the ack of its update before it sends it again (the agents'
    own default, 10 s, makes a thousand agents resend every update many times over while a coordinator works
    through them: a storm that grows the broker's queues without bound). The run is stopped (:class:`LoadError`)
    when the machine's available memory falls below ``min_available_bytes``. ``coordinator_env``: environment
    variables set for the coordinator's process only (e.g. glibc's ``MALLOC_MMAP_THRESHOLD_``). ``revision``: the
    protocol revision the agents announce (`protocol.PROTOCOL_REVISION`; from 6 on they ask before they upload
    when the coordinator grants uploads, and below 2 their tasks come in protocol version 1)."""

    agents: int = 1000
    rounds: int = 3
    workers: int = 2
    brokers: list[str] = field(default_factory=list)
    coordinator_broker: str | None = None
    protocol: str = "3.1.1"
    algorithm: str = "fedavg"
    model: str = "cnn"
    model_options: dict[str, Any] = field(default_factory=lambda: dict(DEFAULT_MODEL_OPTIONS))
    dataset: str = "fashion-mnist"
    eval_samples: int | None = None
    federation: str = "load"
    samples_per_agent: int = 60
    seed: int = 0
    run_dir: str | None = None
    runs_root: str = "runs"
    round_timeout_s: float = 3600.0
    wait_for_agents_s: float = 600.0
    ack_timeout_s: float = 600.0
    update_attempts: int = 30
    status_interval_s: float = 30.0
    settings: dict[str, Any] = field(default_factory=dict)
    profile: bool = False
    sample_every_s: float = 0.25
    min_available_bytes: int = 2 * 2**30
    coordinator_env: dict[str, str] = field(default_factory=dict)
    revision: int = PROTOCOL_REVISION

    def validate(self) -> None:
        """Raises ValueError with one clear sentence."""
        if self.agents < 1 or self.rounds < 1 or self.workers < 1:
            raise ValueError("agents, rounds and workers must be at least 1")
        if self.protocol not in ("3.1.1", "5"):
            raise ValueError(f"protocol must be '3.1.1' or '5', got {self.protocol!r}")
        for address in [*self.brokers, *([self.coordinator_broker] if self.coordinator_broker else [])]:
            _address(address)


@dataclass
class LoadRound:
    """One round of a load run. Times in seconds from the round's start: ``dispatched`` (planned, every task
    extracted, encoded and queued), ``updates_in`` (the last update stored), ``seconds`` (aggregated, evaluated,
    checkpointed); ``first_task``/``last_task`` (the agents had a task whole) and ``last_ack`` (an agent had its
    ack). CPU seconds of each party within the round; ``coordinator_peak_rss`` as sampled."""

    round: int
    seconds: float
    participants: int
    selected: int
    bytes_down: int
    bytes_up: int
    dispatched: float | None = None
    updates_in: float | None = None
    first_task: float | None = None
    last_task: float | None = None
    last_ack: float | None = None
    latency_median: float | None = None
    latency_max: float | None = None
    coordinator_cpu: float | None = None
    agents_cpu: float | None = None
    broker_cpu: float | None = None
    coordinator_peak_rss: int | None = None
    coordinator_rss_dispatched: int | None = None
    coordinator_rss_updates_in: int | None = None
    coordinator_rss_end: int | None = None
    timing: dict[str, Any] | None = None


@dataclass
class LoadOutcome:
    """What a load run measured (see :func:`format_outcome`)."""

    options: LoadOptions
    run_dir: Path
    broker: str
    model: str
    parameters: int
    cores: int
    fd_limit: int
    rounds: list[LoadRound]
    coordinator: dict[str, Any]
    agents: dict[str, Any]
    broker_usage: dict[str, Any]
    profile: dict[str, Any] | None
    wall_seconds: float
    #: The machine's 1-minute load average when the rounds began and when they ended (other work shares the cores).
    load_average: tuple[float, float] = (0.0, 0.0)
    notice: str = SYNTHETIC_NOTICE

    @property
    def complete(self) -> bool:
        """Whether every round aggregated an update from every agent."""
        return len(self.rounds) == self.options.rounds and all(
            r.participants == self.options.agents for r in self.rounds)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["run_dir"] = str(self.run_dir)
        return data


def agent_name(index: int) -> str:
    """Synthetic agents are named load-0000, load-0001, ..."""
    return f"load-{index:04d}"


def broker_for(index: int, brokers: list[str]) -> str:
    """The broker agent ``index`` connects to: ``brokers[index % len(brokers)]``."""
    return brokers[index % len(brokers)]


def _address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"a broker must be HOST:PORT (e.g. 127.0.0.1:1883), got {text!r}")
    return host, int(port)


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in extra.items():
        merged[key] = _merge(merged[key], value) if isinstance(value, dict) and isinstance(merged.get(key), dict) \
            else value
    return merged


def _raise_fd_limit(needed: int) -> int:
    """Raise this process's open-file limit (its children inherit it) towards ``needed``; returns the limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = target
    return int(soft)


class _Monitor:
    """Samples RSS and CPU seconds (user + system) of the coordinator, the agents' workers and the broker."""

    def __init__(self, roles: dict[str, list[psutil.Process]], every: float, min_available: int) -> None:
        self.roles = roles
        self.every = every
        self.min_available = min_available
        #: Set when the machine's available memory fell below ``min_available``: what each party held then.
        self.starved: str | None = None
        self.starving = threading.Event()
        self.samples: list[tuple[float, dict[str, tuple[int, float]]]] = []
        self._stop = threading.Event()
        self._last: dict[int, tuple[int, float]] = {}
        self._thread = threading.Thread(target=self._run, name="load-monitor", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5.0)

    def _read(self, process: psutil.Process) -> tuple[int, float]:
        try:
            with process.oneshot():
                times = process.cpu_times()
                reading = (process.memory_info().rss, times.user + times.system)
        except psutil.Error:
            reading = (0, self._last.get(process.pid, (0, 0.0))[1])  # gone: its CPU stays counted
        self._last[process.pid] = reading
        return reading

    def _run(self) -> None:
        while True:
            now = time.time()
            sample = {}
            for role, processes in self.roles.items():
                readings = [self._read(process) for process in processes]
                sample[role] = (sum(r[0] for r in readings), sum(r[1] for r in readings))
            self.samples.append((now, sample))
            available = psutil.virtual_memory().available
            if available < self.min_available and self.starved is None:
                held = ", ".join(f"{role} {rss / 2**20:,.0f} MiB" for role, (rss, _cpu) in sample.items())
                self.starved = (f"the machine's available memory fell to {available / 2**20:,.0f} MiB (RSS: {held}); "
                                f"the run was stopped")
                self.starving.set()
            if self._stop.wait(self.every):
                return

    def cpu_between(self, role: str, start: float, end: float) -> float | None:
        """CPU seconds ``role`` spent between two wall-clock times (from the samples around them)."""
        before = [s for t, s in self.samples if t <= start]
        after = [s for t, s in self.samples if t >= end]
        if role not in self.roles or not before or not after:
            return None
        return after[0][role][1] - before[-1][role][1]

    def peak_between(self, role: str, start: float, end: float) -> int | None:
        values = [s[role][0] for t, s in self.samples if start <= t <= end and role in s]
        return max(values) if values else None

    def peak(self, role: str) -> int | None:
        values = [s[role][0] for _t, s in self.samples if role in s]
        return max(values) if values else None


def _relay(stream: IO[str], out: IO[str] | None, label: str, lines: list[str]) -> None:
    for line in stream:
        lines.append(line.rstrip("\n"))
        if out is not None:
            print(f"{label}: {line.rstrip()}", file=out, flush=True)


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {**os.environ, **(extra or {})}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_ROOT), env.get("PYTHONPATH", "")]))
    return env


def _coordinator_mapping(options: LoadOptions, host: str, port: int, state_dir: Path) -> dict[str, Any]:
    mapping: dict[str, Any] = {
        "federation": options.federation,
        "broker": {"host": host, "port": port, "keepalive": 60},
        "algorithm": options.algorithm,
        "model": {"family": options.model, "options": dict(options.model_options)},
        "data": {"dataset": options.dataset,
                 **({"eval_samples": options.eval_samples} if options.eval_samples else {})},
        "rounds": options.rounds,
        "min_agents": options.agents,
        "wait_for_agents_s": options.wait_for_agents_s,
        "round_timeout_s": options.round_timeout_s,
        "state_dir": str(state_dir),
        "resume": False,
        "seed": options.seed,
        # The rig's agents run no models: nothing is delivered to them at the end (they would never say they hold it).
        "deployment": {"deliver": False},
    }
    return _merge(mapping, options.settings)


def _worker_specs(options: LoadOptions, brokers: list[str], num_classes: int,
                  sample_shape: list[int]) -> list[WorkerSpec]:
    slots: list[list[AgentSlot]] = [[] for _ in range(options.workers)]
    for index in range(options.agents):
        host, port = _address(broker_for(index, brokers))
        slots[index % options.workers].append(AgentSlot(agent_name(index), host, port))
    return [WorkerSpec(options.federation, agents, options.samples_per_agent, num_classes, sample_shape,
                       protocol=options.protocol, ack_timeout_s=options.ack_timeout_s,
                       update_attempts=options.update_attempts, status_interval_s=options.status_interval_s,
                       connect_timeout_s=options.wait_for_agents_s, seed=options.seed + number,
                       revision=options.revision)
            for number, agents in enumerate(slots) if agents]


def _wait_connected(coordinator: subprocess.Popen[str], lines: list[str], timeout: float) -> None:
    """Wait until the coordinator says it is subscribed (a broker cluster may keep retained messages on the node
    they were published to: the agents' first statuses must find the coordinator's subscription in place)."""
    deadline = time.monotonic() + timeout
    while "connected" not in lines:
        if coordinator.poll() is not None:
            raise LoadError(f"the coordinator ended (code {coordinator.returncode}) before it connected: "
                            f"{' | '.join(lines[-5:])}")
        if time.monotonic() > deadline:
            raise LoadError(f"the coordinator did not connect to its broker within {timeout:g} s")
        time.sleep(0.1)


def _wait_ready(workers: list[subprocess.Popen[str]], lines: list[list[str]], timeout: float,
                monitor: _Monitor) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if monitor.starved:
            raise LoadError(monitor.starved)
        answers = [entries[0] if entries else None for entries in lines]
        failed = [(i, a) for i, a in enumerate(answers) if a is not None and not a.startswith("ready")]
        dead = [i for i, w in enumerate(workers) if w.poll() is not None and answers[i] is None]
        if failed or dead:
            what = failed[0][1] if failed else f"exited with code {workers[dead[0]].returncode}"
            raise LoadError(f"agent worker {failed[0][0] if failed else dead[0]} did not bring its agents online: "
                            f"{what}")
        if all(a is not None for a in answers):
            return
        if time.monotonic() > deadline:
            raise LoadError(f"the agent workers did not bring their agents online within {timeout:g} s")
        time.sleep(0.1)


def _round_rows(metrics: list[dict[str, Any]], events: list[dict[str, Any]], monitor: _Monitor,
                results: list[WorkerResult]) -> list[LoadRound]:
    rows = []
    for entry in metrics:
        number = int(entry["round"])
        marks = {e["event"]: e for e in events if e.get("round") == number}
        done = marks.get("round_done")
        end = float(done["t"]) if done else None
        start = end - float(entry["seconds"]) if end is not None else None

        def since(event: str, marks: dict[str, Any] = marks, start: float | None = start) -> float | None:
            return round(float(marks[event]["t"]) - start, 3) if event in marks and start is not None else None

        seen = [r.rounds[str(number)] for r in results if str(number) in r.rounds]
        latencies = [value for s in seen for value in s.latencies]
        row = LoadRound(number, float(entry["seconds"]), int(entry["participants"]), int(entry["selected"]),
                        int(entry["bytes_down"]), int(entry["bytes_up"]), since("dispatched"), since("updates_in"),
                        timing=entry.get("timing") or (done or {}).get("timing"))
        if start is not None and end is not None:
            if seen:
                row.first_task = round(min(s.first_task_at for s in seen if s.tasks) - start, 3)
                row.last_task = round(max(s.last_task_at for s in seen) - start, 3)
                acked = [s.last_ack_at for s in seen if s.acked]
                row.last_ack = round(max(acked) - start, 3) if acked else None
            row.coordinator_cpu = monitor.cpu_between("coordinator", start, end)
            row.agents_cpu = monitor.cpu_between("agents", start, end)
            row.broker_cpu = monitor.cpu_between("broker", start, end)
            row.coordinator_peak_rss = monitor.peak_between("coordinator", start, end)
            row.coordinator_rss_end = int(done["rss"]) if done else None
            row.coordinator_rss_dispatched = marks.get("dispatched", {}).get("rss")
            row.coordinator_rss_updates_in = marks.get("updates_in", {}).get("rss")
        if latencies:
            row.latency_median = round(statistics.median(latencies), 3)
            row.latency_max = round(max(latencies), 3)
        rows.append(row)
    return rows


def _agents_summary(results: list[WorkerResult], workers: int) -> dict[str, Any]:
    total: dict[str, Any] = {"workers": workers}
    for name in ("agents", "online", "tasks", "duplicate_tasks", "updates", "resends", "asks", "grants", "waits",
                 "abandoned", "acked", "refused", "aggregated", "rejected", "failed_updates", "protocol_errors", "disconnects",
                 "reconnects", "bytes_in", "bytes_out"):
        total[name] = sum(getattr(r, name) for r in results)
    total["cpu_seconds"] = round(sum(r.cpu_seconds for r in results), 3)
    total["peak_rss_per_worker"] = max((r.peak_rss for r in results), default=0)
    reasons: Counter[str] = Counter()
    for r in results:
        reasons.update(r.reasons)
    total["reasons"] = dict(reasons.most_common(10))
    return total


def run_load(options: LoadOptions, progress: IO[str] | None = sys.stderr) -> LoadOutcome:
    """Run a load run (see the module docstring); ``progress`` gets a line per stage and per round (None: quiet).
    Raises :class:`LoadError` when the coordinator or the fleet cannot start."""
    options.validate()
    began = time.time()
    run_dir = claim_run_dir(options.run_dir) if options.run_dir else new_run_dir(options.runs_root, "load")
    fd_limit = _raise_fd_limit(2 * options.agents + 1024)
    dataset = load_dataset(options.dataset)
    from models import get_family  # torch: the coordinator's and the agents' processes import it anyway

    family = get_family(options.model, dataset.num_classes, dataset.in_channels, **options.model_options)
    parameters = family.param_count()
    sample_shape = [dataset.in_channels, *dataset.image_size]
    started: Broker | None = None
    processes: list[subprocess.Popen[str]] = []
    try:
        brokers = list(options.brokers)
        if not brokers:
            started = start_mosquitto()
            brokers = [f"{started.host}:{started.port}"]
            broker_text = f"mosquitto {started.version} (anonymous, loopback) at {brokers[0]}"
        else:
            broker_text = f"{len(brokers)} broker{'s' * (len(brokers) > 1)}: {', '.join(brokers)}"
        host, port = _address(options.coordinator_broker or brokers[0])
        config_path = run_dir / "coordinator.yaml"
        config_path.write_text(yaml.safe_dump(_coordinator_mapping(options, host, port, run_dir / "coordinator"),
                                              sort_keys=False))
        events_path = run_dir / "coordinator-events.json"
        if progress is not None:
            print(f"{SYNTHETIC_NOTICE}\nload run in {run_dir}: {options.agents} synthetic agents in {options.workers} "
                  f"worker processes, {broker_text}", file=progress, flush=True)
        coordinator = subprocess.Popen(
            [sys.executable, "-m", "loadrig.coordinator_process", "--config", str(config_path), "--events",
             str(events_path), "--log-file", str(run_dir / "coordinator.log"),
             *(["--profile"] if options.profile else [])],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(options.coordinator_env))
        processes.append(coordinator)
        coordinator_lines: list[str] = []
        threading.Thread(target=_relay, args=(coordinator.stdout, progress, "coordinator", coordinator_lines),
                         daemon=True).start()
        _wait_connected(coordinator, coordinator_lines, options.wait_for_agents_s)
        specs = _worker_specs(options, brokers, dataset.num_classes, sample_shape)
        workers: list[subprocess.Popen[str]] = []
        worker_lines: list[list[str]] = []
        for number, spec in enumerate(specs):
            spec_path = run_dir / f"agents-{number}.json"
            spec_path.write_text(spec.to_json())
            with open(run_dir / f"agents-{number}.log", "w", encoding="utf-8") as log:
                worker = subprocess.Popen(
                    [sys.executable, "-m", "loadrig.agents", str(spec_path),
                     str(run_dir / f"agents-{number}-result.json")],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, env=_env())
            workers.append(worker)
            processes.append(worker)
            worker_lines.append([])
            threading.Thread(target=_relay, args=(worker.stdout, None, f"agents-{number}", worker_lines[-1]),
                             daemon=True).start()
        roles = {"coordinator": [psutil.Process(coordinator.pid)],
                 "agents": [psutil.Process(worker.pid) for worker in workers]}
        if started is not None:
            roles["broker"] = [child for child in psutil.Process().children() if child.name() == "mosquitto"]
        monitor = _Monitor(roles, options.sample_every_s, options.min_available_bytes)
        monitor.start()
        try:
            _wait_ready(workers, worker_lines, options.wait_for_agents_s, monitor)
            load_before = os.getloadavg()[0]
            if progress is not None:
                print(f"fleet: {options.agents} synthetic agents online", file=progress, flush=True)
            limit = time.monotonic() + options.wait_for_agents_s + options.rounds * options.round_timeout_s + 300
            while coordinator.poll() is None:
                if monitor.starving.wait(1.0):
                    raise LoadError(monitor.starved or "out of memory")
                if time.monotonic() > limit:
                    raise LoadError(f"the coordinator did not finish {options.rounds} rounds in time")
        finally:
            monitor.stop()
            for worker in workers:
                if worker.stdin is not None:
                    worker.stdin.close()
            for worker in workers:
                try:
                    worker.wait(60)
                except subprocess.TimeoutExpired:
                    worker.kill()
        load_after = os.getloadavg()[0]
        if not events_path.exists():
            raise LoadError(f"the coordinator ended (code {coordinator.returncode}) without its figures: "
                            f"{' | '.join(coordinator_lines[-5:])}")
        figures = json.loads(events_path.read_text())
        if figures.get("error"):
            raise LoadError(f"the coordinator failed: {figures['error']}")
        results = [WorkerResult.from_json((run_dir / f"agents-{n}-result.json").read_text())
                   for n in range(len(specs)) if (run_dir / f"agents-{n}-result.json").exists()]
        metrics_path = run_dir / "coordinator" / "metrics.jsonl"
        metrics = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
        events = figures["events"]
        by_name = {e["event"]: e for e in events if "round" not in e}
        dones = [e for e in events if e["event"] == "round_done"]
        first_start = (float(dones[0]["t"]) - float(dones[0]["seconds"])) if dones else None
        last_end = float(dones[-1]["t"]) if dones else None
        coordinator_figures = {
            "idle_rss": by_name.get("fleet_online", {}).get("rss"),
            "ready_rss": by_name.get("ready", {}).get("rss"),
            "peak_rss": figures["peak_rss"],
            "rss_after_rounds": int(dones[-1]["rss"]) if dones else None,
            "cpu_seconds": round(figures["cpu_seconds"], 3),
            "rounds_cpu": (monitor.cpu_between("coordinator", first_start, last_end)
                           if first_start is not None and last_end is not None else None),
            "rounds_seconds": (last_end - first_start) if first_start is not None and last_end is not None else None,
            "uploads": figures.get("uploads"),
        }
        broker_usage = {"cpu_seconds": monitor.cpu_between("broker", monitor.samples[0][0], monitor.samples[-1][0])
                        if started is not None and monitor.samples else None,
                        "peak_rss": monitor.peak("broker") if started is not None else None}
        outcome = LoadOutcome(
            options=options, run_dir=run_dir, broker=broker_text,
            model=f"{options.model} {json.dumps(options.model_options)}", parameters=parameters,
            cores=available_cores(), fd_limit=fd_limit,
            rounds=_round_rows(metrics, events, monitor, results),
            coordinator=coordinator_figures, agents=_agents_summary(results, len(specs)),
            broker_usage=broker_usage, profile=figures.get("profile"), wall_seconds=round(time.time() - began, 3),
            load_average=(load_before, load_after))
        (run_dir / "load-outcome.json").write_text(json.dumps(outcome.to_dict(), indent=1, default=str))
        (run_dir / "usage.json").write_text(json.dumps(
            {"columns": "time, {role: [rss bytes, cpu seconds]}", "samples": monitor.samples}))
        return outcome
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait(10)
        if started is not None:
            started.stop()


#: Frames of FedFit's own code the profile lists (inclusive), less the entry points every sample passes through.
_OWN_CODE = ("coordinator/", "protocol/", "common/", "models/")
_ENTRY_POINTS = ("_dispatch_loop", "_on_message", "run", "run_round", "main", "<module>")


def _mib(value: float | None) -> str:
    return "-" if value is None else f"{value / 2**20:,.0f}"


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def format_outcome(outcome: LoadOutcome, top: int = 8) -> str:
    """The printout of a load run: the SYNTHETIC notice, a row per round, RSS and CPU of each party, what the
    agents saw, the coordinator's own breakdown (when it gives one) and its busiest frames (with ``profile``)."""
    o = outcome.options
    lines = [
        f"=== {outcome.notice} ===",
        (f"{o.agents} synthetic agents ({outcome.agents['workers']} worker processes, MQTT {o.protocol}, ack timeout "
         f"{o.ack_timeout_s:g} s) -> one "
         f"coordinator; {o.algorithm}, {outcome.model}: {outcome.parameters:,} parameters "
         f"({outcome.parameters * 4 / 1e6:.2f} MB of float32 per task and per update); {o.dataset}; {o.rounds} "
         f"rounds; {outcome.broker}; {outcome.cores} cores (load average {outcome.load_average[0]:.1f} when the "
         f"rounds began, {outcome.load_average[1]:.1f} when they ended); open-file limit {outcome.fd_limit}"
         + (f"; coordinator environment {o.coordinator_env}" if o.coordinator_env else "")),
        "",
        ("round  seconds  updates  MB down  MB up | dispatched  updates in | agents: 1st task  last task  last ack"
         " | CPU s: coord  agents  broker | coord RSS MiB: dispatched  updates in  end  peak"),
    ]
    for r in outcome.rounds:
        lines.append(
            f"{r.round:>5}  {r.seconds:7.1f}  {r.participants:>4}/{r.selected:<4}{r.bytes_down / 1e6:7.0f}  "
            f"{r.bytes_up / 1e6:6.0f} | {_s(r.dispatched):>10}  {_s(r.updates_in):>10} | {_s(r.first_task):>16}  "
            f"{_s(r.last_task):>9}  {_s(r.last_ack):>8} | {_s(r.coordinator_cpu):>12}  {_s(r.agents_cpu):>6}  "
            f"{_s(r.broker_cpu):>6} | {_mib(r.coordinator_rss_dispatched):>24}  {_mib(r.coordinator_rss_updates_in):>10}"
            f"  {_mib(r.coordinator_rss_end):>5}  {_mib(r.coordinator_peak_rss):>5}")
    lines.append("(times in seconds from the round's start; 'dispatched': planned and every task extracted, encoded "
                 "and queued for the broker; 'updates in': the last update stored and acked; CPU: seconds each party "
                 "used within the round; RSS peak: sampled every "
                 f"{o.sample_every_s:g} s)")
    timed = [r for r in outcome.rounds if r.timing]
    if timed:
        phases = list(dict.fromkeys(key for r in timed for key, value in (r.timing or {}).items()
                                    if isinstance(value, (int, float))))
        lines += ["", ("the coordinator's own breakdown of each round (RoundResult.timing, seconds; device phases: "
                       "the most any device took):"),
                  "round  " + "  ".join(f"{phase:>{max(7, len(phase))}}" for phase in phases)]
        for r in timed:
            timing = r.timing or {}
            lines.append(f"{r.round:>5}  " + "  ".join(
                f"{timing[phase]:>{max(7, len(phase))}.2f}" if isinstance(timing.get(phase), (int, float))
                else f"{'-':>{max(7, len(phase))}}" for phase in phases))
    c = outcome.coordinator
    lines += [
        "",
        (f"coordinator RSS: {_mib(c['ready_rss'])} MiB once set up, {_mib(c['idle_rss'])} MiB idle with the "
         f"fleet online, peak {_mib(c['peak_rss'])} MiB (ru_maxrss), {_mib(c['rss_after_rounds'])} MiB after the "
         f"last round; CPU {c['cpu_seconds']:.1f} s in all, {_s(c['rounds_cpu'])} s over the rounds' "
         f"{_s(c['rounds_seconds'])} s"),
    ]
    uploads = c.get("uploads")
    lines.append("uploads: sent without asking (not granted)" if not uploads else
                 f"uploads granted within a window of {_mib(uploads['window_bytes'])} MiB: {uploads['granted']} grants, "
                 f"at most {uploads['peak_in_flight'] / 2**20:.1f} MiB granted at once, {uploads['expired']} taken "
                 f"back idle, {uploads.get('dropped', 0)} requests dropped (their update no longer wanted)")
    a = outcome.agents
    rounds_cpu = sum(r.agents_cpu or 0.0 for r in outcome.rounds)
    lines.append(
        f"load generator: {a['online']}/{a['agents']} agents online; {a['tasks']} tasks, {a['updates']} updates, "
        f"{a['resends']} resent after {o.ack_timeout_s:g} s without an ack or grant, {a.get('asks', 0)} asks to "
        f"upload, {a.get('grants', 0)} grants, {a.get('waits', 0)} told to wait, {a['acked']} acked, {a['refused']} "
        f"refused, {a['aggregated']} aggregated, {a['rejected']} rejected, {a['protocol_errors']} protocol errors, "
        f"{a['disconnects']} disconnects; CPU {a['cpu_seconds']:.1f} s in all ({rounds_cpu:.1f} s during the "
        f"rounds), peak RSS per worker {_mib(a['peak_rss_per_worker'])} MiB")
    if a["reasons"]:
        lines.append(f"  what the agents were told: {a['reasons']}")
    b = outcome.broker_usage
    if b.get("cpu_seconds") is not None:
        lines.append(f"broker: CPU {b['cpu_seconds']:.1f} s, peak RSS {_mib(b['peak_rss'])} MiB")
    latencies = [r for r in outcome.rounds if r.latency_median is not None]
    if latencies:
        lines.append("task -> ack at the agents (median / max s): " + ", ".join(
            f"round {r.round}: {r.latency_median:.1f} / {r.latency_max:.1f}" for r in latencies))
    if outcome.profile:
        lines.append("")
        lines.append(f"where the coordinator's threads spent the rounds (sampled every "
                     f"{outcome.profile['interval_s'] * 1000:g} ms; busy = not waiting; top frames by inclusive "
                     f"samples):")
        for name, thread in outcome.profile["threads"].items():
            if not thread["busy"]:
                continue
            samples = thread["samples"]
            lines.append(f"  {name}: busy in {thread['busy'] / samples:.0%} of {samples} samples")
            locks = thread.get("lock_waits") or []
            if locks:
                lines.append("    waiting for a lock in: " + ", ".join(f"{frame} {count / samples:.0%}"
                                                                      for frame, count in locks[:3]))
            inside = [(frame, count) for frame, count in thread["inclusive"]
                      if frame.startswith(_OWN_CODE) and frame.split(":")[1] not in _ENTRY_POINTS][:top]
            lines.append("    in:   " + ", ".join(f"{frame} {count / samples:.0%}" for frame, count in inside))
            lines.append("    self: " + ", ".join(f"{frame} {count / samples:.0%}"
                                                  for frame, count in thread["self"][:top]))
    lines.append(f"wall time {outcome.wall_seconds:.0f} s; run directory {outcome.run_dir}")
    lines.append(f"=== {outcome.notice} ===")
    return "\n".join(lines)
