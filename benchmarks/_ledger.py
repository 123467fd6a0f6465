"""The ledger of one federation's updates, read from its files once it has stopped: per task (by task id) whether
its agent's update was acknowledged, in which rounds it was aggregated, whether it was rejected or refused with a
reason, and whether it was still in its agent's outbox at the end. ``faults.py`` and ``soak.py`` count from it.

What it reads, in the directory ``faults.setup`` makes: the coordinator's and each agent's JSON log
(``coordinator.log``, ``<agent>.log``: every process of that daemon appends to the same file), the coordinator's
``metrics.jsonl`` and round journal (``coordinator/round/round.json``) and the agents' outboxes
(``agents/<agent>/**/outbox/<task id>.update``).

The definitions, for one task (its id names its round and agent: ``r<round>-<agent>-<8 hex>``):

- **acked**: its agent logged ``update_acked`` (the coordinator's ack that it is stored), or heard its verdict
  (``update_aggregated``, ``update_rejected_by_coordinator``: the second ack), or the coordinator logged
  ``update_received`` for it with no refusal (an ack it sent, which a killed agent may not have read).
- **aggregated in round R**: the record of round R in ``metrics.jsonl`` holds it as trained (``ok`` or ``adapted``;
  a rejected update's record says ``rejected``). Records are kept by agent, not by task: the record of agent A in
  round R with staleness ``s`` is the task of A planned in round ``R - s`` (buffered rounds aggregate a carried
  task in a later round than its own), matched to its task id through the ids the logs name for that round and
  agent (one per round and agent: the round's journal keeps a task's id across a coordinator's restart).
- **rejected**: screening or validation refused the stored update with a reason (its record, its verdict, the
  coordinator's ``update_rejected``): refused, not lost.
- **refused**: the coordinator answered the update with a reason instead of storing it (the agent's
  ``update_refused``; e.g. its round closed, an unknown task): never acked, so never lost.
- **lost**: acked, trained, never aggregated in any recorded round and not rejected (a refusal that came after an
  ack does not excuse it: the ack said it was stored). A round missing from ``metrics.jsonl`` (a coordinator killed
  after its checkpoint, before its record) hides what it aggregated: a task lost where such a round could have
  taken it says so (``unrecorded``).
- **counted twice**: aggregated in two records (two rounds, or one round recorded twice); a round recorded twice
  is listed on its own too.
- **left**: its update was still in its agent's outbox when the federation stopped (not acknowledged as stored),
  reported apart from lost; ``carried_at_end`` when the coordinator's last journal carries its task (a buffered
  run ends with tasks still training: nothing will ever take their updates).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TASK_ID = re.compile(r"^r(\d+)-(.+)-[0-9a-f]{8}$")
TRAINED = ("ok", "adapted")
#: Log events that say something went wrong on its own (besides any line at level error or critical).
TROUBLE = ("message_handler_failed", "task_crashed", "update_not_journaled", "spooled_update_corrupt_deleted",
           "update_abandoned", "update_parked", "verdict_not_sent", "spooled_update_dropped", "update_not_spooled")


@dataclass
class TaskEntry:
    """What the files say of one task."""

    task: str
    agent: str
    round: int
    status: str | None = None  # the agent's answer (ok, adapted, declined, failed), as far as anything says
    acked_by: set[str] = field(default_factory=set)  # "agent", "verdict", "coordinator"
    aggregated: list[int] = field(default_factory=list)  # rounds whose record holds it as trained (repeats: twice)
    staleness: list[int] = field(default_factory=list)  # rounds late, per aggregation
    rejected: str | None = None  # screening's or validation's reason
    refused: str | None = None  # the reason the coordinator answered instead of storing it
    heard_aggregated: bool = False  # its agent heard the verdict "aggregated"
    left: bool = False  # in its agent's outbox at the end
    carried_at_end: bool = False  # the coordinator's last journal carries it (a buffered run's end)
    unrecorded: list[int] = field(default_factory=list)  # rounds from its own on missing from metrics.jsonl

    @property
    def acked(self) -> bool:
        return bool(self.acked_by)

    @property
    def trained(self) -> bool:
        return self.status in TRAINED

    @property
    def lost(self) -> bool:
        return self.acked and self.trained and not self.aggregated and self.rejected is None

    @property
    def twice(self) -> bool:
        return len(self.aggregated) > 1

    def note(self) -> str:
        """What the logs say of a task that is lost or left, in a few words."""
        said = [f"acked by {'+'.join(sorted(self.acked_by))}" if self.acked else "never acked"]
        if self.heard_aggregated:
            said.append("its agent heard 'aggregated'")
        if self.refused:
            said.append(f"refused: {self.refused[:80]}")
        if self.carried_at_end:
            said.append("carried out of the last round")
        if self.unrecorded and not self.aggregated:
            said.append(f"round(s) {', '.join(map(str, self.unrecorded))} missing from metrics.jsonl")
        return "; ".join(said)

    def row(self) -> dict[str, Any]:
        return {"task": self.task, "agent": self.agent, "round": self.round, "status": self.status,
                "aggregated_in": self.aggregated, "note": self.note()}


@dataclass
class Ledger:
    """A federation's tasks by id, and what is wrong with its records as a whole."""

    tasks: dict[str, TaskEntry]
    rounds: list[int]  # the rounds recorded, in the order written
    rounds_twice: list[int]
    rounds_missing: list[int]  # between 1 and the last recorded (or ``expected``)
    unreadable_lines: list[int]  # 1-based lines of metrics.jsonl that are no round's result
    participants_off: list[int]  # rounds whose participants differ from their records held as trained
    unmatched: list[str]  # records that no task id of the logs matches, or more than one does
    trouble: Counter[str]  # log events that say something went wrong, "<daemon>: <event>"
    rows: list[dict[str, Any]] = field(default_factory=list)

    def of_rounds(self, rounds: Iterable[int]) -> list[TaskEntry]:
        """The tasks planned in, or aggregated in, any of ``rounds``."""
        wanted = set(rounds)
        return [entry for entry in self.tasks.values()
                if entry.round in wanted or wanted.intersection(entry.aggregated)]

    def staleness(self) -> Counter[int]:
        """Aggregated updates by rounds late."""
        return Counter(late for entry in self.tasks.values() for late in entry.staleness)


