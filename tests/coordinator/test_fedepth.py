"""FeDepth's server half: the full model for every device, copies up to the cap, masked sample-weighted mean,
and what a budget would train (the cut from per-block costs)."""

from __future__ import annotations

import random

import pytest
import torch

from coordinator.config import CoordinatorConfig, FeDepthConfig, ModelConfig
from coordinator.strategies import TaskPlan, TaskResult, make_strategy
from coordinator.strategies.base import base_plan
from models import SubmodelSpec
from protocol import Adaptation, LossTerm, TrainingPlan


def fedepth(make_context, cost=None, **settings: object):
    cfg = CoordinatorConfig(model=ModelConfig(family="cnn", options={"hidden": [4, 8, 8]}), rounds=3,
                            algorithm="fedepth", fedepth=FeDepthConfig(**settings))  # type: ignore[arg-type]
    return make_strategy("fedepth", make_context(cfg, cost=cost) if cost else make_context(cfg))


def test_every_device_gets_the_full_model_to_train_whole_or_depth_wise(make_context, make_agent):
    strategy = fedepth(make_context)
    agents = [make_agent("poor", 1), make_agent("rich", 10**9), make_agent("unknown", None)]
    plan = strategy.configure_round(1, agents, random.Random(0))
    assert plan.skipped == [] and [t.agent_id for t in plan.tasks] == ["poor", "rich", "unknown"]
    for task in plan.tasks:
        assert task.spec == SubmodelSpec.full() and task.adaptation == Adaptation("depthwise", min_micro_batch=8, head_alone=True)
        assert task.plan.copies == 2  # a cap: each device takes as many as its memory holds
        assert task.plan.loss == (*base_plan(strategy.config.recipe).loss, LossTerm.mutual_kd(weight=1.0, tau=1.0))
    spec, whole = strategy.whole_once()  # the describe row: one copy trained whole
    assert spec == SubmodelSpec.full() and whole.copies == 1


def test_one_copy_switches_mutual_distillation_off(make_context, make_agent):
    strategy = fedepth(make_context, max_copies=1, mutual_weight=0.5)
    [task] = strategy.configure_round(1, [make_agent("a", None)], random.Random(0)).tasks
    assert task.plan == base_plan(strategy.config.recipe)


@pytest.mark.parametrize("settings", [{"max_copies": 0}, {"max_copies": 9}, {"mutual_weight": -1.0}])
def test_bad_settings_are_one_sentence(settings):
    with pytest.raises(ValueError, match="fedepth.max_copies must be between 1 and 8"):
        FeDepthConfig(**settings).validate()


def test_aggregation_is_the_sample_weighted_mean_of_what_each_device_trained(make_context):
    strategy = fedepth(make_context)
    family = strategy.family
    level = strategy.levels[0]
    whole, partial = SubmodelSpec.full(), SubmodelSpec(segments=((1, 2), (2, 3)))  # partial skips block 0

    def result(spec: SubmodelSpec, fill: float, samples: int) -> TaskResult:
        keys = family.trainable_keys(spec)
        shapes = family.shapes(spec, track_bn_stats=False)
        index = family.index_map(spec)
        task = TaskPlan("dev", level.name, whole, strategy.level_plan(level, 1), "global")
        return TaskResult(task, spec, {k: torch.full(shapes[k], fill) for k in keys}, {k: index[k] for k in keys},
                          samples, list(range(10)))

    states = strategy.initial_states(0)
    merged = strategy.aggregate(1, [result(whole, 1.0, 100), result(partial, 4.0, 300)], states)["global"]
    assert "conv1.weight" not in family.trainable_keys(partial)
    assert torch.allclose(merged["conv1.weight"], torch.ones_like(merged["conv1.weight"]))  # not diluted
    assert torch.allclose(merged["conv3.weight"], torch.full_like(merged["conv3.weight"], (100 + 1200) / 400))


