"""The fleet as ``fedfit status`` shows it, built from the retained statuses a broker holds: each agent's (online,
busy or offline, its memory, what it trains now and what it last answered, its outbox) and the coordinator's (the
round in progress). Nothing here touches the network: :class:`StatusBook` takes the messages as they arrive."""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

from protocol import (
    STATUS_REPORT_REVISION,
    AgentStatus,
    CoordinatorStatus,
    PrivacySpent,
    ProtocolError,
    RoundProgress,
    Topics,
    decode,
    parse_agent_topic,
)

__all__ = ["AgentRow", "CoordinatorRow", "FleetView", "StatusBook", "format_view", "outage_line", "view_json"]

#: An agent re-publishes its status every 30 s by default (``status_interval_s``): one not heard for this long
#: while it says online may have lost its connection before the broker noticed.
STALE_AFTER_S = 120.0
MiB = 2**20


@dataclass(frozen=True)
class AgentRow:
    """One agent as its retained status says. ``sent_at``: when it published that status (a Last Will's is the
    time its process started); ``reports``: whether the status carried a report (``since`` onwards; agents that
    predate reports, or whose coordinator does not read them, send none)."""

    agent_id: str
    state: str
    sent_at: float
    device_kind: str = ""
    memory_total: int = 0
    memory_available: int = 0
    budget_bytes: int | None = None
    revision: int = 0
    reports: bool = False
    since: float = 0.0
    task: str = ""
    task_round: int = 0
    last_task: str = ""
    last_round: int = 0
    last_status: str = ""
    last_trained: str = ""
    last_reason: str = ""
    last_finished_at: float = 0.0
    outbox: int = 0
    outbox_bytes: int = 0
    model: str = ""
    model_refused: str = ""

    @classmethod
    def of(cls, status: AgentStatus) -> AgentRow:
        caps, report = status.capabilities, status.report
        row = cls(status.agent_id, status.state, status.sent_at)
        if caps is not None:
            row = cls(**{**asdict(row), "device_kind": caps.device_kind, "memory_total": caps.memory_total,
                         "memory_available": caps.memory_available, "budget_bytes": caps.budget_bytes,
                         "revision": caps.protocol_version})
        if report is not None:
            row = cls(**{**asdict(row), **asdict(report), "reports": True})
        return row


@dataclass(frozen=True)
class CoordinatorRow:
    """The coordinator as its retained status says: ``round`` is the round in progress, else the last one done;
    ``revision`` 0 when its status carries no progress (an older coordinator, or one with an older agent online)."""

    state: str
    round: int
    sent_at: float
    revision: int = 0
    progress: RoundProgress | None = None
    privacy: PrivacySpent | None = None


@dataclass(frozen=True)
class FleetView:
    """Everything ``fedfit status`` shows: the coordinator (None when the broker holds no status of it), the
    agents by id, and how many statuses could not be read."""

    federation: str
    coordinator: CoordinatorRow | None
    agents: tuple[AgentRow, ...]
    unreadable: int = 0


class StatusBook:
    """The latest status of every agent of ``federation`` and of its coordinator, fed message by message (from
    any thread); an empty payload (a cleared retained status) forgets it."""

    def __init__(self, federation: str) -> None:
        self.federation = federation
        self._topics = Topics(federation)
        self._agents: dict[str, AgentRow] = {}
        self._coordinator: CoordinatorRow | None = None
        self._unreadable: set[str] = set()
        self._lock = threading.Lock()

    def feed(self, topic: str, payload: bytes) -> None:
        """Take one message of the status topics; one that cannot be read is counted, not raised."""
        try:
            if topic == self._topics.coordinator_status():
                self._take_coordinator(payload)
                return
            federation, agent_id, kind = parse_agent_topic(topic)
            if federation != self.federation or kind != "status":
                return
            self._take_agent(agent_id, payload)
        except ProtocolError:
            with self._lock:
                self._unreadable.add(topic)

    def _take_coordinator(self, payload: bytes) -> None:
        status = decode(payload, expected=CoordinatorStatus) if payload else None
        assert status is None or isinstance(status, CoordinatorStatus)
        with self._lock:
            self._unreadable.discard(self._topics.coordinator_status())
            self._coordinator = None if status is None else CoordinatorRow(status.state, status.round, status.sent_at,
                                                                           status.revision, status.progress,
                                                                           status.privacy)

    def _take_agent(self, agent_id: str, payload: bytes) -> None:
        if not payload:
            with self._lock:
                self._agents.pop(agent_id, None)
            return
        status = decode(payload, expected=AgentStatus)
        assert isinstance(status, AgentStatus)
        if status.state == "starting":  # a process asking whether one runs this id: not a state of the agent
            return
        if status.agent_id != agent_id:
            raise ProtocolError(f"status of {status.agent_id!r} on the topic of {agent_id!r}")
        with self._lock:
            self._unreadable.discard(self._topics.agent_status(agent_id))
            self._agents[agent_id] = AgentRow.of(status)

    def view(self) -> FleetView:
        """The fleet as the statuses taken so far say."""
        with self._lock:
            return FleetView(self.federation, self._coordinator,
                             tuple(self._agents[agent_id] for agent_id in sorted(self._agents)), len(self._unreadable))


