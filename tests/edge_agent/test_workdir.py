"""The work directory's JSON files: what the agent and its decision and training children exchange."""

from __future__ import annotations

import json

import pytest

from edge_agent.config import TaskLimits
from edge_agent.workdir import (
    DECISION_FILE,
    DataShape,
    Decision,
    DecisionRequest,
    TrainingRequest,
)


def test_a_decision_request_round_trips(tmp_path):
    request = DecisionRequest("cpu", "compact", 12_345_678, 1.25, DataShape(16, (0, 3, 9), 1, (8, 8)),
                              TaskLimits(max_epochs=7), {"key": {"parameters": 1, "overhead": 2, "device": "cpu"}},
                              threads=4)
    request.write(tmp_path)
    assert DecisionRequest.read(tmp_path) == request


def test_a_decision_round_trips_whether_it_trains_or_answers(tmp_path):
    trains = Decision("adapted", "adapted width=1 -> width=0.5 to fit 4.0 MiB", {"width": 0.5}, raw_total=1000,
                      raw_overhead=100, estimate=1090, metrics={"cached_stages": 1.0},
                      estimates={"k": {"parameters": 3, "device": "cpu"}}, threads=2)
    trains.write(tmp_path)
    assert Decision.read(tmp_path) == trains and trains.trains
    answers = Decision("declined", "nothing fits")
    answers.write(tmp_path)
    assert Decision.read(tmp_path) == answers and not answers.trains


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"status": "maybe"}, "a decision's status is one of"),
    ({"status": "ok"}, "a decision to train names the spec"),
])
def test_a_decision_refuses_what_the_agent_could_not_act_on(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Decision(**kwargs)


@pytest.mark.parametrize("text", ["[1, 2]", "{\"status\": \"ok\"}", "not json"])
def test_reading_a_garbled_decision_raises(tmp_path, text):
    (tmp_path / DECISION_FILE).write_text(text)
    with pytest.raises((TypeError, ValueError)):
        Decision.read(tmp_path)


def test_a_training_request_round_trips(tmp_path):
    request = TrainingRequest({"width": 0.5}, "cpu", [0, 1], "/data.npz", "/copies", 2, "default")
    request.write(tmp_path)
    assert TrainingRequest.read(tmp_path) == request
    assert json.loads((tmp_path / "plan.json").read_text())["copies_dir"] == "/copies"
