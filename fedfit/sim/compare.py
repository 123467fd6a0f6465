"""Comparing runs: one row per method, its curves beside the others', as text, PNG and a self-contained HTML page.

A comparison reads the reports of runs on the same fleet (the same agents, data partition, budgets and seed; it
says where they differ). Each row is one method: global accuracy (final and best), each level's or exit's at the
end, the mean over levels, tasks trained / declined / failed / rejected / over budget, traffic per round and wall
time, and the baselines the method's paper compares with.
"""

from __future__ import annotations

import base64
import html
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from coordinator.config import CoordinatorConfig
from fedfit.experiment import BASELINES
from fedfit.sim.budgets import fraction_name
from fedfit.sim.compare_table import aligned, markdown_item, markdown_table, run_table
from fedfit.sim.plots import plot_comparison, plot_seed_comparison
from fedfit.sim.report import level_average, levels_round
from fedfit.sim.seeds import SEED_COLUMNS, late_change, seed_cells, seed_notes, seed_row

#: What each method's paper compares it with (the baselines FedFit runs are named as ``fedfit compare`` takes them).
PAPER_BASELINES = {
    "heterofl": "each level alone, e.g. the smallest for all (fedavg at that width)",
    "scalefl": "fedavg (level 1 for all), decoupled, heterofl",
    "fedepth": "fedavg x1/6 (the smallest width), heterofl (and SplitMix, DepthFL)",
    "fedavg": "the memory-ignoring reference (width 1) or the smallest width for all",
    "decoupled": "a separate model per level, never aggregated across levels",
    "flexfl": "heterofl, scalefl",
    "adaptivefl": "heterofl, scalefl, decoupled, all-large (fedavg width 1)",
    "fedrolex": "heterofl, federated dropout (non-IID: fedrolex >= heterofl)",
    "depthfl": "heterofl, fedavg at each depth (deepest classifier and ensemble >= heterofl)",
    "fjord": "each width alone (fedavg at that width), the widths without distillation",
}
#: What a baseline of ``--baseline`` is.
BASELINE_MEANING = {
    "all-large": "the upper bound: every device trains the full model, as if memory did not matter",
    "all-small": "the lower bound: every device trains the width the smallest tier can",
}
#: Settings that must agree for runs to be on the same fleet.
FLEET_KEYS = ("agents", "rounds", "dataset", "partition", "model", "seed", "train_samples", "budgets",
              "budget_variance", "size_for", "allocator", "device", "speeds")
#: What a report written before a fleet key existed ran with (``speeds`` None: every device at the machine's speed;
#: ``size_for`` dip: sized for all but the rarest rounds).
FLEET_DEFAULTS: dict[str, Any] = {"device": "cpu", "speeds": None, "size_for": "dip"}
#: Parts of the resolved configuration that must agree too: they change the model and what a budget buys.
FLEET_CONFIG_KEYS = (("model options", ("model", "options")), ("recipe", ("recipe",)))


def method_name(report: dict[str, Any]) -> str:
    """The algorithm, with FedAvg's width when it is not 1 (``fedavg x1/6``); a baseline by its name
    (``all-large``, ``all-small (fedavg x1/6)``)."""
    label = report.get("run", {}).get("label")
    if label in BASELINES:
        width = report.get("run", {}).get("config", {}).get("fedavg", {}).get("width", 1.0)
        return label if width == 1.0 else f"{label} (fedavg x{fraction_name(width)})"
    name = report["algorithm"]
    if name == "adaptivefl":
        selection = report.get("run", {}).get("config", {}).get("adaptivefl", {}).get("selection", "rl")
        if selection != "rl":
            name += f"-{selection}"
    if name == "fedavg":
        width = report.get("run", {}).get("config", {}).get("fedavg", {}).get("width", 1.0)
        if width != 1.0:
            name += f" x{fraction_name(width)}"
    return name


