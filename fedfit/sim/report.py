"""The simulator's report: one JSON document holding everything needed to read a run later, and the table printed
at the end."""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from coordinator.metrics import RoundResult, TaskRecord, TaskStatus

#: Task statuses in the order reports count them.
STATUSES = tuple(status.value for status in TaskStatus)


def _task(round_number: int, task: TaskRecord) -> dict[str, Any]:
    budget, peak = task.memory("budget_bytes"), task.memory("peak_bytes")
    metrics = task.metrics
    return {
        "round": round_number, "agent": task.agent, "level": task.level, "level_trained": task.level_trained,
        "status": task.status,
        "budget_bytes": budget, "estimated_bytes": task.memory("estimated_bytes"), "peak_bytes": peak,
        "over_budget": None if budget is None or peak is None else peak > budget,
        "stage_peak_bytes": task.stage_peaks(),
        "copies": task.memory("copies") or (1 if task.spec_trained else None),
        "micro_batched_stages": task.memory("micro_batched_stages"),
        "skipped_blocks": task.memory("skipped_blocks"),
        "loss": metrics.get("loss"), "steps": task.memory("steps"), "seconds": metrics.get("seconds"),
        "seconds_slowdown": metrics.get("seconds_slowdown"),  # held back after training (--speeds; None: not)
        "spec_sent": task.spec_sent, "spec_trained": task.spec_trained, "reason": task.reason,
        "screening": dict(task.screening),
        "params_sent": task.params_sent, "params_returned": task.params_returned, "waste": task.waste,
        "staleness": task.staleness,
    }


#: Statuses of a task that came back smaller than sent, or not at all, for want of memory.
SHRUNK = ("adapted", "declined")


def communication(tasks: list[dict[str, Any]]) -> dict[str, float | None]:
    """AdaptiveFL's measures of a set of report tasks: ``waste``, ``1 - sum(size returned) / sum(size sent)``
    (parameters; a task that sent nothing back returned 0), and ``shrunk``, the share of tasks that came back
    pruned or declined for memory. Tasks that sent nothing (skipped, or from a report that counted no
    parameters) are left out; None when none is left."""
    dispatched = [task for task in tasks if task.get("params_sent")]
    sent = sum(task["params_sent"] for task in dispatched)
    if not sent:
        return {"waste": None, "shrunk": None}
    returned = sum(task.get("params_returned") or 0 for task in dispatched)
    return {"waste": 1.0 - returned / sent,
            "shrunk": sum(1 for task in dispatched if task["status"] in SHRUNK) / len(dispatched)}


def _round(r: RoundResult, tasks: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        **communication(tasks),
        "round": r.round,
        # The headline: the model a user would deploy (coordinator.deployable), named; the global model's last
        # output beside it (the same figure when the deployed model is the global one).
        "global_accuracy": r.headline,
        "deployed": r.deployed,
        "global_model_accuracy": r.global_accuracy,
        "level_accuracy": r.level_accuracy,
        **({} if r.levels_evaluated else {"levels_evaluated": False}),  # data.levels_every: the others not asked
        "exit_accuracy": r.exit_accuracy,
        "trained_levels": list(r.trained_levels),
        "trained_exits": list(r.trained_exits),
        "participants": r.participants,
        "selected": r.selected,
        **({"carried": r.carried} if r.carried else {}),
        "bytes_down": r.bytes_down,
        "bytes_up": r.bytes_up,
        "seconds": r.seconds,
        "timing": dict(r.timing),
        **({"privacy": dict(r.privacy)} if r.privacy else {}),  # epsilon spent after the round (privacy section)
        **({"secure": dict(r.secure)} if r.secure else {}),  # the secure exchange (secure_aggregation section)
    }


def model_note(models: Sequence[str]) -> str:
    """`` (b)``: the deployed model a headline is of, when it is not the global model (`coordinator.deployable`)."""
    named = sorted(set(models))
    return "" if named in ([], ["global"]) else f" ({'/'.join(named)})"


def agents_cell(entry: Mapping[str, Any]) -> str:
    """A round's participation as the tables show it: updates aggregated / devices selected, and ``+N`` the tasks
    of earlier rounds it held (buffered rounds), whose updates count too."""
    carried = entry.get("carried", 0)
    selected = entry.get("selected", entry["participants"])
    return f"{entry['participants']}/{selected}" + (f"+{carried}" if carried else "")


