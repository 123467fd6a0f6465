"""The agent daemon's handling of incoming task chunks, without a broker: a task transfer over its size limit or
the memory the device has is refused at its first chunk, before anything is buffered, and answered ``declined``."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest
import structlog
import torch

from edge_agent import daemon as daemon_module
from edge_agent import memory as memory_module
from edge_agent.config import AgentConfig, AgentDataConfig, TaskLimits
from edge_agent.daemon import EdgeAgent
from edge_agent.runner import LocalData
from protocol import Ack, CoordinatorStatus, Topics, Update, UpdateStatus, encode, split_payload

TASKS = Topics("lab").agent_task("pi-01")


@pytest.fixture
def make_agent(tmp_path, monkeypatch) -> Iterator[Callable[..., tuple[EdgeAgent, list[Update]]]]:
    """``make_agent(**config)``: agent pi-01 of federation lab that never starts, and the updates it would send."""
    agents: list[EdgeAgent] = []

    def make(**config) -> tuple[EdgeAgent, list[Update]]:
        agent = EdgeAgent(AgentConfig(agent_id="pi-01", federation="lab", data=AgentDataConfig(dataset="digits"),
                                      state_dir=str(tmp_path), **config),
                          LocalData(torch.zeros(4, 1, 8, 8), torch.tensor([0, 1, 0, 1])))
        agents.append(agent)
        sent: list[Update] = []
        monkeypatch.setattr(agent.uplink, "send", sent.append)
        return agent, sent

    yield make
    for agent in agents:  # release what an agent that never started holds (its training executor and runner)
        agent.executor.shutdown(wait=True)
        agent.runner.close()


def test_a_task_too_big_for_the_memory_available_is_declined_at_its_first_chunk(make_agent, monkeypatch) -> None:
    agent, sent = make_agent()
    monkeypatch.setattr(memory_module, "available_memory", lambda: 3 * 2**20)  # 3 MiB left on the device
    # a 2 MiB task of round 4, 4 chunks, delivered twice (QoS 1 redelivery)
    chunks = split_payload(b"\x00" * (2 * 2**20), "r4-pi-01-abc", chunk_size=2**19, round_number=4)
    with structlog.testing.capture_logs() as logs:
        for chunk in chunks + chunks:
            agent._on_message(TASKS, chunk)
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


def test_a_task_over_max_task_bytes_is_declined_whatever_the_memory(make_agent) -> None:
    agent, sent = make_agent(limits=TaskLimits(max_task_bytes=2**20))
    agent._on_message(TASKS, split_payload(b"\x00" * (2**20 + 2**19), "r1-pi-01-x", round_number=1)[0])
    assert agent.reassembler.pending() == 0
    [update] = sent
    assert update.status == "declined" and update.reason == (
        "task refused at its first chunk: it is 1.5 MiB, more than limits.max_task_bytes 1.0 MiB")


def test_refused_tasks_are_remembered_among_the_last_tasks_seen_only(make_agent, monkeypatch) -> None:
    monkeypatch.setattr(daemon_module, "_SEEN_TASKS", 2)
    agent, sent = make_agent(limits=TaskLimits(max_task_bytes=2**20))
    for n in range(5):  # a run of refused tasks, each answered once
        agent._on_message(TASKS, split_payload(b"\x00" * (2**20 + 1), f"r{n}-pi-01-x", round_number=n)[0])
    assert [update.task_id for update in sent] == [f"r{n}-pi-01-x" for n in range(5)]
    assert agent.activity.seen() == ["r3-pi-01-x", "r4-pi-01-x"]


def test_a_refused_task_whose_chunks_name_no_round_is_only_logged(make_agent) -> None:
    agent, sent = make_agent(limits=TaskLimits(max_task_bytes=2**20))
    with structlog.testing.capture_logs() as logs:  # an older coordinator: its chunks declare no round
        agent._on_message(TASKS, split_payload(b"\x00" * (2**20 + 1), "t1")[0])
    [refusal] = [entry for entry in logs if entry["event"] == "task_refused"]
    assert refusal["answered"] is False and refusal["transfer"] == "t1"
    assert sent == []


def test_the_agent_logs_when_the_coordinator_goes_offline_and_comes_back(make_agent, monkeypatch) -> None:
    agent, _ = make_agent()
    published: list[str] = []
    monkeypatch.setattr(agent.link, "publish", lambda topic, payload, **_: published.append(topic) or True)
    topic = Topics("lab").coordinator_status()
    with structlog.testing.capture_logs() as logs:
        for state, round_number in (("online", 0), ("online", 1), ("offline", 2), ("online", 2), ("online", 3)):
            agent._on_message(topic, encode(CoordinatorStatus("lab", state, round_number, time.time())))
        agent._on_message(topic, b"")  # a cleared retained status says nothing
    said = [(entry["event"], entry["round"]) for entry in logs if entry["event"].startswith("coordinator_")]
    assert said == [("coordinator_online", 0), ("coordinator_offline", 2), ("coordinator_back", 2)]
    assert agent.coordinator_state == "online" and agent.rejected_messages == 0
    # Each time the coordinator came online the agent said its status again (a coordinator that missed the retained
    # one, as RabbitMQ's wildcard subscriptions do, learns of it at once); a status repeating the state: nothing.
    assert published == [Topics("lab").agent_status("pi-01")] * 2


def test_the_screening_verdict_is_logged_and_a_rejection_kept_with_its_reason(make_agent) -> None:
    agent, _ = make_agent()
    acks = Topics("lab").agent_ack("pi-01")
    with structlog.testing.capture_logs() as logs:
        agent._on_message(acks, encode(Ack("r1-pi-01-a", 1, "pi-01", None, "aggregated")))
        agent._on_message(acks, encode(Ack("r2-pi-01-b", 2, "pi-01", "update rejected: too far", "rejected")))
    assert agent.rejected_updates == {"r2-pi-01-b": "update rejected: too far"}
    events = [(entry["event"], entry.get("reason")) for entry in logs]
    assert events == [("update_aggregated", None), ("update_rejected_by_coordinator", "update rejected: too far")]
    assert agent.rejected_messages == 0  # a verdict about an update no longer outstanding is no stray ack


def test_a_process_starting_with_this_id_is_answered_with_a_fresh_status(make_agent, monkeypatch) -> None:
    from protocol import AgentStatus

    agent, _ = make_agent()
    published: list[tuple[str, bytes]] = []
    monkeypatch.setattr(agent.link, "publish", lambda topic, payload, **_: published.append((topic, payload)) or True)
    own = Topics("lab").agent_status("pi-01")
    agent._on_message(own, encode(agent.status()))  # its own status coming back: nothing to answer
    assert published == []
    with structlog.testing.capture_logs() as logs:
        agent._on_message(own, encode(AgentStatus("pi-01", "starting", None, time.time(), "newcomer")))
    assert [topic for topic, _ in published] == [own]
    assert any(entry["event"] == "agent_id_claimed_by_another_process" for entry in logs)


def test_the_status_reports_the_shape_of_one_sample(make_agent) -> None:
    agent, _ = make_agent()
    assert agent.status().capabilities.sample_shape == (1, 8, 8)


def test_a_refused_publish_on_its_own_topics_stops_the_agent_with_one_sentence(make_agent, monkeypatch) -> None:
    agent, _ = make_agent()
    monkeypatch.setattr(agent, "stop", lambda: agent._stop.set())
    agent._on_refused("fedfit/v1/lab/coordinator/status", "Not authorized")  # not its own: ignored
    assert agent.fatal is None and not agent._stop.is_set()
    agent._on_refused(Topics("lab").agent_status("pi-01"), "Not authorized")
    assert agent._stop.is_set()
    assert agent.fatal is not None and "refused to let user None publish on fedfit/v1/lab/agents/pi-01/status " \
                                      "(Not authorized)" in agent.fatal and "\n" not in agent.fatal


def test_the_watchdog_is_fed_while_the_dispatcher_keeps_up_even_without_the_broker(make_agent, monkeypatch) -> None:
    import threading

    from common import systemd_notify

    agent, _ = make_agent(status_interval_s=0.05)
    pings: list[str] = []
    fed_twice, asked_while_stuck = threading.Event(), threading.Event()
    stuck = {"now": False, "asked": 0}

    def pulse() -> float:
        if stuck["now"]:
            stuck["asked"] += 1
            if stuck["asked"] >= 3:
                asked_while_stuck.set()
            return 60.0  # the dispatcher has not got through a heartbeat for a minute
        return 0.05

    def notify(state: str) -> bool:
        pings.append(state)
        if pings.count("WATCHDOG=1") >= 2:
            fed_twice.set()
        return True

    monkeypatch.setattr(systemd_notify, "watchdog_interval", lambda: 0.05)
    monkeypatch.setattr(systemd_notify, "notify", notify)
    monkeypatch.setattr(agent, "publish_status", lambda: None)
    monkeypatch.setattr(agent.link, "pulse", pulse)
    assert not agent.link.connected  # never connected: the broker is away
    loop = daemon_module.threading.Thread(target=agent._status_loop, daemon=True)
    loop.start()
    try:
        assert fed_twice.wait(10)
        stuck["now"] = True
        fed = pings.count("WATCHDOG=1")
        assert asked_while_stuck.wait(10)  # three ticks with a stuck dispatcher...
        assert pings.count("WATCHDOG=1") <= fed + 1  # ...fed at most once more (a tick already past its pulse)
    finally:
        agent._stop.set()
        loop.join(2)


def test_a_task_cut_short_by_the_agents_own_stop_is_not_answered(make_agent, monkeypatch) -> None:
    from types import SimpleNamespace

    agent, sent = make_agent()

    def run(task, payload=None) -> Update:  # the stop (a restart) kills the training child: the runner says failed
        agent._stop.set()
        return Update(task.task_id, 1, "pi-01", "failed", None, 4, [0, 1], {}, {},
                      "the agent stopped while training")

    monkeypatch.setattr(agent.runner, "run", run)
    agent.activity.take(SimpleNamespace(task_id="r1-pi-01-1", round=1))  # type: ignore[arg-type]
    agent._serve(SimpleNamespace(task_id="r1-pi-01-1"), 0.0)
    assert sent == []  # nothing spooled: the next process trains the task the coordinator sends again


def _trained(seconds: float, seconds_task: float) -> Callable[..., Update]:
    """A runner's ``run`` that trains at once and says it trained ``seconds``."""
    def run(task, payload=None) -> Update:
        return Update(task.task_id, 1, "pi-01", UpdateStatus.OK, {}, 4, [0, 1], {},
                      {"seconds": seconds, "seconds_task": seconds_task}, None)
    return run


