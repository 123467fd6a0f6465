"""One coordinator driven by a large fleet of SYNTHETIC agents (no training: accuracy is meaningless) over MQTT.

``loadrig.load`` starts an anonymous mosquitto on loopback (or uses ``--brokers``), the coordinator daemon in a
process of its own and ``--workers`` processes of synthetic agents, each agent its own MQTT client and agent id
answering every task at once with the weights it was sent plus a little noise (accepted by validation and
screening, aggregated for real). It prints per round: time, updates, traffic, when the tasks were all dispatched
and the updates all in, what the agents saw, the CPU seconds of coordinator, agents and broker within the round,
the coordinator's RSS (peak and at the round's end) and its own breakdown of the round; then the coordinator's
idle and peak RSS and, with ``--profile``, where each of its threads spent the rounds.

Issue 21's load run: ``.venv/bin/python benchmarks/fleet_load.py`` (1000 agents, 3 rounds, HeteroFL's CNN with
hidden 64,128,256,256: 963,722 parameters, on Fashion-MNIST). Figures depend on what else the machine runs: the
CPU columns say how much of it each party took.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import _shared  # noqa: F401 - the repository's root on sys.path, for loadrig

from fedfit.sim.broker import BrokerStartError
from loadrig.load import DEFAULT_MODEL_OPTIONS, LoadError, LoadOptions, format_outcome, run_load


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agents", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2, help="processes driving the synthetic agents")
    parser.add_argument("--brokers", default="", metavar="HOST:PORT,...",
                        help="brokers letting anonymous clients in (agent i uses broker i mod n); default: an "
                             "anonymous mosquitto started on loopback")
    parser.add_argument("--coordinator-broker", default=None, metavar="HOST:PORT",
                        help="where the coordinator connects (default: the first broker)")
    parser.add_argument("--protocol", choices=("3.1.1", "5"), default="3.1.1", help="the agents' MQTT version")
    parser.add_argument("--algorithm", default="fedavg")
    parser.add_argument("--hidden", default=",".join(str(h) for h in DEFAULT_MODEL_OPTIONS["hidden"]),
                        help="channels of the CNN's conv blocks")
    parser.add_argument("--dataset", default="fashion-mnist")
    parser.add_argument("--eval-samples", type=int, default=None,
                        help="test samples the coordinator evaluates on each round (default: the whole test set)")
    parser.add_argument("--ack-timeout", type=float, default=LoadOptions.ack_timeout_s,
                        help="seconds an agent waits for its update's ack before sending it again (the agents' own "
                             "default, 10, makes a thousand agents flood the broker with resends)")
    parser.add_argument("--revision", type=int, default=LoadOptions.revision,
                        help="the protocol revision the agents announce (below 6 they never ask before uploading; "
                             "below 2 their tasks come in protocol version 1)")
    parser.add_argument("--min-available-gib", type=float, default=2.0,
                        help="stop the run when the machine's available memory falls below this")
    parser.add_argument("--coordinator-env", action="append", default=[], metavar="NAME=VALUE",
                        help="an environment variable of the coordinator's process only, e.g. "
                             "MALLOC_MMAP_THRESHOLD_=262144 (repeatable)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=JSON", dest="settings",
                        help="a coordinator setting, e.g. --set screening.enabled=false (repeatable)")
    parser.add_argument("--profile", action=argparse.BooleanOptionalAction, default=True,
                        help="sample the coordinator's threads during the rounds")
    parser.add_argument("--run-dir", default=None, help="default: a new runs/<time>-load/")
    parser.add_argument("--json", default=None, metavar="FILE", help="also write the outcome as JSON here")
    args = parser.parse_args()
    try:
        return run(args)
    except (ValueError, LoadError, BrokerStartError) as exc:  # a bad flag, a run that could not start: one sentence
        parser.error(str(exc))
    return 2


def run(args: argparse.Namespace) -> int:
    settings: dict[str, object] = {}
    for assignment in args.settings:
        key, _, text = assignment.partition("=")
        *parents, last = key.split(".")
        node = settings
        for part in parents:
            node = node.setdefault(part, {})  # type: ignore[assignment]
        try:
            node[last] = json.loads(text)
        except json.JSONDecodeError:
            raise ValueError(f"--set {assignment!r}: its value must be JSON (e.g. 10, true, \"text\")") from None
    if any("=" not in item for item in args.coordinator_env):
        raise ValueError("--coordinator-env takes NAME=VALUE")
    if not all(part.strip().isdigit() for part in args.hidden.split(",")):
        raise ValueError(f"--hidden takes channel counts separated by commas, got {args.hidden!r}")
    options = LoadOptions(
        agents=args.agents, rounds=args.rounds, workers=args.workers,
        brokers=[b for b in args.brokers.split(",") if b], coordinator_broker=args.coordinator_broker,
        protocol=args.protocol, algorithm=args.algorithm,
        model_options={"hidden": [int(h) for h in args.hidden.split(",")]}, dataset=args.dataset,
        eval_samples=args.eval_samples, ack_timeout_s=args.ack_timeout, revision=args.revision,
        min_available_bytes=int(args.min_available_gib * 2**30),
        coordinator_env=dict(item.split("=", 1) for item in args.coordinator_env), settings=settings, profile=args.profile,
        run_dir=args.run_dir)
    outcome = run_load(options)
    print(format_outcome(outcome))
    if args.json:
        Path(args.json).write_text(json.dumps(outcome.to_dict(), indent=1, default=str))
    return 0 if outcome.complete else 1


if __name__ == "__main__":
    sys.exit(main())
