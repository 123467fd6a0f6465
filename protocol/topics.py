"""MQTT topic names: ``fedfit/v1/<federation>/agents/<id>/<kind>`` and ``.../coordinator/status``.

A federation or agent id is exactly one topic level, so a broker ACL such as Mosquitto's
``pattern readwrite fedfit/v1/+/agents/%u/#`` can pin each device to its own topics.
"""

from __future__ import annotations

from dataclasses import dataclass

from protocol._ids import shown, validate_name
from protocol.errors import ProtocolError

__all__ = ["AGENT_TOPIC_KINDS", "ROOT", "Topics", "parse_agent_topic", "validate_name"]

ROOT = "fedfit/v1"
AGENT_TOPIC_KINDS: tuple[str, ...] = ("status", "task", "update", "ack")


@dataclass(frozen=True)
class Topics:
    """Topic names of one federation; ``Topics("lab")`` validates the federation id."""

    federation: str

    def __post_init__(self) -> None:
        validate_name(self.federation, "federation")

    @property
    def prefix(self) -> str:
        """``fedfit/v1/<federation>``."""
        return f"{ROOT}/{self.federation}"

    def _agent(self, agent_id: str, kind: str) -> str:
        return f"{self.prefix}/agents/{validate_name(agent_id, 'agent id')}/{kind}"

    def agent_status(self, agent_id: str) -> str:
        """Retained status of one agent (its Last Will writes "offline" here)."""
        return self._agent(agent_id, "status")

    def agent_task(self, agent_id: str) -> str:
        """Tasks from the coordinator to one agent."""
        return self._agent(agent_id, "task")

    def agent_update(self, agent_id: str) -> str:
        """Updates from one agent to the coordinator."""
        return self._agent(agent_id, "update")

    def agent_ack(self, agent_id: str) -> str:
        """Acks from the coordinator to one agent."""
        return self._agent(agent_id, "ack")

    def coordinator_status(self) -> str:
        """Retained status of the coordinator (with its own Last Will)."""
        return f"{self.prefix}/coordinator/status"

    def all_agent_status(self) -> str:
        """Wildcard subscription to every agent's status."""
        return f"{self.prefix}/agents/+/status"

    def all_agent_updates(self) -> str:
        """Wildcard subscription to every agent's updates."""
        return f"{self.prefix}/agents/+/update"


def parse_agent_topic(topic: str) -> tuple[str, str, str]:
    """Split an agent topic into ``(federation, agent_id, kind)``; ProtocolError if it is not one."""
    if not isinstance(topic, str):
        raise ProtocolError(f"topic must be a string, got {shown(topic)}")
    parts = topic.split("/")
    if len(parts) != 6 or f"{parts[0]}/{parts[1]}" != ROOT or parts[3] != "agents":
        raise ProtocolError(f"{topic[:200]!r} is not an agent topic ({ROOT}/<federation>/agents/<id>/<kind>)")
    federation = validate_name(parts[2], "federation")
    agent_id = validate_name(parts[4], "agent id")
    kind = parts[5]
    if kind not in AGENT_TOPIC_KINDS:
        raise ProtocolError(f"unknown agent topic kind {kind[:64]!r} (known: {', '.join(AGENT_TOPIC_KINDS)})")
    return federation, agent_id, kind
