"""Every run has a directory of its own: the report, the metrics as CSV, a summary, the plots, and the state the
run made (the coordinator's checkpoint and metrics, the agents' calibrations). Nothing one run learns leaks into
another, and a second run never overwrites or appends to a first.

Layout of ``runs/<time>-<algorithm>/`` (a comparison puts one such directory per algorithm under its own)::

    report.json      everything needed to read the run later (see fedfit.sim.report)
    metrics.csv      one row per round: accuracies, which levels were trained, traffic, time
    summary.txt      the final table, best and final accuracy, tasks by status, traffic, wall time
    accuracy.png     accuracy per round of the global model, each level and each exit
    traffic.png      bytes down and up per round
    daemons.log      the coordinator's and agents' JSON logs (unless --log-file says otherwise)
    checkpoint.safetensors, metrics.jsonl, agents/   the coordinator's and the agents' state
    status.yaml      what ``fedfit status --config`` reads (fedfit.sim.status_file)
    broker/          while the run goes on: its broker's files, secrets included (0700; fedfit.sim.broker)
"""

from __future__ import annotations

import csv
import time
from pathlib import Path
from typing import Any

from coordinator.model_courier import holds
from fedfit.sim.plots import plot_run
from fedfit.sim.progress import duration_text
from fedfit.sim.report import STATUSES, format_table, write_report

#: Files that say a directory holds a run already.
RUN_MARKERS = ("report.json", "checkpoint.safetensors", "metrics.jsonl")
REPORT_FILE = "report.json"


def new_run_dir(root: str | Path, label: str, now: float | None = None) -> Path:
    """A fresh ``root/<YYYYmmdd-HHMMSS>-<label>`` (``-2``, ``-3``... when that exists), created."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(time.time() if now is None else now))
    base = Path(root) / f"{stamp}-{label}"
    path, number = base, 1
    while True:
        try:
            path.mkdir(parents=True)
            return path
        except FileExistsError:
            number += 1
            path = base.with_name(f"{base.name}-{number}")


def refuse_used_dir(path: str | Path) -> None:
    """ValueError (one sentence) when ``path`` cannot become a run's (or comparison's) directory: a file, or a
    directory holding anything (an earlier run, a comparison, an interrupted run's calibrations). Creates nothing,
    so a run checks it before its slower checks."""
    target = Path(path)
    try:
        if target.exists() and not target.is_dir():
            raise ValueError(f"{target} is a file, not a directory: give another directory")
        if target.is_dir():
            found = sorted(entry.name for entry in target.iterdir())
            if found:
                what = "a run" if any(name in found for name in RUN_MARKERS) else "files"
                raise ValueError(f"{target} holds {what} already ({', '.join(found[:4])}"
                                 f"{', ...' if len(found) > 4 else ''}): give a new or empty directory, or leave it "
                                 f"out for a new one under runs/")
    except OSError as exc:
        raise ValueError(f"cannot use {target} for a run: {exc.strerror or exc}") from None


def claim_run_dir(path: str | Path) -> Path:
    """``path`` as a run's (or comparison's) directory: created, or an empty one; ValueError (one sentence) as
    :func:`refuse_used_dir`, or when it cannot be made."""
    target = Path(path)
    refuse_used_dir(target)
    try:
        target.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"cannot use {target} for a run: {exc.strerror or exc}") from None
    return target


def metrics_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per round: global accuracy, each level's and exit's, which of them no device trained, traffic."""
    rounds = report["rounds"]
    levels = sorted({name for r in rounds for name in r["level_accuracy"]})
    exits = sorted({name for r in rounds for name in r["exit_accuracy"]}, key=lambda name: (len(name), name))
    rows = []
    for r in rounds:
        row: dict[str, Any] = {"round": r["round"], "global_accuracy": r["global_accuracy"],
                               "deployed": r.get("deployed", "global")}
        row.update({f"level_{name}": r["level_accuracy"].get(name, "") for name in levels})
        row.update({name: r["exit_accuracy"].get(name, "") for name in exits})
        trained = set(r.get("trained_levels", levels)) | set(r.get("trained_exits", exits))
        untrained = [name for name in (*levels, *exits)
                     if name in {**r["level_accuracy"], **r["exit_accuracy"]} and name not in trained]
        row.update({"untrained": " ".join(untrained), "participants": r["participants"],
                    "selected": r.get("selected", r["participants"]), "bytes_down": r["bytes_down"],
                    "bytes_up": r["bytes_up"], "seconds": r["seconds"]})
        rows.append(row)
    return rows


def write_metrics_csv(report: dict[str, Any], path: Path) -> None:
    """``metrics.csv``: :func:`metrics_rows`."""
    rows = metrics_rows(report)
    with path.open("w", newline="", encoding="utf-8") as handle:
        if rows:
            writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)


def left_text(left: list[dict[str, str]]) -> str:
    """The line saying what a run ended without settling (``run.left`` of its report)."""
    if not left:
        return "left at the end: nothing (every update a device sent was aggregated or refused with a reason)"
    places = {"training": "still training", "held back": "trained, held back by its slowdown",
              "outbox": "in its outbox, not acked",
              "carried": "carried, no round took it", "held": "held for a round that never came"}
    return "left at the end: " + "; ".join(
        f"{entry['agent']} {entry['task']} ({places.get(entry['where'], entry['where'])})" for entry in left)