def _ago(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _mib(size: int) -> str:
    return f"{size / MiB:.0f}" if size >= 10 * MiB else f"{size / MiB:.1f}"


def _state(row: AgentRow, now: float) -> str:
    if row.state == "offline":  # (a Last Will's time is when the process started: not when it went)
        return f"offline (status sent {_ago(now - row.sent_at)} ago)"
    text = "training" if row.state == "busy" else "idle"
    if row.reports:
        text += f" {_ago(now - row.since)}"
    if now - row.sent_at > STALE_AFTER_S:
        text += f" (not heard for {_ago(now - row.sent_at)})"
    return text


def _memory(row: AgentRow) -> str:
    if not row.memory_total:
        return "-"
    text = f"{_mib(row.memory_available)}/{_mib(row.memory_total)} MiB"
    return text + (f", budget {_mib(row.budget_bytes)}" if row.budget_bytes is not None else "")


def _doing(row: AgentRow) -> str:
    if not row.reports:
        return "-" if row.state == "offline" else "(no report: no coordinator that reads them yet, or an older agent)"
    parts = []
    if row.task:
        parts.append(f"now: {row.task} (round {row.task_round})")
    if row.last_task:
        last = f"last: round {row.last_round} {row.last_status}"
        last += f" {row.last_trained}" if row.last_trained else ""
        last += f" ({row.last_reason})" if row.last_reason and row.last_status != "ok" else ""
        parts.append(last)
    if row.outbox:
        parts.append(f"outbox {row.outbox} ({_mib(row.outbox_bytes)} MiB)")
    if row.model:
        parts.append(f"holds model {row.model.partition('@')[0]}")
    if row.model_refused:
        name, _, rest = row.model_refused.partition("@")
        parts.append(f"refused model {name}{rest[64:]}")
    return "; ".join(parts) or "no task yet"


def _coordinator_line(view: FleetView, now: float) -> str:
    line = _coordinator_state(view, now)
    spent = view.coordinator.privacy if view.coordinator is not None else None
    if spent is None or view.coordinator is None or view.coordinator.state == "offline":
        return line
    budget = f" of a budget of {spent.max_epsilon:g}" if spent.max_epsilon else ""
    return f"{line}; privacy spent: epsilon {spent.epsilon:.3g}{budget} at delta {spent.delta:g}"


def _coordinator_state(view: FleetView, now: float) -> str:
    coordinator = view.coordinator
    if coordinator is None:
        return f"coordinator of '{view.federation}': no status on this broker (never started, or this login may " \
               "not read it)"
    if coordinator.state == "offline":  # (its Last Will was made when it started: its time and round are those)
        return f"coordinator: offline (status sent {_ago(now - coordinator.sent_at)} ago)"
    progress = coordinator.progress
    if coordinator.revision < STATUS_REPORT_REVISION:
        return (f"coordinator: online, round {coordinator.round} (in progress or done: its progress is not reported, "
                "an older coordinator or an older agent online)")
    if progress is None:
        return f"coordinator: online, round {coordinator.round} done, none in progress" if coordinator.round else \
            "coordinator: online, no round yet"
    left = progress.deadline - now
    return (f"coordinator: online, round {progress.round}: {progress.received}/{progress.expected} answers, "
            f"{_ago(now - progress.started_at)} elapsed, deadline " +
            (f"in {_ago(left)}" if left >= 0 else f"passed {_ago(-left)} ago"))


def format_view(view: FleetView, now: float) -> str:
    """The fleet as text: the coordinator's line, a count, and one row per agent."""
    online = [row for row in view.agents if row.state != "offline"]
    training = sum(row.state == "busy" for row in online)
    lines = [f"federation '{view.federation}'", _coordinator_line(view, now),
             (f"agents: {len(view.agents)} known, {len(online)} online ({training} training), "
             f"{len(view.agents) - len(online)} offline")]
    if view.unreadable:
        lines.append(f"{view.unreadable} status(es) could not be read (another FedFit version?)")
    if view.agents:
        rows = [("agent", "device", "state", "memory available/total", "tasks")]
        rows += [(row.agent_id, row.device_kind or "-", _state(row, now), _memory(row), _doing(row))
                 for row in view.agents]
        widths = [max(len(row[column]) for row in rows) for column in range(4)]
        lines.append("")
        lines += ["  ".join(cell.ljust(width) for cell, width in zip(row[:4], widths, strict=True)) + "  " + row[4]
                  for row in rows]
    return "\n".join(line.rstrip() for line in lines)


def view_json(view: FleetView, now: float) -> dict[str, Any]:
    """The fleet as plain data (``fedfit status --json``): every field of every row, and ``now``."""
    coordinator = None if view.coordinator is None else asdict(view.coordinator)
    return {"federation": view.federation, "now": now, "coordinator": coordinator,
            "agents": [asdict(row) for row in view.agents], "unreadable": view.unreadable}


def outage_line(broker: str, lost_at: float, now: float) -> str:
    """What ``fedfit status --watch`` says first while its broker is unreachable: since when, and that the fleet
    shown is the last one seen."""
    clock = time.strftime("%H:%M:%S", time.localtime(lost_at))
    return (f"broker {broker} unreachable since {clock} ({_ago(now - lost_at)} ago), reconnecting: the fleet below "
            f"is as last seen")
