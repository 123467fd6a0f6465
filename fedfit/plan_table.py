"""The table ``fedfit plan`` prints: one row per level or pool model."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_FIRST = ("name", "tier", "budget_bytes", "trains", "segments", "spec", "params", "flops", "train_bytes")


def _cell(key: str, value: Any) -> str:
    if isinstance(value, list):
        return " ".join(_cell(key, item) for item in value)
    if key.endswith("_bytes"):
        return f"{value / 2**20:.1f} MiB"
    if key in ("params", "flops"):
        return f"{value / 1e6:.3f} M"
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def format_plan(rows: Sequence[dict[str, Any]]) -> str:
    """Aligned columns: name (or tier), spec, parameters, FLOPs, training memory, then the strategy's own
    figures."""
    keys = [k for k in _FIRST if any(k in row for row in rows)]
    keys += [k for row in rows for k in row if k not in keys]
    keys = list(dict.fromkeys(keys))
    table = [keys] + [[_cell(k, row[k]) if k in row else "-" for k in keys] for row in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(keys))]
    lines = ["  ".join(cell.ljust(w) if i == 1 else cell.rjust(w) for i, (cell, w) in enumerate(zip(line, widths)))
             for line in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
