"""The ``fedfit`` command: ``coordinator`` and ``agent`` daemons, ``sim`` for broker-based local runs, ``plan``
to see what a strategy would hand each device tier before deploying, ``broker`` to secure the fleet's broker, and
``status`` to see a running fleet.

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
from types import FrameType
from typing import Any

import yaml

from common.config import ConfigError, from_mapping, load_yaml
from common.data import DATASET_NAMES, DatasetError
from common.logs import configure_logging
from common.mqtt_link import BrokerRefused, BrokerUnavailable
from edge_agent.forkserver import TorchUnavailable
from edge_agent.id_probe import AgentIdInUse
from fedfit import broker_command, deliver_command, export_command, predict_command, status_command
from fedfit.run_command import budgets_type
from fedfit.secure_broker import BrokerSetupError, PkiError
from fedfit.sim.broker import BrokerStartError
from fedfit.version import version_string

# Errors a user can cause: reported as one sentence, without a traceback (the coordinator's join them when the
# command needs the coordinator: see _user_errors).
USER_ERRORS: tuple[type[BaseException], ...] = (
    ConfigError, DatasetError, BrokerUnavailable, BrokerRefused, BrokerStartError, AgentIdInUse, TorchUnavailable,
    BrokerSetupError, PkiError, ValueError, OSError)
#: Commands that need neither the coordinator nor the models (nor, with them, torch).
LIGHT_COMMANDS = ("agent", "broker", "status", "predict")


def _user_errors(command: str) -> tuple[type[BaseException], ...]:
    if command in LIGHT_COMMANDS:
        return USER_ERRORS
    from coordinator.checkpoint import CheckpointError
    from coordinator.daemon import NoAgentsError

    return (*USER_ERRORS, CheckpointError, NoAgentsError)


class _Version(argparse.Action):
    """``--version``: asks git for the revision only when it is used."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        print(version_string())
        parser.exit()


