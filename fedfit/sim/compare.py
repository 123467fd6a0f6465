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
from pathlib import Path
from typing import Any

from fedfit.sim.budgets import fraction_name
from fedfit.sim.plots import plot_comparison
from fedfit.sim.progress import duration_text
from fedfit.sim.report import level_average

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
#: Settings that must agree for runs to be on the same fleet.
FLEET_KEYS = ("agents", "rounds", "dataset", "partition", "model", "seed", "train_samples", "budgets",
              "budget_variance", "allocator", "device")
#: What a report written before a fleet key existed ran with.
FLEET_DEFAULTS = {"device": "cpu"}
#: Parts of the resolved configuration that must agree too: they change the model and what a budget buys.
FLEET_CONFIG_KEYS = (("model options", ("model", "options")), ("recipe", ("recipe",)))


def method_name(report: dict[str, Any]) -> str:
    """The algorithm, with FedAvg's width when it is not 1 (``fedavg x1/6``)."""
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


def fleet_differences(reports: Sequence[dict[str, Any]]) -> list[str]:
    """The fleet settings in which the runs differ (each as ``key: a / b / ...``)."""
    found = []
    for key in FLEET_KEYS:
        values = [str(report.get("settings", {}).get(key, FLEET_DEFAULTS.get(key))) for report in reports]
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


def comparison_rows(reports: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per run (see the module docstring)."""
    rows = []
    for report in reports:
        summary = report.get("summary", {})
        final = report["rounds"][-1] if report["rounds"] else {"level_accuracy": {}, "exit_accuracy": {}}
        tasks = summary.get("tasks", {})
        untrained = [name for name in final["level_accuracy"] if name not in final.get("trained_levels", [name])]
        untrained += [name for name in final["exit_accuracy"] if name not in final.get("trained_exits", [name])]
        rows.append({
            "method": method_name(report),
            "global": summary.get("final_global_accuracy"),
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
            "paper_baselines": PAPER_BASELINES.get(report["algorithm"], ""),
            "run": report.get("run", {}).get("directory"),
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


def _waste(row: dict[str, Any]) -> str:
    """Communication waste in all, and from the first rounds to the last (``0.31 (0.52->0.10)``)."""
    if row.get("waste") is None:
        return "-"
    trend = row.get("waste_first_last")
    return f"{row['waste']:.3f}" + (f" ({trend[0]:.2f}->{trend[1]:.2f})" if trend else "")


def _pruned(row: dict[str, Any]) -> str:
    """The share of tasks returned pruned or declined, from the first rounds to the last (``60%->0%``)."""
    trend = row.get("shrunk_first_last")
    return f"{trend[0]:.0%}->{trend[1]:.0%}" if trend else "-"


def _served(row: dict[str, Any]) -> str:
    """Devices that trained at least once, of all (``6/8``)."""
    served = row.get("served")
    return f"{served[0]}/{served[1]}" if served else "-"


def _accuracy(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def _outputs(row: dict[str, Any]) -> str:
    """Each level's and exit's accuracy at the end, ``*`` where no device trained it itself in the last round."""
    marked = set(row.get("untrained", ()))
    parts = [f"{name} {value:.3f}" + ("*" if name in marked else "")
             for name, value in (*row["levels"].items(), *row["exits"].items())]
    return " ".join(parts) or "-"


_COLUMNS = ("method", "global", "best", "level avg", "levels / exits at the end", "served", "trained", "declined",
            "failed",
            "rejected", "over budget", "waste", "pruned", "MB/round", "wall time")


def _cells(row: dict[str, Any]) -> list[str]:
    wall = row["wall_seconds"]
    return [row["method"], _accuracy(row["global"]), _accuracy(row["best_global"]), _accuracy(row["level_average"]),
            _outputs(row), _served(row), str(row["trained"]), str(row["declined"]), str(row["failed"]), str(row["rejected"]),
            str(row["over_budget"]), _waste(row), _pruned(row), f"{row['mb_per_round']:.2f}", duration_text(wall) if wall is not None else "-"]


def comparison_table(rows: Sequence[dict[str, Any]]) -> str:
    """The rows as aligned text, then each method's paper baselines."""
    table = [list(_COLUMNS)] + [_cells(row) for row in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(_COLUMNS))]
    lines = ["  ".join(cell.ljust(w) if i in (0, 4) else cell.rjust(w) for i, (cell, w) in enumerate(zip(line, widths)))
             for line in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append("")
    lines += footnotes(rows)
    lines += [f"{row['method']}: its paper compares with {row['paper_baselines']}" for row in rows
              if row["paper_baselines"]]
    return "\n".join(lines)


def footnotes(rows: Sequence[dict[str, Any]]) -> list[str]:
    """What the table's marks and averages mean, and per method what its counts hide: tasks micro-batched or
    partly trained, refusals per agent."""
    notes = ["level avg: the mean over the levels some device trained itself in the last round",
             "waste: communication waste, 1 - parameters returned / parameters sent, in all (the mean of the first "
             + "two rounds -> of the last two; one and one below 4 rounds); pruned: the share of tasks returned "
             + "pruned or declined for memory, the same way"]
    notes.append("served: devices that trained at least once / devices in the fleet")
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
    return (f"{settings.get('agents', '?')} agents | {settings.get('dataset', '?')} {settings.get('partition', '')} | "
            f"{settings.get('model', '?')} | budgets {settings.get('budgets', '?')} | seed {settings.get('seed', '?')} "
            f"| {rounds} round{'' if rounds == 1 else 's'}")


def comparison_html(reports: Sequence[dict[str, Any]], rows: Sequence[dict[str, Any]], png: Path) -> str:
    """A self-contained page: the heading, the table, the paper baselines and the plot (embedded)."""
    image = base64.b64encode(png.read_bytes()).decode("ascii")
    header = "".join(f"<th>{html.escape(name)}</th>" for name in _COLUMNS)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(cell)}</td>" for cell in _cells(row)) + "</tr>"
                   for row in rows)
    notes = "".join(f"<li>{html.escape(note)}</li>" for note in footnotes(rows))
    notes += "".join(f"<li><b>{html.escape(row['method'])}</b>: its paper compares with "
                     f"{html.escape(row['paper_baselines'])}</li>" for row in rows if row["paper_baselines"])
    differences = fleet_differences(reports)
    warning = ("<p class='warn'>The runs are not on the same fleet: " + html.escape("; ".join(differences)) + "</p>"
               if differences else "")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>FedFit comparison</title>
