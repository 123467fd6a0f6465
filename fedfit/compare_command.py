"""``fedfit compare``: run several methods on the same fleet (once per seed, with the baselines asked for), or read
finished runs, and write the comparison; ``--resume`` goes on with one stopped part-way.

Layout of a comparison's directory (``--seeds``, or an experiment file's ``seeds``, put each seed's runs apart)::

    comparison.{txt,md,json,png,html}   the comparison of every run (over the seeds: mean and spread)
    compare.json, config.yaml           what it was run with (the flags, a copy of --config): what --resume reads
    seed-S/<label>/                     one run directory per method (and baseline) and seed, as fedfit sim's
    seed-S/comparison.*                 that seed's own comparison
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common.config import ConfigError
from fedfit.experiment import BASELINES, Experiment, parse_baselines, parse_seeds
from fedfit.run_command import SETTINGS, Loader, _checked, _load, _logging, _options, resolve

if TYPE_CHECKING:
    from coordinator.config import CoordinatorConfig

#: What a comparison keeps of how it was run (the parsed flags), for ``--resume``.
SETUP_FILE = "compare.json"
#: The copy of ``--config`` a comparison keeps beside it: a resumed one runs with what the first part ran with.
CONFIG_COPY = "config.yaml"
SETUP_FORMAT = "fedfit-compare-v1"


def _fedavg_width(values: dict[str, Any], base: Any, dataset: Any) -> float:
    """FedAvg's width in a comparison: the widest every device of the scenario can train (its smallest tier)."""
    from coordinator.strategies.base import base_plan
    from fedfit.sim.budgets import BudgetAnchor, width_for_all
    from models import get_family

    family = get_family(values["model"], dataset.num_classes, dataset.in_channels, **base.model.options)
    anchor = BudgetAnchor.estimate(family, base_plan(base.recipe), input_size=dataset.image_size,
                                   allocator=values["allocator"], device=values["device"])
    return width_for_all(values["budgets"], anchor, base.levels, values["budget_variance"])


def compare_variant(label: str) -> tuple[str, str | None]:
    """The algorithm a ``--algorithms`` entry runs, and AdaptiveFL's selection mode when the entry names an
    ablation (``adaptivefl-random``, ``adaptivefl-greedy``, ``adaptivefl-curiosity``, ``adaptivefl-resource``).
    A baseline (``all-large``, ``all-small``) runs FedAvg."""
    from coordinator.client_selection import SELECTION_MODES

    if label in BASELINES:
        return "fedavg", None
    algorithm, _, mode = label.partition("-")
    if algorithm == "adaptivefl" and mode in SELECTION_MODES and mode != "rl":  # rl is plain adaptivefl
        return algorithm, mode
    return label, None


def _resumed(args: argparse.Namespace) -> argparse.Namespace:
    """The flags the comparison in ``--resume DIR`` was started with, to go on with it (ConfigError when DIR holds
    none, or when other flags were given: a resumed comparison runs as it started, but for ``--workers``,
    ``--log-file`` and a larger ``--rounds``, which carries every run on to that many rounds and is kept for later
    resumes)."""
    directory = Path(args.resume)
    given = [arg for arg in getattr(args, "argv", []) if arg.startswith("-")
             and arg.split("=")[0] not in ("--resume", "--workers", "--log-file", "--rounds")]
    if args.runs or given:
        raise ConfigError(f"fedfit compare --resume goes on as the comparison started: leave out "
                          f"{', '.join(given) or 'the run directories'} (only --workers, --log-file and --rounds "
                          f"may change)")
    try:
        setup = json.loads((directory / SETUP_FILE).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"--resume {directory}: no {SETUP_FILE} there: it is not a comparison fedfit compare "
                          f"--algorithms started (or it predates --resume)") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"--resume {directory}: cannot read {SETUP_FILE}: {exc}") from None
    if setup.get("format") != SETUP_FORMAT:
        raise ConfigError(f"--resume {directory}: {SETUP_FILE} is not of format {SETUP_FORMAT}")
    stored = setup.get("arguments")
    if not isinstance(stored, dict):
        raise ConfigError(f"--resume {directory}: {SETUP_FILE} holds no flags")
    # Every flag this version has, at its default where the comparison's file predates it, then the stored ones.
    stored = {**vars(args), **stored}
    update = {**stored, "rounds": args.rounds} if args.rounds is not None else None  # kept once checked
    if stored.get("config"):
        stored["config"] = str(directory / CONFIG_COPY)
    for name in ("workers", "log_file", "rounds"):
        if getattr(args, name) is not None:
            stored[name] = getattr(args, name)
    return argparse.Namespace(**{**stored, "out": str(directory), "resume": str(directory), "runs": [],
                                 "argv": getattr(args, "argv", []), "setup_update": update})