def fleet_differences(reports: Sequence[dict[str, Any]], keys: Sequence[str] = FLEET_KEYS) -> list[str]:
    """The fleet settings (of ``keys``) in which the runs differ (each as ``key: a / b / ...``)."""
    found = []
    for key in keys:
        values = [str(report.get("settings", {}).get(key, FLEET_DEFAULTS.get(key))) for report in reports]
        if key == "speeds" and len({_device_speeds(report) for report in reports}) == 1:
            continue  # the same factor on every device, however the flag said it ("1", or none; "10,1" as "10,10,1,1")
        if len(set(values)) > 1:
            found.append(f"{key}: {' / '.join(values)}")
    for label, path in FLEET_CONFIG_KEYS:
        values = []
        for report in reports:
            value: Any = report.get("run", {}).get("config", {})
            for key in path:
                value = value.get(key) if isinstance(value, dict) else None
            values.append(json.dumps(value, sort_keys=True))
        if len(set(values)) > 1:
            found.append(f"{label}: {' / '.join(values)}")
    return found


def _device_speeds(report: dict[str, Any]) -> tuple[float, ...] | None:
    """The factor of each device of a run (None: every device at this machine's speed)."""
    factors = report.get("settings", {}).get("device_speeds")
    return tuple(float(factor) for factor in factors) if factors and any(factor != 1 for factor in factors) else None