def models_text(models: dict[str, str]) -> str:
    """The line saying which model each agent holds to run at the end (``run.models`` of its report)."""
    held = {agent: text.partition("@")[0] for agent, text in models.items() if holds(text)}
    line = f"models held at the end: {len(held)} of {len(models)} agents"
    by_model: dict[str, list[str]] = {}
    for agent, name in sorted(held.items()):
        by_model.setdefault(name, []).append(agent)
    line += "".join(f"; {name}: {', '.join(agents)}" for name, agents in by_model.items())
    missing = {agent: why for agent, why in models.items() if agent not in held}
    return line + "".join(f"; {agent} none ({why})" for agent, why in sorted(missing.items()))


def summary_text(report: dict[str, Any]) -> str:
    """What ``summary.txt`` says: the run's settings, its final table and its figures."""
    settings = report.get("settings", {})
    summary = report.get("summary", {})
    run = report.get("run", {})
    heading = (f"{report['algorithm']} | {settings.get('agents', '?')} agents | {settings.get('dataset', '?')} "
               f"{settings.get('partition', '')} | {settings.get('model', '?')} | budgets "
               f"{settings.get('budgets', '?')} | " + (f"speeds {settings['speeds']} | " if settings.get("speeds") else "")
               + f"seed {settings.get('seed', '?')}")
    lines = [heading]
    if run.get("version"):
        lines.append(f"{run['version']}, started {run.get('started_at', '?')}, ended {run.get('ended_at', '?')}")
    lines += ["", format_table(report["rounds"]), ""]
    if summary.get("rounds"):
        deployed = summary.get("deployed", "global")
        lines.append(f"global accuracy (the model a user would deploy: "
                     f"{'the global model' if deployed == 'global' else deployed}): "
                     f"final {summary['final_global_accuracy']:.4f}, best "
                     f"{summary['best_global_accuracy']:.4f} (round {summary['best_round']})"
                     + ("" if summary["final_level_average"] is None else
                        f"; mean over levels at the end {summary['final_level_average']:.4f}"))
        tasks = summary["tasks"]
        lines.append("tasks: " + (", ".join(f"{tasks[status]} {status}" for status in STATUSES if tasks.get(status))
                                  or "none")
                     + f"; {summary['over_budget']} peaked over their budget"
                     + (f"; {summary['micro_batched']} trained in micro-batches" if summary.get("micro_batched") else "")
                     + (f"; {summary['partial']} partial" if summary.get("partial") else ""))
        stale = {int(rounds): count for rounds, count in (summary.get("staleness") or {}).items() if int(rounds)}
        if stale:
            lines.append("buffered rounds: trained updates aggregated late, by rounds late: " + ", ".join(
                f"{rounds}: {count}" for rounds, count in sorted(stale.items()))
                + f" (on time: {(summary.get('staleness') or {}).get('0', 0)})")
        if summary.get("adaptations"):
            lines.append("adapted on the device: " + ", ".join(f"{move} x{count}"
                                                              for move, count in summary["adaptations"].items()))
        if summary.get("communication_waste") is not None:
            first, last = (report["rounds"][i].get("waste") for i in (0, -1))
            lines.append(f"communication waste (1 - size returned / size sent): {summary['communication_waste']:.3f} "
                         f"in all, {'-' if first is None else f'{first:.3f}'} in round 1, "
                         f"{'-' if last is None else f'{last:.3f}'} in the last; tasks returned pruned or declined: "
                         f"{summary['shrunk_share']:.0%}")
        lines.append(f"traffic: {summary['bytes_down'] / 1e6:.1f} MB down, {summary['bytes_up'] / 1e6:.1f} MB up "
                     f"({summary['bytes_per_round'] / 1e6:.2f} MB a round)")
        wall = summary.get("wall_seconds")
        lines.append(f"time: {summary['round_seconds']:.1f} s a round" + (
            f", {duration_text(wall)} in all" if wall is not None else ""))
    if "left" in run:
        lines.append(left_text(run["left"]))
    if run.get("models"):
        lines.append(models_text(run["models"]))
    refusals = {agent: entry for agent, entry in report.get("agents", {}).items()
                if entry.get("rejected") or entry.get("declined") or entry.get("failed")}
    if refusals:
        lines.append("refused or failed, per agent: " + "; ".join(
            f"{agent} ({entry.get('tier') or '-'}): " + ", ".join(
                f"{entry[s]} {s}" for s in ("declined", "failed", "rejected") if entry.get(s))
            for agent, entry in refusals.items()))
    return "\n".join(lines) + "\n"


def write_run_outputs(report: dict[str, Any], directory: Path) -> list[Path]:
    """Write the report and what is read from it (CSV, summary, plots) into ``directory``; returns the paths."""
    directory.mkdir(parents=True, exist_ok=True)
    write_metrics_csv(report, directory / "metrics.csv")
    (directory / "summary.txt").write_text(summary_text(report), encoding="utf-8")
    written = [directory / "metrics.csv", directory / "summary.txt"]
    if report["rounds"]:
        written += plot_run(report, directory)
    write_report(report, directory / REPORT_FILE)  # last: a run with its report is a finished run (--resume)
    return [directory / REPORT_FILE, *written]
