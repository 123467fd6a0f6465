"""The commented example configurations load and validate (they are what a new user copies first)."""

from __future__ import annotations

from pathlib import Path

from common.config import from_mapping, load_yaml
from coordinator.config import CoordinatorConfig
from edge_agent.config import AgentConfig

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_the_example_coordinator_config_names_every_method_section_and_validates() -> None:
    config = from_mapping(CoordinatorConfig, load_yaml(EXAMPLES / "coordinator.yaml"))
    config.validate()
    text = (EXAMPLES / "coordinator.yaml").read_text()
    for section in ("scalefl:", "fedepth:", "fedavg:", "flexfl:", "adaptivefl:"):
        assert f"\n{section}" in text, section


def test_the_example_agent_config_lists_every_data_key_and_validates() -> None:
    from dataclasses import fields

    from edge_agent.config import AgentDataConfig

    config = from_mapping(AgentConfig, load_yaml(EXAMPLES / "agent.yaml"))
    config.validate()
    data = load_yaml(EXAMPLES / "agent.yaml")["data"]
    assert set(data) == {field.name for field in fields(AgentDataConfig)}
