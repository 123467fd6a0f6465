"""Topic names, id validation and agent-topic parsing."""

from __future__ import annotations

import pytest

from protocol import ProtocolError, Topics, parse_agent_topic, validate_name


@pytest.mark.parametrize("name", ["a", "pi-01", "jetson_orin.2", "A" * 64, "0", "a.b-c_d"])
def test_validate_name_accepts_one_topic_level(name: str) -> None:
    assert validate_name(name) == name


@pytest.mark.parametrize(
    "name",
    ["", "A" * 65, "a/b", "+", "#", "a b", "caf\u00e9", "$SYS", "a\n", ".", "..", None, 5, b"pi"],
)
def test_validate_name_rejects(name: object) -> None:
    with pytest.raises(ProtocolError, match="agent id"):
        validate_name(name, "agent id")


def test_topics_paths() -> None:
    topics = Topics("lab")
    assert topics.prefix == "fedfit/v1/lab"
    assert topics.agent_status("pi-01") == "fedfit/v1/lab/agents/pi-01/status"
    assert topics.agent_task("pi-01") == "fedfit/v1/lab/agents/pi-01/task"
    assert topics.agent_update("pi-01") == "fedfit/v1/lab/agents/pi-01/update"
    assert topics.agent_ack("pi-01") == "fedfit/v1/lab/agents/pi-01/ack"
    assert topics.coordinator_status() == "fedfit/v1/lab/coordinator/status"
    assert topics.all_agent_status() == "fedfit/v1/lab/agents/+/status"
    assert topics.all_agent_updates() == "fedfit/v1/lab/agents/+/update"


def test_topics_validate_federation_and_agent_ids() -> None:
    with pytest.raises(ProtocolError, match="federation"):
        Topics("lab/other")
    with pytest.raises(ProtocolError, match="agent id"):
        Topics("lab").agent_task("+")
    with pytest.raises(ProtocolError, match="agent id"):
        Topics("lab").agent_update("pi/../x")


@pytest.mark.parametrize("kind", ["status", "task", "update", "ack"])
def test_parse_agent_topic_inverts_topics(kind: str) -> None:
    topic = getattr(Topics("lab"), f"agent_{kind}")("pi-01")
    assert parse_agent_topic(topic) == ("lab", "pi-01", kind)


@pytest.mark.parametrize(
    "topic",
    [
        "fedfit/v1/lab/coordinator/status",
        "fedfit/v2/lab/agents/pi-01/status",
        "other/v1/lab/agents/pi-01/status",
        "fedfit/v1/lab/agents/pi-01/status/extra",
        "fedfit/v1/lab/agents/pi-01",
        "fedfit/v1/lab/agents/pi-01/reboot",
        "fedfit/v1/lab/agents/+/status",
        "fedfit/v1//agents/pi-01/status",
        "fedfit/v1/lab/devices/pi-01/status",
        "",
    ],
)
def test_parse_agent_topic_rejects(topic: str) -> None:
    with pytest.raises(ProtocolError):
        parse_agent_topic(topic)


def test_parse_agent_topic_rejects_non_string() -> None:
    with pytest.raises(ProtocolError, match="string"):
        parse_agent_topic(b"fedfit/v1/lab/agents/pi-01/status")  # type: ignore[arg-type]