def _keep_setup(args: argparse.Namespace, out: Path) -> None:
    """Write what ``--resume`` needs: the parsed flags and a copy of ``--config``."""
    if args.config:
        shutil.copyfile(args.config, out / CONFIG_COPY)
    _write_setup(vars(args), out)


def _write_setup(flags: dict[str, Any], out: Path) -> None:
    """The parsed flags of a comparison, in its directory (written whole, then renamed into place)."""
    arguments = {key: value for key, value in flags.items() if key not in ("argv", "resume", "out", "setup_update")}
    kept = out / f".{SETUP_FILE}.tmp"
    kept.write_text(json.dumps({"format": SETUP_FORMAT, "arguments": arguments}, indent=2) + "\n", encoding="utf-8")
    os.replace(kept, out / SETUP_FILE)


def _read_runs(args: argparse.Namespace) -> tuple[list[dict[str, Any]], Path]:
    """``fedfit compare RUN_DIR...``: the reports of finished runs, and the comparison's directory."""
    from fedfit.sim.report import read_report
    from fedfit.sim.rundir import claim_run_dir, new_run_dir

    ignored = [setting.flag for name, setting in SETTINGS.items()
               if getattr(args, "run_dir" if name == "state_dir" else name, None) is not None]
    ignored += ["--config"] * bool(args.config) + ["--set"] * bool(args.overrides)
    ignored += ["--seeds"] * bool(args.seeds) + ["--baseline"] * bool(args.baseline)
    if ignored:
        raise ConfigError(f"fedfit compare reads finished runs as they are: {', '.join(ignored)} only apply to "
                          f"runs it makes (--algorithms)")
    reports = [read_report(path) for run in args.runs for path in _report_paths(Path(run))]
    return reports, (claim_run_dir(args.out) if args.out else new_run_dir("runs", "compare"))


def _report_paths(path: Path) -> list[Path]:
    """The reports ``path`` names: a report, a run's directory, or a comparison's directory (every run in it, seed
    by seed)."""
    from fedfit.sim.rundir import REPORT_FILE

    if not path.is_dir() or (path / REPORT_FILE).exists():
        return [path / REPORT_FILE if path.is_dir() else path]
    found = sorted(path.glob(f"*/{REPORT_FILE}")) + sorted(path.glob(f"seed-*/*/{REPORT_FILE}"),
                                                           key=lambda p: (_seed_of(p.parent.parent), p))
    if not found:
        raise ConfigError(f"{path} holds no run (no {REPORT_FILE} in it, its directories or their seed-*/ ones)")
    return found


def _seed_of(directory: Path) -> int:
    try:
        return int(directory.name.removeprefix("seed-"))
    except ValueError:
        return 0


