"""Fleet registry: what the coordinator knows of each agent, fed by retained status messages."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from protocol import AgentStatus, Capabilities


@dataclass
class AgentRecord:
    """The latest status of one agent."""

    agent_id: str
    state: str
    capabilities: Capabilities | None
    last_seen: float
    instance: str = ""
    #: The model it holds to run, ``name@sha256``, and the last delivery it refused, ``name@sha256: reason``, as its
    #: report last said (protocol.MODEL_DELIVERY_REVISION).
    model: str = ""
    model_refused: str = ""

    @property
    def online(self) -> bool:
        return self.state in ("online", "busy") and self.capabilities is not None

    def budget(self) -> int | None:
        """Memory the agent said it can give training: its budget, capped by what is available."""
        if self.capabilities is None:
            return None
        candidates = [self.capabilities.memory_available]
        if self.capabilities.budget_bytes is not None:
            candidates.append(self.capabilities.budget_bytes)
        return min(candidates)


def _models_said(status: AgentStatus, previous: AgentRecord | None) -> dict[str, str]:
    """What ``status`` says of the models the agent holds and refused; a status without a report keeps what the same
    process said before."""
    if status.report is not None:
        return {"model": status.report.model, "model_refused": status.report.model_refused}
    if previous is not None and previous.instance == status.instance:
        return {"model": previous.model, "model_refused": previous.model_refused}
    return {}


class FleetRegistry:
    """Thread-safe map of agent id to its latest status; waiters wake on every change."""

    def __init__(self) -> None:
        self._agents: dict[str, AgentRecord] = {}
        self._changed = threading.Condition()
        self._last_change = time.monotonic()
        self._interrupted = False

    def interrupt(self) -> None:
        """Wake every waiter now and let later waits return at once (the run is ending)."""
        with self._changed:
            self._interrupted = True
            self._changed.notify_all()

    def on_status(self, status: AgentStatus, now: float | None = None) -> AgentRecord | None:
        """Record a status message (the Last Will arrives as state 'offline'); returns the record it replaces."""
        with self._changed:
            previous = self._agents.get(status.agent_id)
            self._agents[status.agent_id] = AgentRecord(
                agent_id=status.agent_id,
                state=status.state,
                capabilities=status.capabilities,
                last_seen=time.time() if now is None else now,
                instance=status.instance,
                # A status without a report (a heartbeat to an older coordinator, the Last Will) changes nothing.
                **_models_said(status, previous),
            )
            # The fleet changed (a new agent, one gone or back, another process): a heartbeat of an agent online
            # all along is no change, else a large fleet's statuses would never leave the quiet wait_settled needs.
            if previous is None or previous.online != self._agents[status.agent_id].online or \
                    previous.instance != status.instance:
                self._last_change = time.monotonic()
            self._changed.notify_all()
            return previous

    def get(self, agent_id: str) -> AgentRecord | None:
        with self._changed:
            return self._agents.get(agent_id)

    def revision(self, agent_id: str) -> int:
        """The protocol revision ``agent_id`` announced (`protocol.PROTOCOL_REVISION`; 1 when it announced none or
        is not known)."""
        record = self.get(agent_id)
        return record.capabilities.protocol_version if record is not None and record.capabilities else 1

    def oldest_revision(self) -> int | None:
        """The oldest protocol revision an agent online announced (``Capabilities.protocol_version``); None when
        no agent is online."""
        with self._changed:
            revisions = [a.capabilities.protocol_version for a in self._agents.values()
                         if a.online and a.capabilities is not None]
        return min(revisions) if revisions else None

    def online(self) -> list[AgentRecord]:
        """Agents that are connected and have reported their capabilities, sorted by id."""
        with self._changed:
            return sorted((a for a in self._agents.values() if a.online), key=lambda a: a.agent_id)

    def wait_for(self, count: int, timeout: float) -> list[AgentRecord]:
        """Block until ``count`` agents are online, ``timeout`` passes or :meth:`interrupt`; returns those online."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                online = sorted((a for a in self._agents.values() if a.online), key=lambda a: a.agent_id)
                remaining = deadline - time.monotonic()
                if len(online) >= count or remaining <= 0 or self._interrupted:
                    return online
                self._changed.wait(remaining)

    def wait_until(self, done: Callable[[dict[str, AgentRecord]], bool], timeout: float) -> bool:
        """Block until ``done(records by agent id)`` (asked under the lock at every change: it must not block),
        ``timeout`` passes or :meth:`interrupt`; whether it came true."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                if done(self._agents):
                    return True
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._interrupted:
                    return False
                self._changed.wait(remaining)

    def wait_settled(self, count: int, quiet: float, timeout: float,
                     on_change: Callable[[int], None] | None = None) -> list[AgentRecord]:
        """Block until ``count`` agents are online and the fleet has not changed for ``quiet`` seconds (no agent new,
        gone, back or restarted: the retained statuses of the whole fleet are in), or ``timeout`` passes; returns those online. ``on_change(online)`` is
        called (lock held: it must not block) whenever the number online changes, and once at the start."""
        deadline = time.monotonic() + timeout
        seen = -1
        with self._changed:
            while True:
                online = sorted((a for a in self._agents.values() if a.online), key=lambda a: a.agent_id)
                if on_change is not None and len(online) != seen:
                    seen = len(online)
                    on_change(seen)
                now = time.monotonic()
                calm = now - self._last_change
                if (len(online) >= count and calm >= quiet) or now >= deadline or self._interrupted:
                    return online
                wake = deadline if len(online) < count else min(deadline, now + quiet - calm)
                self._changed.wait(max(0.001, wake - now))
