"""Screening on honest fleets: how many honest updates it rejects, and how close the others come to its limits.

Run as ``.venv/bin/python benchmarks/screening.py`` (a benchmark, not a test: it prints, it never fails on a number).
For every algorithm, budget scenario and number of local epochs it runs a whole federation through the real path
(``fedfit.sim``: a secured mosquitto, the coordinator, the agents and their training children) with screening on,
and prints, per run: the updates screened, those rejected (every one a false positive: the fleet is honest), and
the two margins of the rules (``coordinator.screening``):

- ``reach``: the largest ``|change| / bound`` of an update (rule 1 rejects above 1; by construction no honest run
  exceeds 1);
- ``peers``: the largest ratio rule 2 saw: of an update's change and of its change per step over the medians of
  the other updates of the same trained spec in its round, the smaller (rule 2 rejects when both exceed
  ``screening.max_ratio``, 10 by default), where it had enough peers.

The last line is the false-positive rate over every run. The forged update of the fault benchmark (the sent weights
times -50) is rejected by rule 1; ``tests/integration/test_forged_update.py`` checks it end to end.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

ALGORITHMS = ("heterofl", "scalefl", "fedepth", "fedavg", "decoupled")
SCENARIOS = ("tiers", "fair", "lack", "surplus")


def margins(report: dict[str, Any], min_peers: int) -> tuple[int, float, float]:
    """(updates screened, largest |change| / bound, largest change per step over its same-spec peers' median)."""
    screened = [task for task in report["tasks"] if task["screening"]]
    reach = max((task["screening"]["norm"] / task["screening"]["bound"] for task in screened
                 if task["screening"].get("bound")), default=0.0)
    groups: dict[tuple[int, str], list[tuple[float, float]]] = defaultdict(list)
    for task in screened:
        figures = task["screening"]
        groups[(task["round"], task["spec_trained"] or "")].append((figures["per_step"], figures["norm"]))
    peers = 0.0
    for updates in groups.values():
        for index, (per_step, norm) in enumerate(updates):
            others = updates[:index] + updates[index + 1:]
            if len(others) < min_peers:
                continue
            step_median = statistics.median(other[0] for other in others)
            norm_median = statistics.median(other[1] for other in others)
            if step_median > 0 and norm_median > 0:
                peers = max(peers, min(per_step / step_median, norm / norm_median))
    return len(screened), reach, peers


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--algorithms", default=",".join(ALGORITHMS))
    parser.add_argument("--budgets", default=",".join(SCENARIOS), help="budget scenarios, comma-separated")
    parser.add_argument("--epochs", default="1,15", help="local epochs, comma-separated")
    parser.add_argument("--agents", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dataset", default="digits")
    parser.add_argument("--partition", default="dirichlet:0.3")
    parser.add_argument("--model", default="cnn")
    parser.add_argument("--hidden", default="32,64,128", help="the CNN's channels (default 32,64,128)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    from common.logs import configure_logging
    from coordinator.config import CoordinatorConfig, DataConfig, DeploymentConfig, ModelConfig, RecipeConfig
    from fedfit.sim.harness import SimOptions, run_simulation

    configure_logging("error")
    options = {"hidden": [int(c) for c in args.hidden.split(",")]} if args.model == "cnn" else {}
    header = (f"{'algorithm':10s} {'budgets':8s} {'epochs':>6s} {'screened':>8s} {'rejected':>8s} {'reach':>6s} "
              f"{'peers':>6s} {'seconds':>7s}")
    print(header)
    print("-" * len(header))
    total = rejected_total = 0
    with tempfile.TemporaryDirectory(prefix="fedfit-screening-") as root:
        for epochs in (int(e) for e in args.epochs.split(",")):
            for algorithm in args.algorithms.split(","):
                # FedAvg ignores memory (at 1/6 width every device trains it): one scenario is all of them.
                scenarios = args.budgets.split(",")[:1] if algorithm == "fedavg" else args.budgets.split(",")
                for budgets in scenarios:
                    base = CoordinatorConfig(model=ModelConfig(args.model, options),
                                             data=DataConfig(bn_samples=500), recipe=RecipeConfig(epochs=epochs),
                                             round_timeout_s=3600.0, deployment=DeploymentConfig(deliver=False))
                    if algorithm == "fedavg":
                        base = replace(base, fedavg=replace(base.fedavg, width=1 / 6))
                    started = time.monotonic()
                    run = SimOptions(algorithm=algorithm, agents=args.agents, rounds=args.rounds,
                                     dataset=args.dataset, partition=args.partition, model=args.model,
                                     seed=args.seed, budgets=budgets, base=base,
                                     state_dir=str(Path(root) / f"{algorithm}-{budgets}-{epochs}"))
                    report = run_simulation(run, progress=None).report
                    screened, reach, peers = margins(report, base.screening.min_peers)
                    rejected = sum(1 for task in report["tasks"] if task["status"] == "rejected")
                    total += screened
                    rejected_total += rejected
                    print(f"{algorithm:10s} {budgets:8s} {epochs:6d} {screened:8d} {rejected:8d} {reach:6.3f} "
                          f"{peers:6.2f} {time.monotonic() - started:7.0f}", flush=True)
    rate = rejected_total / total if total else 0.0
    print(f"false positives: {rejected_total} of {total} honest updates ({rate:.1%})")


if __name__ == "__main__":
    main()
