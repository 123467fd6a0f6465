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


def test_carried_tasks_keep_their_round_and_deadline_and_their_bases_read_back(tmp_path) -> None:
    """A buffered round's journal: its own tasks, those it carries (with their own round and deadline), the states
    those were cut from, and the stored updates of both kinds."""
    import torch

    from coordinator.round import DispatchedTask

    journal = RoundJournal(tmp_path / "round", MODEL)
    old = tasks()["r3-b-1"]
    carried = [DispatchedTask("r1-c-1", 1, old, 999.0)]
    base = {"global": {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)}}
    journal.begin(3, 1234.5, {"r3-a-1": tasks()["r3-a-1"]}, [], carried, {1: base, 3: {"global": {}}})
    stale = Update("r1-c-1", 1, "c", "ok", None, 7, [0], {"w": np.ones(3, np.float32)}, {}, None)
    journal.store(stale, encode(stale))
    back = journal.load()
    assert back is not None and back.planned and list(back.tasks) == ["r3-a-1"]
    assert back.carried == carried  # round 1, deadline 999.0, the same plan
    assert list(back.bases) == [1] and torch.equal(back.bases[1]["global"]["w"], base["global"]["w"])
    assert [u.task_id for u, _ in journal.stored({*back.tasks, "r1-c-1"})] == ["r1-c-1"]


def test_what_the_next_round_carries_is_journaled_unplanned(tmp_path) -> None:
    import torch

    from coordinator.round import DispatchedTask

    journal = RoundJournal(tmp_path / "round", MODEL)
    carried = [DispatchedTask("r3-b-1", 3, tasks()["r3-b-1"], 999.0)]
    journal.begin(4, 0.0, {}, [], carried, {3: {"global": {"w": torch.zeros(2)}}}, planned=False)
    back = journal.load()
    assert back is not None and not back.planned and back.round == 4 and back.tasks == {}
    assert back.carried == carried and list(back.bases) == [3]


def test_a_damaged_base_is_one_sentence(tmp_path) -> None:
    import torch

    from coordinator.round import DispatchedTask

    journal = RoundJournal(tmp_path / "round", MODEL)
    journal.begin(4, 0.0, {}, [], [DispatchedTask("r3-b-1", 3, tasks()["r3-b-1"], 9.0)],
                  {3: {"global": {"w": torch.zeros(2)}}}, planned=False)
    (tmp_path / "round" / "base-3.safetensors").write_bytes(b"garbage")
    with pytest.raises(ValueError, match=r"the round journal in .* cannot be read"):
        journal.load()


def test_a_base_still_needed_is_kept_as_written_when_the_journal_begins_again(tmp_path) -> None:
    import torch

    from coordinator.round import DispatchedTask

    journal = RoundJournal(tmp_path / "round", MODEL)
    carried = [DispatchedTask("r3-b-1", 3, tasks()["r3-b-1"], 999.0)]
    journal.begin(4, 0.0, {}, [], carried, {3: {"global": {"w": torch.zeros(2)}}}, planned=False)
    base = tmp_path / "round" / "base-3.safetensors"
    written = base.stat().st_mtime_ns
    journal.begin(4, 10.0, tasks(), [], carried, {3: {"global": {"w": torch.ones(2)}}})  # (not read: kept)
    assert base.stat().st_mtime_ns == written
    back = journal.load()
    assert back is not None and torch.equal(back.bases[3]["global"]["w"], torch.zeros(2))
    journal.begin(5, 20.0, tasks(), [])  # nothing carried: no base left
    assert not base.exists()


