"""FjORD: the width grid as levels, each device's p_max the widest it affords, the plan it trains (ordered
dropout over the grid up to p_max, with or without D-KD), and sample-weighted aggregation."""

from __future__ import annotations

import random

import pytest

from coordinator.config import CoordinatorConfig, FjORDConfig, ModelConfig
from coordinator.method_settings.fjord import FJORD_WIDTHS
from coordinator.strategies import make_strategy
from coordinator.strategies.base import TaskResult
from models import SubmodelSpec, get_family
from protocol import LossTerm

FAMILY = get_family("cnn", 10, 1, hidden=[10, 20])


def fjord(make_context, **settings):
    config = CoordinatorConfig(model=ModelConfig(family="cnn", options={"hidden": [10, 20]}),
                               fjord=FjORDConfig(**settings))
    return make_strategy("fjord", make_context(config, family=FAMILY))


def test_the_grid_is_the_papers_and_each_device_gets_the_widest_it_affords(make_context, make_agent):
    assert FJORD_WIDTHS == (1.0, 0.8, 0.6, 0.4, 0.2)
    strategy = fjord(make_context)
    assert [(level.name, level.spec) for level in strategy.levels] == [
        (name, SubmodelSpec.uniform(width)) for name, width in zip("abcde", FJORD_WIDTHS)]
    # The conftest's cost: 1000 bytes times the width (a level's memory at its p_max).
    agents = [make_agent("big", 1000), make_agent("mid", 650), make_agent("small", 250), make_agent("tiny", 100)]
    plan = strategy.configure_round(1, agents, random.Random(0))
    assert {task.agent_id: task.level for task in plan.tasks} == {"big": "a", "mid": "c", "small": "e"}
    assert [skip.agent_id for skip in plan.skipped] == ["tiny"]


def test_a_device_draws_from_the_grid_up_to_its_p_max_and_distils_from_it(make_context):
    strategy = fjord(make_context)
    plans = {level.name: strategy.level_plan(level, 1) for level in strategy.levels}
    assert plans["a"].widths == (1.0, 0.8, 0.6, 0.4, 0.2)
    assert plans["c"].widths == (0.6, 0.4, 0.2)
    assert plans["c"].loss == (LossTerm.ce(), LossTerm.width_kd(tau=1.0))
    # The narrowest has nothing narrower to draw: it trains itself, on the labels.
    assert plans["e"].widths == () and plans["e"].loss == (LossTerm.ce(),)
    undistilled = fjord(make_context, distill=False)
    plan = undistilled.level_plan(undistilled.levels[1], 1)
    assert plan.widths == (0.8, 0.6, 0.4, 0.2) and plan.loss == (LossTerm.ce(),)


def test_a_device_short_of_memory_falls_to_a_narrower_p_max_with_its_own_grid(make_context, make_agent):
    (task,) = fjord(make_context).configure_round(1, [make_agent("big", 1000)], random.Random(0)).tasks
    assert task.adaptation is not None
    assert [candidate.plan.widths for candidate in task.adaptation.candidates] == [
        (0.8, 0.6, 0.4, 0.2), (0.6, 0.4, 0.2), (0.4, 0.2), ()]


def test_updates_are_weighted_by_their_samples(make_context):
    strategy = fjord(make_context)
    result = TaskResult(None, SubmodelSpec.full(), {}, {}, num_samples=120, labels=[0])  # type: ignore[arg-type]
    assert strategy.weight(result) == 120.0


def test_a_bad_grid_is_refused():
    for widths in ([], [0.5, 1.0], [1.0, 1.0], [1.0, 0.0]):
        with pytest.raises(ValueError, match="fjord.widths"):
            CoordinatorConfig(fjord=FjORDConfig(widths=widths)).validate()
