"""Broker-based local testing: a real broker, the coordinator and a fleet of agents on one machine.

Every agent is its own MQTT client with its own data shard and memory budget; they share one process and a
small training pool. Nothing is short-circuited: tasks and updates cross the broker as on real devices.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch

from common.blas_threads import guard_blas_threads
from common.config import to_mapping
from common.cores import available_cores
from common.data import Dataset, load_dataset, parse_partition, partition_indices
from coordinator.config import CoordinatorConfig
from coordinator.daemon import Coordinator
from coordinator.metrics import MetricsWriter, RoundResult, read_metrics
from coordinator.serving import TierService
from edge_agent import forkserver
from edge_agent.config import AgentConfig, AgentDataConfig
from edge_agent.daemon import EdgeAgent
from edge_agent.data_source import to_local_data
from edge_agent.memory import available_memory, gpu_free_memory
from edge_agent.runner import CUDA_CONTEXT_BYTES
from fedfit.sim.broker import Broker, external_broker, start_broker
from fedfit.sim.budgets import BudgetAnchor, DeviceBudget, device_budgets
from fedfit.sim.progress import ProgressPrinter
from fedfit.sim.report import build_report
from fedfit.sim.rundir import claim_run_dir, new_run_dir, write_run_outputs
from fedfit.sim.speeds import device_speeds, parse_speeds, speeds_line, speeds_text
from fedfit.sim.status_file import RunMark, running_elsewhere, write_ended, write_running
from fedfit.version import version_string


@dataclass
class SimOptions:
    """What to simulate; the defaults of everything not given come from ``base`` (a coordinator config).

    ``state_dir`` is the run's directory (it must not hold a run already, unless ``resume``; default: a new
    ``<runs_root>/<time>-<algorithm>/``); ``overrides`` and ``command`` are recorded in the report. ``resume``:
    go on with the run ``state_dir`` holds, stopped before its last round (its checkpoint, its metrics, its agents'
    calibrations), or start it there when it stopped before its first round was done.
    """

    algorithm: str = "heterofl"
    agents: int = 8
    rounds: int = 5
    dataset: str = "fashion-mnist"
    partition: str = "iid"
    model: str = "cnn"
    seed: int = 0
    federation: str = "sim"
    broker: str | None = None
    secure_broker: bool = True  # the broker started here: TLS, a login per client and the ACL; False: anonymous
    workers: int | None = None  # training children at once; None: the cores this process may use
    budgets: str = "tiers"
    budget_variance: float = 10.0
    size_for: str = "dip"  # what fluctuating budgets are sized for: "dip" (all but the rarest rounds) or "typical"
    allocator: str = "pooled"
    device: str = "cpu"  # where the agents' training children train: "cpu" or "cuda" (budgets in GPU memory)
    train_samples: int | None = None  # a seeded random subset of the training set this many samples (None: all)
    speeds: str | None = None  # --speeds F,G,...: slowdown factors of tiers of devices (fedfit.sim.speeds); None: 1
    base: CoordinatorConfig = field(default_factory=CoordinatorConfig)
    state_dir: str | None = None
    runs_root: str = "runs"
    overrides: list[str] = field(default_factory=list)
    command: list[str] = field(default_factory=list)
    resume: bool = False


@dataclass
class SimOutcome:
    """Results of a simulation, the report built from them and the run's directory."""

    rounds: list[RoundResult]
    report: dict[str, Any]
    rejected_messages: int
    run_dir: Path


def agent_id(index: int) -> str:
    """Simulated agents are named sim-000, sim-001, ..."""
    return f"sim-{index:03d}"


