"""The comparison's table of runs: its columns (with ``epsilon`` where some run was private) and each run's cells,
and the table as aligned text or markdown."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fedfit.sim.progress import duration_text
from fedfit.sim.report import model_note

__all__ = ["aligned", "markdown_item", "markdown_table", "run_table"]


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
            "rejected", "over budget", "waste", "pruned", "MB/round", "wall time", "last-5 change")


def run_table(rows: Sequence[dict[str, Any]]) -> tuple[tuple[str, ...], list[list[str]]]:
    """The table's columns and each run's cells, with ``epsilon`` at the end where some run was private (the
    privacy section)."""
    private = any("epsilon" in row for row in rows)
    return _COLUMNS + (("epsilon",) if private else ()), [_cells(row) + ([_epsilon(row)] if private else [])
                                                          for row in rows]


def _epsilon(row: dict[str, Any]) -> str:
    return f"{row['epsilon']:.3g} (delta {row['delta']:g})" if "epsilon" in row else "-"


def _cells(row: dict[str, Any]) -> list[str]:
    wall = row["wall_seconds"]
    return [row["method"], _accuracy(row["global"]) + model_note([row.get("model", "global")]),
            _accuracy(row["best_global"]), _accuracy(row["level_average"]),
            _outputs(row), _served(row), str(row["trained"]), str(row["declined"]), str(row["failed"]), str(row["rejected"]),
            str(row["over_budget"]), _waste(row), _pruned(row), f"{row['mb_per_round']:.2f}", duration_text(wall) if wall is not None else "-",
            "-" if row.get("late_change") is None else f"{row['late_change'] * 100:+.1f}"]


def aligned(header: Sequence[str], cells: Sequence[Sequence[str]], left: Sequence[int]) -> str:
    """Rows of cells as aligned text under ``header`` (the columns in ``left`` flush left, the others right)."""
    table = [list(header)] + [list(row) for row in cells]
    widths = [max(len(line[i]) for line in table) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) if i in left else cell.rjust(w) for i, (cell, w) in enumerate(zip(line, widths)))
             for line in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A GitHub-flavoured Markdown table (``|`` in a cell escaped)."""
    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"

    return "\n".join([line(header), line(["---"] * len(header)), *(line(row) for row in rows)])


def markdown_item(note: str) -> str:
    """A note as a Markdown list item (a leading ``*`` escaped: it would start a list of its own)."""
    return "- " + ("\\" + note if note.startswith("*") else note)
