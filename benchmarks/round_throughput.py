"""How fast one coordinator plans a round for many devices and aggregates their updates, and whether its memory
grows with the number of updates (issue 21: 100 updates of a 1M-parameter model planned and aggregated in under
2 s; coordinator RSS independent of the number of updates).

No broker and no training: a real :class:`coordinator.daemon.Coordinator` (FedAvg, screening on, the round
journaled to disk as in production) plans a round for ``--agents`` online devices, then takes one update per task
as its message handler would: the encoded message (the task's weights plus a small step, as a device's SGD
would move them) is decoded, examined against its task, measured for screening, journaled (fsync) and folded
into the round's aggregate. The round is then closed (screening's second rule) and its new state computed.
Encoding the updates is the devices' work and is not counted. The process's RSS is read after every tenth update.

Run: ``.venv/bin/python benchmarks/round_throughput.py [--agents 100] [--model resnet20:32,64,128]``.
"""

from __future__ import annotations

import argparse
import gc
import random
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import psutil

from coordinator.config import CoordinatorConfig, DataConfig, ModelConfig, RecipeConfig
from coordinator.daemon import Coordinator
from coordinator.intake import single_threaded_torch
from coordinator.registry import AgentRecord
from models import SubmodelSpec
from protocol import Capabilities, Update, decode, encode

MIB = 2**20
GOAL_SECONDS = 2.0


@dataclass
class Throughput:
    """What one run measured (seconds, bytes)."""

    agents: int
    parameters: int
    update_bytes: int
    planning: float
    receiving: float  # decode + examine + measure + journal + fold, all updates
    journaling: float  # of which the journal's writes (each update on disk, fsync, before its ack)
    closing: float  # screening's second rule + the new state
    rss: list[tuple[int, int]]  # (updates taken, RSS bytes)

    @property
    def total(self) -> float:
        return self.planning + self.receiving + self.closing


def coordinator_for(state_dir: Path, family: str, hidden: list[int], agents: int) -> Coordinator:
    config = CoordinatorConfig(
        algorithm="fedavg", model=ModelConfig(family=family, options={"hidden": hidden}),
        data=DataConfig(dataset="digits", bn_samples=50, eval_samples=50), recipe=RecipeConfig(batch_size=16),
        state_dir=str(state_dir), min_agents=agents, fraction=1.0)
    return Coordinator(config)


def online(agents: int) -> list[AgentRecord]:
    capabilities = Capabilities("generic", 2**40, 2**40, None, 100, list(range(10)), (1, 8, 8))
    return [AgentRecord(f"dev-{i:04d}", "online", capabilities, 0.0) for i in range(agents)]


def measure(agents: int, family: str, hidden: list[int]) -> Throughput:
    with tempfile.TemporaryDirectory(prefix="fedfit-round-") as state_dir:
        coordinator = coordinator_for(Path(state_dir), family, hidden, agents)
        fleet = online(agents)
        coordinator.registry.wait_settled = lambda *args, **kwargs: fleet  # type: ignore[method-assign]
        coordinator.registry.wait_for = lambda *args, **kwargs: fleet  # type: ignore[method-assign]
        started = time.perf_counter()
        current = coordinator.planner.next_round(1, stopped=lambda: False, on_count=lambda count: None)
        assert current is not None
        planning = time.perf_counter() - started
        rng = np.random.default_rng(0)
        payloads = []
        for task_id, dispatched in current.tasks.items():
            spec = dispatched.task.spec
            sent = coordinator.family.extract(coordinator.states["global"], spec,
                                              keys=coordinator.family.trainable_keys(spec))
            step = rng.uniform(0.5e-4, 1.5e-4)  # a norm of about 0.1: inside what 7 clipped steps can move
            weights = {key: (value.numpy() + rng.normal(0, step, value.shape).astype(np.float32))
                       for key, value in sent.items()}
            payloads.append(bytes(encode(Update(task_id, 1, dispatched.task.agent_id, "ok", None, 100,
                                                list(range(10)), weights, {"loss": 1.0}))))
        del weights
        gc.collect()
        process = psutil.Process()
        rss = [(0, process.memory_info().rss)]
        receiving = journaling = 0.0

        journal_store = coordinator.intake.store

        def store(update: Update, payload: bytes | bytearray | memoryview) -> None:  # the intake's, timed
            nonlocal journaling
            began = time.perf_counter()
            journal_store(update, payload)
            journaling += time.perf_counter() - began

        coordinator.intake.store = store  # type: ignore[method-assign,assignment]

        def take() -> None:  # on a thread of its own, as the daemon's message thread
            nonlocal receiving
            single_threaded_torch()
            for index, payload in enumerate(payloads, start=1):
                began = time.perf_counter()
                update = decode(payload, expected=Update)
                assert isinstance(update, Update)
                receipt = current.receive(update, payload, str(index))
                del update
                receiving += time.perf_counter() - began
                assert receipt.refusal is None, receipt.refusal
                if index % 10 == 0:
                    rss.append((index, process.memory_info().rss))

        taker = threading.Thread(target=take)
        taker.start()
        taker.join()
        began = time.perf_counter()
        current.close()
        states = current.finish()
        closing = time.perf_counter() - began
        rejected = [a.rejection for a in current.answers.values() if a.rejection]
        assert not rejected, rejected[:2]
        assert sum(1 for _ in current.aggregated()) == agents and states["global"]
        return Throughput(agents, coordinator.family.param_count(SubmodelSpec.full()), len(payloads[0]), planning,
                          receiving, journaling, closing, rss)


def report(result: Throughput) -> str:
    lines = [
        (f"round throughput: {result.agents} updates of a {result.parameters / 1e6:.2f}M-parameter model "
         f"({result.update_bytes / MIB:.1f} MiB each), FedAvg, screening on, journaled"),
        (f"  planning {result.planning:.3f} s; taking the updates (decode, validate, measure, journal, fold) "
         f"{result.receiving:.3f} s ({result.receiving / result.agents * 1e3:.1f} ms each, of which the journal's "
         f"durable writes {result.journaling:.3f} s); closing (screening, new state) {result.closing:.3f} s"),
        (f"  planned and aggregated in {result.total:.3f} s (goal < {GOAL_SECONDS:g} s: "
         f"{'met' if result.total < GOAL_SECONDS else 'NOT met'}); without the journal's writes "
         f"{result.total - result.journaling:.3f} s"),
        "  coordinator RSS (MiB) after n updates: "
        + ", ".join(f"{taken}: {size / MIB:.0f}" for taken, size in result.rss),
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, default=100)
    parser.add_argument("--model", default="resnet20:32,64,128", help="FAMILY:HIDDEN,... (default: 1.08M parameters)")
    args = parser.parse_args()
    if args.agents < 1:
        parser.error("--agents must be at least 1")
    family, _, hidden = args.model.partition(":")
    try:
        widths = [int(n) for n in hidden.split(",")] if hidden else []
    except ValueError:
        parser.error(f"--model {args.model!r}: HIDDEN must be whole numbers separated by commas, e.g. resnet20:32,64")
    random.seed(0)
    try:
        print(report(measure(args.agents, family, widths)))
    except ValueError as exc:  # the coordinator's own sentence for a model or option it cannot build
        parser.error(f"--model {args.model!r}: {exc}")


if __name__ == "__main__":
    main()