def test_a_head_alone_update_counts_only_in_the_head(make_context):
    strategy = fedepth(make_context)
    family = strategy.family
    level = strategy.levels[0]
    n = family.num_blocks
    head_only, block = SubmodelSpec(segments=((n, n),)), SubmodelSpec(segments=((n - 1, n),))
    assert set(family.trainable_keys(head_only)) == set(family.head_keys())  # what the device uploads
    assert family.is_nested(head_only, strategy.global_spec())  # the coordinator accepts it

    def result(spec: SubmodelSpec, fill: float, samples: int) -> TaskResult:
        keys = family.trainable_keys(spec)
        shapes = family.shapes(spec, track_bn_stats=False)
        index = family.index_map(spec)
        task = TaskPlan("dev", level.name, SubmodelSpec.full(), strategy.level_plan(level, 1), "global")
        return TaskResult(task, spec, {k: torch.full(shapes[k], fill) for k in keys}, {k: index[k] for k in keys},
                          samples, list(range(10)))

    states = strategy.initial_states(0)
    before = states["global"]
    merged = strategy.aggregate(1, [result(head_only, 2.0, 100), result(block, 6.0, 300)], states)["global"]
    for key in family.head_keys():  # both trained the head: their sample-weighted mean
        assert torch.allclose(merged[key], torch.full_like(merged[key], (200 + 1800) / 400))
    for key in set(family.trainable_keys(block)) - set(family.head_keys()):  # only the block's device trained it
        assert torch.allclose(merged[key], torch.full_like(merged[key], 6.0)), key
    for key in set(before) - set(family.trainable_keys(block)):  # nobody trained it: unchanged
        assert torch.equal(merged[key], before[key]), key
    alone = strategy.aggregate(1, [result(head_only, 2.0, 100)], states)["global"]
    assert all(torch.equal(alone[key], before[key]) for key in set(before) - set(family.head_keys()))


def test_plan_for_budget_cuts_by_the_estimates(make_context):
    def cost(spec: SubmodelSpec, plan: TrainingPlan) -> int:
        if spec.segments is None:
            return 1000 * plan.copies  # whole: 1000 a copy
        (start, stop), = spec.segments
        return sum((500, 300, 200)[start:stop]) or 150  # per-block costs, as FeDepth's cut reads them; the head 150

    strategy = fedepth(make_context, cost=cost, max_copies=3)
    assert strategy.plan_for_budget(3000) == {"trains": "whole, 3 copies", "train_bytes": 3000}
    assert strategy.plan_for_budget(2500) == {"trains": "whole, 2 copies", "train_bytes": 2000}
    assert strategy.plan_for_budget(1000) == {"trains": "whole", "train_bytes": 1000}
    assert strategy.plan_for_budget(600) == {"trains": "depth-wise", "segments": "0 | 1-2", "cut": [[0, 1], [1, 3]],
                                               "train_bytes": [500, 500]}
    described = strategy.plan_for_budget(300)
    assert described["trains"] == "depth-wise" and "skipped 0" in described["segments"]
    # No block fits alone (the cheapest needs 200): the head alone on the frozen blocks, down to its own need.
    assert strategy.plan_for_budget(199) == {"trains": "head alone", "segments": "on frozen blocks 0-2",
                                             "cut": [[3, 3]], "train_bytes": [150]}
    assert strategy.plan_for_budget(150)["cut"] == [[3, 3]]
    nothing = strategy.plan_for_budget(149)  # not even the head: smaller micro-batches would not change that
    assert nothing == {"trains": "nothing", "needs_bytes": 150, "to_fit": nothing["to_fit"]}
    assert "lighter blocks" in nothing["to_fit"] and "preresnet20" in nothing["to_fit"]