def _labels(args: argparse.Namespace, experiment: Experiment) -> list[str]:
    """What runs, in order: the baselines first (a comparison stopped part-way has its bounds, and a fleet's gap
    between them is known before the methods' hours), then the methods (``--algorithms``, else the experiment
    file's)."""
    from coordinator.strategies import check_algorithm

    if args.algorithms is not None:
        methods = [name.strip() for name in args.algorithms.split(",") if name.strip()]
        if not methods:
            raise ConfigError(f"--algorithms names no algorithm: {args.algorithms!r}")
    else:
        methods = list(experiment.algorithms)
    baselines = parse_baselines(args.baseline) if args.baseline else list(experiment.baselines)
    labels = baselines + methods
    if not labels:
        raise ConfigError("fedfit compare needs --algorithms A,B,... (to run them), an experiment file naming its "
                          "algorithms, or run directories (to read them)")
    if len(set(labels)) != len(labels):
        raise ConfigError(f"fedfit compare names one more than once: {', '.join(labels)}")
    for label in labels:
        check_algorithm(compare_variant(label)[0])
    return labels


def _run_bases(labels: list[str], mapping: dict[str, Any], base: Any, values: dict[str, Any],
               dataset: Any) -> dict[str, Any]:
    """Each label's coordinator configuration: FedAvg at the widest width every device can train (unless
    ``fedavg.width`` is set; always for all-small), all-large at width 1, AdaptiveFL's ablations' selection."""
    small = None
    fedavg_set = _present_width(mapping)
    if "all-small" in labels or ("fedavg" in labels and not fedavg_set):
        small = _fedavg_width(values, base, dataset)
    bases = {}
    for label in labels:
        selection = compare_variant(label)[1]
        run_base = base
        if label == "all-large":
            run_base = replace(base, fedavg=replace(base.fedavg, width=1.0))
        elif label == "all-small" or (label == "fedavg" and not fedavg_set):
            run_base = replace(base, fedavg=replace(base.fedavg, width=small))
        if selection is not None:
            run_base = replace(run_base, adaptivefl=replace(run_base.adaptivefl, selection=selection))
        bases[label] = run_base
    return bases


def _present_width(mapping: dict[str, Any]) -> bool:
    fedavg = mapping.get("fedavg")
    return isinstance(fedavg, dict) and "width" in fedavg


def run_compare(args: argparse.Namespace, load: Loader) -> int:
    """``fedfit compare``: run each method (and baseline) on the same fleet once per seed, or read the runs given,
    or go on with a comparison stopped part-way; write the comparison."""
    from fedfit.sim.compare import write_comparison

    if args.resume:
        args = _resumed(args)
    if args.runs and (args.algorithms or args.baseline):
        raise ConfigError("fedfit compare takes either run directories or --algorithms/--baseline, not both")
    if args.runs:
        reports, out = _read_runs(args)
        experiment = None
    else:
        reports, out, experiment = _run_methods(args, load)
    paths = write_comparison(reports, out, experiment.describe() if experiment else None)
    print(paths["txt"].read_text(encoding="utf-8").rstrip())
    print(f"comparison in {out}: " + ", ".join(path.name for path in paths.values()))
    return 0


def _rounds_run(report: dict[str, Any]) -> int:
    """The rounds a finished run ran to."""
    return int(report["settings"]["rounds"])


def _check_privacy_budget(out: Path, rounds: int, base: CoordinatorConfig) -> None:
    """ConfigError, before anything of the comparison is written or started, when a private run in ``out`` cannot
    afford ``rounds`` within its budget (`coordinator.privacy.guard`)."""
    from common.logs import get_logger
    from coordinator.checkpoint import CheckpointError, checkpoint_metadata
    from coordinator.metrics import RoundResult
    from coordinator.privacy.guard import PrivacyGuard

    if not base.privacy.enabled or base.privacy.max_epsilon is None:
        return
    for checkpoint in sorted({*out.glob("*/checkpoint.safetensors"), *out.glob("seed-*/*/checkpoint.safetensors")}):
        try:
            meta = checkpoint_metadata(checkpoint)
            record = RoundResult.from_dict(meta["record"]) if meta.get("record") else None
        except (CheckpointError, OSError, ValueError):
            continue  # its own resume says what is wrong with it
        try:
            PrivacyGuard(base.privacy, rounds, record, int(meta.get("round", 0)), get_logger("compare"))
        except ValueError as exc:
            raise ConfigError(f"{checkpoint.parent}: {exc}") from None


