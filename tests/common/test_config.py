"""Tests for common.config."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

import pytest
import yaml

from common.config import ConfigError, from_mapping, load_yaml, to_mapping

# This module uses ``from __future__ import annotations``: every annotation below is a string that
# from_mapping must resolve with typing.get_type_hints.


@dataclass
class Broker:
    host: str = "localhost"
    port: int = 1883
    tls: bool = False


@dataclass
class Coordinator:
    rounds: int
    lr: float = 0.1
    strategy: Literal["heterofl", "fedavg"] = "heterofl"
    deadline_s: float | None = None
    checkpoint: Optional[str] = None  # noqa: UP045 - the typing.Optional spelling is tested on purpose
    levels: list[float] = field(default_factory=lambda: [1.0, 0.5])
    widths: tuple[int, ...] = (1, 2)
    pair: tuple[int, str] = (0, "a")
    budgets: dict[str, int] = field(default_factory=dict)
    extra: Any = None


@dataclass
class Agent:
    id: str
    memory_mb: int = 512


@dataclass
class Root:
    coordinator: Coordinator
    broker: Broker = field(default_factory=Broker)
    agents: list[Agent] = field(default_factory=list)
    data_dir: Path | None = None


def build(data: dict[str, Any]) -> Root:
    return from_mapping(Root, data)


def error(data: object, cls: type = Root) -> str:
    with pytest.raises(ConfigError) as info:
        from_mapping(cls, data)
    return str(info.value)


# --- from_mapping: success ------------------------------------------------------------------------------


def test_nested_and_defaults() -> None:
    cfg = build({"coordinator": {"rounds": 5}, "broker": {"port": 8883, "tls": True}})
    assert isinstance(cfg.coordinator, Coordinator) and isinstance(cfg.broker, Broker)
    assert cfg.coordinator.rounds == 5
    assert cfg.coordinator.lr == 0.1
    assert cfg.broker == Broker(host="localhost", port=8883, tls=True)
    assert cfg.agents == []


def test_all_supported_types() -> None:
    cfg = build({
        "coordinator": {
            "rounds": 3, "lr": 1, "strategy": "fedavg", "deadline_s": 2, "checkpoint": "ck",
            "levels": [1, 0.25], "widths": [4, 8, 16], "pair": [7, "b"], "budgets": {"pi": 256},
            "extra": {"anything": [1, "x"]},
        },
        "agents": [{"id": "pi-1"}, {"id": "jetson", "memory_mb": 4096}],
        "data_dir": "~/data",
    })
    c = cfg.coordinator
    assert c.lr == 1.0 and type(c.lr) is float
    assert c.strategy == "fedavg"
    assert c.deadline_s == 2.0 and type(c.deadline_s) is float
    assert c.checkpoint == "ck"
    assert c.levels == [1.0, 0.25] and all(type(v) is float for v in c.levels)
    assert c.widths == (4, 8, 16)
    assert c.pair == (7, "b")
    assert c.budgets == {"pi": 256}
    assert c.extra == {"anything": [1, "x"]}
    assert cfg.agents == [Agent("pi-1", 512), Agent("jetson", 4096)]
    assert cfg.data_dir == Path("~/data").expanduser()


def test_optional_accepts_null() -> None:
    cfg = build({"coordinator": {"rounds": 1, "deadline_s": None, "checkpoint": None}})
    assert cfg.coordinator.deadline_s is None and cfg.coordinator.checkpoint is None


def test_float_accepts_numeric_string_from_yaml() -> None:
    # PyYAML reads 1e-3 (no dot) as a string.
    data = yaml.safe_load("coordinator: {rounds: 1, lr: 1e-3}")
    assert data["coordinator"]["lr"] == "1e-3"
    assert build(data).coordinator.lr == pytest.approx(0.001)


def test_where_prefixes_paths() -> None:
    with pytest.raises(ConfigError, match="'fleet.coordinator.rounds'"):
        from_mapping(Root, {"coordinator": {"rounds": "x"}}, where="fleet")


# --- from_mapping: errors -------------------------------------------------------------------------------


def test_unknown_key_lists_valid_keys() -> None:
    msg = error({"coordinator": {"rounds": 1, "round": 2}})
    assert "'coordinator.round'" in msg
    assert "did you mean 'rounds'" in msg
    for key in ("rounds", "lr", "strategy", "budgets"):
        assert key in msg


def test_unknown_top_level_key() -> None:
    msg = error({"coordinator": {"rounds": 1}, "brokr": {}})
    assert "Unknown key 'brokr'" in msg and "agents, broker, coordinator, data_dir" in msg


def test_wrong_type_message_exact() -> None:
    msg = error({"coordinator": {"rounds": "abc"}})
    assert msg == "'coordinator.rounds' must be an integer, got 'abc' (str)."


def test_int_rejects_bool_and_float() -> None:
    assert "got True (bool)" in error({"coordinator": {"rounds": True}})
    msg = error({"coordinator": {"rounds": 2.5}})
    assert "'coordinator.rounds' must be an integer, got 2.5 (float)" in msg


def test_float_rejects_bool_and_text() -> None:
    assert "'coordinator.lr' must be a number" in error({"coordinator": {"rounds": 1, "lr": False}})
    assert "'coordinator.lr' must be a number" in error({"coordinator": {"rounds": 1, "lr": "fast"}})


def test_bool_and_str_are_strict() -> None:
    assert "'broker.tls' must be a boolean" in error({"coordinator": {"rounds": 1}, "broker": {"tls": 1}})
    assert "'broker.host' must be a string, got 5 (int)" in error(
        {"coordinator": {"rounds": 1}, "broker": {"host": 5}}
    )


def test_missing_required_key() -> None:
    assert "Missing required key 'coordinator.rounds'" in error({"coordinator": {"lr": 0.2}})
    assert "Missing required key 'coordinator'" in error({})
    assert "Missing required key 'agents[1].id'" in error(
        {"coordinator": {"rounds": 1}, "agents": [{"id": "a"}, {"memory_mb": 1}]}
    )


def test_literal_not_allowed_lists_choices() -> None:
    msg = error({"coordinator": {"rounds": 1, "strategy": "scalefl"}})
    assert "'coordinator.strategy'" in msg
    assert "'heterofl', 'fedavg'" in msg and "'scalefl'" in msg


def test_optional_wrong_type() -> None:
    msg = error({"coordinator": {"rounds": 1, "deadline_s": "soon"}})
    assert msg.startswith("'coordinator.deadline_s' must be a number")
    msg = error({"coordinator": {"rounds": 1, "checkpoint": 3}})
    assert "'coordinator.checkpoint' must be a string" in msg


def test_container_errors_name_the_element() -> None:
    assert "'coordinator.levels' must be a list" in error({"coordinator": {"rounds": 1, "levels": 0.5}})
    assert "'coordinator.levels[1]' must be a number" in error(
        {"coordinator": {"rounds": 1, "levels": [1, "x"]}}
    )
    assert "'coordinator.widths[2]' must be an integer" in error(
        {"coordinator": {"rounds": 1, "widths": [1, 2, "3"]}}
    )
    assert "exactly 2 items" in error({"coordinator": {"rounds": 1, "pair": [1]}})
    assert "'coordinator.pair[1]' must be a string" in error({"coordinator": {"rounds": 1, "pair": [1, 2]}})
    assert "'coordinator.budgets.pi' must be an integer" in error(
        {"coordinator": {"rounds": 1, "budgets": {"pi": "lots"}}}
    )
    assert "keys must be strings" in error({"coordinator": {"rounds": 1, "budgets": {1: 2}}})
    assert "'agents[0].memory_mb' must be an integer" in error(
        {"coordinator": {"rounds": 1}, "agents": [{"id": "a", "memory_mb": "1G"}]}
    )


def test_section_not_a_mapping() -> None:
    assert "'coordinator' must be a mapping" in error({"coordinator": 3})
    assert "the configuration must be a mapping" in error([1, 2])
    assert "'agents[0]' must be a mapping" in error({"coordinator": {"rounds": 1}, "agents": ["pi"]})


def test_post_init_error_becomes_config_error() -> None:
    @dataclass
    class Positive:
        n: int

        def __post_init__(self) -> None:
            if self.n <= 0:
                raise ValueError("n must be > 0")

    msg = error({"n": -1}, Positive)
    assert "n must be > 0" in msg


def test_not_a_dataclass() -> None:
    with pytest.raises(TypeError):
        from_mapping(dict, {})


# --- to_mapping -----------------------------------------------------------------------------------------


def test_to_mapping_round_trip() -> None:
    cfg = build({
        "coordinator": {"rounds": 2, "widths": [1, 3], "budgets": {"a": 1}},
        "agents": [{"id": "x"}],
        "data_dir": "/tmp/d",
    })
    plain = to_mapping(cfg)
    assert plain["coordinator"]["widths"] == [1, 3]
    assert plain["coordinator"]["pair"] == [0, "a"]
    assert plain["agents"] == [{"id": "x", "memory_mb": 512}]
    assert plain["data_dir"] == "/tmp/d"
    dumped = yaml.safe_dump(plain)  # only plain types
    assert from_mapping(Root, yaml.safe_load(dumped)) == cfg
    with pytest.raises(TypeError):
        to_mapping({"a": 1})


# --- load_yaml ------------------------------------------------------------------------------------------


def test_load_yaml_ok(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("coordinator:\n  rounds: 4\nbroker:\n  port: 1884\n")
    data = load_yaml(path)
    assert data == {"coordinator": {"rounds": 4}, "broker": {"port": 1884}}
    assert build(data).broker.port == 1884


def test_load_yaml_empty_is_empty_mapping(tmp_path: Path) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text("# only a comment\n")
    assert load_yaml(str(path)) == {}


def test_load_yaml_missing(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist") as info:
        load_yaml(tmp_path / "nope.yaml")
    assert "nope.yaml" in str(info.value)


def test_load_yaml_syntax_error_names_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("coordinator:\n  rounds: 4\n  lr: [1, 2\nbroker: {}\n")
    with pytest.raises(ConfigError) as info:
        load_yaml(path)
    msg = str(info.value)
    assert "bad.yaml" in msg and "not valid YAML" in msg and "line 4" in msg


def test_load_yaml_top_level_not_mapping(tmp_path: Path) -> None:
    path = tmp_path / "list.yaml"
    path.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="list.yaml") as info:
        load_yaml(path)
    assert "not a list" in str(info.value)


def test_load_yaml_duplicate_key(tmp_path: Path) -> None:
    path = tmp_path / "dup.yaml"
    path.write_text("coordinator:\n  rounds: 4\n  rounds: 5\n")
    with pytest.raises(ConfigError, match="duplicate key 'rounds'") as info:
        load_yaml(path)
    assert "line 3" in str(info.value)


def test_load_yaml_merge_keys_still_work(tmp_path: Path) -> None:
    path = tmp_path / "merge.yaml"
    path.write_text("base: &b {port: 1, host: h}\nbroker:\n  <<: *b\n  port: 2\n")
    assert load_yaml(path)["broker"] == {"port": 2, "host": "h"}


def test_load_yaml_refuses_python_tags(tmp_path: Path) -> None:
    path = tmp_path / "evil.yaml"
    path.write_text("x: !!python/object/apply:os.system ['true']\n")
    with pytest.raises(ConfigError, match="evil.yaml"):
        load_yaml(path)