def test_plan_for_budget_trains_the_head_alone_exactly_where_no_block_fits(make_context):
    head = 120

    def cost(spec: SubmodelSpec, plan: TrainingPlan) -> int:
        if spec.segments is None:
            return 10_000
        (start, stop), = spec.segments
        micro = plan.schedule[0].micro_batch if plan.schedule else 0
        shrink = {0: 1.0, 16: 0.8, 8: 0.7, 2: 0.5}[micro]  # micro-batches cut the activations' share
        return round((sum((900, 700, 800)[start:stop]) if stop > start else head) * shrink)

    strategy = fedepth(make_context, cost=cost)
    cheapest_block = round(700 * 0.7)  # block 1 in micro-batches of 8
    below = strategy.plan_for_budget(cheapest_block - 1)
    assert below["trains"] == "head alone" and below["cut"] == [[3, 3]]
    assert below["train_bytes"] == [head]  # it fits at the whole batch: no micro-batches
    at = strategy.plan_for_budget(cheapest_block)
    assert at["trains"] == "depth-wise" and [1, 2] in at["cut"] and [3, 3] not in at["cut"]
    micro = strategy.plan_for_budget(head - 1)  # the head fits only in micro-batches: the largest that fits
    assert micro["cut"] == [[3, 3]] and micro["train_bytes"] == [round(head * 0.8)] and "16" in micro["segments"]
    nothing = strategy.plan_for_budget(round(head * 0.7) - 1)  # below the floor's need: micro-batches of 2 would do
    assert nothing["trains"] == "nothing" and nothing["needs_bytes"] == round(head * 0.7)
    assert nothing["to_fit"] == strategy.setting_to_shrink() and "fedepth.min_micro_batch, now 8" in nothing["to_fit"]
    assert "lighter blocks" in strategy.plan_for_budget(round(head * 0.5) - 1)["to_fit"]  # not even those


def test_auxiliary_classifier_route_sends_an_exit_after_every_block(make_context, make_agent):
    strategy = fedepth(make_context, route="exit")
    exits = strategy.family.exit_points
    assert exits == (0, 1)  # every block but the last (three blocks)
    [task] = strategy.configure_round(1, [make_agent("a", None)], random.Random(0)).tasks
    assert task.spec == SubmodelSpec(exits=exits) == strategy.global_spec()
    assert task.adaptation == Adaptation("depthwise", route="exit", min_micro_batch=8, head_alone=True)
    assert strategy.whole_once()[0] == SubmodelSpec.full()  # a device that trains whole: no classifiers
    assert set(strategy.initial_states(0)["global"]) == set(strategy.family.shapes(SubmodelSpec(exits=exits)))


def test_plan_for_budget_through_auxiliary_classifiers_costs_each_segment_with_its_exit(make_context):
    seen: list[SubmodelSpec] = []

    def cost(spec: SubmodelSpec, plan: TrainingPlan) -> int:
        if spec.segments is None:
            return 1000
        seen.append(spec)
        assert plan.schedule[0].route == "exit"
        (start, stop), = spec.segments
        return sum((500, 300, 200)[start:stop]) + 50 * len(spec.exits)

    strategy = fedepth(make_context, cost=cost, route="exit")
    assert strategy.plan_for_budget(600) == {"trains": "depth-wise via auxiliary classifiers", "segments": "0 | 1-2",
                                             "cut": [[0, 1], [1, 3]], "train_bytes": [550, 500]}
    assert SubmodelSpec(exits=(0,), segments=((0, 1),)) in seen and SubmodelSpec(segments=((1, 3),)) in seen


def test_describe_shows_the_whole_model_once_and_with_its_copies(make_context):
    strategy = fedepth(make_context, cost=lambda spec, plan: 1000 * plan.copies)
    [row] = strategy.describe()
    assert row["name"] == "full" and row["train_bytes"] == 1000 and row["x2_copies_train_bytes"] == 2000


def test_an_unknown_route_is_one_sentence():
    with pytest.raises(ValueError, match="fedepth.route must be one of skip, exit, got 'teleport'"):
        FeDepthConfig(route="teleport").validate()