def cuda_workers(cores: int, task_bytes: int, context_bytes: int = CUDA_CONTEXT_BYTES) -> int:
    """How many CUDA training processes run at once by default: one per core, as many as the GPU's free memory
    (NVML; without it, a Jetson's, the system's available RAM, which CPU and GPU share) has room for, each its
    CUDA start (``context_bytes``: context and cuBLAS's workspace, 832-869 MiB measured on an H100 with CUDA 13,
    once per process) and the largest task the method hands out (``task_bytes``, its device need)."""
    free = gpu_free_memory()
    if free is None:
        free = available_memory()
    return max(1, min(cores, free // (context_bytes + max(0, task_bytes))))


def workers_line(device: str, cores: int, workers: int, threads: int) -> str:
    """Where the fleet trains and how many training processes run at once, with how many threads each."""
    where = "the GPU (CUDA)" if device == "cuda" else f"{cores} core{'s' * (cores > 1)}"
    return (f"training on {where}: {workers} training process{'es' * (workers > 1)} at once, {threads} torch "
            f"thread{'s' * (threads > 1)} each")


def check_device(device: str) -> None:
    """Refuse, in one sentence, a device the agents cannot train on here (``cuda`` is asked in a forkserver child,
    which starts CUDA and allocates); declares it to this process's forkserver before that starts."""
    if device not in ("cpu", "cuda"):
        raise ValueError(f"--device is cpu or cuda, got {device!r}")
    forkserver.declare_device(device)  # before its forkserver starts: "cuda" keeps CUDA usable in children
    if device == "cuda" and not forkserver.cuda_available():
        raise ValueError("--device cuda: torch cannot train on a GPU here (it sees none, or CUDA could not start "
                         "and allocate)")


def tier_services(brief: Any, schedules: Sequence[DeviceBudget | None],
                  size_for: str = "dip") -> list[TierService]:
    """What the method (``brief``: its `coordinator.brief.MethodBrief`) hands each tier of the fleet (its devices
    counted, the budget it is sized for: in all but their rarest rounds, or ``size_for`` ``typical`` their median
    one), by the devices' own rule: the start-of-run statement (none for a fleet without budgets)."""
    counts: dict[str, int] = {}
    budgets: dict[str, int] = {}
    for schedule in schedules:
        if schedule is not None:
            counts[schedule.tier.name] = counts.get(schedule.tier.name, 0) + 1
            budgets[schedule.tier.name] = schedule.sized_for(size_for)
    ordered = sorted(counts, key=lambda name: budgets[name])
    return list(brief.serve([(name, budgets[name], counts[name]) for name in ordered]))


def budget_anchor(coordinator: Coordinator, allocator: str = "pooled", device: str = "cpu") -> BudgetAnchor:
    """What the fleet's budgets are measured against (the same for every algorithm): the full model of the
    coordinator's family trained with plain cross-entropy at its recipe's batch size, by agents running
    ``allocator`` on ``device``."""
    plain = coordinator.brief.plain_training()
    return BudgetAnchor.estimate(plain.family, plain.plan, input_size=plain.input_size, allocator=allocator,
                                 device=device)


def prepare_run_dir(options: SimOptions) -> Path:
    """The run's directory: ``options.state_dir`` (refused when it holds a run, unless the run is resumed) or a new
    one under ``options.runs_root``."""
    if options.state_dir and options.resume and Path(options.state_dir).is_dir():
        return Path(options.state_dir)
    if options.state_dir:
        return claim_run_dir(options.state_dir)
    return new_run_dir(options.runs_root, options.algorithm)


def coordinator_config(options: SimOptions, broker: Broker, run_dir: Path) -> CoordinatorConfig:
    """The coordinator configuration for this simulation."""
    base = options.base
    return replace(
        base,
        federation=options.federation,
        broker=(broker.coordinator_config() if broker.secured
                else replace(base.broker, host=broker.host, port=broker.port)),
        algorithm=options.algorithm,  # type: ignore[arg-type]
        model=replace(base.model, family=options.model),  # type: ignore[arg-type]
        data=replace(base.data, dataset=options.dataset),
        rounds=options.rounds,
        min_agents=options.agents,
        seed=options.seed,
        training_device=options.device,  # type: ignore[arg-type]
        state_dir=str(run_dir),
        resume=options.resume,
    )


def _public(config: CoordinatorConfig) -> dict[str, Any]:
    """The resolved configuration as the report keeps it (the broker's address and security, no secrets)."""
    data = asdict(config)
    broker = data.pop("broker")
    data["broker"] = {"host": broker["host"], "port": broker["port"], "tls": broker["tls"],
                      "login": broker["username"] is not None}
    return data


def _utc(moment: float) -> str:
    return datetime.fromtimestamp(moment, timezone.utc).isoformat(timespec="seconds")


FleetData = tuple[Dataset, list[np.ndarray]]
"""A dataset and its partition among the agents: each agent's training indices."""


def fleet_data(dataset: str, root: str | Path | None, agents: int, partition: str, seed: int, *,
               train_samples: int | None = None) -> FleetData:
    """Load ``dataset`` and partition its training set among ``agents`` (ValueError for a bad partition), or only
    a seeded random ``train_samples`` of it (None, or at least the whole set: all of it), partitioned as the whole
    would be."""
    loaded = load_dataset(dataset, root)
    if train_samples is not None and train_samples < 1:
        raise ValueError(f"--train-samples must be at least 1, got {train_samples}")
    kept = np.arange(len(loaded.y_train))
    if train_samples is not None and train_samples < len(kept):
        kept = np.sort(np.random.default_rng(seed).choice(len(kept), size=train_samples, replace=False))
    shards = partition_indices(loaded.y_train[kept], agents, parse_partition(partition), seed)
    return loaded, [kept[shard] for shard in shards]


#: The run's broker's own directory in the run's directory (0700: its configuration and log and, secured, the CA
#: key and every login's password); removed when the run ends, left behind (in the run, not in /tmp) by a run that
#: was killed.
BROKER_DIR = "broker"


def start_run_broker(options: SimOptions, run_dir: Path) -> Broker:
    """The run's broker: the one ``options.broker`` names, or one started with its files in ``run_dir``'s
    :data:`BROKER_DIR` (what a killed run left there is removed first: its broker went with it)."""
    if options.broker:
        return external_broker(options.broker)
    other = running_elsewhere(run_dir)
    if other is not None:
        raise ValueError(f"{run_dir} is in use: process {other.pid} runs it (since {other.started_at}); wait for it "
                         f"to end, or give this run another directory")
    shutil.rmtree(run_dir / BROKER_DIR, ignore_errors=True)
    return start_broker(federation=options.federation if options.secure_broker else None,
                        workdir=run_dir / BROKER_DIR)


#: Seconds the end of a run waits at most for the acks in flight to reach the agents before it reports what is left.
SETTLE_S = 5.0


def left_behind(coordinator: Coordinator, agents: Sequence[EdgeAgent],
                settle_s: float = SETTLE_S) -> list[dict[str, str]]:
    """What the run ends without settling, by agent and task: what the coordinator carried or held for a round that
    never came, the tasks an agent still trains (or holds back), and the updates still in an agent's outbox once
    the acks already sent had ``settle_s`` seconds to arrive. Empty when every update an agent sent was aggregated
    or refused with a reason."""
    deadline = time.monotonic() + settle_s
    while (any(where == "outbox" for agent in agents for _, where in agent.unsettled())
           and time.monotonic() < deadline):
        time.sleep(0.05)
    left = [{"agent": agent, "task": task, "where": where} for agent, task, where in coordinator.left_behind()]
    known = {entry["task"] for entry in left}
    return left + [{"agent": agent.agent_id, "task": task, "where": where} for agent in agents
                   for task, where in agent.unsettled() if task not in known]


def _earlier_rounds(run_dir: Path, completed: int) -> tuple[list[RoundResult], int | None]:
    """The results of the ``completed`` rounds a resumed run did before it stopped, from its ``metrics.jsonl``,
    which is written again with exactly those (a line cut short by the stop, or a round after the checkpoint's,
    would spoil the lines appended next); and the last round when it was checkpointed but stopped before its line
    was written (its figures are lost; ValueError when more than that is missing)."""
    path = run_dir / "metrics.jsonl"
    earlier = [result for result in read_metrics(path) if result.round <= completed]
    numbers = [result.round for result in earlier]
    unrecorded = completed if numbers == list(range(1, completed)) and completed else None
    if numbers != list(range(1, completed + 1)) and unrecorded is None:
        raise ValueError(f"{run_dir} holds a checkpoint after round {completed} but metrics.jsonl has rounds "
                         f"{numbers}: it cannot be resumed into a whole report (start it again in a new directory)")
    if path.exists():
        kept = path.with_name(f".{path.name}.tmp")
        kept.unlink(missing_ok=True)
        writer = MetricsWriter(kept)
        for result in earlier:
            writer.write(result)
        kept.touch()
        os.replace(kept, path)
    return earlier, unrecorded


#: ``run_simulation``'s default live display: the standard error stream of the moment it runs (not of the moment this
#: module was imported: a test's captured stream is closed by then).
STDERR = "stderr"


def run_simulation(options: SimOptions, progress: IO[str] | str | None = STDERR, *, label: str = "",
                   run_dir: Path | None = None, data: FleetData | None = None) -> SimOutcome:
    """Start broker, coordinator and fleet; run the rounds; stop everything; write the run's directory (report,
    CSV, summary, plots) and return the results. ``progress``: where the live display goes (None: nowhere);
    ``label`` prefixes its lines; ``run_dir``: one :func:`prepare_run_dir` made already; ``data``: the dataset
    and its partition among the agents when the caller has them already (:func:`fleet_data` of these options)."""
    if options.agents < 1 or options.rounds < 1 or (options.workers is not None and options.workers < 1):
        raise ValueError("--agents, --rounds and --workers must be at least 1")
    if isinstance(progress, str):
        progress = sys.stderr
    check_device(options.device)
    factors = parse_speeds(options.speeds) if options.speeds else None
    speeds = (device_speeds(factors, options.agents, options.budgets, options.seed) if factors
              else [1.0] * options.agents)
    started = time.time()
    dataset, shards = data or fleet_data(options.dataset, options.base.data.root, options.agents,
                                         options.partition, options.seed, train_samples=options.train_samples)
    run_dir = run_dir or prepare_run_dir(options)
    cores = available_cores()
    torch.set_num_threads(cores)  # this process's: the coordinator evaluates and aggregates while the fleet waits
    guard_blas_threads()
    broker = start_run_broker(options, run_dir)
    mark = RunMark.this_process(run_dir, started)
    agents: list[EdgeAgent] = []
    pool: ThreadPoolExecutor | None = None
    coordinator: Coordinator | None = None
    printer = ProgressPrinter(progress, options.rounds, label) if progress is not None else None
    try:
        config = coordinator_config(options, broker, run_dir)
        watch = write_running(run_dir, config.federation, to_mapping(config.broker), mark)
        if progress is not None:
            print(f"{label + ': ' if label else ''}watch the fleet: fedfit status --config {watch} --watch",
                  file=progress, flush=True)
        # A round resumed from the journal is trained again from scratch by this process's agents: it gets a whole
        # round's deadline, however long the run was stopped.
        coordinator = Coordinator(config, dataset=dataset, on_round=printer.on_round if printer else None,
                                  on_progress=printer, resume_grace_s=config.round_timeout_s)
        resumed_after = coordinator.completed_rounds
        earlier, unrecorded = _earlier_rounds(run_dir, resumed_after)
        if resumed_after and progress is not None:
            print(f"{label + ': ' if label else ''}resumed after round {resumed_after} of "
                  f"{options.rounds}" + (f" (round {unrecorded} was checkpointed but not recorded: the report "
                                         f"lacks its figures)" if unrecorded else ""), file=progress, flush=True)
        # FedAvg ignores memory: its devices train its one model (the full one, or fedavg.width) whatever they have.
        schedules: list[DeviceBudget | None] = [None] * options.agents
        if options.algorithm != "fedavg":
            schedules = list(device_budgets(options.budgets, options.agents,
                                            budget_anchor(coordinator, options.allocator, options.device),
                                            options.seed,
                                            options.budget_variance))
        # Sized to the budgets this fleet's devices get (ScaleFL's ratios: auto, ...); a resumed run's checkpoint
        # holds what the sizing chose, and the coordinator then sizes nothing, as for a method that sizes nothing.
        if any(schedules):
            # the budgets they have in all but their rarest rounds (as fedfit plan --budgets and the statement use),
            # or in their median round (--size-for typical)
            coordinator.fit_to_fleet([schedule.sized_for(options.size_for) for schedule in schedules
                                      if schedule is not None])
        services = tier_services(coordinator.brief, schedules, options.size_for)
        if progress is not None:
            for line in coordinator.brief.statement(services):
                print(f"{label + ': ' if label else ''}{line}", file=progress, flush=True)
        if factors and progress is not None:
            print(f"{label + ': ' if label else ''}{speeds_line(speeds, options.budgets, options.seed)}",
                  file=progress, flush=True)
        workers = options.workers or (cores if options.device == "cpu" else
                                      cuda_workers(cores, coordinator.brief.largest_task_bytes()))
        threads = max(1, cores // workers)  # each training child's
        if progress is not None:
            print(f"{label + ': ' if label else ''}{workers_line(options.device, cores, workers, threads)}",
                  file=progress, flush=True)
        pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sim-train")
        coordinator.start()
        broker.add_logins([agent_id(index) for index in range(options.agents)])
        for index, indices in enumerate(shards):
            data_config = AgentDataConfig(dataset=options.dataset, partition=options.partition,
                                          num_shards=options.agents, shard=index, seed=options.seed)
            schedule = schedules[index]
            agents.append(EdgeAgent(
                AgentConfig(agent_id=agent_id(index), federation=options.federation,
                            broker=broker.client_config(agent_id(index)),
                            device_kind=schedule.tier.name if schedule else "simulated",
                            budget_bytes=schedule(0) if schedule else None, data=data_config,
                            torch_threads=threads, state_dir=str(run_dir / "agents"),
                            allocator=options.allocator, device=options.device,  # type: ignore[arg-type]
                            slowdown=speeds[index]),
                to_local_data(dataset.x_train[indices], dataset.y_train[indices]),
                executor=pool, budget_schedule=schedule,
            ))
        with ThreadPoolExecutor(max_workers=8, thread_name_prefix="sim-connect") as connector:
            for started_agent in [connector.submit(agent.start) for agent in agents]:
                started_agent.result()  # re-raises a connection failure
        rounds = earlier + coordinator.run()
        ended = time.time()
        left = left_behind(coordinator, agents)
        rejected = coordinator.rejected_messages + sum(agent.rejected_messages for agent in agents)
        settings = {"agents": options.agents, "rounds": options.rounds, "dataset": dataset.name,
                    "partition": options.partition, "model": options.model, "seed": options.seed,
                    # None: the whole training set (as reports that predate the setting ran)
                    "train_samples": (options.train_samples if options.train_samples is not None
                                      and options.train_samples < len(dataset.y_train) else None),
                    "federation": options.federation, "level_assignment": config.level_assignment,
                    **coordinator.brief.report_settings(),  # the levels, and masked_ce
                    "budgets": options.budgets,
                    "budget_variance": options.budget_variance if options.budgets == "tiers-fluctuating" else 0.0,
                    # what fluctuating budgets were sized for (dip where nothing fluctuates: nothing to size for)
                    "size_for": options.size_for if options.budgets == "tiers-fluctuating" else "dip",
                    "device_tiers": [s.tier.name if s else None for s in schedules],
                    # --speeds as given (None: every device at this machine's speed) and each device's factor
                    "speeds": speeds_text(factors) if factors else None,
                    "device_speeds": speeds,
                    # the heap the agents' children ran ("pooled" falls back to "compact" without the page pool)
                    "allocator": agents[0].runner.allocator if agents else options.allocator,
                    "device": options.device,
                    "serving": [service.as_dict() for service in services]}
        # A resumed run's time: this process's, and the rounds the earlier one finished (its set-up is not known).
        wall = ended - started + sum(result.seconds for result in earlier)
        run = {"version": version_string(), "started_at": _utc(started), "ended_at": _utc(ended),
               "wall_seconds": round(wall, 3), "directory": str(run_dir), "config": _public(config),
               "overrides": list(options.overrides), "command": list(options.command),
               "cores": cores, "workers": workers, "torch_threads": threads,
               "left": left,
               # the model each agent holds to run at the end (name@sha256), or why none (deployment.deliver)
               "models": dict(coordinator.courier.outcome),
               **({"label": label} if label else {}),
               **({"resumed_after_round": resumed_after} if resumed_after else {}),
               **({"rounds_not_recorded": [unrecorded]} if unrecorded else {})}
        tiers = {agent_id(index): (s.tier.name if s else None) for index, s in enumerate(schedules)}
        report = build_report(options.algorithm, broker.kind, broker.version, rounds, settings,
                              secured=broker.secured, run=run, tiers=tiers)
        write_run_outputs(report, run_dir)
        return SimOutcome(rounds, report, rejected, run_dir)
    finally:
        for agent in agents:
            agent.stop()
        if coordinator is not None:
            coordinator.stop()
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
        try:  # before the broker goes: fedfit status --watch then says the run ended, not the broker unreachable
            write_ended(run_dir, options.federation, mark, time.time())
        finally:
            broker.stop()
