"""The agent's outbox on disk: stored before the first send, removed when settled, bounded, damage refused."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from edge_agent.spool import UpdateSpool
from protocol import Update, encode


def payload(task_id: str, size: int = 4) -> bytes:
    return encode(Update(task_id=task_id, round=1, agent_id="a", status="ok", spec_trained=None, num_samples=3,
                         labels=[0], weights={"w": np.zeros(size, dtype=np.float32)}, metrics={}))


def test_an_update_is_stored_read_back_and_removed(tmp_path) -> None:
    spool = UpdateSpool(tmp_path / "outbox", max_bytes=10**6)
    data = payload("r1-a-1")
    assert spool.put("r1-a-1", data) and "r1-a-1" in spool
    assert (tmp_path / "outbox" / "r1-a-1.update").stat().st_mode & 0o777 == 0o600
    assert UpdateSpool(tmp_path / "outbox", max_bytes=10**6).load("r1-a-1").payload == data  # a new process
    assert spool.remove("r1-a-1") and "r1-a-1" not in spool and spool.task_ids() == []
    assert not spool.remove("r1-a-1")


def test_the_budget_drops_the_oldest_updates_first(tmp_path) -> None:
    first, second, third = (payload(f"r{i}-a-1", size=1000) for i in (1, 2, 3))
    spool = UpdateSpool(tmp_path, max_bytes=len(first) + len(second) + 10)
    spool.put("r1-a-1", first)
    os.utime(tmp_path / "r1-a-1.update", (time.time() - 60, time.time() - 60))  # older by its time
    spool.put("r2-a-1", second)
    spool.put("r3-a-1", third)
    assert spool.task_ids() == ["r2-a-1", "r3-a-1"]
    assert spool.used_bytes() <= spool.max_bytes


def test_an_update_larger_than_the_budget_is_not_stored_and_drops_nothing(tmp_path) -> None:
    spool = UpdateSpool(tmp_path, max_bytes=len(payload("small")) + 10)
    assert spool.put("small", payload("small"))
    assert not spool.put("huge", payload("huge", size=10_000))
    assert spool.task_ids() == ["small"]


def test_a_damaged_file_or_one_of_another_task_is_deleted_not_resent(tmp_path) -> None:
    spool = UpdateSpool(tmp_path, max_bytes=10**6)
    (tmp_path / "r1-a-1.update").write_bytes(payload("r1-a-1")[:-7])  # cut short
    (tmp_path / "r1-a-2.update").write_bytes(payload("r9-a-9"))  # renamed by hand
    assert spool.load("r1-a-1") is None and spool.load("r1-a-2") is None
    assert spool.task_ids() == []


def test_a_task_id_that_is_not_a_file_name_is_refused(tmp_path) -> None:
    spool = UpdateSpool(tmp_path, max_bytes=10**6)
    with pytest.raises(Exception, match="task id must be"):
        spool.put("../escape", b"x")
    assert "../escape" not in spool


def test_the_budget_must_be_positive(tmp_path) -> None:
    with pytest.raises(ValueError, match="disk budget must be positive"):
        UpdateSpool(tmp_path, max_bytes=0)
