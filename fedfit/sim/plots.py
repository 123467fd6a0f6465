"""Plots of runs (matplotlib, Agg: no display needed): accuracy per round of the global model, of each level and
exit, and bytes per round; and the curves of several runs side by side. A round in which no device trained a level
(or exit) itself is drawn as a hollow marker."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator  # drawn by Agg on save, without pyplot: nothing global changes

from fedfit.sim.report import level_average

_DPI = 110


def _round_ticks(ax: Axes, rounds: Sequence[int]) -> None:
    """A tick per round for a short run, whole numbers at matplotlib's spacing for a long one."""
    if len(rounds) <= 15:
        ax.set_xticks(list(rounds))
    else:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _series(ax: Axes, rounds: list[dict[str, Any]], key: str, name: str, trained_key: str, label: str,
            style: str = "-") -> None:
    """One level's (or exit's) accuracy per round; rounds where nobody trained it itself are hollow."""
    points = [(r["round"], r[key][name], name in r.get(trained_key, [name])) for r in rounds if name in r[key]]
    if not points:
        return
    line, = ax.plot([p[0] for p in points], [p[1] for p in points], style, label=label, linewidth=1.2)
    colour = line.get_color()
    for number, value, trained in points:
        ax.plot(number, value, "o", markersize=4, color=colour, markerfacecolor=colour if trained else "white")


def accuracy_axes(ax: Axes, report: dict[str, Any], title: str) -> None:
    """Global accuracy (bold: the model a user would deploy), each level (thin) and each exit (dashed) per round
    on ``ax``."""
    rounds = report["rounds"]
    numbers = [r["round"] for r in rounds]
    ax.plot(numbers, [r["global_accuracy"] for r in rounds], "k-o", linewidth=2.2, markersize=4, label="global")
    for name in sorted({n for r in rounds for n in r["level_accuracy"]}):
        _series(ax, rounds, "level_accuracy", name, "trained_levels", f"level {name}")
    for name in sorted({n for r in rounds for n in r["exit_accuracy"]}, key=lambda n: (len(n), n)):
        _series(ax, rounds, "exit_accuracy", name, "trained_exits", name, "--")
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("round")
    ax.set_ylabel("test accuracy")
    _round_ticks(ax, numbers)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, ncol=2)


def plot_run(report: dict[str, Any], directory: Path) -> list[Path]:
    """``accuracy.png`` and ``traffic.png`` of one run in ``directory``; returns their paths."""
    settings = report.get("settings", {})
    title = (f"{report['algorithm']} | {settings.get('model', '?')} | {settings.get('dataset', '?')} "
             f"{settings.get('partition', '')} | budgets {settings.get('budgets', '?')}")
    figure = Figure(figsize=(7, 4.5))
    ax = figure.subplots()
    accuracy_axes(ax, report, title + "\n(hollow: no device trained that level itself in that round)")
    figure.tight_layout()
    accuracy = directory / "accuracy.png"
    figure.savefig(accuracy, dpi=_DPI)

    rounds = report["rounds"]
    numbers = [r["round"] for r in rounds]
    figure = Figure(figsize=(7, 3.5))
    ax = figure.subplots()
    down = [r["bytes_down"] / 1e6 for r in rounds]
    ax.bar(numbers, down, label="down (tasks)")
    ax.bar(numbers, [r["bytes_up"] / 1e6 for r in rounds], bottom=down, label="up (updates)")
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("round")
    ax.set_ylabel("MB per round")
    _round_ticks(ax, numbers)
    ax.legend(fontsize=8)
    figure.tight_layout()
    traffic = directory / "traffic.png"
    figure.savefig(traffic, dpi=_DPI)
    return [accuracy, traffic]