def _busy_with(agent: EdgeAgent, task_id: str) -> None:
    """What the dispatcher does before it hands a task to the training executor."""
    from types import SimpleNamespace

    assert agent.activity.take(SimpleNamespace(task_id=task_id, round=1))  # type: ignore[arg-type]


def test_a_slowed_agent_holds_its_update_back_busy_without_holding_its_training_slot(make_agent, monkeypatch) -> None:
    import threading
    from concurrent.futures import ThreadPoolExecutor
    from types import SimpleNamespace

    from protocol import decode

    agent, sent = make_agent(slowdown=1_000_001.0)  # held back 10^6 x 2 s: far beyond any test, only stop ends it
    monkeypatch.setattr(agent.runner, "run", _trained(2.0, 2.5))
    task = SimpleNamespace(task_id="r1-pi-01-1", round=1, ask_to_upload=False, secure=False)
    _busy_with(agent, task.task_id)
    with ThreadPoolExecutor(max_workers=1) as slot:  # the simulator's training pool, one slot for every agent
        slot.submit(agent._serve, task, time.perf_counter()).result(30)
        assert slot.submit(lambda: "another agent trains").result(30)  # the slot is free at once
    assert agent.status(report=False).state == "busy" and task.task_id in agent.activity.training()  # the agent is not
    assert sent == [] and agent.uplink.backlog() == (0, 0)  # nothing sent, nothing queued...
    assert agent.uplink.pending(task.task_id)  # ...but the update is in the outbox spool already
    assert agent.spool is not None
    spooled = agent.spool.load(task.task_id)
    assert spooled is not None
    update = decode(spooled.payload, expected=Update)
    assert isinstance(update, Update)
    assert update.metrics["seconds"] == 2.0  # the training as measured
    assert update.metrics["seconds_slowdown"] == 1_000_000.0 * 2.5  # (f - 1) x its task's seconds
    assert update.metrics["seconds_task"] == 2.5 + 2_500_000.0  # the device's own time, the hold included
    stopper = threading.Thread(target=agent.stop)
    stopper.start()
    stopper.join(30)
    assert not stopper.is_alive()  # the stop did not wait out the slowdown
    assert agent.holdback.held() == [] and agent.uplink.pending(task.task_id)  # left for the next start


