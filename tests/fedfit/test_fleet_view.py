"""fedfit.fleet_view: the fleet built from retained statuses, as text and as JSON (no network)."""

from __future__ import annotations

import json

from fedfit.fleet_view import STALE_AFTER_S, StatusBook, format_view, view_json
from protocol import (
    AgentReport,
    AgentStatus,
    Capabilities,
    CoordinatorStatus,
    PrivacySpent,
    RoundProgress,
    Topics,
    encode,
)

NOW = 10_000.0
MiB = 2**20
TOPICS = Topics("fleet")


def caps(available: int = 300 * MiB, budget: int | None = 27 * MiB, revision: int = 5) -> Capabilities:
    return Capabilities("pi4", 2048 * MiB, available, budget, 120, [0, 1, 2], (1, 8, 8), revision)


def feed_agent(book: StatusBook, status: AgentStatus) -> None:
    book.feed(TOPICS.agent_status(status.agent_id), encode(status))


def feed_coordinator(book: StatusBook, status: CoordinatorStatus) -> None:
    book.feed(TOPICS.coordinator_status(), encode(status))


def test_a_fleet_in_a_round() -> None:
    book = StatusBook("fleet")
    feed_coordinator(book, CoordinatorStatus("fleet", "online", 3, NOW, 5,
                                             RoundProgress(3, 16, 11, NOW - 42, NOW + 558)))
    feed_agent(book, AgentStatus("pi-02", "busy", caps(), NOW - 5, "i2",
                                 AgentReport(NOW - 30, task="r3-pi-02", task_round=3, last_task="r2-pi-02",
                                             last_round=2, last_status="adapted", last_trained="width=0.5",
                                             last_reason="adapted width=1 -> width=0.5 to fit 25.9 MiB",
                                             last_finished_at=NOW - 300, outbox=1, outbox_bytes=3 * MiB)))
    feed_agent(book, AgentStatus("pi-01", "online", caps(), NOW - 5, "i1",
                                 AgentReport(NOW - 12, last_task="r3-pi-01", last_round=3, last_status="ok",
                                             last_trained="width=1", last_finished_at=NOW - 12)))
    feed_agent(book, AgentStatus("pi-03", "offline", None, NOW - 3600, "i3"))
    view = book.view()
    assert [row.agent_id for row in view.agents] == ["pi-01", "pi-02", "pi-03"]  # sorted by id
    text = format_view(view, NOW)
    assert "round 3: 11/16 answers, 42 s elapsed, deadline in 9 min" in text
    assert "agents: 3 known, 2 online (1 training), 1 offline" in text
    lines = {line.split()[0]: line for line in text.splitlines() if line.startswith("pi-")}
    assert "idle 12 s" in lines["pi-01"] and "last: round 3 ok width=1" in lines["pi-01"]
    assert "(" not in lines["pi-01"].split("last:")[1]  # an ok answer has no reason to show
    assert "training 30 s" in lines["pi-02"] and "now: r3-pi-02 (round 3)" in lines["pi-02"]
    assert "last: round 2 adapted width=0.5 (adapted width=1 -> width=0.5 to fit 25.9 MiB)" in lines["pi-02"]
    assert "outbox 1 (3.0 MiB)" in lines["pi-02"] and "300/2048 MiB, budget 27" in lines["pi-02"]
    assert "offline (status sent 60 min ago)" in lines["pi-03"]


def test_json_has_every_field() -> None:
    book = StatusBook("fleet")
    feed_agent(book, AgentStatus("pi-01", "online", caps(), NOW, "i1", AgentReport(NOW - 1)))
    data = json.loads(json.dumps(view_json(book.view(), NOW)))
    assert data["coordinator"] is None and data["now"] == NOW and data["unreadable"] == 0
    [agent] = data["agents"]
    assert agent["agent_id"] == "pi-01" and agent["memory_available"] == 300 * MiB and agent["reports"] is True
    assert agent["budget_bytes"] == 27 * MiB and agent["revision"] == 5 and agent["since"] == NOW - 1


