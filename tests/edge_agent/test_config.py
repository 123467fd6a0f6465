"""AgentConfig.validate."""

from __future__ import annotations

import pytest

from common.config import ConfigError, from_mapping
from edge_agent.config import AgentConfig, AgentDataConfig


def valid(**kwargs) -> AgentConfig:
    kwargs.setdefault("data", AgentDataConfig(path="/data/local.npz"))
    kwargs.setdefault("agent_id", "pi-01")
    return AgentConfig(**kwargs)


def refusal(config: AgentConfig) -> str | None:
    """What ``validate`` says of ``config``; None when it is valid."""
    try:
        config.validate()
    except ValueError as error:
        return str(error)
    return None


def test_an_id_and_a_data_source_make_a_valid_config():
    # Every other setting has a valid default; the data may be a file or a shard of a known dataset.
    assert refusal(valid()) is None
    assert refusal(valid(data=AgentDataConfig(dataset="digits"))) is None


@pytest.mark.parametrize(("last_valid", "first_refused", "said"), [
    ({"budget_bytes": 1}, {"budget_bytes": 0}, "budget_bytes must be positive"),
    ({"data": AgentDataConfig(dataset="digits", num_shards=4, shard=3)},
     {"data": AgentDataConfig(dataset="digits", num_shards=4, shard=4)}, "data.shard must be in [0, num_shards)"),
    ({"data": AgentDataConfig(dataset="digits", num_shards=4, shard=0)},
     {"data": AgentDataConfig(dataset="digits", num_shards=4, shard=-1)}, "data.shard must be in [0, num_shards)"),
    ({"stall_timeout_s": 0.001}, {"stall_timeout_s": 0.0}, "stall_timeout_s must be positive"),
    ({"slowdown": 1.0}, {"slowdown": 0.999}, "slowdown must be a number of at least 1"),
])  # fmt: skip
def test_the_last_valid_value_passes_and_the_next_is_refused(last_valid, first_refused, said):
    # The value at the edge of the documented range passes, its neighbour outside it is refused with that sentence.
    assert refusal(valid(**last_valid)) is None
    message = refusal(valid(**first_refused))
    assert message is not None and said in message, message


def test_data_source_is_required():
    with pytest.raises(ValueError, match="either 'path'"):
        AgentConfig(agent_id="pi-01").validate()


@pytest.mark.parametrize("budget", [0, -5])
def test_budget_must_be_positive(budget):
    with pytest.raises(ValueError, match="budget_bytes must be positive"):
        valid(budget_bytes=budget).validate()


@pytest.mark.parametrize(("shard", "num_shards"), [(2, 2), (-1, 3), (0, 0)])
def test_shard_must_be_in_range(shard, num_shards):
    data = AgentDataConfig(dataset="digits", shard=shard, num_shards=num_shards)
    with pytest.raises(ValueError, match=r"data\.shard must be in \[0, num_shards\)"):
        valid(data=data).validate()


@pytest.mark.parametrize("value", [0.0, -5.0])
def test_the_stall_timeout_must_be_positive(value):
    with pytest.raises(ValueError, match=f"stall_timeout_s must be positive, got {value}"):
        valid(stall_timeout_s=value).validate()


@pytest.mark.parametrize("kwargs", [{"ack_timeout_s": 0.0}, {"update_attempts": 0}, {"status_interval_s": -1.0}])
def test_timing_settings_must_be_positive(kwargs):
    with pytest.raises(ValueError, match="ack_timeout_s and status_interval_s must be positive"):
        valid(**kwargs).validate()


def test_from_mapping_requires_agent_id_and_names_nested_keys():
    with pytest.raises(ConfigError, match="agent_id"):
        from_mapping(AgentConfig, {"data": {"path": "x"}})
    with pytest.raises(ConfigError, match=r"'data\.shards'"):
        from_mapping(AgentConfig, {"agent_id": "a", "data": {"shards": 2}})
    config = from_mapping(AgentConfig, {"agent_id": "a", "data": {"dataset": "digits"}, "budget_bytes": 10})
    assert config.data.dataset == "digits" and config.budget_bytes == 10
    config.validate()


def test_allocator_defaults_to_pooled_and_takes_only_known_settings():
    assert valid().allocator == "pooled"
    config = from_mapping(AgentConfig, {"agent_id": "a", "data": {"dataset": "digits"}, "allocator": "default"})
    assert config.allocator == "default"
    with pytest.raises(ConfigError, match="allocator"):
        from_mapping(AgentConfig, {"agent_id": "a", "data": {"dataset": "digits"}, "allocator": "jemalloc"})


def test_the_forkserver_starts_at_the_first_task_unless_told_otherwise():
    assert valid().forkserver == "first-task"
    config = from_mapping(AgentConfig, {"agent_id": "a", "data": {"dataset": "digits"}, "forkserver": "start-up"})
    assert config.forkserver == "start-up"
    with pytest.raises(ConfigError, match="forkserver"):
        from_mapping(AgentConfig, {"agent_id": "a", "data": {"dataset": "digits"}, "forkserver": "never"})


@pytest.mark.parametrize("agent_id", ["../x", "a/b", "", ".", "..", "x" * 65, "pi 01", "pi+01"])
def test_an_agent_id_that_is_no_topic_level_or_file_name_is_refused(agent_id):
    with pytest.raises(ValueError, match="agent_id must be 1 to 64 characters"):
        valid(agent_id=agent_id).validate()


def test_a_federation_that_is_no_topic_level_is_refused():
    with pytest.raises(ValueError, match="federation must be 1 to 64 characters"):
        valid(federation="lab/#").validate()


def test_a_bad_agent_id_writes_nothing_before_it_is_refused(tmp_path):
    import torch

    from edge_agent.daemon import EdgeAgent
    from edge_agent.runner import LocalData

    state = tmp_path / "state"
    state.mkdir()
    config = valid(agent_id="../escaped", state_dir=str(state))
    with pytest.raises(ValueError, match="agent_id"):
        EdgeAgent(config, LocalData(torch.zeros(2, 1, 8, 8), torch.tensor([0, 1])))
    assert list(tmp_path.iterdir()) == [state] and not any(state.iterdir())


@pytest.mark.parametrize("field", ["max_epochs", "max_steps", "max_deadline_s", "max_parameters", "max_task_bytes"])
def test_limits_must_be_positive(field):
    from edge_agent.config import TaskLimits

    with pytest.raises(ValueError, match="every limits.max_\\* setting must be positive"):
        valid(limits=TaskLimits(**{field: 0})).validate()


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_the_slowdown_must_be_a_finite_number(value):
    with pytest.raises(ValueError, match="slowdown must be a number of at least 1"):
        valid(slowdown=value).validate()


def test_the_slowdown_defaults_to_the_devices_own_speed_and_reads_from_yaml():
    assert valid().slowdown == 1.0
    config = from_mapping(AgentConfig, {"agent_id": "pi-01", "data": {"dataset": "digits"}, "slowdown": 10})
    assert config.slowdown == 10.0 and refusal(config) is None