def comparison_rows(reports: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per run (see the module docstring)."""
    rows = []
    for report in reports:
        summary = report.get("summary", {})
        final = levels_round(report["rounds"]) if report["rounds"] else {"level_accuracy": {}, "exit_accuracy": {}}
        tasks = summary.get("tasks", {})
        untrained = [name for name in final["level_accuracy"] if name not in final.get("trained_levels", [name])]
        untrained += [name for name in final["exit_accuracy"] if name not in final.get("trained_exits", [name])]
        rows.append({
            "method": method_name(report),
            "global": summary.get("final_global_accuracy"),
            "model": summary.get("deployed", "global"),
            "best_global": summary.get("best_global_accuracy"),
            "level_average": level_average(final) if report["rounds"] else None,
            "levels": dict(sorted(final["level_accuracy"].items())),
            "exits": dict(final["exit_accuracy"]),
            "untrained": untrained,
            "trained": summary.get("trained", 0),
            "served": summary.get("devices_served"),
            "unserved_tiers": [f"{tier['tier']} ({tier['devices'] - tier['served']} of {tier['devices']})"
                               for tier in report.get("tiers", []) if tier["served"] < tier["devices"]],
            "declined": tasks.get("declined", 0) + tasks.get("skipped", 0),
            "failed": tasks.get("failed", 0) + tasks.get("missing", 0),
            "rejected": tasks.get("rejected", 0),
            "over_budget": summary.get("over_budget", 0),
            "rejected_by_agent": {agent: counts["rejected"] for agent, counts in report.get("agents", {}).items()
                                  if counts.get("rejected")},
            "micro_batched": summary.get("micro_batched", 0),
            "partial": summary.get("partial", 0),
            "waste": summary.get("communication_waste"),
            "waste_first_last": _first_last(report["rounds"], "waste"),
            "shrunk_first_last": _first_last(report["rounds"], "shrunk"),
            "mb_per_round": (summary.get("bytes_per_round") or 0) / 1e6,
            "wall_seconds": summary.get("wall_seconds"),
            "late_change": late_change([r["global_accuracy"] for r in report["rounds"]]),
            "paper_baselines": ("" if report.get("run", {}).get("label") in BASELINES
                                else PAPER_BASELINES.get(report["algorithm"], "")),
            "baseline": BASELINE_MEANING.get(report.get("run", {}).get("label", ""), ""),
            "run": report.get("run", {}).get("directory"),
            **({"epsilon": summary["epsilon"], "delta": summary["delta"]} if "epsilon" in summary else {}),
        })
    return rows


def _first_last(rounds: Sequence[dict[str, Any]], key: str, span: int = 2) -> list[float] | None:
    """The mean of ``key`` over the first ``span`` rounds and over the last ``span`` (None when a run does not
    report it)."""
    found = [r.get(key) for r in rounds]
    values = [float(value) for value in found if value is not None]
    if not values or len(values) != len(found):
        return None
    span = max(1, min(span, len(values) // 2))
    return [sum(values[:span]) / span, sum(values[-span:]) / span]


def method_notes(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Once per method: what its paper compares it with, or what the baseline is."""
    notes: dict[str, str] = {}
    for row in rows:
        name = row["method"].split(" (seed ")[0]
        if row.get("baseline"):
            notes.setdefault(name, f"{name}: {row['baseline']}")
        elif row["paper_baselines"]:
            notes.setdefault(name, f"{name}: its paper compares with {row['paper_baselines']}")
    return list(notes.values())


def footnotes(rows: Sequence[dict[str, Any]]) -> list[str]:
    """What the table's marks and averages mean, and per method what its counts hide: tasks micro-batched or
    partly trained, refusals per agent."""
    notes = ["level avg: the mean over the levels some device trained itself in the last round",
             "waste: communication waste, 1 - parameters returned / parameters sent, in all (the mean of the first "
             + "two rounds -> of the last two; one and one below 4 rounds); pruned: the share of tasks returned "
             + "pruned or declined for memory, the same way"]
    notes.append("served: devices that trained at least once / devices in the fleet")
    notes.append("last-5 change: the mean global accuracy of the last five rounds minus that of the five before, in "
                 "points (fewer below 20 rounds: a quarter of them each, at least one): near 0 once the curve has flattened")
    for row in rows:
        if row.get("unserved_tiers"):
            notes.append(f"{row['method']}: devices never trained, by tier: {', '.join(row['unserved_tiers'])}")
    if any(row.get("untrained") for row in rows):
        notes.append("* no device trained that level (or exit) itself in the last round")
    for row in rows:
        if row.get("micro_batched") or row.get("partial"):
            notes.append(f"{row['method']}: {row['micro_batched']} of {row['trained']} trained tasks micro-batched, "
                         f"{row['partial']} partly trained (blocks skipped)")
        if row.get("rejected_by_agent"):
            notes.append(f"{row['method']}: rejected per agent: "
                         + ", ".join(f"{agent} {count}" for agent, count in row["rejected_by_agent"].items()))
    return notes


def _heading(reports: Sequence[dict[str, Any]]) -> str:
    settings = reports[0].get("settings", {})
    rounds = len(reports[0]["rounds"])
    seeds = list(dict.fromkeys(str(report.get("settings", {}).get("seed", "?")) for report in reports))
    return (f"{settings.get('agents', '?')} agents | {settings.get('dataset', '?')} {settings.get('partition', '')} | "
            f"{settings.get('model', '?')} | budgets {settings.get('budgets', '?')} | "
            + (f"speeds {settings['speeds']} | " if settings.get("speeds") else "") + f"seed{'s' * (len(seeds) > 1)} "
            f"{','.join(seeds)} "
            f"| {rounds} round{'' if rounds == 1 else 's'}")


@dataclass
class Comparison:
    """What a comparison says, before it is written as text, Markdown, JSON or HTML."""

    heading: str
    quoted: list[str]  # the experiment's claim and paper figures
    differences: list[str]  # where the runs are not one fleet
    rows: list[dict[str, Any]]  # one per run
    seed_table: list[dict[str, Any]]  # one per method over its seeds (empty: not averaged)
    remarks: list[str]  # e.g. why runs were not averaged, the fleet's memory against All-Large's
    reports: list[dict[str, Any]] = field(default_factory=list)  # the runs, in the rows' order

    def notes(self) -> list[str]:
        """The notes under the tables: the seeds table's, the runs table's, what each method is compared with."""
        return [*(seed_notes(self.seed_table) if self.seed_table else []), *footnotes(self.rows),
                *method_notes(self.rows)]


def comparison_html(comparison: Comparison, png: Path) -> str:
    """A self-contained page: the heading, the tables, the notes and the plot (embedded)."""
    def table(header: Sequence[str], cells: Sequence[Sequence[str]]) -> str:
        head = "".join(f"<th>{html.escape(name)}</th>" for name in header)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(cell)}</td>" for cell in row) + "</tr>" for row in cells)
        return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"

    image = base64.b64encode(png.read_bytes()).decode("ascii")
    paragraphs = "".join(f"<p>{html.escape(line)}</p>" for line in (*comparison.quoted, *comparison.remarks))
    warning = ("<p class='warn'>The runs are not on the same fleet: " + html.escape("; ".join(comparison.differences))
               + "</p>" if comparison.differences else "")
    seeds = (f"<h2>Over the seeds</h2>{table(SEED_COLUMNS, [seed_cells(r) for r in comparison.seed_table])}"
             f"<h2>Every run</h2>" if comparison.seed_table else "")
    notes = "".join(f"<li>{html.escape(note)}</li>" for note in comparison.notes())
    runs = table(*run_table(comparison.rows))
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>FedFit comparison</title>
<style>
body {{ font-family: sans-serif; margin: 2em; }}
table {{ border-collapse: collapse; font-size: 0.9em; }}
th, td {{ border: 1px solid #ccc; padding: 0.3em 0.6em; text-align: right; }}
td:first-child, th {{ text-align: left; }}
.warn {{ color: #a00; }}
img {{ max-width: 100%; }}
</style></head><body>
<h1>FedFit comparison</h1>
<p>{html.escape(comparison.heading)}</p>
{paragraphs}
{warning}
{seeds}
{runs}
<p>Accuracy on the test set at the last round (best: the best round's). Declined counts tasks refused or skipped for
memory, failed those that crashed or missed the deadline, rejected those the coordinator's screening refused; over
budget counts tasks whose measured peak exceeded the device's budget.</p>
<ul>{notes}</ul>
<img alt="accuracy and traffic per round" src="data:image/png;base64,{image}">
</body></html>
"""


def seed_groups(reports: Sequence[dict[str, Any]]) -> tuple[dict[str, list[dict[str, Any]]] | None, str]:
    """The runs by method when some method ran more than once, each time with another seed, or None and why not
    (empty: nothing to average; two runs of one method with one seed are not seeds of one experiment)."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for report in reports:
        groups.setdefault(method_name(report), []).append(report)
    if all(len(group) == 1 for group in groups.values()):
        return None, ""
    for name, group in groups.items():
        seeds = [report.get("settings", {}).get("seed") for report in group]
        repeated = sorted({str(seed) for seed in seeds if seeds.count(seed) > 1})
        if repeated:
            return None, (f"not averaged over seeds: {name} has more than one run with seed {', '.join(repeated)} "
                          f"(runs of one experiment differ in their seed)")
    return groups, ""


#: Parts of a run's resolved configuration that may differ between the seeds of one method.
_PER_RUN_CONFIG = ("seed", "state_dir", "broker", "federation", "min_agents", "resume")
#: Settings that change what is evaluated, not what is trained or deployed: seeds may differ in them.
_EVALUATION_ONLY = ("data.levels_every",)


def _settings(config: dict[str, Any], algorithm: str | None, prefix: str = "") -> dict[str, Any]:
    """A run's configuration as dotted settings (``scalefl.beta``), the per-run parts and the sections of methods
    other than its ``algorithm`` left out."""
    from coordinator.strategies import ALGORITHM_NAMES

    found: dict[str, Any] = {}
    for key, value in config.items():
        if not prefix and (key in _PER_RUN_CONFIG or (key in ALGORITHM_NAMES and key != algorithm)):
            continue
        if isinstance(value, dict) and value:
            found.update(_settings(value, algorithm, f"{prefix}{key}."))
        else:
            found[f"{prefix}{key}"] = value
    return found


def _seed_differences(groups: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Where runs averaged over seeds are not one fleet and one method: a fleet key other than the seed, a method
    setting that differs between one method's seeds, or methods that ran on other seeds."""
    reports = [report for group in groups.values() for report in group]
    found = fleet_differences(reports, [key for key in FLEET_KEYS if key != "seed"])
    for name, group in groups.items():
        # A setting a run lacks was added after it ran: read as its default now (what the run did, unless the
        # default has changed since: the runs' versions say).
        defaults = _settings(asdict(CoordinatorConfig()), group[0].get("algorithm"))
        configs = [_settings(report.get("run", {}).get("config", {}), report.get("algorithm")) for report in group]
        keys = sorted({key for config in configs for key in config
                       if key not in _EVALUATION_ONLY and all(key in c or key in defaults for c in configs)
                       and len({json.dumps(c.get(key, defaults.get(key)), sort_keys=True) for c in configs}) > 1})
        if keys:
            found.append(f"{name}: its seeds' runs differ in {', '.join(keys)}")
    seed_sets = {name: sorted(str(report.get("settings", {}).get("seed")) for report in group)
                 for name, group in groups.items()}
    if len({tuple(seeds) for seeds in seed_sets.values()}) > 1:
        found.append("seeds: " + " / ".join(f"{name} {','.join(seeds)}" for name, seeds in seed_sets.items()))
    return found


def fleet_memory(reports: Sequence[dict[str, Any]]) -> str | None:
    """The fleet's memory against All-Large's: the mean budget of a device (the first run with budgets) and the
    most an All-Large task was estimated to need in the same terms (None without both)."""
    serving = next((report["settings"]["serving"] for report in reports
                    if report.get("settings", {}).get("serving")), None)
    large = [task.get("estimated_bytes") for report in reports if report.get("run", {}).get("label") == "all-large"
             for task in report.get("tasks", [])]
    needs = [need for need in large if need]
    if not serving or not needs:
        return None
    devices = sum(tier["devices"] for tier in serving)
    if not devices:
        return None
    mean = sum(tier["budget_bytes"] * tier["devices"] for tier in serving) / devices
    return (f"memory: the fleet's budgets average {mean / 2**20:.1f} MiB a device, {mean / max(needs):.2f} of what "
            f"All-Large asks of every device ({max(needs) / 2**20:.1f} MiB, its estimate with the same margin)")


#: Runs that are bounds or baselines, not heterogeneous methods (``fedavg x1/6``, ``all-small (fedavg x1/16)``).
_NOT_METHODS = ("all-large", "all-small", "fedavg", "decoupled")


def learning_goal(reports: Sequence[dict[str, Any]]) -> str | None:
    """FedFit's learning goal, read from a comparison with both bounds: the best heterogeneous method's deployed
    model within 1 point of All-Large, and above All-Small by more than half the gap between them, each figure the
    mean over the seeds the method and both bounds ran (a method sharing none is left out); None without both
    bounds or a method. Says which of the three curves are not yet flat (their last-5 change beyond a point): a
    figure on such a curve is not yet the method's."""
    runs: dict[str, dict[Any, tuple[float, float | None]]] = {}
    for report in reports:
        final = report.get("summary", {}).get("final_global_accuracy")
        if final is not None:
            runs.setdefault(method_name(report), {})[report.get("settings", {}).get("seed")] = (
                final, late_change([r["global_accuracy"] for r in report["rounds"]]))
    large = next((name for name in runs if name.split(" ")[0] == "all-large"), None)
    small = next((name for name in runs if name.split(" ")[0] == "all-small"), None)
    if large is None or small is None:
        return None
    paired = {name: sorted(set(seeds) & set(runs[large]) & set(runs[small]), key=str)
              for name, seeds in runs.items() if name.split(" ")[0] not in _NOT_METHODS}
    paired = {name: seeds for name, seeds in paired.items() if seeds}
    if not paired:
        return None

    def mean(name: str, seeds: Sequence[Any], part: int) -> float | None:
        values = [runs[name][seed][part] for seed in seeds]
        present = [value for value in values if value is not None]
        return sum(present) / len(present) if present else None

    best = max(paired, key=lambda name: mean(name, paired[name], 0) or 0.0)
    seeds = paired[best]
    accuracy, top, bottom = (mean(name, seeds, 0) or 0.0 for name in (best, large, small))
    gap = round((top - accuracy) * 100, 6)
    above, half = round((accuracy - bottom) * 100, 6), round((top - bottom) * 50, 6)
    met = gap <= 1.0 and above > half
    position = f"{gap:.2f} points below" if gap >= 0 else f"{-gap:.2f} points above"
    moving = [f"{name} {change * 100:+.1f}" for name in (best, large, small)
              if (change := mean(name, seeds, 1)) is not None and abs(change) > 0.01]
    over = f" (seed{'s' * (len(seeds) > 1)} {', '.join(map(str, seeds))})"
    return (f"learning goal{over}: the best method, {best} ({accuracy:.4f}), is {position} {large} ({top:.4f}; "
            f"goal: within 1) and {above:.2f} above {small} ({bottom:.4f}; goal: more than half their gap, "
            f"{half:.2f}): {'met' if met else 'not met'}"
            + (f"; not yet flat (last-5 change in points): {', '.join(moving)}" if moving else ""))


def comparison_of(reports: Sequence[dict[str, Any]], experiment: dict[str, str] | None = None) -> Comparison:
    """What the comparison of ``reports`` says (see :func:`write_comparison`)."""
    if not reports:
        raise ValueError("a comparison needs at least one run")
    rows = comparison_rows(reports)
    groups, not_averaged = seed_groups(reports)
    seeds = {str(report.get("settings", {}).get("seed")) for report in reports}
    if len(seeds) > 1:  # every run's row says its seed
        for row, report in zip(rows, reports):
            row["method"] += f" (seed {report.get('settings', {}).get('seed')})"
    seed_table: list[dict[str, Any]] = []
    if groups is not None:
        differences = _seed_differences(groups)
        row_of = {id(report): row for row, report in zip(rows, reports)}
        seed_table = [seed_row(name, group, [row_of[id(report)] for report in group])
                      for name, group in groups.items()]
    else:
        differences = fleet_differences(reports)
    # Ranked by the headline: the final accuracy of the model each method would deploy (its mean over seeds).
    order = sorted(range(len(rows)), key=lambda i: -(rows[i]["global"] if rows[i]["global"] is not None else -1.0))
    rows, ranked = [rows[i] for i in order], [reports[i] for i in order]
    if seed_table:
        seed_table = sorted(seed_table, key=lambda row: -(row["global"]["mean"] if row["global"] else -1.0))
    remarks = [remark for remark in (not_averaged, fleet_memory(reports), learning_goal(reports)) if remark]
    quoted = [f"{key}: {value}" for key, value in (experiment or {}).items()]
    return Comparison(_heading(reports), quoted, differences, rows, seed_table, remarks, ranked)


def write_comparison(reports: Sequence[dict[str, Any]], directory: Path,
                     experiment: dict[str, str] | None = None) -> dict[str, Path]:
    """Write ``comparison.txt``, ``comparison.md``, ``comparison.json``, ``comparison.png`` and ``comparison.html``
    into ``directory``; returns their paths by kind. Where a method ran with several seeds, each leads with its
    mean and spread over them and the PNG draws its mean with a band; ``experiment``: the claim and the paper's
    figures the comparison tests (:meth:`fedfit.experiment.Experiment.describe`)."""
    comparison = comparison_of(reports, experiment)
    directory.mkdir(parents=True, exist_ok=True)
    rows, seed_table = comparison.rows, comparison.seed_table
    seed_cells_ = [seed_cells(row) for row in seed_table]
    warning = ["NOT THE SAME FLEET: " + "; ".join(comparison.differences)] if comparison.differences else []
    text = "\n".join([comparison.heading, *comparison.quoted, *comparison.remarks, *warning]) + "\n\n"
    markdown = "\n\n".join([comparison.heading, *comparison.quoted, *comparison.remarks,
                             *(f"**Not the same fleet:** {'; '.join(comparison.differences)}"
                               for _ in warning)]) + "\n\n"
    if seed_table:
        text += "over the seeds:\n" + aligned(SEED_COLUMNS, seed_cells_, left=(0, 6)) + "\n\nevery run:\n"
        markdown += markdown_table(SEED_COLUMNS, seed_cells_) + "\n\nEvery run:\n\n"
    header, run_cells = run_table(rows)
    text += aligned(header, run_cells, left=(0, 4)) + "\n\n"
    text += "\n".join(comparison.notes()) + "\n"
    markdown += markdown_table(header, run_cells) + "\n\n"
    markdown += "\n".join(markdown_item(note) for note in comparison.notes()) + "\n"
    paths = {"txt": directory / "comparison.txt", "md": directory / "comparison.md",
             "json": directory / "comparison.json", "png": directory / "comparison.png",
             "html": directory / "comparison.html"}
    paths["txt"].write_text(text, encoding="utf-8")
    paths["md"].write_text(markdown, encoding="utf-8")
    paths["json"].write_text(json.dumps({"heading": comparison.heading, **(experiment or {}),
                                         "remarks": comparison.remarks, "differences": comparison.differences,
                                         "over_seeds": seed_table, "rows": rows}, indent=2) + "\n",
                             encoding="utf-8")
    groups = seed_groups(reports)[0]
    if groups is not None:
        plot_seed_comparison(groups, paths["png"])
    else:
        plot_comparison(comparison.reports, [row["method"] for row in rows], paths["png"])
    paths["html"].write_text(comparison_html(comparison, paths["png"]), encoding="utf-8")
    return paths
