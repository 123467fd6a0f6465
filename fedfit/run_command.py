"""``fedfit sim``, and what ``fedfit compare`` shares with it: the flags, how a setting is resolved, the checks
before a run. (``fedfit compare`` itself: :mod:`fedfit.compare_command`.)

A setting comes from its flag when the flag is given, else from ``--config``/``--set`` when they set it, else from
the default shown in ``--help``: a configuration naming scalefl, 20 rounds and resnet20 runs exactly that.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from common.config import ConfigError
from common.data import DATASET_NAMES
from common.logs import configure_logging
from fedfit.experiment import Experiment
from fedfit.sim.budgets import BUDGET_SCENARIOS, scenario_tiers
from fedfit.sim.speeds import parse_speeds

#: Reads ``--config`` with ``--set``: the mapping they give (what they set, an experiment file's ``experiment``
#: section apart), the validated coordinator config and that section (None: the file has none).
Loader = Callable[[str | None, Sequence[str]], tuple[dict[str, Any], Any, Experiment | None]]


@dataclass(frozen=True)
class Setting:
    """A flag that may also come from the coordinator configuration (at ``path``) and its default."""

    flag: str
    path: tuple[str, ...] | None
    default: Any


#: The settings a flag, the configuration or the default may give, by ``SimOptions`` field.
SETTINGS = {
    "algorithm": Setting("--algorithm", ("algorithm",), "heterofl"),
    "rounds": Setting("--rounds", ("rounds",), 5),
    "seed": Setting("--seed", ("seed",), 0),
    "model": Setting("--model", ("model", "family"), "cnn"),
    "dataset": Setting("--dataset", ("data", "dataset"), "fashion-mnist"),
    "federation": Setting("--federation", ("federation",), "sim"),
    "state_dir": Setting("--run-dir", ("state_dir",), None),
    "agents": Setting("--agents", None, 8),
    "partition": Setting("--partition", None, "iid"),
    "budgets": Setting("--budgets", None, "tiers"),
    "budget_variance": Setting("--budget-variance", None, 10.0),
    "size_for": Setting("--size-for", None, "dip"),
    "allocator": Setting("--allocator", None, "pooled"),
    "device": Setting("--device", ("training_device",), "cpu"),
    "workers": Setting("--workers", None, None),
    "train_samples": Setting("--train-samples", None, None),
    "speeds": Setting("--speeds", None, None),
}


def budgets_type(text: str) -> str:
    """argparse type of ``--budgets``: a known scenario, ``widths:A,B,...`` or ``fractions:A,B,...``."""
    try:
        scenario_tiers(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--budgets ")) from None
    return text


def speeds_type(text: str) -> str:
    """argparse type of ``--speeds``: slowdown factors, each at least 1 (``fedfit.sim.speeds``)."""
    try:
        parse_speeds(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(re.sub(r"^--speeds:? ", "", str(exc))) from None
    return text.strip()


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def add_run_arguments(parser: argparse.ArgumentParser, algorithm_names: Sequence[str],
                      family_names: Sequence[str], *, compare: bool) -> None:
    """The flags ``sim`` and ``compare`` share (``compare`` takes ``--algorithms`` instead of ``--algorithm``)."""
    def default(name: str) -> str:
        setting = SETTINGS[name]
        return (f" (default: the config's, else {setting.default})" if setting.path
                else f" (default: {setting.default})")

    if not compare:
        parser.add_argument("--algorithm", choices=algorithm_names, default=None,
                            help="the method" + default("algorithm"))
    parser.add_argument("--agents", type=_positive, default=None, help="number of simulated edge agents"
                        + default("agents"))
    parser.add_argument("--rounds", type=_positive, default=None, help="rounds" + default("rounds"))
    parser.add_argument("--dataset", choices=DATASET_NAMES, default=None, help="the data" + default("dataset"))
    parser.add_argument("--partition", default=None,
                        help="iid, dirichlet:ALPHA or shards:N (labels per agent)" + default("partition"))
    parser.add_argument("--model", choices=family_names, default=None, help="model family" + default("model"))
    parser.add_argument("--seed", type=int, default=None, help="seed of data, budgets and weights" + default("seed"))
    parser.add_argument("--train-samples", type=_positive, default=None, metavar="N",
                        help="train on a seeded random N of the training set, partitioned among the agents as the "
                             "whole would be (default: all of it)")
    parser.add_argument("--federation", default=None, help="federation name (one MQTT topic level)"
                        + default("federation"))
    parser.add_argument("--broker", default=None, metavar="HOST:PORT",
                        help="use this broker (anonymous clients allowed) instead of starting a secured one on a free "
                             "loopback port")
    parser.add_argument("--insecure-broker", action="store_true",
                        help="start the broker without TLS, logins and ACL (a quick local try; anyone on this machine "
                             "could join)")
    parser.add_argument("--config", default=None, metavar="FILE",
                        help="coordinator YAML the run starts from (algorithm, model, recipe, levels, method settings, "
                             "rounds, seed...); flags given override it")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                        help="override one coordinator setting, e.g. --set scalefl.cost=params (repeatable)")
    parser.add_argument("--budgets", type=budgets_type, default=None,
                        help=f"device memory budgets: {', '.join(BUDGET_SCENARIOS)}, widths:A,B,... (each tier can "
                             "train the r-width model; fair/lack/surplus are FeDepth's lists) or fractions:A,B,... "
                             "(shares of the full model's training memory); see docs/budgets.md" + default("budgets"))
    parser.add_argument("--budget-variance", type=float, default=None,
                        help="sigma^2 of the per-round fluctuation of tiers-fluctuating, in percentage points squared"
                             + default("budget_variance"))
    parser.add_argument("--size-for", choices=("dip", "typical"), default=None,
                        help="what fluctuating budgets size and plan the methods for: dip, the budget a device has in "
                             "all but its rarest rounds (2 sigma short), or typical, its median round's (a round below "
                             "it takes the task down the device's own ladder, or declines it)" + default("size_for"))
    parser.add_argument("--speeds", type=speeds_type, default=None, metavar="F,G,...",
                        help="training speeds: slowdown factors (at least 1) of tiers of devices; a device of factor f "
                             "takes f times as long as this machine for a task (its update held back (f-1) x the task's "
                             "seconds, no training slot held). With as many factors as budget tiers, one per tier in "
                             "the scenario's order (weakest first); else equal shares of the devices taken in tier "
                             "order (see docs/budgets.md; default: every device at this machine's speed)")
    parser.add_argument("--allocator", choices=("pooled", "compact", "default"), default=None,
                        help="heap of the agents' training processes: pooled (low, predictable peaks at full speed), "
                             "compact (the same peaks, slower steps) or glibc's default (higher, noisier peaks)"
                             + default("allocator"))
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None,
                        help="where the agents' training processes train: cpu, or cuda (one GPU shared by the fleet; "
                             "budgets are then GPU memory)" + default("device"))
    parser.add_argument("--workers", type=_positive, default=None,
                        help="training processes run at once across the fleet, each with the cores divided among them "
                             "(default: as many as this process may use cores: its CPU affinity, capped by its "
                             "cgroup's quota; with --device cuda no more than the GPU's free memory holds, each its "
                             "CUDA start and the method's largest task)")
    parser.add_argument("--log-file", default=None,
                        help="write the daemons' JSON logs here (default: daemons.log in the run's directory)")
    if not compare:
        parser.add_argument("--run-dir", "--state-dir", default=None, dest="run_dir",
                            help="the run's directory, which must not hold a run already (default: the config's "
                                 "state_dir, else a new runs/<time>-<algorithm>/)")
        parser.add_argument("--report", default=None, metavar="FILE",
                            help="also write the JSON report here (it is always in the run's directory)")


def _present(mapping: dict[str, Any], path: tuple[str, ...]) -> bool:
    node: Any = mapping
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return False
        node = node[key]
    return True


def _config_value(config: Any, path: tuple[str, ...]) -> Any:
    value = config
    for key in path:
        value = getattr(value, key)
    return value


def resolve(args: argparse.Namespace, mapping: dict[str, Any], config: Any,
            file_settings: dict[str, Any] | None = None) -> tuple[dict[str, Any], list[str]]:
    """The value of every :data:`SETTINGS` entry (flag, else an experiment file's ``experiment`` section, else the
    configuration, else default) and the flags that were given (for the report)."""
    values: dict[str, Any] = {}
    given: list[str] = []
    for name, setting in SETTINGS.items():
        dest = "run_dir" if name == "state_dir" else name
        flag_value = getattr(args, dest, None)
        if flag_value is not None:
            values[name] = flag_value
            given.append(f"{setting.flag} {flag_value}")
        elif file_settings and name in file_settings:
            values[name] = file_settings[name]
        elif setting.path is not None and _present(mapping, setting.path):
            values[name] = _config_value(config, setting.path)
        else:
            values[name] = setting.default
    return values, given


#: A simulation's round deadline unless the configuration sets ``round_timeout_s``: its agents share this
#: machine's cores (``--workers`` training processes at once), so a round lasts as long as the fleet's training
#: divided among them (an hour or more for PreResNet-20 on Fashion-MNIST on two cores), far beyond a real fleet's 600 s. Below the
#: agents' own ``limits.max_deadline_s`` (6 h).
SIM_ROUND_TIMEOUT_S = 4 * 3600.0


def _load(args: argparse.Namespace, load: Loader) -> tuple[dict[str, Any], Any, Experiment]:
    """The mapping ``--config`` and ``--set`` give (what they set), the coordinator configuration, with a
    simulation's round deadline where they set none, and the experiment file's ``experiment`` section (empty when
    the file has none)."""
    mapping, config, experiment = load(args.config, args.overrides)
    if not _present(mapping, ("round_timeout_s",)):
        config = replace(config, round_timeout_s=SIM_ROUND_TIMEOUT_S)
    return mapping, config, experiment or Experiment()


def _logging(args: argparse.Namespace, run_dir: Path) -> None:
    """The daemons' JSON logs go to ``--log-file`` or the run's ``daemons.log``."""
    path = Path(args.log_file) if args.log_file else run_dir / "daemons.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    stream = open(path, "a", encoding="utf-8")  # noqa: SIM115 - lives as long as the run
    configure_logging("info", stream)


def _writable_file(flag: str, value: str | None) -> None:
    """A file the run will write (``--log-file``, ``--report``) refused now rather than after the run."""
    if not value:
        return
    path = Path(value)
    if path.is_dir():
        raise ConfigError(f"{flag} {value} is a directory: give a file name")
    parent = next((p for p in path.parents if p.exists()), None)
    if parent is not None and not parent.is_dir():
        raise ConfigError(f"{flag} {value} cannot be written: {parent} is a file, not a directory")


def _checked(values: dict[str, Any], base: Any, mapping: dict[str, Any], args: argparse.Namespace,
             algorithms: Sequence[str]) -> Any:
    """Everything a run can refuse at its start, checked before its directory is made: the settings, the files it
    will write, the partition of this dataset among the agents and, for each of ``algorithms``, the coordinator's
    configuration, model and strategy. Returns the dataset and its partition, for the runs to use as they are."""
    from common.data import parse_partition
    from coordinator.planning import model_family, strategy_for
    from fedfit.sim.harness import check_device, fleet_data
    from fedfit.sim.rundir import refuse_used_dir
    from protocol import validate_name

    if min(values["agents"], values["rounds"], values["workers"] or 1) < 1:
        raise ValueError("--agents, --rounds and --workers must be at least 1")
    parse_partition(values["partition"])  # refused here, before the slower checks
    validate_name(values["federation"], "--federation")
    if values["budget_variance"] < 0:
        raise ValueError(f"--budget-variance must be non-negative, got {values['budget_variance']}")
    if values["state_dir"] is not None and _present(mapping, ("state_dir",)) and base.resume:
        raise ValueError(f"the configuration's state_dir {values['state_dir']} belongs to a coordinator that resumes "
                         f"(resume: true): give the simulation its own --run-dir")
    for directory in (values["state_dir"], getattr(args, "out", None)):
        if directory:  # before the slow checks: the cheapest refusal, and the one that keeps a finished run safe
            refuse_used_dir(directory)
    check_device(values["device"])
    _writable_file("--log-file", args.log_file)
    _writable_file("--report", getattr(args, "report", None))
    data = fleet_data(values["dataset"], base.data.root, values["agents"], values["partition"], values["seed"],
                      train_samples=values["train_samples"])
    dataset = data[0]
    for algorithm in algorithms:
        config = replace(base, algorithm=algorithm, model=replace(base.model, family=values["model"]),
                         data=replace(base.data, dataset=values["dataset"]), rounds=values["rounds"],
                         seed=values["seed"])
        config.validate()
        strategy_for(config, dataset, model_family(config, dataset))
    return data


def _options(values: dict[str, Any], args: argparse.Namespace, base: Any, given: list[str], **changes: Any) -> Any:
    from fedfit.sim.harness import SimOptions

    options = SimOptions(**values, broker=args.broker, secure_broker=not args.insecure_broker, base=base,
                         overrides=[*given, *(f"--set {item}" for item in args.overrides)],
                         command=["fedfit", *getattr(args, "argv", sys.argv[1:])])
    return replace(options, **changes)


def _heading(options: Any, report: dict[str, Any]) -> str:
    broker = report["broker"]
    return (f"{options.algorithm} | {options.agents} agents | {report['settings']['dataset']} {options.partition} | "
            f"{options.model} | budgets {options.budgets} | "
            + (f"speeds {options.speeds} | " if options.speeds else "") + f"broker {broker['kind']} {broker['version']} "
            + ("(TLS, logins, ACL)" if broker["secured"] else "(UNSECURED)"))


def run_sim(args: argparse.Namespace, load: Loader) -> int:
    """``fedfit sim``: one run; prints its table and where its directory is."""
    from fedfit.sim.harness import prepare_run_dir, run_simulation
    from fedfit.sim.report import format_table, format_timing, write_report
    from fedfit.sim.rundir import left_text

    mapping, base, experiment = _load(args, load)
    values, given = resolve(args, mapping, base, experiment.settings())
    data = _checked(values, base, mapping, args, [values["algorithm"]])
    options = _options(values, args, base, given)
    run_dir = prepare_run_dir(options)
    _logging(args, run_dir)
    print(f"run directory: {run_dir}", file=sys.stderr, flush=True)
    outcome = run_simulation(options, run_dir=run_dir, data=data)
    print(_heading(options, outcome.report))
    print(format_table(outcome.report["rounds"]))
    timing = format_timing(outcome.report["rounds"])
    if timing:
        print(timing)
    print(left_text(outcome.report["run"].get("left", [])))
    if args.report:
        write_report(outcome.report, args.report)
        print(f"report written to {args.report}")
    written = [name for name in ("report.json", "metrics.csv", "summary.txt", "accuracy.png", "traffic.png")
               if (run_dir / name).exists()]
    print(f"results in {run_dir}: {', '.join(written)}")
    return 0
