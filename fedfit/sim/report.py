"""The simulator's outputs: the JSON report and the table printed at the end."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from coordinator.metrics import RoundResult


def build_report(algorithm: str, broker_kind: str, broker_version: str, rounds: list[RoundResult],
                 settings: dict[str, Any], *, secured: bool = False) -> dict[str, Any]:
    """The report: algorithm, broker, one entry per round, every task (its memory figures, the peak of each
    depth-wise stage, the copies it trained, what was sent and trained, and why), and the settings used."""
    return {
        "algorithm": algorithm,
        "broker": {"kind": broker_kind, "version": broker_version, "secured": secured},
        "rounds": [
            {
                "round": r.round,
                "global_accuracy": r.global_accuracy,
                "level_accuracy": r.level_accuracy,
                "exit_accuracy": r.exit_accuracy,
                "participants": r.participants,
                "bytes_down": r.bytes_down,
                "bytes_up": r.bytes_up,
                "seconds": r.seconds,
            }
            for r in rounds
        ],
        "tasks": [
            {"round": r.round, "agent": t.agent, "level": t.level, "status": t.status,
             "budget_bytes": t.memory("budget_bytes"), "estimated_bytes": t.memory("estimated_bytes"),
             "peak_bytes": t.memory("peak_bytes"), "stage_peak_bytes": t.stage_peaks(),
             "copies": t.memory("copies") or (1 if t.spec_trained else None), "spec_sent": t.spec_sent,
             "spec_trained": t.spec_trained, "reason": t.reason}
            for r in rounds for t in r.tasks
        ],
        "settings": settings,
    }


def write_report(report: dict[str, Any], path: str | Path) -> None:
    """Write the report as JSON (creating the parent folder)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(report, indent=2, sort_keys=False) + "\n", encoding="utf-8")


def format_table(rounds: list[RoundResult]) -> str:
    """A plain-text table: accuracy overall, per level and per exit, traffic and time per round."""
    levels = sorted({name for r in rounds for name in r.level_accuracy})
    exits = sorted({name for r in rounds for name in r.exit_accuracy}, key=lambda name: (len(name), name))
    header = (["round", "global"] + [f"lvl {name}" for name in levels] + list(exits)
              + ["agents", "MB down", "MB up", "seconds"])
    rows = [header]
    for r in rounds:
        rows.append([str(r.round), f"{r.global_accuracy:.4f}"]
                    + [f"{r.level_accuracy[name]:.4f}" if name in r.level_accuracy else "-" for name in levels]
                    + [f"{r.exit_accuracy[name]:.4f}" if name in r.exit_accuracy else "-" for name in exits]
                    + [f"{r.participants}/{r.selected}", f"{r.bytes_down / 1e6:.2f}", f"{r.bytes_up / 1e6:.2f}",
                       f"{r.seconds:.1f}"])
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.rjust(width) for cell, width in zip(row, widths)) for row in rows]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)
