"""Strategies: HeteroFL fix/dynamic planning, FedAvg, Decoupled, evaluation targets and make_strategy."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from coordinator.config import HETEROFL_RATES
from coordinator.levels import make_levels
from coordinator.registry import AgentRecord
from coordinator.strategies import STRATEGIES, Assignment, make_strategy
from coordinator.strategies.decoupled import Decoupled
from coordinator.strategies.fedavg import FedAvg
from coordinator.strategies.heterofl import HeteroFL
from models import SubmodelSpec
from protocol import Capabilities

LEVELS = make_levels(HETEROFL_RATES)  # costs below: a 1000, b 500, c 250, d 125, e 62


def cost(spec: SubmodelSpec) -> int:
    return int(spec.width * 1000)


def agent(agent_id: str, budget: int) -> AgentRecord:
    capabilities = Capabilities(device_kind="generic", memory_total=10**9, memory_available=10**9,
                                budget_bytes=budget, num_samples=10, labels=[0])
    return AgentRecord(agent_id, "online", capabilities, 0.0)


# ---------------------------------------------------------------------------------------------- HeteroFL
def test_heterofl_fix_gives_largest_level_fitting_each_budget():
    strategy = HeteroFL(LEVELS, cost, "fix")
    agents = [agent("a0", 1000), agent("a1", 999), agent("a2", 300), agent("a3", 130), agent("a4", 62)]
    assignments, skipped = strategy.plan(agents, random.Random(0))
    assert skipped == []
    assert [(a.agent_id, a.level) for a in assignments] == [
        ("a0", "a"), ("a1", "b"), ("a2", "c"), ("a3", "d"), ("a4", "e")]
    by_name = {level.name: level for level in LEVELS}
    for assignment in assignments:
        assert assignment.spec == by_name[assignment.level].spec
        assert assignment.group == "global"


def test_heterofl_skips_agent_when_nothing_fits_with_reason():
    strategy = HeteroFL(LEVELS, cost, "fix")
    assignments, skipped = strategy.plan([agent("big", 2000), agent("tiny", 50)], random.Random(0))
    assert [a.agent_id for a in assignments] == ["big"]
    assert len(skipped) == 1 and skipped[0].agent_id == "tiny"
    reason = skipped[0].reason
    assert "50 bytes" in reason and "62 bytes" in reason and "level e" in reason


def test_heterofl_budget_is_capped_by_available_memory():
    capabilities = Capabilities(device_kind="generic", memory_total=10**9, memory_available=260,
                                budget_bytes=10**6, num_samples=1, labels=[0])
    record = AgentRecord("x", "online", capabilities, 0.0)
    assignments, _ = HeteroFL(LEVELS, cost, "fix").plan([record], random.Random(0))
    assert assignments[0].level == "c"


def test_heterofl_dynamic_samples_all_levels_whatever_the_budget():
    # HeteroFL's dynamic setting: capabilities change every round, so the level is sampled from all levels;
    # an agent that cannot afford it adapts (the task carries the width-levels hint) or declines.
    strategy = HeteroFL(LEVELS, cost, "dynamic")
    rng = random.Random(3)
    seen: Counter[str] = Counter()
    for _ in range(200):
        assignments, skipped = strategy.plan([agent("p", 300), agent("q", 130)], rng)
        assert skipped == []
        seen.update(a.level for a in assignments)
    assert set(seen) == {level.name for level in LEVELS}
    assert strategy.adaptation_hint() == {"kind": "width-levels", "rates": [level.rate for level in LEVELS]}


def test_heterofl_dynamic_uses_proportions():
    strategy = HeteroFL(LEVELS, cost, "dynamic", proportions=[0, 0, 0, 1, 0])
    assignments, _ = strategy.plan([agent(f"x{i}", 10**6) for i in range(30)], random.Random(0))
    assert {a.level for a in assignments} == {"d"}


def test_heterofl_groups_and_eval_targets():
    strategy = HeteroFL(LEVELS, cost)
    assert strategy.groups() == ["global"]
    targets = strategy.eval_targets()
    assert set(targets) == {"global", "a", "b", "c", "d", "e"}
    assert targets["global"].group == "global" and targets["global"].spec.is_full
    for level in LEVELS:
        assert targets[level.name].group == "global"
        assert targets[level.name].spec == level.spec


# ---------------------------------------------------------------------------------------------- FedAvg
def test_fedavg_always_assigns_full_model_regardless_of_budget():
    strategy = FedAvg(LEVELS, cost, "dynamic")
    assignments, skipped = strategy.plan([agent("poor", 1), agent("rich", 10**9)], random.Random(0))
    assert skipped == []
    assert [(a.level, a.group) for a in assignments] == [("a", "global"), ("a", "global")]
    assert all(a.spec.is_full for a in assignments)
    assert strategy.groups() == ["global"]


def test_fedavg_eval_targets_are_full_model_only():
    targets = FedAvg(LEVELS, cost).eval_targets()
    assert set(targets) == {"global", "a"}
    assert all(t.group == "global" and t.spec.is_full for t in targets.values())


# ---------------------------------------------------------------------------------------------- Decoupled
def test_decoupled_keeps_one_group_per_level():
    strategy = Decoupled(LEVELS, cost, "fix")
    assert strategy.groups() == ["a", "b", "c", "d", "e"]
    assignments, _ = strategy.plan([agent("x", 600), agent("y", 100)], random.Random(0))
    assert [(a.level, a.group) for a in assignments] == [("b", "b"), ("e", "e")]


def test_decoupled_eval_targets_use_level_groups_and_global_is_level_a():
    targets = Decoupled(LEVELS, cost).eval_targets()
    assert set(targets) == {"global", "a", "b", "c", "d", "e"}
    assert targets["global"].group == "a" and targets["global"].spec.is_full
    for level in LEVELS:
        assert targets[level.name].group == level.name
        assert targets[level.name].spec == level.spec


# ---------------------------------------------------------------------------------------------- factory
@pytest.mark.parametrize("name", ["heterofl", "fedavg", "decoupled"])
def test_make_strategy_builds_known_strategies(name):
    strategy = make_strategy(name, LEVELS, cost, "dynamic", [1, 2, 3, 4, 5])
    assert type(strategy) is STRATEGIES[name] and strategy.name == name
    assert strategy.assignment == "dynamic"
    assert strategy.proportions == {"a": 1, "b": 2, "c": 3, "d": 4, "e": 5}


def test_make_strategy_default_proportions_are_uniform():
    strategy = make_strategy("heterofl", LEVELS, cost)
    assert strategy.proportions == {name: 1.0 for name in "abcde"}


def test_make_strategy_unknown_name_lists_known_ones():
    with pytest.raises(ValueError, match="unknown algorithm 'scalefl'") as info:
        make_strategy("scalefl", LEVELS, cost)
    assert "decoupled, fedavg, heterofl" in str(info.value)


def test_assignment_is_immutable():
    assignment = Assignment("x", "a", SubmodelSpec.full(), "global")
    with pytest.raises(AttributeError):
        assignment.level = "b"  # type: ignore[misc]