def test_a_journal_is_never_read_half_replaced(tmp_path, monkeypatch) -> None:
    """A kill while a new journal replaces the old (simulated: the first file removal fails) leaves the old one
    whole: the new files are written and the index replaced before anything the old index names goes."""
    import torch

    from coordinator import journal as journal_module
    from coordinator.round import DispatchedTask

    journal = RoundJournal(tmp_path / "round", MODEL)
    carried = [DispatchedTask("r3-b-1", 3, tasks()["r3-b-1"], 999.0)]
    journal.begin(4, 9.0, {"r4-a-1": tasks()["r3-a-1"]}, [], carried, {3: {"global": {"w": torch.zeros(2)}}})
    stored = update("r3-b-1", "b")
    journal.store(stored, encode(stored))

    def killed(self, *args, **kwargs):
        raise KeyboardInterrupt("killed")

    monkeypatch.setattr(journal_module.Path, "unlink", killed)
    with pytest.raises(KeyboardInterrupt):
        journal.begin(5, 10.0, {"r5-a-1": tasks()["r3-a-1"]}, [])  # the new index is in before any removal
    back = journal.load()
    assert back is not None and back.round == 5 and set(back.tasks) == {"r5-a-1"}
    monkeypatch.undo()
    with pytest.raises(KeyboardInterrupt):  # a clear stopped at its first removal leaves no index behind
        monkeypatch.setattr(journal_module.shutil, "rmtree", killed)
        journal.clear()
    assert journal.load() is None


def test_what_the_next_round_carries_survives_a_stop_between_checkpoint_and_journal(tmp_path) -> None:
    """``carry_on`` records, beside the round's own journal, what the next round carries and the base of the
    round's own tasks; read back, the round is still the one to resume until its checkpoint exists, and ``next``
    says what to carry once it does."""
    import torch

    from coordinator.round import DispatchedTask

    journal = RoundJournal(tmp_path / "round", MODEL)
    journal.begin(3, 9.0, tasks(), [])
    still = [DispatchedTask("r3-b-1", 3, tasks()["r3-b-1"], 999.0)]
    journal.carry_on(4, still, {3: {"global": {"w": torch.ones(2)}}})
    back = journal.load()
    assert back is not None and back.round == 3 and back.planned and back.tasks == tasks()
    following = journal.load_next()
    assert following is not None and following.round == 4 and not following.planned
    assert following.carried == still and torch.equal(following.bases[3]["global"]["w"], torch.ones(2))
    journal.begin(4, 0.0, {}, [], still, {3: {"global": {"w": torch.zeros(2)}}}, planned=False)
    again = journal.load()
    assert again is not None and again.round == 4 and journal.load_next() is None and again.carried == still
    assert torch.equal(again.bases[3]["global"]["w"], torch.ones(2))  # the base as first written
    journal.carry_on(5, [], {})  # a round that carries nothing says so: no earlier record is read instead
    nothing = journal.load_next()
    assert nothing is not None and nothing.round == 5 and nothing.carried == []


def test_a_record_of_what_the_next_round_carries_goes_first_when_the_journal_is_replaced(tmp_path,
                                                                                        monkeypatch) -> None:
    """``next.json`` names files a new journal may remove: it goes before any of them (and a damaged one is read
    only when asked for)."""
    import torch

    from coordinator import journal as journal_module
    from coordinator.round import DispatchedTask

    journal = RoundJournal(tmp_path / "round", MODEL)
    journal.begin(3, 9.0, tasks(), [])
    journal.carry_on(4, [DispatchedTask("r3-b-1", 3, tasks()["r3-b-1"], 999.0)], {3: {"global": {"w": torch.ones(2)}}})
    removed: list[str] = []
    unlink = journal_module.Path.unlink

    def recorded(self, *args, **kwargs):
        removed.append(self.name)
        return unlink(self, *args, **kwargs)

    monkeypatch.setattr(journal_module.Path, "unlink", recorded)
    journal.begin(5, 10.0, {"r5-a-1": tasks()["r3-a-1"]}, [])
    assert removed[0] == "next.json" and journal.load_next() is None
    (tmp_path / "round" / "next.json").write_text("{damaged")
    assert journal.load() is not None  # not read here
    with pytest.raises(ValueError, match="cannot be read"):
        journal.load_next()
