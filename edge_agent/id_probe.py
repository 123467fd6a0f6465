"""One agent id, one process: before an agent connects as itself, it asks whether another process runs its id.

Through a short-lived probe connection (a client id of its own) the starting agent publishes a "starting" status;
when the retained status that came before its echo says another instance is online or busy, it waits up to
:data:`ID_PROBE_WAIT_S` for that instance's answer. A running agent answers at once from its dispatcher, whatever
either side's status interval; a status left by a process that is gone gets no answer, and this one starts.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Callable

from common.mqtt_link import BrokerConfig, MqttLink
from protocol import AgentStatus, ProtocolError, Topics, decode, encode

__all__ = ["ID_PROBE_WAIT_S", "AgentIdInUse", "probe_agent_id"]

#: Seconds a starting agent waits for a running process of its id to answer its "starting" status. The running
#: agent answers from its dispatcher at once, whatever its status interval.
ID_PROBE_WAIT_S = 5.0


class AgentIdInUse(RuntimeError):
    """Another process is connected as this agent already."""


def probe_agent_id(broker: BrokerConfig, topics: Topics, agent_id: str, instance: str, timeout: float, *,
                   refused: Callable[[str, str], Exception], in_use: str) -> AgentStatus | None:
    """Ask whether another process runs ``agent_id`` (this process being ``instance``; see the module docstring).
    Raises :class:`AgentIdInUse` (naming federation ``in_use``) when one answers, and ``refused(topic, reason)``
    when the broker refuses the probe's publish; returns the status a process that is gone left behind, if any."""
    seen: list[AgentStatus] = []  # statuses of other processes of this id, in the order the broker sent them
    echoed = threading.Event()  # our own "starting" came back: everything the broker held came before it
    answered = threading.Event()  # another process's online status came after it
    refusals: list[tuple[str, str]] = []
    own_topic = topics.agent_status(agent_id)

    def keep(topic: str, payload: bytes) -> None:
        with contextlib.suppress(ProtocolError):
            status = decode(payload, expected=AgentStatus)
            assert isinstance(status, AgentStatus)
            if status.agent_id != agent_id:
                return
            if status.instance == instance:
                echoed.set()
                return
            seen.append(status)
            if status.state in ("online", "busy") and echoed.is_set():
                answered.set()

    def refuse(topic: str, reason: str) -> None:
        refusals.append((topic, reason))
        echoed.set()

    probe = MqttLink(client_id=f"fedfit-probe-{agent_id}-{uuid.uuid4().hex[:8]}", broker=broker,
                     subscriptions=[own_topic], handler=keep, on_refused=refuse)
    try:
        probe.start(timeout)
        # Ask whether a process runs this id. The broker delivers in order on the one subscription, so the
        # retained status (if any) arrives before our own "starting" comes back: no fixed wait to guess.
        probe.publish(own_topic, encode(AgentStatus(agent_id, "starting", None, time.time(), instance)))
        echoed.wait(ID_PROBE_WAIT_S)
        if any(status.state in ("online", "busy") for status in seen) and not refusals:
            answered.wait(ID_PROBE_WAIT_S)  # a running agent answers at once; a status left behind never
    finally:
        probe.stop()
    if refusals:
        raise refused(own_topic, refusals[0][1])
    if answered.is_set():
        running = seen[-1]
        raise AgentIdInUse(
            f"agent '{agent_id}' of federation '{in_use}' is running already (process {running.instance or '?'} "
            f"answered): another process uses this agent_id; stop it or give this device its own agent_id")
    stale = [status for status in seen if status.state in ("online", "busy")]
    return stale[-1] if stale else None
