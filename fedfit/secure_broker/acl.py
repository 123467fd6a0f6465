"""Mosquitto's ACL for one federation: every device pinned to its own topics, the coordinator to its role.

A device logs in with its agent id as its username, which the ``%u`` patterns substitute. It may publish only
its own status and updates, and read only its own tasks, acks and status (its start-up check for a second
process with its id) and the coordinator's status. The coordinator reads every status and update and
publishes tasks, acks and its own status. Anything else is refused by the broker.
"""

from __future__ import annotations

from protocol.topics import Topics


def acl_text(federation: str, coordinator: str) -> str:
    """The ACL file's text for ``federation`` with ``coordinator`` as the coordinator's username."""
    topics = Topics(federation)
    device = "%u"
    lines = [
        f"# Written by `fedfit broker init` for federation {federation!r}. Anonymous clients get nothing.",
        "",
        "# The coordinator: every agent's status and update in; tasks, acks and its own status out.",
        f"user {coordinator}",
        f"topic read {topics.all_agent_status()}",
        f"topic read {topics.all_agent_updates()}",
        f"topic write {topics.prefix}/agents/+/task",
        f"topic write {topics.prefix}/agents/+/ack",
        f"topic readwrite {topics.coordinator_status()}",
        "",
        "# Every device (username = agent id): its own status and updates out; its own tasks, acks and status,",
        "# and the coordinator's status, in.",
        f"pattern readwrite {topics.prefix}/agents/{device}/status",
        f"pattern write {topics.prefix}/agents/{device}/update",
        f"pattern read {topics.prefix}/agents/{device}/task",
        f"pattern read {topics.prefix}/agents/{device}/ack",
        f"pattern read {topics.coordinator_status()}",
    ]
    return "\n".join(lines) + "\n"
