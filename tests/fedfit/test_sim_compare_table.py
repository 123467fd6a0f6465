"""fedfit.sim.compare_table: the runs' columns (epsilon only where some run was private) and the table as text and
markdown."""

from __future__ import annotations

from fedfit.sim.compare_table import aligned, markdown_item, markdown_table, run_table


def row(method: str, **extra: object) -> dict:
    return {"method": method, "global": 0.5, "model": "global", "best_global": 0.6, "level_average": None,
            "levels": {"a": 0.5}, "exits": {}, "untrained": [], "served": [2, 2], "trained": 4, "declined": 0,
            "failed": 0, "rejected": 0, "over_budget": 0, "waste": None, "shrunk_first_last": None,
            "mb_per_round": 1.0, "wall_seconds": 61.0, "late_change": 0.004, **extra}


def test_the_epsilon_column_appears_only_where_a_run_was_private() -> None:
    header, cells = run_table([row("heterofl")])
    assert "epsilon" not in header and cells[0][0] == "heterofl" and cells[0][1] == "0.5000"
    header, cells = run_table([row("heterofl"), row("fedepth", epsilon=3.25, delta=1e-5)])
    assert header[-1] == "epsilon" and [line[-1] for line in cells] == ["-", "3.25 (delta 1e-05)"]
    assert all(len(line) == len(header) for line in cells)


def test_the_table_as_text_and_markdown() -> None:
    text = aligned(("method", "global"), [["a", "0.5"], ["long name", "0.25"]], left=(0,))
    assert text.splitlines()[0].startswith("method") and "long name" in text
    assert markdown_table(("method", "global"), [["a", "0.5"]]).splitlines()[1] == "| --- | --- |"
    assert markdown_item("a note").startswith("- ")