def _parser(light: bool = False) -> argparse.ArgumentParser:
    """The command line; ``light``: only the commands of :data:`LIGHT_COMMANDS` (the rest import torch)."""
    # The module docstring's first paragraph, without its reStructuredText backticks: help is plain text.
    parser = argparse.ArgumentParser(prog="fedfit", description=__doc__.split("\n\n")[0].replace("``", ""))
    parser.add_argument("-V", "--version", action=_Version, help="print FedFit's version (and git revision) and exit")
    sub = parser.add_subparsers(dest="command", required=True)

    agent = sub.add_parser("agent", help="run an edge agent daemon")
    agent.add_argument("--config", required=True, help="YAML file with the agent configuration")
    agent.add_argument("--log-level", default=None, choices=("debug", "info", "warning", "error"),
                       help="default: the config's log_level")
    broker_command.add_parser(sub)
    status_command.add_parser(sub)
    predict_command.add_parser(sub)
    if light:
        return parser

    from coordinator.strategies import ALGORITHM_NAMES
    from fedfit.run_command import add_run_arguments
    from models import FAMILY_NAMES

    coord = sub.add_parser("coordinator", help="run the coordinator daemon")
    coord.add_argument("--config", required=True, help="YAML file with the coordinator configuration")
    coord.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"),
                       help="default: info")

    sim = sub.add_parser("sim", help="run a whole federation on this machine over a real MQTT broker",
                         description="Run a whole federation on this machine over a real MQTT broker; the run gets a "
                                     "directory of its own (report, CSV, summary, plots).")
    add_run_arguments(sim, ALGORITHM_NAMES, FAMILY_NAMES, compare=False)

    compare = sub.add_parser("compare", help="run several algorithms on the same fleet (or read runs) and compare",
                             description="Run several algorithms on the same fleet, data partition, budgets and seed "
                                         "(--algorithms), or read existing run directories, and write one comparison: "
                                         "a table, a PNG and a self-contained HTML page.")
    compare.add_argument("runs", nargs="*", metavar="RUN_DIR", help="run directories of fedfit sim to compare")
    compare.add_argument("--algorithms", default=None, metavar="A,B,...",
                         help=f"the algorithms to run, comma-separated, of {', '.join(ALGORITHM_NAMES)} (fedavg runs "
                              "at the smallest width every device can train unless fedavg.width is set; "
                              "adaptivefl-random, -greedy, -curiosity or -resource: AdaptiveFL with that client "
                              "selection)")
    compare.add_argument("--out", default=None, metavar="DIR",
                         help="where the comparison (and the runs) go (default: a new runs/<time>-compare/)")
    compare.add_argument("--seeds", default=None, metavar="S,T,...",
                         help="run every method once per seed (data, budgets and weights), each seed's runs in "
                              "OUT/seed-S/; the table gives each column's mean and spread over the seeds, the plot "
                              "the mean with a band (default: the experiment file's seeds, else the one --seed)")
    compare.add_argument("--baseline", default=None, metavar="all-large,all-small",
                         help="add baselines: all-large (FedAvg on the full model, every device, no budgets: the "
                              "upper bound) and/or all-small (FedAvg at the widest width the smallest tier trains: "
                              "the lower bound)")
    compare.add_argument("--resume", default=None, metavar="DIR",
                         help="go on with the comparison DIR holds, stopped part-way: its finished runs are read, "
                              "a run stopped part-way goes on from its last round, the rest run (no other flag)")
    add_run_arguments(compare, ALGORITHM_NAMES, FAMILY_NAMES, compare=True)

    plan = sub.add_parser("plan", help="print the levels or pool a strategy would use, before deploying")
    plan.add_argument("--config", default=None, metavar="FILE",
                      help="coordinator YAML (algorithm, model, recipe, method settings); flags override it")
    plan.add_argument("--algorithm", choices=ALGORITHM_NAMES, default=None,
                      help="default: the config's, else heterofl")
    plan.add_argument("--model", choices=FAMILY_NAMES, default=None, help="default: the config's, else cnn")
    plan.add_argument("--dataset", choices=DATASET_NAMES, default=None,
                      help="sets the classes, input channels and image size (default: the config's data.dataset, "
                           "else auto: fashion-mnist when installed, else digits)")
    plan.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                      help="override one coordinator setting, e.g. --set scalefl.cost=params (repeatable)")
    plan.add_argument("--budgets", type=budgets_type, default=None,
                      help="also show each device tier of this budget scenario (see sim --budgets): its bytes and "
                           "what every method would hand it")
    plan.add_argument("--size-for", choices=("dip", "typical"), default="dip",
                      help="the budget a fluctuating tier is shown with, as sim --size-for sizes the methods: dip (in "
                           "all but its rarest rounds) or typical (its median round; default: dip)")
    plan.add_argument("--device", choices=("cpu", "cuda"), default=None,
                      help="the training memory on this device: cpu (the pooled heap) or cuda (the CUDA caching "
                           "allocator's peak, without what each training process's CUDA start adds; default: the "
                           "config's training_device, else cpu)")
    plan.add_argument("--json", action="store_true",
                      help='print JSON: {"levels": [...], "tiers": [...]} (tiers empty without --budgets)')
    export_command.add_parser(sub)
    deliver_command.add_parser(sub)
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


