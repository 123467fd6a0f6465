"""Broker-based local testing: a real broker, the coordinator and a fleet of agents on one machine.

Every agent is its own MQTT client with its own data shard and memory budget; they share one process and a
small training pool. Nothing is short-circuited: tasks and updates cross the broker as on real devices.
"""

from __future__ import annotations

import os
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, Any

import torch

from common.data import load_dataset, parse_partition, partition_indices
from coordinator.config import CoordinatorConfig
from coordinator.daemon import Coordinator
from coordinator.metrics import RoundResult
from edge_agent.config import AgentConfig, AgentDataConfig
from edge_agent.daemon import EdgeAgent
from edge_agent.data_source import to_local_data
from fedfit.sim.broker import Broker, external_broker, start_broker
from fedfit.sim.budgets import DeviceBudget, device_budgets
from fedfit.sim.report import build_report
from models import estimate_plan_memory


@dataclass
class SimOptions:
    """What to simulate; the defaults of everything not given come from ``base`` (a coordinator config)."""

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
    workers: int = 1
    budgets: str = "tiers"
    budget_variance: float = 10.0
    allocator: str = "compact"
    base: CoordinatorConfig = field(default_factory=CoordinatorConfig)
    state_dir: str | None = None


@dataclass
class SimOutcome:
    """Results of a simulation and the report built from them."""

    rounds: list[RoundResult]
    report: dict[str, Any]
    rejected_messages: int


def agent_id(index: int) -> str:
    """Simulated agents are named sim-000, sim-001, ..."""
    return f"sim-{index:03d}"


def full_model_training_memory(coordinator: Coordinator, allocator: str = "compact") -> tuple[int, int]:
    """(fixed runtime overhead, model-dependent part) of the training memory of the most demanding task the
    coordinator's strategy hands out (the full model; ScaleFL's with every exit), for agents running
    ``allocator``: the budgets' 0% and 100% points."""
    spec, plan = coordinator.strategy.largest_task()
    estimate = estimate_plan_memory(coordinator.family, spec, plan, input_size=coordinator.dataset.image_size,
                                    allocator=allocator)
    return estimate.overhead, estimate.total - estimate.overhead


def coordinator_config(options: SimOptions, broker: Broker) -> CoordinatorConfig:
    """The coordinator configuration for this simulation."""
    base = options.base
    partition = parse_partition(options.partition)
    recipe = replace(base.recipe, masked_ce=base.recipe.masked_ce or partition.kind != "iid")
    return replace(
        base,
        federation=options.federation,
        broker=(broker.coordinator_config() if broker.secured
                else replace(base.broker, host=broker.host, port=broker.port)),
        algorithm=options.algorithm,  # type: ignore[arg-type]
        model=replace(base.model, family=options.model),  # type: ignore[arg-type]
        data=replace(base.data, dataset=options.dataset),
        recipe=recipe,
        rounds=options.rounds,
        min_agents=options.agents,
        seed=options.seed,
        state_dir=options.state_dir or os.path.join("runs", f"sim-{options.federation}"),
    )


def print_progress(stream: IO[str], total: int) -> Any:
    """A callback printing one line per finished round."""

    def on_round(result: RoundResult) -> None:
        levels = " ".join(f"{name}={acc:.3f}" for name, acc in sorted(result.level_accuracy.items()))
        exits = " ".join(f"{name}={acc:.3f}" for name, acc in result.exit_accuracy.items())
        stream.write(f"round {result.round}/{total}: global {result.global_accuracy:.4f} [{levels}] "
                     + (f"exits [{exits}] " if exits else "") +
                     f"agents {result.participants}/{result.selected} {result.seconds:.1f}s\n")
        stream.flush()

    return on_round


def run_simulation(options: SimOptions, progress: IO[str] | None = sys.stderr) -> SimOutcome:
    """Start broker, coordinator and fleet; run the rounds; stop everything; return the results."""
    if options.agents < 1 or options.rounds < 1 or options.workers < 1:
        raise ValueError("--agents, --rounds and --workers must be at least 1")
    dataset = load_dataset(options.dataset, options.base.data.root)
    shards = partition_indices(dataset.y_train, options.agents, parse_partition(options.partition), options.seed)
    threads = max(1, (os.cpu_count() or 1) // options.workers)
    torch.set_num_threads(threads)
    broker = (external_broker(options.broker) if options.broker
              else start_broker(federation=options.federation if options.secure_broker else None))
    agents: list[EdgeAgent] = []
    pool = ThreadPoolExecutor(max_workers=options.workers, thread_name_prefix="sim-train")
    coordinator: Coordinator | None = None
    try:
        config = coordinator_config(options, broker)
        coordinator = Coordinator(config, dataset=dataset,
                                  on_round=print_progress(progress, options.rounds) if progress else None)
        # FedAvg ignores memory: its devices train its one model (the full one, or fedavg.width) whatever they have.
        schedules: list[DeviceBudget | None] = [None] * options.agents
        if options.algorithm != "fedavg":
            fixed, variable = full_model_training_memory(coordinator, options.allocator)
            schedules = list(device_budgets(options.budgets, options.agents, variable, options.seed,
                                            options.budget_variance, fixed_bytes=fixed))
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
                            torch_threads=threads, state_dir=str(Path(config.state_dir) / "agents"),
                            allocator=options.allocator),  # type: ignore[arg-type]
                to_local_data(dataset.x_train[indices], dataset.y_train[indices]),
                executor=pool, budget_schedule=schedule,
            ))
        with ThreadPoolExecutor(max_workers=8, thread_name_prefix="sim-connect") as connector:
            for started in [connector.submit(agent.start) for agent in agents]:
                started.result()  # re-raises a connection failure
        rounds = coordinator.run()
        rejected = coordinator.rejected_messages + sum(agent.rejected_messages for agent in agents)
        settings = {"agents": options.agents, "rounds": options.rounds, "dataset": dataset.name,
                    "partition": options.partition, "model": options.model, "seed": options.seed,
                    "federation": options.federation, "level_assignment": config.level_assignment,
                    "levels": [entry["name"] for entry in coordinator.strategy.describe()],
                    "budgets": options.budgets,
                    "budget_variance": options.budget_variance if options.budgets == "tiers-fluctuating" else 0.0,
                    "device_tiers": [s.tier.name if s else None for s in schedules],
                    "allocator": options.allocator}
        report = build_report(options.algorithm, broker.kind, broker.version, rounds, settings,
                              secured=broker.secured)
        return SimOutcome(rounds, report, rejected)
    finally:
        for agent in agents:
            agent.stop()
        if coordinator is not None:
            coordinator.stop()
        pool.shutdown(wait=False, cancel_futures=True)
        broker.stop()

