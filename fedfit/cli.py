"""The ``fedfit`` command: ``coordinator`` and ``agent`` daemons, ``sim`` for broker-based local runs, ``plan``
to see what a strategy would hand each device tier before deploying, and ``broker`` to secure the fleet's broker.

``fedfit agent`` imports nothing that pulls in torch (the coordinator, the models): the agent process stays small
and leaves torch to its training forkserver. The other commands import what they need when they run.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

import yaml

from common.config import ConfigError, from_mapping, load_yaml
from common.data import DATASET_NAMES, DatasetError
from common.logs import configure_logging
from common.mqtt_link import BrokerUnavailable
from edge_agent.daemon import AgentIdInUse
from edge_agent.forkserver import TorchUnavailable
from fedfit import broker_command
from fedfit.secure_broker import BrokerSetupError, PkiError
from fedfit.sim.broker import BrokerStartError
from fedfit.sim.budgets import scenario_tiers

# Errors a user can cause: reported as one sentence, without a traceback (the coordinator's join them when the
# command needs the coordinator: see _user_errors).
USER_ERRORS: tuple[type[BaseException], ...] = (
    ConfigError, DatasetError, BrokerUnavailable, BrokerStartError, AgentIdInUse, TorchUnavailable, BrokerSetupError,
    PkiError, ValueError, FileNotFoundError)
#: Commands that need neither the coordinator nor the models (nor, with them, torch).
LIGHT_COMMANDS = ("agent", "broker")


def _user_errors(command: str) -> tuple[type[BaseException], ...]:
    if command in LIGHT_COMMANDS:
        return USER_ERRORS
    from coordinator.checkpoint import CheckpointError
    from coordinator.daemon import NoAgentsError

    return (*USER_ERRORS, CheckpointError, NoAgentsError)


def _budgets(text: str) -> str:
    """argparse type of ``--budgets``: a known scenario or ``fractions:A,B,...``."""
    try:
        scenario_tiers(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _parser(light: bool = False) -> argparse.ArgumentParser:
    """The command line; ``light``: only the commands of :data:`LIGHT_COMMANDS` (the rest import torch)."""
    parser = argparse.ArgumentParser(prog="fedfit", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    agent = sub.add_parser("agent", help="run an edge agent daemon")
    agent.add_argument("--config", required=True, help="YAML file with the agent configuration")
    agent.add_argument("--log-level", default=None, choices=("debug", "info", "warning", "error"))
    broker_command.add_parser(sub)
    if light:
        return parser

    from coordinator.strategies import ALGORITHM_NAMES
    from models import FAMILY_NAMES

    coord = sub.add_parser("coordinator", help="run the coordinator daemon")
    coord.add_argument("--config", required=True, help="YAML file with the coordinator configuration")
    coord.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))

    sim = sub.add_parser("sim", help="run a whole federation on this machine over a real MQTT broker")
    sim.add_argument("--algorithm", choices=ALGORITHM_NAMES, default="heterofl")
    sim.add_argument("--agents", type=int, default=8, help="number of simulated edge agents")
    sim.add_argument("--rounds", type=int, default=5)
    sim.add_argument("--dataset", choices=DATASET_NAMES, default="fashion-mnist")
    sim.add_argument("--partition", default="iid", help="iid, dirichlet:ALPHA or shards:N (labels per agent)")
    sim.add_argument("--model", choices=FAMILY_NAMES, default="cnn")
    sim.add_argument("--seed", type=int, default=0)
    sim.add_argument("--federation", default="sim", help="federation name (one MQTT topic level)")
    sim.add_argument("--broker", default=None, metavar="HOST:PORT",
                     help="use this broker (anonymous clients allowed) instead of starting a secured one on a free "
                          "loopback port")
    sim.add_argument("--insecure-broker", action="store_true",
                     help="start the broker without TLS, logins and ACL (a quick local try; anyone on this machine "
                          "could join)")
    sim.add_argument("--report", default=None, metavar="FILE", help="write the JSON report here")
    sim.add_argument("--config", default=None, metavar="FILE",
                     help="coordinator YAML whose settings (recipe, levels, model options, ...) the run starts from")
    sim.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                     help="override one coordinator setting, e.g. --set scalefl.cost=params (repeatable)")
    sim.add_argument("--budgets", type=_budgets, default="tiers",
                     help="device memory budgets as shares of the full model's training memory: uniform (all 110%%), "
                          "tiers (weak/medium/strong 40/30/30%% with 35/60/110%%), tiers-fluctuating (r = r_M - |u|), "
                          "FeDepth's fair {1/6,1/3,1/2,1}, lack {1/8,1/6,1/2,1}, surplus {1/6,1/3,1/2,2}, or "
                          "fractions:A,B,... (a quarter, third... of the fleet each)")
    sim.add_argument("--budget-variance", type=float, default=10.0,
                     help="sigma^2 of the per-round fluctuation u, in percentage points squared")
    sim.add_argument("--allocator", choices=("compact", "default"), default="compact",
                     help="heap of the agents' training processes: compact (lower, predictable peaks; slower "
                          "steps) or glibc's default; budgets are relative to the full model's need under it")
    sim.add_argument("--workers", type=int, default=1, help="training processes run at once across the fleet")
    sim.add_argument("--state-dir", default=None, help="where checkpoints and metrics go (default runs/sim-NAME)")
    sim.add_argument("--log-file", default=None, help="write the daemons' JSON logs here (default: warnings "
                                                     "and errors to stderr)")

    plan = sub.add_parser("plan", help="print the levels or pool a strategy would use, before deploying")
    plan.add_argument("--config", default=None, metavar="FILE",
                      help="coordinator YAML (algorithm, model, recipe, method settings); flags override it")
    plan.add_argument("--algorithm", choices=ALGORITHM_NAMES, default=None)
    plan.add_argument("--model", choices=FAMILY_NAMES, default=None)
    plan.add_argument("--dataset", choices=DATASET_NAMES, default=None,
                      help="sets the classes, input channels and image size (default: the config's data.dataset)")
    plan.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                      help="override one coordinator setting, e.g. --set scalefl.cost=params (repeatable)")
    plan.add_argument("--budgets", type=_budgets, default=None,
                      help="also show what each device tier of this budget scenario would train (see sim --budgets)")
    plan.add_argument("--json", action="store_true",
                      help="print JSON: a list of the levels (with --budgets: {\"levels\": [...], \"tiers\": [...]})")
    return parser


def _override(mapping: dict[str, Any], assignment: str) -> None:
    """Apply one ``--set dotted.key=value`` (the value read as YAML) to a configuration mapping."""
    key, sep, text = assignment.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set expects KEY=VALUE (e.g. scalefl.cost=params), got {assignment!r}")
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"--set {key}: the value {text!r} is not valid YAML ({exc})") from exc
    *parents, last = key.strip().split(".")
    target = mapping
    for part in parents:
        child = target.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {key}: {part!r} is not a section of the configuration")
        target = child
    target[last] = value


def _load(cls: type[Any], path: str | None, overrides: Sequence[str] = (),
          check: Callable[[Any], None] | None = None) -> Any:
    """The configuration of ``cls`` from ``path`` with ``overrides``, validated (and ``check``-ed)."""
    mapping = load_yaml(path) if path else {}
    for assignment in overrides:
        _override(mapping, assignment)
    config = from_mapping(cls, mapping, where="")
    try:
        config.validate()
        if check is not None:
            check(config)
    except ValueError as exc:
        raise ConfigError(f"{path or 'the configuration'}: {exc}") from exc
    return config


def _load_coordinator(path: str | None, overrides: Sequence[str] = ()) -> Any:
    """A coordinator configuration whose algorithm is known."""
    from coordinator.config import CoordinatorConfig
    from coordinator.strategies import check_algorithm

    return _load(CoordinatorConfig, path, overrides, lambda config: check_algorithm(config.algorithm))


def _stop_on_signals(stop: Any) -> None:
    def handler(signum: int, frame: FrameType | None) -> None:
        threading.Thread(target=stop, daemon=True).start()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def _run_coordinator(args: argparse.Namespace) -> int:
    from common import systemd_notify
    from coordinator.daemon import Coordinator

    configure_logging(args.log_level)
    config = _load_coordinator(args.config)
    coordinator = Coordinator(config)
    coordinator.start()
    systemd_notify.notify("READY=1")
    try:
        coordinator.run()
    except KeyboardInterrupt:
        pass
    finally:
        coordinator.stop()
    return 0


def _run_agent(args: argparse.Namespace) -> int:
    from edge_agent import allocator
    from edge_agent.config import AgentConfig
    from edge_agent.daemon import EdgeAgent
    from edge_agent.data_source import load_agent_data

    config = _load(AgentConfig, args.config)
    configure_logging(args.log_level or config.log_level)
    allocator.configure_agent_process()  # what a task's messages needed goes back to the device afterwards
    agent = EdgeAgent(config, load_agent_data(config.data))
    agent.start()
    _stop_on_signals(agent.stop)
    agent.run_forever()
    if agent.taken_over:
        print(f"fedfit agent: error: {agent.taken_over_message()}", file=sys.stderr)
        return 1
    return 0


def _run_sim(args: argparse.Namespace) -> int:
    from fedfit.sim.harness import SimOptions, run_simulation
    from fedfit.sim.report import format_table, write_report

    if args.log_file:
        Path(args.log_file).parent.mkdir(parents=True, exist_ok=True)
        log_stream = open(args.log_file, "a", encoding="utf-8")  # noqa: SIM115 - lives as long as the run
        configure_logging("info", log_stream)
    else:
        configure_logging("warning", sys.stderr)
    base = _load_coordinator(args.config, args.overrides)
    options = SimOptions(algorithm=args.algorithm, agents=args.agents, rounds=args.rounds, dataset=args.dataset,
                         partition=args.partition, model=args.model, seed=args.seed, federation=args.federation,
                         broker=args.broker, secure_broker=not args.insecure_broker, workers=args.workers, budgets=args.budgets,
                         budget_variance=args.budget_variance, allocator=args.allocator, base=base,
                         state_dir=args.state_dir)
    outcome = run_simulation(options)
    broker = outcome.report["broker"]
    print(f"{args.algorithm} | {args.agents} agents | {args.dataset} {args.partition} | {args.model} | broker "
          f"{broker['kind']} {broker['version']} " + ("(TLS, logins, ACL)" if broker["secured"] else "(UNSECURED)"))
    print(format_table(outcome.rounds))
    if args.report:
        write_report(outcome.report, args.report)
        print(f"report written to {args.report}")
    return 0


def _run_plan(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from common.data import load_dataset
    from coordinator.planning import strategy_for
    from fedfit.plan_table import format_plan

    config = _load_coordinator(args.config, args.overrides)
    config = replace(config, algorithm=args.algorithm or config.algorithm,
                     model=replace(config.model, family=args.model or config.model.family),
                     data=replace(config.data, dataset=args.dataset or config.data.dataset))
    config.validate()
    dataset = load_dataset(config.data.dataset, config.data.root)
    strategy = strategy_for(config, dataset)
    rows = strategy.describe()
    tiers = _tier_rows(strategy, args.budgets) if args.budgets else None
    if args.json:
        print(json.dumps(rows if tiers is None else {"levels": rows, "tiers": tiers}, indent=2))
    else:
        print(f"{config.algorithm} | {config.model.family} | {dataset.name} {dataset.image_size[0]}x"
              f"{dataset.image_size[1]}x{dataset.in_channels}, {dataset.num_classes} classes | training memory at "
              f"batch {config.recipe.batch_size} (compact heap, this CPU)")
        print(format_plan(rows))
        if tiers is not None:
            print(f"\ndevice tiers of --budgets {args.budgets} (shares of the full model's training memory):")
            print(format_plan(tiers))
    return 0


def _tier_rows(strategy: Any, scenario: str) -> list[dict[str, Any]]:
    """What each tier of ``scenario`` would train: budgets are the fixed overhead plus the tier's share of the
    model-dependent training memory of the strategy's largest task, as in ``fedfit sim``."""
    from fedfit.sim.budgets import tier_budget

    spec, plan = strategy.largest_task()
    estimate = strategy.context.training_memory(spec, plan)
    rows = []
    for tier in scenario_tiers(scenario):
        budget = tier_budget(tier, estimate.total - estimate.overhead, estimate.overhead)
        rows.append({"tier": tier.name, "budget_bytes": budget, **strategy.plan_for_budget(budget)})
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``fedfit`` console command."""
    arguments = list(sys.argv[1:] if argv is None else argv)
    args = _parser(light=bool(arguments) and arguments[0] in LIGHT_COMMANDS).parse_args(arguments)
    runners = {"coordinator": _run_coordinator, "agent": _run_agent, "sim": _run_sim, "plan": _run_plan,
               "broker": broker_command.run}
    try:
        return runners[args.command](args)
    except _user_errors(args.command) as exc:
        print(f"fedfit {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"fedfit {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
