"""The journal of the round in flight: written before tasks go out and before acks, read back whole after a
crash, cleared once the round is checkpointed; a damaged journal is one sentence."""

from __future__ import annotations

import numpy as np
import pytest

from coordinator.journal import RoundJournal
from coordinator.strategies.base import Skip, TaskPlan
from models import SubmodelSpec
from protocol import Adaptation, LossTerm, ModelRef, TrainingPlan, Update, encode

MODEL = ModelRef("cnn", 10, 1, {"hidden": [4, 8]})


def tasks() -> dict[str, TaskPlan]:
    plan = TrainingPlan(epochs=2, batch_size=8, seed=3, loss=(LossTerm.ce(masked=True),))
    return {
        "r3-a-1": TaskPlan("a", "full", SubmodelSpec.full(), plan, "global", Adaptation("depthwise", route="exit")),
        "r3-b-1": TaskPlan("b", "c", SubmodelSpec.uniform(0.25), plan, "global", None),
    }


def update(task_id: str, agent: str) -> Update:
    return Update(task_id, 3, agent, "ok", {"width": 0.25}, 7, [0, 1], {"w": np.ones(3, np.float32)}, {}, None)


def test_a_journaled_round_reads_back_whole(tmp_path) -> None:
    journal = RoundJournal(tmp_path / "round", MODEL)
    journal.begin(3, 1234.5, tasks(), [Skip("c", "no budget reported")])
    stored = update("r3-b-1", "b")
    journal.store(stored, encode(stored))
    stray = Update("r9-x-1", 9, "x", "ok", None, 7, [0], {}, {}, None)  # of another round: not read back
    journal.store(stray, encode(stray))
    back = journal.load()
    assert back is not None and (back.round, back.deadline) == (3, 1234.5)
    assert back.tasks == tasks()
    assert back.skipped == [Skip("c", "no budget reported")]
    [(update_back, payload)] = list(journal.stored(back.tasks))
    assert update_back.task_id == "r3-b-1" and payload == encode(stored)
    assert update_back.weights["w"].tolist() == [1.0, 1.0, 1.0]
    assert journal.read_update("r3-b-1").weights["w"].tolist() == [1.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="holds no update of task 'r3-a-1'"):
        journal.read_update("r3-a-1")


def test_begin_replaces_the_journal_and_clear_removes_it(tmp_path) -> None:
    journal = RoundJournal(tmp_path / "round", MODEL)
    journal.begin(3, 1.0, tasks(), [])
    journal.store(update("r3-b-1", "b"), encode(update("r3-b-1", "b")))
    journal.begin(4, 2.0, {}, [])
    back = journal.load()
    assert back is not None and back.round == 4 and list(journal.stored(back.tasks)) == [] and back.tasks == {}
    journal.clear()
    assert journal.load() is None and not (tmp_path / "round").exists()
    journal.clear()  # nothing to clear: fine


def test_a_damaged_journal_is_one_sentence(tmp_path) -> None:
    journal = RoundJournal(tmp_path / "round", MODEL)
    journal.begin(3, 1.0, tasks(), [])
    next((tmp_path / "round").glob("task-*.msgpack")).write_bytes(b"\xc1garbage")
    with pytest.raises(ValueError, match=r"the round journal in .* cannot be read \(.*\); move it away to start the "
                                         r"round afresh"):
        journal.load()


def test_a_damaged_stored_update_is_one_sentence(tmp_path) -> None:
    journal = RoundJournal(tmp_path / "round", MODEL)
    journal.begin(3, 1.0, tasks(), [])
    journal.store(update("r3-b-1", "b"), b"\xc1garbage")
    with pytest.raises(ValueError, match=r"the round journal in .* cannot be read \(update-.*\.msgpack: .*\); move it "
                                         r"away to start the round afresh"):
        list(journal.stored({"r3-b-1"}))
