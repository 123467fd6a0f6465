"""Screening updates before aggregation: non-finite and outsized changes are rejected with a reason."""

from __future__ import annotations

import math

import pytest
import torch

from coordinator.config import ScreeningConfig
from coordinator.screening import change_of, screen
from coordinator.strategies import TaskPlan, TaskResult
from models import SubmodelSpec
from protocol import TrainingPlan

SENT = {"w": torch.zeros(4, 4), "b": torch.zeros(4)}


def result(agent: str, delta: float, keys: tuple[str, ...] = ("w", "b")) -> TaskResult:
    task = TaskPlan(agent, "a", SubmodelSpec.full(), TrainingPlan(), "global")
    state = {key: SENT[key] + delta for key in keys}
    return TaskResult(task, SubmodelSpec.full(), state, {}, 10, [0])


def sent_of(_result: TaskResult) -> dict[str, torch.Tensor]:
    return SENT


def names(results: list[TaskResult]) -> list[str]:
    return [r.task.agent_id for r in results]


def test_change_is_the_root_mean_square_over_the_trained_elements() -> None:
    assert change_of({"w": torch.full((4, 4), 3.0)}, SENT) == pytest.approx(3.0)
    mixed = {"w": torch.zeros(4, 4), "b": torch.full((4,), 2.0)}  # 4 of 20 elements moved by 2
    assert change_of(mixed, SENT) == pytest.approx(math.sqrt(16 / 20))
    assert math.isnan(change_of({"b": torch.tensor([0.0, math.nan, 0.0, 0.0])}, SENT))


def test_ordinary_updates_all_pass() -> None:
    results = [result("a", 0.01), result("b", 0.03), result("c", 0.02), result("d", 0.05, keys=("b",))]
    kept, rejected = screen(results, sent_of, ScreeningConfig())
    assert names(kept) == ["a", "b", "c", "d"] and rejected == []


def test_a_scaled_update_is_rejected_with_its_ratio() -> None:
    results = [result("a", 0.01), result("b", 0.02), result("evil", -1.0), result("c", 0.015)]
    kept, rejected = screen(results, sent_of, ScreeningConfig(max_ratio=10))
    assert names(kept) == ["a", "b", "c"]
    [(bad, reason)] = rejected
    assert bad.task.agent_id == "evil"
    assert reason.startswith("update rejected: its change (rms 1) is 66.7 times the median of the round's other "
                             "updates (0.015), above screening.max_ratio 10")


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_a_non_finite_update_is_rejected_and_does_not_count_for_the_others(value: float) -> None:
    results = [result("a", 0.01), result("bad", value), result("b", 0.012)]
    kept, rejected = screen(results, sent_of, ScreeningConfig())
    assert names(kept) == ["a", "b"]
    assert [(r.task.agent_id, why) for r, why in rejected] == [("bad", "update rejected: its weights are not finite")]


def test_alone_or_beside_unchanged_updates_only_finiteness_is_checked() -> None:
    assert names(screen([result("a", 5.0)], sent_of, ScreeningConfig())[0]) == ["a"]
    kept, _ = screen([result("a", 5.0), result("idle", 0.0)], sent_of, ScreeningConfig())
    assert names(kept) == ["a", "idle"]  # the median of the others is 0: no ratio to take


def test_two_updates_the_outsized_one_goes() -> None:
    kept, rejected = screen([result("honest", 0.02), result("evil", 3.0)], sent_of, ScreeningConfig())
    assert names(kept) == ["honest"] and [r.task.agent_id for r, _ in rejected] == ["evil"]


def test_disabled_screening_keeps_everything() -> None:
    results = [result("a", 0.01), result("bad", math.nan)]
    assert screen(results, sent_of, ScreeningConfig(enabled=False)) == (results, [])


@pytest.mark.parametrize("ratio", [1.0, 0.5, -3.0])
def test_max_ratio_must_be_above_one(ratio: float) -> None:
    with pytest.raises(ValueError, match="screening.max_ratio must be above 1"):
        ScreeningConfig(max_ratio=ratio).validate()