def plot_comparison(reports: Sequence[dict[str, Any]], names: Sequence[str], path: Path) -> Path:
    """The runs side by side in one PNG: global accuracy per round of every run, its mean over levels, and its
    bytes per round; below, each run's own accuracy plot."""
    rows = 1 + -(-len(reports) // 3)
    figure = Figure(figsize=(15.6, 3.8 * rows))
    grid = figure.add_gridspec(rows, 3)
    overview = [figure.add_subplot(grid[0, i]) for i in range(3)]
    for report, name in zip(reports, names):
        rounds = report["rounds"]
        numbers = [r["round"] for r in rounds]
        overview[0].plot(numbers, [r["global_accuracy"] for r in rounds], "-o", markersize=4, label=name)
        averaged = [(r["round"], value) for r in rounds if (value := level_average(r)) is not None]
        overview[1].plot([n for n, _ in averaged], [v for _, v in averaged], "-o", markersize=4, label=name)
        overview[2].plot(numbers, [(r["bytes_down"] + r["bytes_up"]) / 1e6 for r in rounds], "-o", markersize=4,
                         label=name)
    rounds = sorted({r["round"] for report in reports for r in report["rounds"]})
    for ax, title, unit in zip(overview, ("global (the model deployed)", "mean over the levels trained", "traffic"),
                               ("test accuracy", "test accuracy", "MB per round")):
        _finish(ax, title, unit, rounds)
    for index, (report, name) in enumerate(zip(reports, names)):
        accuracy_axes(figure.add_subplot(grid[1 + index // 3, index % 3]), report, name)
    figure.tight_layout()
    figure.savefig(path, dpi=_DPI)
    return path


def _band(ax: Axes, rounds: list[int], means: list[float], spreads: list[float], label: str, width: float = 1.6,
          style: str = "-") -> None:
    line, = ax.plot(rounds, means, style, linewidth=width, label=label)
    if any(spreads):
        ax.fill_between(rounds, [m - s for m, s in zip(means, spreads)], [m + s for m, s in zip(means, spreads)],
                        color=line.get_color(), alpha=0.18, linewidth=0)


def _finish(ax: Axes, title: str, unit: str, rounds: Sequence[int]) -> None:
    """An overview panel's title, axes, round ticks, grid and legend."""
    _round_ticks(ax, rounds)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("round")
    ax.set_ylabel(unit)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)


def plot_seed_comparison(groups: dict[str, list[dict[str, Any]]], path: Path) -> Path:
    """Methods run with several seeds, in one PNG: each method's global accuracy and mean over levels per round as
    the mean over its seeds with a band (plus and minus the spread), and its traffic; below, each method's global
    model and levels (means over the seeds)."""
    from fedfit.sim.seeds import mean_curve

    rows = 1 + -(-len(groups) // 3)
    figure = Figure(figsize=(15.6, 3.8 * rows))
    grid = figure.add_gridspec(rows, 3)
    overview = [figure.add_subplot(grid[0, i]) for i in range(3)]
    rounds = sorted({r["round"] for reports in groups.values() for report in reports for r in report["rounds"]})
    for name, reports in groups.items():
        label = f"{name} ({len(reports)} seed{'s' * (len(reports) > 1)})"
        _band(overview[0], *mean_curve(reports, "global"), label)
        _band(overview[1], *mean_curve(reports, "levels"), label)
        overview[2].plot(*_per_round_mean(reports, lambda r: (r["bytes_down"] + r["bytes_up"]) / 1e6), "-",
                         label=name)
    for ax, title, unit in zip(overview, ("global model (mean over seeds, band: ± spread)",
                                          "mean over the levels trained", "traffic (mean over seeds)"),
                               ("test accuracy", "test accuracy", "MB per round")):
        _finish(ax, title, unit, rounds)
    for index, (name, reports) in enumerate(groups.items()):
        ax = figure.add_subplot(grid[1 + index // 3, index % 3])
        _band(ax, *mean_curve(reports, "global"), "global", width=2.2)
        for key, style, prefix in (("level_accuracy", "-", "level "), ("exit_accuracy", "--", "")):
            outputs = sorted({n for report in reports for r in report["rounds"] for n in r[key]},
                             key=lambda n: (len(n), n))
            for output in outputs:
                numbers, means = _per_round_mean(reports, _output_of(key, output))
                _band(ax, numbers, means, [0.0] * len(numbers), prefix + output, width=1.0, style=style)
        _finish(ax, name, "test accuracy", rounds)
    figure.tight_layout()
    figure.savefig(path, dpi=_DPI)
    return path


def _output_of(key: str, name: str) -> Callable[[dict[str, Any]], float | None]:
    """A round's accuracy of one level (``key`` level_accuracy) or exit (exit_accuracy), None where absent."""
    return lambda r: r[key].get(name)


def _per_round_mean(reports: Sequence[dict[str, Any]],
                    value: Callable[[dict[str, Any]], float | None]) -> tuple[list[int], list[float]]:
    """Rounds and the mean of ``value(round)`` over the runs that report it (None: not reported)."""
    values: dict[int, list[float]] = {}
    for report in reports:
        for r in report["rounds"]:
            found = value(r)
            if found is not None:
                values.setdefault(r["round"], []).append(found)
    numbers = sorted(values)
    return numbers, [sum(values[n]) / len(values[n]) for n in numbers]