def test_older_statuses_silence_and_what_cannot_be_read() -> None:
    book = StatusBook("fleet")
    feed_coordinator(book, CoordinatorStatus("fleet", "online", 2, NOW))  # reports no progress
    feed_agent(book, AgentStatus("old", "online", caps(revision=4), NOW - 2 * STALE_AFTER_S, "i"))
    book.feed(TOPICS.agent_status("bad"), b"\x93not a status")
    book.feed(TOPICS.agent_status("starter"), encode(AgentStatus("starter", "starting", None, NOW, "s")))
    book.feed(Topics("other").agent_status("x"), encode(AgentStatus("x", "online", caps(), NOW, "x")))
    text = format_view(book.view(), NOW)
    assert "coordinator: online, round 2 (in progress or done: its progress is not reported" in text
    assert "1 status(es) could not be read" in text
    [line] = [line for line in text.splitlines() if line.startswith("old ")]
    assert "no report" in line and "not heard for 4 min" in line
    assert [row.agent_id for row in book.view().agents] == ["old"]  # "bad" unreadable; "starter", "x" never rows
    assert "starter" not in text
    book.feed(TOPICS.agent_status("old"), b"")  # a cleared retained status: gone
    book.feed(TOPICS.agent_status("bad"), encode(AgentStatus("bad", "online", caps(), NOW, "b")))  # readable now
    view = book.view()
    assert [row.agent_id for row in view.agents] == ["bad"] and view.unreadable == 0


def test_a_status_on_another_agents_topic_is_not_believed() -> None:
    book = StatusBook("fleet")
    book.feed(TOPICS.agent_status("pi-01"), encode(AgentStatus("pi-02", "online", caps(), NOW, "i")))
    assert book.view().agents == () and book.view().unreadable == 1


def test_no_coordinator_and_no_agents() -> None:
    text = format_view(StatusBook("fleet").view(), NOW)
    assert "no status on this broker" in text and "agents: 0 known" in text
    book = StatusBook("fleet")
    feed_coordinator(book, CoordinatorStatus("fleet", "offline", 7, NOW - 60))
    assert "coordinator: offline (status sent 60 s ago)" in format_view(book.view(), NOW)
    feed_coordinator(book, CoordinatorStatus("fleet", "online", 7, NOW, 5))
    assert "coordinator: online, round 7 done, none in progress" in format_view(book.view(), NOW)


def test_the_model_an_agent_holds_to_run_is_shown() -> None:
    book = StatusBook("fleet")
    feed_coordinator(book, CoordinatorStatus("fleet", "online", 40, NOW, 8))
    feed_agent(book, AgentStatus("pi-01", "online", caps(revision=8), NOW - 1, "i1",
                                 AgentReport(NOW - 60, model="b@" + "0" * 64,
                                             model_refused="a@" + "1" * 64 + ": needs 10.4 MiB to run")))
    assert "holds model b; refused model a: needs 10.4 MiB to run" in format_view(book.view(), NOW)
    assert view_json(book.view(), NOW)["agents"][0]["model"] == "b@" + "0" * 64


def test_what_a_private_run_has_spent_is_shown_beside_the_coordinator() -> None:
    book = StatusBook("fleet")
    feed_coordinator(book, CoordinatorStatus("fleet", "online", 7, NOW, 9, None, PrivacySpent(2.345, 1e-5, 8.0)))
    text = format_view(book.view(), NOW)
    assert ("coordinator: online, round 7 done, none in progress; privacy spent: epsilon 2.35 of a budget of 8 at "
            "delta 1e-05") in text
    assert view_json(book.view(), NOW)["coordinator"]["privacy"] == {"epsilon": 2.345, "delta": 1e-5, "max_epsilon": 8.0}
    feed_coordinator(book, CoordinatorStatus("fleet", "online", 8, NOW, 9, None, PrivacySpent(3.0, 1e-5)))
    assert "privacy spent: epsilon 3 at delta 1e-05" in format_view(book.view(), NOW)