def log_entries(path: Path) -> tuple[list[dict[str, Any]], int]:
    """The JSON lines of a daemon's log, and how many tracebacks it holds outside them."""
    if not path.exists():
        return [], 0
    entries, tracebacks = [], 0
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            try:
                entries.append(json.loads(line))
            except ValueError:
                continue
        elif line.startswith("Traceback"):
            tracebacks += 1
    return entries, tracebacks


def read_metrics(path: Path) -> tuple[list[dict[str, Any]], list[int]]:
    """Every round's result in ``metrics.jsonl`` in the order written, and the lines that are none (a write cut
    short by a kill, with the next one appended to it)."""
    rows, unreadable = [], []
    if path.exists():
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), start=1):
            try:
                row = json.loads(line)
                rows.append({"round": int(row["round"]), **row})
            except (ValueError, KeyError, TypeError):
                unreadable.append(number)
    return rows, unreadable


def read_ledger(workdir: Path, agents: Iterable[str], expected_rounds: int | None = None) -> Ledger:
    """The ledger of the federation in ``workdir`` (see the module docstring); ``expected_rounds``: the rounds it
    was to record, for the missing ones."""
    tasks: dict[str, TaskEntry] = {}
    trouble: Counter[str] = Counter()

    def entry(task_id: object) -> TaskEntry | None:
        match = TASK_ID.match(str(task_id))
        if match is None:
            return None
        if task_id not in tasks:
            tasks[str(task_id)] = TaskEntry(str(task_id), match.group(2), int(match.group(1)))
        return tasks[str(task_id)]

    def scan(daemon: str, entries: list[dict[str, Any]], tracebacks: int) -> None:
        for event in entries:
            name = event.get("event", "")
            if event.get("level") in ("error", "critical") or name in TROUBLE:
                trouble[f"{daemon}: {name}"] += 1
        if tracebacks:
            trouble[f"{daemon}: traceback"] += tracebacks

    coordinator, tracebacks = log_entries(workdir / "coordinator.log")
    scan("coordinator", coordinator, tracebacks)
    for event in coordinator:
        name = event.get("event")
        task = entry(event.get("task")) if name in ("update_received", "update_rejected", "update_deferred",
                                                   "task_resent") else None
        if task is None:
            continue
        if name == "update_received":
            task.status = task.status or event.get("status")
            if event.get("refused"):
                task.refused = str(event["refused"])
            elif event.get("verdict") in ("accepted", "duplicate"):
                task.acked_by.add("coordinator")
        elif name == "update_rejected":
            task.rejected = str(event.get("reason"))
    for agent in agents:
        entries, tracebacks = log_entries(workdir / f"{agent}.log")
        scan("agents", entries, tracebacks)
        for event in entries:
            task = entry(event.get("task"))
            if task is None:
                continue
            name = event.get("event")
            if name == "task_done":
                task.status = str(event.get("status"))
            elif name == "update_acked":
                task.acked_by.add("agent")
            elif name == "update_aggregated":
                task.acked_by.add("verdict")
                task.heard_aggregated = True
            elif name == "update_rejected_by_coordinator":
                task.acked_by.add("verdict")
                task.rejected = str(event.get("reason"))
            elif name == "update_refused":
                task.refused = str(event.get("reason"))
        for path in (workdir / "agents" / agent).rglob("outbox/*.update"):
            task = entry(path.name[: -len(".update")])
            if task is not None:
                task.left = True
    journal = workdir / "coordinator" / "round" / "round.json"
    try:
        for listed in json.loads(journal.read_text()).get("tasks", []):
            task = entry(listed.get("task_id"))
            if task is not None:
                task.carried_at_end = True
    except (OSError, ValueError, AttributeError):
        pass

    rows, unreadable = read_metrics(workdir / "coordinator" / "metrics.jsonl")
    by_key: dict[tuple[int, str], list[TaskEntry]] = {}
    for task in tasks.values():
        by_key.setdefault((task.round, task.agent), []).append(task)
    unmatched, participants_off = [], []
    for row in rows:
        held = 0
        for record in row.get("tasks", []):
            status = record.get("status")
            if status == "skipped":
                continue
            late = int(record.get("staleness", 0))
            candidates = by_key.get((row["round"] - late, record.get("agent", "")), [])
            held += status in TRAINED
            if len(candidates) != 1:
                if status != "missing":
                    unmatched.append(f"round {row['round']} {record.get('agent')} ({status}, {late} late): "
                                     f"{len(candidates)} task ids")
                continue
            task = candidates[0]
            if status in TRAINED:
                task.aggregated.append(row["round"])
                task.staleness.append(late)
                task.status = task.status or status
            elif status == "rejected":
                task.rejected = task.rejected or str(record.get("reason"))
            elif status in ("declined", "failed"):
                task.status = task.status or status
        if row.get("participants") != held:
            participants_off.append(row["round"])
    recorded = [row["round"] for row in rows]
    last = max([*recorded, expected_rounds or 0])
    missing = [r for r in range(1, last + 1) if r not in set(recorded)]
    for task in tasks.values():
        task.unrecorded = [r for r in missing if r >= task.round]
    return Ledger(tasks, recorded, sorted(r for r, n in Counter(recorded).items() if n > 1), missing, unreadable,
                  participants_off, unmatched, trouble, rows)


