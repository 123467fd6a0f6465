"""Which federations a broker shows: read once through a short-lived connection, for the sentence a coordinator
says when no agent of its own federation comes online (a misspelt or default ``federation:`` on one side)."""

from __future__ import annotations

import contextlib
import threading
import time

from common.mqtt_link import BrokerConfig, MqttLink
from protocol import AgentStatus, ProtocolError, decode, parse_agent_topic
from protocol.topics import ROOT

#: Seconds to collect the retained statuses after the subscription is acknowledged.
RETAINED_WAIT_S = 1.0
#: Seconds the probe tries to connect (the daemon is connected already: a broker that takes longer is in trouble).
PROBE_TIMEOUT_S = 5.0


def federations_seen(broker: BrokerConfig, client_id: str, wait_s: float = RETAINED_WAIT_S) -> dict[str, set[str]]:
    """Federation -> ids of its agents whose retained status says online or busy, as this login sees them (a
    broker's ACL may hide other federations: then only the login's own shows)."""
    seen: dict[str, set[str]] = {}
    lock = threading.Lock()

    def keep(topic: str, payload: bytes) -> None:
        with contextlib.suppress(ProtocolError):
            federation, agent_id, kind = parse_agent_topic(topic)
            if kind != "status" or not payload:
                return
            status = decode(payload, expected=AgentStatus)
            assert isinstance(status, AgentStatus)
            if status.state in ("online", "busy") and status.agent_id == agent_id:
                with lock:
                    seen.setdefault(federation, set()).add(agent_id)

    link = MqttLink(client_id=client_id, broker=broker, subscriptions=[f"{ROOT}/+/agents/+/status"], handler=keep)
    try:
        link.start(timeout=PROBE_TIMEOUT_S)
        time.sleep(wait_s)  # the broker sends every retained status right after the subscription
    finally:
        link.stop()
    with lock:
        return {federation: set(agents) for federation, agents in seen.items()}