def test_a_held_back_update_goes_to_the_uplink_when_due_and_the_agent_is_free_again(make_agent, monkeypatch) -> None:
    import threading
    from types import SimpleNamespace

    agent, sent = make_agent(slowdown=3.0)
    monkeypatch.setattr(agent.runner, "run", _trained(0.01, 0.02))
    queued, over = threading.Event(), threading.Event()
    send_later = agent.uplink.send_later

    def watched(update: Update, **kwargs) -> Callable[[], None]:
        queue = send_later(update, **kwargs)

        def release() -> None:
            queue()
            queued.set()
        return release

    monkeypatch.setattr(agent.uplink, "send_later", watched)
    monkeypatch.setattr(agent, "publish_status", lambda report=True: over.set())  # the last thing a task's end does
    task = SimpleNamespace(task_id="r1-pi-01-2", round=1, ask_to_upload=False, secure=False)
    _busy_with(agent, task.task_id)
    agent._serve(task, time.perf_counter())
    assert queued.wait(30) and over.wait(30)
    assert agent.uplink.backlog()[0] == 1 and sent == []  # queued for delivery (send() is the undelayed path)
    assert not agent.activity.busy and task.task_id not in agent.activity.training() and agent.tasks_done == 1
    assert agent.activity.report(0, 0).last_task == task.task_id