def _check_rounds(out: Path, rounds: int) -> int:
    """The most rounds a finished run of the comparison in ``out`` ran (by its report); ConfigError when a run ran
    more than ``rounds`` (finished, by its report; stopped part-way, by its checkpoint): a resumed comparison's
    rounds are carried further, never cut back."""
    from coordinator.checkpoint import CheckpointError, checkpoint_metadata
    from fedfit.sim.report import read_report
    from fedfit.sim.rundir import REPORT_FILE

    most = 0
    for run_dir in sorted({path.parent for pattern in ("*/", "seed-*/*/")
                           for name in (REPORT_FILE, "checkpoint.safetensors")
                           for path in out.glob(f"{pattern}{name}")}):
        reported = _rounds_run(read_report(run_dir / REPORT_FILE)) if (run_dir / REPORT_FILE).exists() else 0
        ran = reported
        try:
            ran = max(ran, int(checkpoint_metadata(run_dir / "checkpoint.safetensors").get("round", 0)))
        except (CheckpointError, OSError, ValueError):
            pass  # no checkpoint (not a round done yet), or one its own resume will refuse in a sentence
        if ran > rounds:
            raise ConfigError(f"{run_dir} ran {ran} rounds: a resumed comparison goes on to as many rounds or more, "
                              f"it cannot cut its runs back to {rounds}")
        most = max(most, reported)
    return most


def _keep_comparison(out: Path, rounds: int) -> None:
    """Before a comparison's runs are carried on past ``rounds``: its comparison files as they stand (``OUT`` and
    each seed's), copied into ``OUT/at-round-<rounds>/`` once, since the runs' reports will be rewritten."""
    kept = out / f"at-round-{rounds}"
    if kept.exists():
        return
    partial = out / f".at-round-{rounds}.tmp"  # whole or not at all: a copy cut short is made again
    shutil.rmtree(partial, ignore_errors=True)
    for path in sorted(out.glob("comparison.*")) + sorted(out.glob("seed-*/comparison.*")):
        target = partial / path.relative_to(out)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)
    if partial.exists():
        os.replace(partial, kept)


def _run_methods(args: argparse.Namespace, load: Loader) -> tuple[list[dict[str, Any]], Path, Experiment]:
    """Run every label once per seed (a resumed comparison: what is not finished) and return the reports."""
    from fedfit.sim.compare import write_comparison
    from fedfit.sim.harness import fleet_data

    if args.seeds and args.seed is not None:
        raise ConfigError("fedfit compare takes --seed or --seeds, not both")
    mapping, base, experiment = _load(args, load)
    labels = _labels(args, experiment)
    values, given = resolve(args, mapping, base, experiment.settings())
    # --seed wins over the file's seeds as any flag does: that one seed, laid out as the file's would be
    seeds = (parse_seeds(args.seeds) if args.seeds else [args.seed] if args.seed is not None and experiment.seeds
             else list(experiment.seeds))
    apart = bool(seeds)  # each seed's runs in a directory of their own
    seeds = seeds or [values["seed"]]
    algorithms = list(dict.fromkeys(compare_variant(label)[0] for label in labels))
    checked = {**values, "seed": seeds[0], "state_dir": None}
    # a resumed comparison's directory is in use, by itself
    check_args = argparse.Namespace(**{**vars(args), "out": None}) if args.resume else args
    data = _checked(checked, base, mapping, check_args, algorithms)
    bases = _run_bases(labels, mapping, base, values, data[0])
    out = _claim_comparison_dir(args, values["rounds"], base)
    if seeds[1:] or apart:
        given = [entry for entry in given if not entry.startswith("--seed ")] + [f"--seeds {','.join(map(str, seeds))}"]
    runner = _Runner(args, out, values, bases, given, experiment, apart)
    reports: list[dict[str, Any]] = []
    for seed in seeds:
        if seed != seeds[0]:
            data = fleet_data(values["dataset"], base.data.root, values["agents"], values["partition"], seed,
                              train_samples=values["train_samples"])
        seed_dir = out / f"seed-{seed}" if apart else out
        seed_reports: list[dict[str, Any]] = []
        for label in labels:
            seed_reports.append(runner.run(label, seed, data, done=reports + seed_reports))
        if apart and len(seeds) > 1:
            write_comparison(seed_reports, seed_dir, experiment.describe())
        reports += seed_reports
    return reports, out, experiment