def level_average(entry: dict[str, Any]) -> float | None:
    """A round's mean accuracy over the levels some device trained itself in it (a level no tier can train is a
    slice of the others' work, not the method's result); all levels when none is marked; the global accuracy when
    the method has no levels; None in a round that did not evaluate its levels (``data.levels_every``)."""
    if entry.get("levels_evaluated", True) is False:
        return None
    levels = entry["level_accuracy"]
    trained = [value for name, value in levels.items() if name in entry.get("trained_levels", levels)]
    values = trained or list(levels.values())
    return sum(values) / len(values) if values else entry["global_accuracy"]


def levels_round(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The last round that evaluated every level (the last round, unless the run stopped between two rounds of
    ``data.levels_every``); the last round when none did."""
    return next((r for r in reversed(rounds) if r.get("levels_evaluated", True) is not False), rounds[-1])


def summarize(rounds: list[dict[str, Any]], tasks: list[dict[str, Any]],
              wall_seconds: float | None = None) -> dict[str, Any]:
    """The run in a few figures: final and best global accuracy, the final mean over the levels trained
    (:func:`level_average`), tasks by status, tasks over budget, traffic and time."""
    if not rounds:
        return {"rounds": 0}
    final = rounds[-1]
    best = max(rounds, key=lambda r: r["global_accuracy"])
    statuses = Counter(task["status"] for task in tasks)
    measured = communication(tasks)
    return {
        "rounds": len(rounds),
        "final_global_accuracy": final["global_accuracy"],
        "deployed": final.get("deployed", "global"),
        "best_global_accuracy": best["global_accuracy"],
        "best_round": best["round"],
        "final_level_average": level_average(levels_round(rounds)),
        "tasks": {status: statuses.get(status, 0) for status in STATUSES},
        "trained": statuses.get("ok", 0) + statuses.get("adapted", 0),
        "over_budget": sum(1 for task in tasks if task.get("over_budget")),
        "micro_batched": sum(1 for task in tasks if task.get("micro_batched_stages")),
        "partial": sum(1 for task in tasks if task.get("skipped_blocks")),
        "adaptations": adaptations(tasks),
        "communication_waste": measured["waste"],
        "shrunk_share": measured["shrunk"],
        "bytes_down": sum(r["bytes_down"] for r in rounds),
        "bytes_up": sum(r["bytes_up"] for r in rounds),
        "bytes_per_round": sum(r["bytes_down"] + r["bytes_up"] for r in rounds) / len(rounds),
        "round_seconds": sum(r["seconds"] for r in rounds) / len(rounds),
        "wall_seconds": wall_seconds,
        "staleness": staleness(tasks),
        **({"epsilon": final["privacy"]["epsilon"], "delta": final["privacy"]["delta"]} if final.get("privacy") else {}),
    }


def staleness(tasks: list[dict[str, Any]]) -> dict[str, int]:
    """How many trained updates were aggregated how many rounds after their task's (buffered rounds; a
    synchronous run's are all 0): ``{"0": n, "1": m, ...}``."""
    counts = Counter(str(task.get("staleness") or 0) for task in tasks if task["status"] in ("ok", "adapted"))
    return dict(sorted(counts.items(), key=lambda item: int(item[0])))


def adaptations(tasks: list[dict[str, Any]]) -> dict[str, int]:
    """How often a device fell from the level it was sent to a lower one it could train now: ``"M3->M3'"``
    (levels a trained spec is not one of, e.g. depth-wise segments, are left out)."""
    moves = Counter(f"{task['level']}->{task['level_trained']}" for task in tasks
                    if task["status"] == "adapted" and task.get("level_trained")
                    and task["level_trained"] != task["level"])
    return dict(sorted(moves.items()))


def per_agent(tasks: list[dict[str, Any]], tiers: dict[str, str | None]) -> dict[str, dict[str, Any]]:
    """Each agent's tier, how its tasks ended (refusals included) and how many peaked over its budget."""
    agents: dict[str, dict[str, Any]] = {}
    for agent in sorted({*tiers, *(task["agent"] for task in tasks)}):
        own = [task for task in tasks if task["agent"] == agent]
        counts = Counter(task["status"] for task in own)
        agents[agent] = {"tier": tiers.get(agent), **{status: counts.get(status, 0) for status in STATUSES},
                         "over_budget": sum(1 for task in own if task.get("over_budget"))}
    return agents


def devices_served(agents: dict[str, dict[str, Any]]) -> list[int]:
    """``[devices that trained at least once, devices]``."""
    return [sum(1 for counts in agents.values() if counts.get("ok", 0) + counts.get("adapted", 0) > 0), len(agents)]


def tier_outcomes(agents: dict[str, dict[str, Any]], planned: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per tier of devices: what the start-of-run statement planned for it (``planned``: the simulator's
    ``settings.serving``), how many of its devices trained at least once, and its tasks by status."""
    plans = {entry["tier"]: entry for entry in planned}
    outcomes = []
    names = sorted({str(counts.get("tier")) for counts in agents.values()},
                   key=lambda name: (plans.get(name, {}).get("budget_bytes", 0), name))
    for name in names:
        own = [counts for counts in agents.values() if str(counts.get("tier")) == name]
        served, devices = devices_served({str(i): counts for i, counts in enumerate(own)})
        outcomes.append({"tier": name, "devices": devices, "served": served,
                         "planned": plans.get(name, {}).get("trains"),
                         **{status: sum(counts.get(status, 0) for counts in own) for status in STATUSES}})
    return outcomes


def build_report(algorithm: str, broker_kind: str, broker_version: str, rounds: list[RoundResult],
                 settings: dict[str, Any], *, secured: bool = False, run: dict[str, Any] | None = None,
                 tiers: dict[str, str | None] | None = None) -> dict[str, Any]:
    """The report: algorithm, broker, one entry per round (which levels and exits some device trained), every
    task (its memory figures, the peak of each depth-wise stage, the copies, micro-batches and skipped blocks,
    loss, screening figures, what was sent and trained, and why), each agent's outcomes, a summary, the settings
    used and ``run`` (version, times, resolved configuration, overrides, command line)."""
    tasks_by_round = [[_task(r.round, t) for t in r.tasks] for r in rounds]
    round_entries = [_round(r, own) for r, own in zip(rounds, tasks_by_round)]
    tasks = [task for own in tasks_by_round for task in own]
    run = dict(run or {})
    agents = per_agent(tasks, tiers or {})
    summary = summarize(round_entries, tasks, run.get("wall_seconds"))
    if rounds:
        summary["devices_served"] = devices_served(agents)
    return {
        "algorithm": algorithm,
        "broker": {"kind": broker_kind, "version": broker_version, "secured": secured},
        "run": run,
        "summary": summary,
        "rounds": round_entries,
        "tasks": tasks,
        "agents": agents,
        "tiers": tier_outcomes(agents, settings.get("serving", [])),
        "settings": settings,
    }


def _json_safe(value: Any) -> Any:
    """``value`` with every non-finite float as None (standard JSON has no NaN)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _json_safe(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_json_safe(item) for item in value]
    return value


def write_report(report: dict[str, Any], path: str | Path) -> None:
    """Write the report as standard JSON (a non-finite number as null), creating the parent folder; whole or not at
    all (a temporary file renamed)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.tmp")
    partial.write_text(json.dumps(_json_safe(report), indent=2, sort_keys=False, allow_nan=False) + "\n",
                       encoding="utf-8")
    os.replace(partial, target)


def read_report(path: str | Path) -> dict[str, Any]:
    """A report written by :func:`write_report`; ValueError (one sentence) for anything else."""
    target = Path(path)
    try:
        report = json.loads(target.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"{target} does not exist: give a run directory of `fedfit sim` (it holds report.json)") \
            from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{target} is not a FedFit report ({exc})") from None
    if not isinstance(report, dict) or not {"algorithm", "rounds", "tasks"} <= set(report):
        raise ValueError(f"{target} is not a FedFit report (it lacks algorithm, rounds or tasks)")
    return report


def format_table(rounds: list[dict[str, Any]]) -> str:
    """A plain-text table: the deployed model's accuracy (``global``, the model a user would deploy, named in
    ``model`` when it is not the global model), per level and per exit (``*``: no device trained that level or exit
    this round, its figure is of the slice others trained), traffic and time per round."""
    levels = sorted({name for r in rounds for name in r["level_accuracy"]})
    exits = sorted({name for r in rounds for name in r["exit_accuracy"]}, key=lambda name: (len(name), name))
    named = any(r.get("deployed", "global") != "global" for r in rounds)
    private = any(r.get("privacy") for r in rounds)
    header = (["round", "global"] + (["model"] if named else []) + [f"lvl {name}" for name in levels] + list(exits)
              + ["agents", "waste", "MB down", "MB up", "seconds"] + (["epsilon"] if private else []))
    rows = [header]
    marked = False

    def cell(values: dict[str, float], trained: list[str], name: str) -> str:
        nonlocal marked
        if name not in values:
            return "-"
        untrained = name not in trained
        marked |= untrained
        return f"{values[name]:.4f}" + ("*" if untrained else " ")

    for r in rounds:
        rows.append([str(r["round"]), f"{r['global_accuracy']:.4f}"] + ([r.get("deployed", "global")] if named else [])
                    + [cell(r["level_accuracy"], r.get("trained_levels", list(r["level_accuracy"])), name)
                       for name in levels]
                    + [cell(r["exit_accuracy"], r.get("trained_exits", list(r["exit_accuracy"])), name)
                       for name in exits]
                    + [agents_cell(r),
                       "-" if r.get("waste") is None else f"{r['waste']:.3f}", f"{r['bytes_down'] / 1e6:.2f}",
                       f"{r['bytes_up'] / 1e6:.2f}", f"{r['seconds']:.1f}"]
                    + ([f"{r['privacy']['epsilon']:.3g}" if r.get("privacy") else "-"] if private else []))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.rjust(width) for cell, width in zip(row, widths)) for row in rows]
    lines.insert(1, "  ".join("-" * width for width in widths))
    if named:
        lines.append("global: the accuracy of the model a user would deploy, the one named under model (the largest "
                     "level some device trained, or the ensemble of the trained classifiers)")
    if marked:
        lines.append("* no device trained this level (or exit) itself this round: its figure is the slice of the "
                     "global model that others trained")
    if private:
        delta = next(r["privacy"]["delta"] for r in rounds if r.get("privacy"))
        lines.append(f"epsilon: the privacy spent after the round, at delta {delta:g} (docs/privacy.md)")
    if any(r.get("carried") for r in rounds):
        lines.append("agents: updates aggregated / devices selected + tasks carried from earlier rounds (buffered)")
    return "\n".join(lines)


#: Column headings of :func:`format_timing`, by phase (coordinator.metrics.COORDINATOR_PHASES, DEVICE_PHASES).
_TIMING_COLUMNS = {"waiting_for_agents": "waiting", "planning": "planning", "dispatch": "dispatch",
                   "collecting": "collecting", "validation": "validation", "aggregation": "aggregation",
                   "evaluation": "evaluation", "checkpoint": "checkpoint", "queued": "queued", "decision": "decision",
                   "training": "training", "slowdown": "slowdown", "transfer": "transfer"}


def format_timing(rounds: list[dict[str, Any]]) -> str:
    """Where each round's time went (seconds): the coordinator's phases, then the slowest device's. Empty when
    the rounds carry no timing (a report of an older version)."""
    phases = [phase for phase in _TIMING_COLUMNS if any(phase in r.get("timing", {}) for r in rounds)]
    if not phases:
        return ""
    header = ["round", "seconds"] + [_TIMING_COLUMNS[phase] for phase in phases]
    rows = [header] + [[str(r["round"]), f"{r['seconds']:.2f}"]
                       + [f"{r['timing'][phase]:.3f}" if phase in r.get("timing", {}) else "-" for phase in phases]
                       for r in rounds]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.rjust(width) for cell, width in zip(row, widths)) for row in rows]
    lines.insert(1, "  ".join("-" * width for width in widths))
    lines.insert(0, "where the time went (seconds): the coordinator's phases (validation and most of aggregation run "
                    "while collecting), then the slowest device's (queued, decision, training, slowdown, transfer: "
                    "inside collecting)")
    return "\n".join(lines)