def _mapping(path: str | None, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """The configuration file's mapping with ``overrides`` applied (not yet validated)."""
    mapping = load_yaml(path) if path else {}
    for assignment in overrides:
        _override(mapping, assignment)
    return mapping


def _load(cls: type[Any], path: str | None, overrides: Sequence[str] = (),
          check: Callable[[Any], None] | None = None, mapping: dict[str, Any] | None = None) -> Any:
    """The configuration of ``cls`` from ``path`` with ``overrides`` (or from ``mapping``, read from ``path``
    already), validated (and ``check``-ed)."""
    mapping = _mapping(path, overrides) if mapping is None else mapping
    config = from_mapping(cls, mapping, where="")
    try:
        config.validate()
        if check is not None:
            check(config)
    except ValueError as exc:
        raise ConfigError(f"{path or 'the configuration'}: {exc}") from exc
    return config


def _load_coordinator(path: str | None, overrides: Sequence[str] = (), mapping: dict[str, Any] | None = None) -> Any:
    """A coordinator configuration whose algorithm is known."""
    from coordinator.config import CoordinatorConfig
    from coordinator.strategies import check_algorithm

    return _load(CoordinatorConfig, path, overrides, lambda config: check_algorithm(config.algorithm), mapping)


def _coordinator_settings(path: str | None, overrides: Sequence[str] = ()) -> tuple[dict[str, Any], Any, Any]:
    """The mapping the file and ``overrides`` give (what they set, without an experiment file's ``experiment``
    section), the validated configuration, and the :class:`fedfit.experiment.Experiment` (None: none given)."""
    from fedfit.experiment import split_experiment

    mapping, experiment = split_experiment(_mapping(path, overrides), path or "the configuration")
    return mapping, _load_coordinator(path, overrides, mapping), experiment


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
    if agent.taken_over or agent.fatal:
        print(f"fedfit agent: error: {agent.fatal or agent.taken_over_message()}", file=sys.stderr)
        return 1
    return 0


def _run_sim(args: argparse.Namespace) -> int:
    from fedfit.run_command import run_sim

    return run_sim(args, _coordinator_settings)


def _run_compare(args: argparse.Namespace) -> int:
    from fedfit.compare_command import run_compare

    return run_compare(args, _coordinator_settings)


def _run_plan(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from common.data import load_dataset
    from coordinator.planning import strategy_for
    from fedfit.plan_table import format_plan, format_setup, format_tiers, scenario_budgets, tier_rows

    mapping, config, _ = _coordinator_settings(args.config, args.overrides)
    config = replace(config, algorithm=args.algorithm or config.algorithm,
                     model=replace(config.model, family=args.model or config.model.family),
                     data=replace(config.data, dataset=args.dataset or config.data.dataset))
    try:
        config.validate()
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    dataset = load_dataset(config.data.dataset, config.data.root)
    if args.device is not None:
        config = replace(config, training_device=args.device)
    strategy = strategy_for(config, dataset)
    sized = (strategy.fit_to_fleet([budget for _, budget in scenario_budgets(config, dataset, args.budgets,
                                                                            config.training_device, args.size_for)])
             if args.budgets else None)
    unsized = strategy.awaits_fleet
    rows = strategy.describe()
    fedavg_set = "width" in mapping.get("fedavg", {}) if isinstance(mapping.get("fedavg"), dict) else False
    tiers = (tier_rows(config, dataset, args.budgets, fedavg_width_set=fedavg_set, device=config.training_device,
                       size_for=args.size_for) if args.budgets else [])
    setup = strategy.setup_summary()
    if args.json:
        print(json.dumps({"levels": rows, "tiers": tiers, **({"setup": setup} if setup else {})}, indent=2))
    else:
        print(f"{config.algorithm} | {config.model.family} | {dataset.name} {dataset.image_size[0]}x"
              f"{dataset.image_size[1]}x{dataset.in_channels}, {dataset.num_classes} classes | training memory at "
              f"batch {config.recipe.batch_size} ("
              + ("CUDA allocator's peak, CUDA's start excluded)" if config.training_device == "cuda"
                 else "pooled heap, this CPU)"))
        print(format_plan(rows))
        if sized:
            print(f"\n{sized}")
        elif unsized:
            print(f"\n{config.algorithm} sizes its models to the budgets the fleet reports at its first round: shown "
                  "here with its fixed defaults (--budgets SCENARIO shows them sized to a fleet)")
        if setup:
            print("\nset-up:")
            print(format_setup(setup))
        if args.budgets:
            print(f"\ndevice tiers of --budgets {args.budgets}, and what each method would hand them:")
            print(format_tiers(tiers))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``fedfit`` console command."""
    arguments = list(sys.argv[1:] if argv is None else argv)
    if arguments in (["--version"], ["-V"]):  # without importing torch
        print(version_string())
        return 0
    args = _parser(light=bool(arguments) and arguments[0] in LIGHT_COMMANDS).parse_args(arguments)
    args.argv = arguments  # the command line as given, for the run's report
    runners = {"coordinator": _run_coordinator, "agent": _run_agent, "sim": _run_sim, "compare": _run_compare,
               "plan": _run_plan, "broker": broker_command.run, "export": export_command.run,
               "deliver": deliver_command.run,
               "predict": predict_command.run,
               "status": status_command.run}
    stopping = None
    if args.command in ("coordinator", "sim", "compare", "deliver") and \
            threading.current_thread() is threading.main_thread():
        # A stop (systemd's, kill, timeout) ends the run as Ctrl-C does: its clean-up runs (the broker and its
        # secrets gone, the status file saying so, the exporter's last scrape), which a SIGTERM's default skips.
        stopping = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        return runners[args.command](args)
    except _user_errors(args.command) as exc:
        print(f"fedfit {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"fedfit {args.command}: interrupted", file=sys.stderr)
        return 130
    finally:
        if stopping is not None:
            signal.signal(signal.SIGTERM, stopping)


if __name__ == "__main__":
    sys.exit(main())