def figures(entries: Iterable[TaskEntry]) -> dict[str, int]:
    """The counts of a set of tasks: acked, trained and acked, aggregated, lost (of them: where a round that could
    have taken them is missing from the records), counted twice, rejected, refused, left (of them: acked too, carried
    out of the last round)."""
    entries = list(entries)
    return {"tasks": len(entries), "acked": sum(e.acked for e in entries),
            "acked_trained": sum(e.acked and e.trained for e in entries),
            "aggregated": sum(bool(e.aggregated) for e in entries), "lost": sum(e.lost for e in entries),
            "lost_where_a_round_is_unrecorded": sum(e.lost and bool(e.unrecorded) for e in entries),
            "counted_twice": sum(e.twice for e in entries),
            "rejected": sum(e.rejected is not None for e in entries),
            "refused": sum(e.refused is not None and not e.acked for e in entries),
            "left": sum(e.left for e in entries), "left_acked": sum(e.left and e.acked for e in entries),
            "left_carried_at_end": sum(e.left and e.carried_at_end for e in entries)}


def summary(counts: Mapping[str, int]) -> str:
    """One line of :func:`figures`."""
    return (f"acked {counts['acked']}, lost {counts['lost']}, counted twice {counts['counted_twice']}, rejected "
            f"{counts['rejected']}, refused {counts['refused']}, left {counts['left']}")
