"""The agent daemon's handling of incoming task chunks, without a broker: a task transfer over its size limit or
the memory the device has is refused at its first chunk, before anything is buffered, and answered ``declined``."""

from __future__ import annotations

import structlog
import torch

from edge_agent import daemon as daemon_module
from edge_agent.config import AgentConfig, AgentDataConfig
from edge_agent.daemon import EdgeAgent
from edge_agent.runner import LocalData
from protocol import Topics, Update, split_payload


def close(agent: EdgeAgent) -> None:
    """Release what an agent that never started holds (its training executor and runner)."""
    agent.executor.shutdown(wait=True)
    agent.runner.close()


def test_a_task_too_big_for_the_memory_available_is_declined_at_its_first_chunk(tmp_path, monkeypatch) -> None:
    config = AgentConfig(agent_id="pi-01", federation="lab", data=AgentDataConfig(dataset="digits"),
                         state_dir=str(tmp_path))
    agent = EdgeAgent(config, LocalData(torch.zeros(4, 1, 8, 8), torch.tensor([0, 1, 0, 1])))
    sent: list[Update] = []
    try:
        monkeypatch.setattr(daemon_module, "available_memory", lambda: 3 * 2**20)  # 3 MiB left on the device
        monkeypatch.setattr(agent.uplink, "send", sent.append)
        # a 2 MiB task of round 4, 4 chunks, delivered twice (QoS 1 redelivery)
        chunks = split_payload(b"\x00" * (2 * 2**20), "r4-pi-01-abc", chunk_size=2**19, round_number=4)
        with structlog.testing.capture_logs() as logs:
            for chunk in chunks + chunks:
                agent._on_message(Topics("lab").agent_task("pi-01"), chunk)
        assert agent.reassembler.pending() == 0  # nothing of it was buffered
        reason = ("task refused at its first chunk: buffering and decoding its 2.0 MiB needs about 4.0 MiB, 3.0 MiB "
                  "are available")
        [refusal] = [entry for entry in logs if entry["event"] == "task_refused"]  # once, not once per chunk
        assert (refusal["task"], refusal["round"], refusal["reason"], refusal["answered"]) == (
            "r4-pi-01-abc", 4, reason, True)
        assert not [entry for entry in logs if entry["event"] == "message_rejected"]
        # The coordinator hears why, once: a declined update for the task the transfer carried.
        [update] = sent
        assert (update.task_id, update.round, update.agent_id, update.status, update.reason) == (
            "r4-pi-01-abc", 4, "pi-01", "declined", reason)
        assert update.weights == {} and update.spec_trained is None and update.num_samples == 4
        assert agent.rejected_messages == 1
    finally:
        close(agent)


def test_a_task_over_max_task_bytes_is_declined_whatever_the_memory(tmp_path, monkeypatch) -> None:
    from edge_agent.config import TaskLimits

    config = AgentConfig(agent_id="pi-01", federation="lab", data=AgentDataConfig(dataset="digits"),
                         state_dir=str(tmp_path), limits=TaskLimits(max_task_bytes=2**20))
    agent = EdgeAgent(config, LocalData(torch.zeros(4, 1, 8, 8), torch.tensor([0, 1, 0, 1])))
    sent: list[Update] = []
    monkeypatch.setattr(agent.uplink, "send", sent.append)
    try:
        agent._on_message(Topics("lab").agent_task("pi-01"),
                          split_payload(b"\x00" * (2**20 + 2**19), "r1-pi-01-x", round_number=1)[0])
        assert agent.reassembler.pending() == 0
        [update] = sent
        assert update.status == "declined" and update.reason == (
            "task refused at its first chunk: it is 1.5 MiB, more than limits.max_task_bytes 1.0 MiB")
    finally:
        close(agent)


def test_a_refused_task_whose_chunks_name_no_round_is_only_logged(tmp_path, monkeypatch) -> None:
    from edge_agent.config import TaskLimits

    config = AgentConfig(agent_id="pi-01", federation="lab", data=AgentDataConfig(dataset="digits"),
                         state_dir=str(tmp_path), limits=TaskLimits(max_task_bytes=2**20))
    agent = EdgeAgent(config, LocalData(torch.zeros(4, 1, 8, 8), torch.tensor([0, 1, 0, 1])))
    sent: list[Update] = []
    monkeypatch.setattr(agent.uplink, "send", sent.append)
    try:
        with structlog.testing.capture_logs() as logs:  # an older coordinator: its chunks declare no round
            agent._on_message(Topics("lab").agent_task("pi-01"), split_payload(b"\x00" * (2**20 + 1), "t1")[0])
        [refusal] = [entry for entry in logs if entry["event"] == "task_refused"]
        assert refusal["answered"] is False and refusal["transfer"] == "t1"
        assert sent == []
    finally:
        close(agent)


def test_the_agent_logs_when_the_coordinator_goes_offline_and_comes_back(tmp_path) -> None:
    import time as clock

    from protocol import CoordinatorStatus, encode

    config = AgentConfig(agent_id="pi-01", federation="lab", data=AgentDataConfig(dataset="digits"),
                         state_dir=str(tmp_path))
    agent = EdgeAgent(config, LocalData(torch.zeros(4, 1, 8, 8), torch.tensor([0, 1, 0, 1])))
    topic = Topics("lab").coordinator_status()
    try:
        with structlog.testing.capture_logs() as logs:
            for state, round_number in (("online", 0), ("online", 1), ("offline", 2), ("online", 2), ("online", 3)):
                agent._on_message(topic, encode(CoordinatorStatus("lab", state, round_number, clock.time())))
            agent._on_message(topic, b"")  # a cleared retained status says nothing
        said = [(entry["event"], entry["round"]) for entry in logs if entry["event"].startswith("coordinator_")]
        assert said == [("coordinator_online", 0), ("coordinator_offline", 2), ("coordinator_back", 2)]
        assert agent.coordinator_state == "online" and agent.rejected_messages == 0
    finally:
        close(agent)