def test_an_agent_at_its_own_speed_sends_at_once(make_agent, monkeypatch) -> None:
    from types import SimpleNamespace

    agent, sent = make_agent()
    monkeypatch.setattr(agent.uplink, "send", lambda update, **kwargs: sent.append(update))
    monkeypatch.setattr(agent.runner, "run", _trained(2.0, 2.5))
    task = SimpleNamespace(task_id="r1-pi-01-3", round=1, ask_to_upload=False, secure=False)
    _busy_with(agent, task.task_id)
    agent._serve(task, time.perf_counter())
    [update] = sent
    assert "seconds_slowdown" not in update.metrics and update.metrics["seconds_task"] == 2.5
    assert not agent.activity.busy and agent.holdback.held() == []


def test_a_task_that_comes_while_a_slowed_agent_holds_an_update_back_starts_once_it_is_free(make_agent,
                                                                                          monkeypatch) -> None:
    """A device f times slower does not train a second task while it is still busy with the first (whose update it
    holds back): the new task waits for the hold to end, and no training slot meanwhile."""
    import threading
    from types import SimpleNamespace

    agent, _ = make_agent(slowdown=3.0)
    submitted = threading.Event()
    monkeypatch.setattr(agent.executor, "submit", lambda *args: submitted.set())
    assert agent.holdback.hold("r1-pi-01-held", 3600.0, lambda: None)  # busy for an hour
    agent._start(SimpleNamespace(task_id="r2-pi-01-new"), time.perf_counter(), b"")
    assert not submitted.is_set() and "start-r2-pi-01-new" in agent.holdback.held()
    agent.holdback.close()
    fresh, _ = make_agent(slowdown=3.0)
    monkeypatch.setattr(fresh.executor, "submit", lambda *args: submitted.set())
    assert fresh.holdback.hold("r1-pi-01-held", 0.01, lambda: None)  # busy for a moment
    fresh._start(SimpleNamespace(task_id="r2-pi-01-new"), time.perf_counter(), b"")
    assert submitted.wait(30)  # started once free
