"""Buffered rounds: FedBuff's staleness weight, the buffer's size, and a stale update rebased onto the round's
states (masked: only the positions its index map names)."""

from __future__ import annotations

import math

import pytest
import torch

from coordinator.staleness import buffer_size, rebased, staleness_weight
from coordinator.strategies import TaskPlan, TaskResult
from models import SubmodelSpec
from protocol import TrainingPlan


def test_the_staleness_weight_is_one_over_the_root_of_one_plus_tau():
    assert staleness_weight(0) == 1.0
    assert staleness_weight(1) == pytest.approx(1 / math.sqrt(2))
    assert staleness_weight(3) == pytest.approx(0.5)
    assert all(staleness_weight(tau + 1) < staleness_weight(tau) for tau in range(10))
    with pytest.raises(ValueError):
        staleness_weight(-1)


def test_the_buffer_is_the_configured_count_or_half_the_tasks_that_may_train():
    assert buffer_size(0, 10) == 5 and buffer_size(0, 7) == 4 and buffer_size(0, 1) == 1
    assert buffer_size(3, 10) == 3 and buffer_size(30, 10) == 10 and buffer_size(0, 0) == 1
    # Declines fill no buffer: half of the 8 that may still train; a count no larger than they are.
    assert buffer_size(0, 16, untrained=8) == 4 and buffer_size(6, 10, untrained=7) == 3


def result(state: dict[str, torch.Tensor], index_map) -> TaskResult:
    task = TaskPlan("a", "a", SubmodelSpec.full(), TrainingPlan())
    return TaskResult(task, SubmodelSpec.full(), state, index_map, 5, [0])


def test_a_stale_update_moves_the_rounds_states_by_its_scaled_change_where_it_trained():
    sent = {"w": torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]), "b": torch.zeros(3)}
    current = {"w": sent["w"] + 10.0, "b": torch.ones(3)}
    # A leading block (rows 0-1, columns 0-1) and an index grid (b's elements 0 and 2).
    index_map = {"w": (torch.arange(2), torch.arange(2)), "b": (torch.tensor([0, 2]),)}
    trained = {"w": torch.tensor([[2.0, 2.0], [4.0, 7.0]]), "b": torch.tensor([4.0, 4.0])}
    back = rebased(result(trained, index_map), sent, current, staleness=3)
    change_w = trained["w"] - sent["w"][:2, :2]
    assert torch.allclose(back.state["w"], current["w"][:2, :2] + 0.5 * change_w)
    assert torch.allclose(back.state["b"], torch.tensor([1.0 + 0.5 * 4.0, 1.0 + 0.5 * 4.0]))
    assert back.index_map is index_map and back.num_samples == 5
    assert torch.equal(trained["w"], torch.tensor([[2.0, 2.0], [4.0, 7.0]]))  # the update itself untouched


def test_a_fresh_update_is_folded_as_it_came():
    state = {"w": torch.ones(2)}
    fresh = result(state, {"w": (torch.arange(2),)})
    assert rebased(fresh, {"w": torch.zeros(2)}, {"w": torch.full((2,), 9.0)}, staleness=0) is fresh