def _claim_comparison_dir(args: argparse.Namespace, rounds: int, base: CoordinatorConfig) -> Path:
    """The comparison's directory: a new one, its set-up kept; or, resumed, the one given, checked against
    ``rounds`` (and a private run's budget), its comparison as it stood kept when ``--rounds`` carries it further."""
    from fedfit.sim.rundir import claim_run_dir, new_run_dir

    if not args.resume:
        out = claim_run_dir(args.out) if args.out else new_run_dir("runs", "compare")
        _keep_setup(args, out)
        return out
    out = Path(args.out)
    ran = _check_rounds(out, rounds)
    _check_privacy_budget(out, rounds, base)
    if getattr(args, "setup_update", None):  # a larger --rounds: later resumes go on to it too
        if 0 < ran < rounds:
            _keep_comparison(out, ran)
        _write_setup(args.setup_update, out)
    return out


class _Runner:
    """Runs a comparison's methods one at a time, each in its own directory (``OUT/<label>``, or
    ``OUT/seed-S/<label>`` with the seeds ``apart``); a resumed comparison's finished runs are read, the others
    carried on."""

    def __init__(self, args: argparse.Namespace, out: Path, values: dict[str, Any],
                 bases: dict[str, CoordinatorConfig], given: list[str], experiment: Experiment, apart: bool) -> None:
        self.args, self.out, self.values, self.bases = args, out, values, bases
        self.given, self.experiment, self.apart = given, experiment, apart
        self.resuming = bool(args.resume)
        # --log-file: configured once, by the first run that runs (a resumed comparison reads some)
        self.logged = False

    def run(self, label: str, seed: int, data: Any, done: list[dict[str, Any]]) -> dict[str, Any]:
        """The report of ``label``'s run for ``seed``: read where a resumed comparison finished it, else from
        running it (or carrying it on); when the run fails, the runs ``done`` before it are compared and the
        error re-raised."""
        from fedfit.sim.compare import write_comparison
        from fedfit.sim.harness import run_simulation
        from fedfit.sim.report import read_report
        from fedfit.sim.rundir import REPORT_FILE, claim_run_dir

        args, resuming, apart = self.args, self.resuming, self.apart
        run_dir = (self.out / f"seed-{seed}" if apart else self.out) / label
        if resuming and (run_dir / REPORT_FILE).exists():
            finished = read_report(run_dir / REPORT_FILE)
            if _rounds_run(finished) >= self.values["rounds"]:
                print(f"{label} (seed {seed}): finished already, read from {run_dir}", file=sys.stderr, flush=True)
                return finished
        going_on = resuming and run_dir.is_dir()
        run_dir = run_dir if going_on else claim_run_dir(run_dir)
        if not args.log_file:
            _logging(args, run_dir)
        elif not self.logged:
            _logging(args, self.out)
            self.logged = True
        options = _options({**self.values, "seed": seed, "algorithm": compare_variant(label)[0],
                            "state_dir": str(run_dir)}, args, self.bases[label], self.given, resume=going_on)
        name = label if not apart else f"{label} (seed {seed})"
        print(f"{name}: {'going on' if going_on else 'running'} in {run_dir}", file=sys.stderr, flush=True)
        try:
            return run_simulation(options, label=label, run_dir=run_dir, data=data).report
        except BaseException:  # Ctrl-C too: the runs that finished are compared
            if done:  # what finished is compared: a failure late in a long comparison keeps the rest
                write_comparison(done, self.out, self.experiment.describe())
            print(f"{name} stopped; " + (f"the comparison of the runs before it is in {self.out}; " if done else "")
                  + f"fedfit compare --resume {self.out} goes on", file=sys.stderr)
            raise