<style>
body {{ font-family: sans-serif; margin: 2em; }}
table {{ border-collapse: collapse; font-size: 0.9em; }}
th, td {{ border: 1px solid #ccc; padding: 0.3em 0.6em; text-align: right; }}
td:first-child, td:nth-child(5), th {{ text-align: left; }}
.warn {{ color: #a00; }}
img {{ max-width: 100%; }}
</style></head><body>
<h1>FedFit comparison</h1>
<p>{html.escape(_heading(reports))}</p>
{warning}
<table><thead><tr>{header}</tr></thead><tbody>{body}</tbody></table>
<p>Accuracy on the test set at the last round (best: the best round's). Declined counts tasks refused or skipped for
memory, failed those that crashed or missed the deadline, rejected those the coordinator's screening refused; over
budget counts tasks whose measured peak exceeded the device's budget.</p>
<ul>{notes}</ul>
<img alt="accuracy and traffic per round" src="data:image/png;base64,{image}">
</body></html>
"""


def write_comparison(reports: Sequence[dict[str, Any]], directory: Path) -> dict[str, Path]:
    """Write ``comparison.txt``, ``comparison.json``, ``comparison.png`` and ``comparison.html`` into
    ``directory``; returns their paths by kind."""
    if not reports:
        raise ValueError("a comparison needs at least one run")
    directory.mkdir(parents=True, exist_ok=True)
    rows = comparison_rows(reports)
    differences = fleet_differences(reports)
    text = _heading(reports) + "\n"
    if differences:
        text += "NOT THE SAME FLEET: " + "; ".join(differences) + "\n"
    text += "\n" + comparison_table(rows) + "\n"
    paths = {"txt": directory / "comparison.txt", "json": directory / "comparison.json",
             "png": directory / "comparison.png", "html": directory / "comparison.html"}
    paths["txt"].write_text(text, encoding="utf-8")
    paths["json"].write_text(json.dumps({"heading": _heading(reports), "differences": differences, "rows": rows},
                                        indent=2) + "\n", encoding="utf-8")
    plot_comparison(reports, [row["method"] for row in rows], paths["png"])
    paths["html"].write_text(comparison_html(reports, rows, paths["png"]), encoding="utf-8")
    return paths
