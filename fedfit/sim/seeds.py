"""Comparing methods over several seeds: each method's runs (one per seed) as one row of means and spreads, and
its curves as the mean over the seeds with a band.

The spread is the sample standard deviation over the seeds (n - 1 in the denominator; none for one seed). A
curve's band is the mean plus and minus that spread, round by round, over the seeds that reached the round.
Whether a run has converged is read from its last rounds: ``last-5 change`` is the mean global accuracy of the
last five rounds minus that of the five before (fewer below 20 rounds: a quarter of the rounds each, at least one).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from fedfit.sim.report import level_average, model_note


def mean_spread(values: Sequence[float]) -> tuple[float, float | None]:
    """The mean and the sample standard deviation (None for fewer than two values)."""
    if not values:
        raise ValueError("no values to average")
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, None
    return mean, math.sqrt(sum((value - mean) ** 2 for value in values) / (len(values) - 1))


def late_change(accuracies: Sequence[float], span: int = 5) -> float | None:
    """The mean of the last ``span`` accuracies minus the mean of the ``span`` before (a quarter of the rounds each
    when there are fewer than ``4 * span``; None below 2 rounds): near 0 once a curve has flattened."""
    span = min(span, len(accuracies) // 4) or min(1, len(accuracies) // 2)
    if span < 1:
        return None
    last = accuracies[-span:]
    before = accuracies[-2 * span:-span]
    return sum(last) / span - sum(before) / span


def curve(report: dict[str, Any], kind: str) -> dict[int, float]:
    """A run's accuracy per round: ``global`` or ``levels`` (the mean over the levels trained)."""
    if kind == "global":
        return {r["round"]: r["global_accuracy"] for r in report["rounds"]}
    return {r["round"]: value for r in report["rounds"] if (value := level_average(r)) is not None}


def mean_curve(reports: Sequence[dict[str, Any]], kind: str) -> tuple[list[int], list[float], list[float]]:
    """The rounds every run reached, the mean over the runs and its spread (0 for one run) for :func:`curve`: a
    round some seeds did not reach would average other seeds than the rest of the curve."""
    curves = [curve(report, kind) for report in reports]
    rounds = sorted(set.intersection(*(set(one) for one in curves))) if curves else []
    means, spreads = [], []
    for number in rounds:
        mean, spread = mean_spread([one[number] for one in curves])
        means.append(mean)
        spreads.append(spread or 0.0)
    return rounds, means, spreads


def _stat(values: Sequence[float | None]) -> dict[str, Any] | None:
    present = [float(value) for value in values if value is not None]
    if not present:
        return None
    mean, spread = mean_spread(present)
    return {"mean": mean, "spread": spread, "values": present}


def seed_row(name: str, reports: Sequence[dict[str, Any]], rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One method over its seeds: ``rows`` are :func:`fedfit.sim.compare.comparison_rows` of ``reports``."""
    outputs: dict[str, list[float]] = {}
    for row in rows:
        for output, value in (*row["levels"].items(), *row["exits"].items()):
            outputs.setdefault(output, []).append(value)
    served = [row["served"] for row in rows if row.get("served")]
    changes = [late_change([r["global_accuracy"] for r in report["rounds"]]) for report in reports]
    return {
        "method": name,
        "seeds": [report.get("settings", {}).get("seed") for report in reports],
        "rounds": max((len(report["rounds"]) for report in reports), default=0),
        "global": _stat([row["global"] for row in rows]),
        "models": sorted({row.get("model", "global") for row in rows}),
        "best_global": _stat([row["best_global"] for row in rows]),
        "level_average": _stat([row["level_average"] for row in rows]),
        "outputs": {output: mean_spread(values)[0] for output, values in outputs.items()},
        "untrained": sorted({output for row in rows for output in row["untrained"]}),
        "late_change": _stat(changes),
        "served": [min(entry[0] for entry in served), served[0][1]] if served else None,
        **{key: sum(row[key] for row in rows) for key in ("trained", "declined", "failed", "rejected", "over_budget")},
        "mb_per_round": mean_spread([row["mb_per_round"] for row in rows])[0],
        "wall_seconds": _stat([row["wall_seconds"] for row in rows]),
    }


def stat_text(stat: dict[str, Any] | None, digits: int = 4, scale: float = 1.0, sign: bool = False) -> str:
    """``0.8123 ±0.0041`` (no spread for one seed; ``-`` for none)."""
    if stat is None:
        return "-"
    mean = f"{stat['mean'] * scale:+.{digits}f}" if sign else f"{stat['mean'] * scale:.{digits}f}"
    return mean if stat["spread"] is None else f"{mean} ±{stat['spread'] * scale:.{digits}f}"


SEED_COLUMNS = ("method", "seeds", "global", "best", "level avg", "last-5 change (points)",
                "levels / exits at the end (mean)", "served (fewest)", "trained", "declined", "failed", "rejected",
                "over budget", "MB/round")


def seed_cells(row: dict[str, Any]) -> list[str]:
    """A row of :func:`seed_row` as the table's cells (:data:`SEED_COLUMNS`)."""
    marked = set(row["untrained"])
    outputs = " ".join(f"{name} {value:.3f}" + ("*" if name in marked else "")
                       for name, value in row["outputs"].items()) or "-"
    served = f"{row['served'][0]}/{row['served'][1]}" if row["served"] else "-"
    return [row["method"], str(len(row["seeds"])), stat_text(row["global"]) + model_note(row.get("models", [])),
            stat_text(row["best_global"]),
            stat_text(row["level_average"]), stat_text(row["late_change"], 1, 100.0, sign=True), outputs, served,
            str(row["trained"]), str(row["declined"]), str(row["failed"]), str(row["rejected"]),
            str(row["over_budget"]), f"{row['mb_per_round']:.2f}"]


def seed_notes(rows: Sequence[dict[str, Any]]) -> list[str]:
    """What the seed table's figures are."""
    notes = [("each figure is the mean over the seeds, ± the sample standard deviation (none for one seed); "
              "counts are summed over the seeds"),
             "served (fewest): devices that trained at least once, in the seed that served the fewest"]
    if any(row["untrained"] for row in rows):
        notes.append("* no device trained that level (or exit) itself in the last round of some seed")
    return notes
