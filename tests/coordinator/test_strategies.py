"""Strategies on the LevelStrategy base: HeteroFL fix/dynamic planning and its ladder, FedAvg, Decoupled,
evaluation targets, aggregation, state, and the registry (make_strategy, check_algorithm)."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import replace

import pytest
import torch

from coordinator.aggregation import grid
from coordinator.config import HETEROFL_RATES, CoordinatorConfig, FedAvgConfig, ModelConfig, RecipeConfig
from coordinator.levels import width_levels
from coordinator.strategies import (
    ALGORITHM_NAMES,
    STRATEGIES,
    RoundPlan,
    TaskOutcome,
    TaskPlan,
    TaskResult,
    check_algorithm,
    make_strategy,
)
from coordinator.strategies.base import base_plan
from coordinator.strategies.decoupled import Decoupled
from coordinator.strategies.fedavg import FedAvg
from coordinator.strategies.heterofl import HeteroFL
from models import SubmodelSpec
from protocol import Adaptation, Candidate, LossTerm

LEVELS = width_levels(HETEROFL_RATES)  # costs (conftest.width_cost): a 1000, b 500, c 250, d 125, e 62
BY_NAME = {level.name: level for level in LEVELS}


def config(**overrides: object) -> CoordinatorConfig:
    cfg = CoordinatorConfig(model=ModelConfig(family="cnn", options={"hidden": [4, 8]}), rounds=4)
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


@pytest.fixture
def make(make_context):
    """``make(name, cost=..., overhead=..., **config overrides)``: a strategy on a tiny CNN."""

    def build(name: str, *, cost=None, overhead: int = 0, **overrides: object):
        kwargs = {"overhead": overhead} if cost is None else {"cost": cost, "overhead": overhead}
        return make_strategy(name, make_context(config(**overrides), **kwargs))

    return build


def ladder_below(name: str, cfg: CoordinatorConfig) -> Adaptation | None:
    """HeteroFL's ladder for level ``name``: every smaller level, largest first, with the recipe's plan."""
    below = LEVELS[[level.name for level in LEVELS].index(name) + 1:]
    if not below:
        return None
    return Adaptation("ladder", [Candidate(level.spec.to_dict(), base_plan(cfg.recipe, masked=True))
                                 for level in below])


# ---------------------------------------------------------------------------------------------- HeteroFL
def test_heterofl_fix_gives_largest_level_fitting_each_budget(make, make_agent):
    strategy = make("heterofl")
    agents = [make_agent("a0", 1000), make_agent("a1", 999), make_agent("a2", 300), make_agent("a3", 130),
              make_agent("a4", 62)]
    plan = strategy.configure_round(1, agents, random.Random(0))
    assert isinstance(plan, RoundPlan)
    assert plan.skipped == []
    assert [(t.agent_id, t.level) for t in plan.tasks] == [
        ("a0", "a"), ("a1", "b"), ("a2", "c"), ("a3", "d"), ("a4", "e")]
    for task in plan.tasks:
        assert task.spec == BY_NAME[task.level].spec
        assert task.group == "global"
        assert task.plan == base_plan(strategy.config.recipe, masked=True)  # HeteroFL's default
        assert task.adaptation == ladder_below(task.level, strategy.config)


def test_heterofl_ladder_offers_only_the_smaller_levels_largest_first(make, make_agent):
    strategy = make("heterofl")
    task = strategy.configure_round(1, [make_agent("x", 300)], random.Random(0)).tasks[0]
    assert task.level == "c"
    assert task.adaptation is not None and task.adaptation.kind == "ladder"
    assert [SubmodelSpec.from_dict(c.spec) for c in task.adaptation.candidates] == [BY_NAME["d"].spec,
                                                                                   BY_NAME["e"].spec]
    for candidate in task.adaptation.candidates:
        assert strategy.family.is_nested(SubmodelSpec.from_dict(candidate.spec), task.spec)


def test_heterofl_smallest_level_has_no_ladder(make, make_agent):
    task = make("heterofl").configure_round(1, [make_agent("x", 62)], random.Random(0)).tasks[0]
    assert task.level == "e" and task.adaptation is None


def test_heterofl_skips_agent_when_nothing_fits_with_reason(make, make_agent):
    plan = make("heterofl").configure_round(1, [make_agent("big", 2000), make_agent("tiny", 50)],
                                            random.Random(0))
    assert [t.agent_id for t in plan.tasks] == ["big"]
    assert len(plan.skipped) == 1 and plan.skipped[0].agent_id == "tiny"
    reason = plan.skipped[0].reason
    assert "50 bytes" in reason and "62 bytes" in reason and "level e" in reason


def test_heterofl_budget_is_capped_by_available_memory(make, make_agent):
    plan = make("heterofl").configure_round(1, [make_agent("x", 10**6, available=260)], random.Random(0))
    assert plan.tasks[0].level == "c"


def test_heterofl_fix_compares_the_budget_with_the_whole_estimate(make, make_agent):
    # The estimate's total counts the runtime's fixed overhead: with 100 bytes of it, 1000 bytes no longer fit
    # level a (1100) but fit b (600); 160 bytes fit only e (162).
    strategy = make("heterofl", overhead=100)
    assert strategy.cost(BY_NAME["a"]) == 1100
    plan = strategy.configure_round(1, [make_agent("x", 1000), make_agent("y", 170), make_agent("z", 160)],
                                    random.Random(0))
    assert [(t.agent_id, t.level) for t in plan.tasks] == [("x", "b"), ("y", "e")]
    assert [s.agent_id for s in plan.skipped] == ["z"]
    assert "162 bytes" in plan.skipped[0].reason


def test_heterofl_fix_gives_every_level_to_agents_without_a_budget(make, make_agent):
    # No budget and the memory available unknown: the registry reports None, every level is affordable.
    strategy = make("heterofl")
    record = make_agent("x", None)
    record.capabilities = None
    assert record.budget() is None
    assert strategy.choose_level(record, random.Random(0), 1).name == "a"


def test_heterofl_dynamic_samples_all_levels_whatever_the_budget(make, make_agent):
    # HeteroFL's dynamic setting: capabilities change every round, so the level is sampled from all levels;
    # an agent that cannot afford it adapts (the task carries the ladder of smaller levels) or declines.
    strategy = make("heterofl", level_assignment="dynamic")
    rng = random.Random(3)
    seen: Counter[str] = Counter()
    for round_number in range(1, 201):
        plan = strategy.configure_round(round_number, [make_agent("p", 300), make_agent("q", 130)], rng)
        assert plan.skipped == []
        for task in plan.tasks:
            assert task.spec == BY_NAME[task.level].spec
            assert task.adaptation == ladder_below(task.level, strategy.config)
        seen.update(t.level for t in plan.tasks)
    assert set(seen) == {level.name for level in LEVELS}


def test_heterofl_dynamic_uses_proportions(make, make_agent):
    strategy = make("heterofl", level_assignment="dynamic", level_proportions=[0, 0, 0, 1, 0])
    plan = strategy.configure_round(1, [make_agent(f"x{i}", 10**6) for i in range(30)], random.Random(0))
    assert {t.level for t in plan.tasks} == {"d"}
    assert len(plan.tasks) == 30


def test_level_proportions_need_one_weight_per_level(make):
    for proportions in ([1.0, 1.0], [1, 1, 1, 1, 1, 1]):
        with pytest.raises(ValueError, match=r"level_proportions needs one weight per level of heterofl \(5\)"):
            make("heterofl", level_proportions=proportions)
    with pytest.raises(ValueError, match=r"fedavg \(1\), got 5"):
        make("fedavg", level_proportions=[1, 1, 1, 1, 1])
    assert make("fedavg", level_proportions=[2.0]).proportions == {"a": 2.0}


def test_fraction_selects_a_seeded_share_of_the_agents_sorted_by_id(make, make_agent):
    strategy = make("heterofl", fraction=0.3)
    agents = [make_agent(f"x{i:02d}", 10**6) for i in range(10)]
    first = [t.agent_id for t in strategy.configure_round(1, agents, random.Random(5)).tasks]
    again = [t.agent_id for t in strategy.configure_round(1, agents, random.Random(5)).tasks]
    assert len(first) == 3 and first == sorted(first) and first == again
    chosen = {tuple(t.agent_id for t in strategy.configure_round(1, agents, random.Random(seed)).tasks)
              for seed in range(20)}
    assert len(chosen) > 1
    tiny = make("heterofl", fraction=0.01)
    assert len(tiny.configure_round(1, agents, random.Random(0)).tasks) == 1  # at least one
    assert tiny.configure_round(1, [], random.Random(0)) == RoundPlan()


def test_heterofl_groups_and_eval_targets(make):
    strategy = make("heterofl")
    assert strategy.groups() == ["global"]
    targets = strategy.eval_targets()
    assert set(targets) == {"global", "a", "b", "c", "d", "e"}
    assert targets["global"].group == "global" and targets["global"].spec.is_full
    assert targets["global"].store_bn is True
    for level in LEVELS:
        assert targets[level.name].group == "global"
        assert targets[level.name].spec == level.spec
        assert targets[level.name].store_bn is False


def test_heterofl_masks_by_default_and_describes_its_levels(make):
    strategy = make("heterofl")
    assert strategy.masked_ce and strategy.level_plan(strategy.levels[0], 1) == base_plan(strategy.config.recipe,
                                                                                         masked=True)
    rows = strategy.describe()
    assert [row["name"] for row in rows] == ["a", "b", "c", "d", "e"]
    for row, level in zip(rows, LEVELS):
        assert row["spec"] == level.spec.describe()
        assert row["params"] == strategy.family.param_count(level.spec)
        assert row["macs"] == strategy.family.flops(level.spec, (8, 8))
        assert row["train_bytes"] == int(level.spec.width * 1000)
        assert row["rate"] == level.info["rate"]
    assert rows[0]["params"] > rows[1]["params"] > rows[4]["params"]


def test_initial_states_are_seeded_builds_of_the_global_spec(make):
    strategy = make("heterofl")
    states = strategy.initial_states(3)
    assert set(states) == {"global"}
    assert set(states["global"]) == set(strategy.family.build(strategy.global_spec()).state_dict())
    again = strategy.initial_states(3)["global"]
    other = strategy.initial_states(4)["global"]
    assert all(torch.equal(again[k], v) for k, v in states["global"].items())
    assert not torch.equal(other["conv1.weight"], states["global"]["conv1.weight"])


# ---------------------------------------------------------------------------------------------- aggregation
def result_of(strategy, level: str, fill: float, labels=(0, 1, 2, 3, 4, 5, 6, 7, 8, 9), samples: int = 10,
              round_number: int = 1) -> TaskResult:
    """A result of ``level`` whose every trained tensor is ``fill``."""
    spec = BY_NAME[level].spec
    family = strategy.family
    shapes = family.shapes(spec, track_bn_stats=False)
    state = {key: torch.full(shapes[key], fill) for key in family.trainable_keys(spec)}
    full_map = family.index_map(spec)
    task = TaskPlan("dev", level, spec, strategy.level_plan(BY_NAME[level], round_number),
                    strategy.group_of(BY_NAME[level]))
    return TaskResult(task, spec, state, {k: full_map[k] for k in state}, samples, list(labels))


def covered(strategy, spec: SubmodelSpec, key: str) -> torch.Tensor:
    mask = torch.zeros(strategy.family.global_shapes()[key], dtype=torch.bool)
    if key in strategy.family.trainable_keys(spec):
        mask[grid(strategy.family.index_map(spec)[key])] = True
    return mask


def test_heterofl_aggregate_is_masked_mean_over_the_updates_holding_each_element(make):
    strategy = make("heterofl")
    states = strategy.initial_states(0)
    merged = strategy.aggregate(1, [result_of(strategy, "a", 1.0), result_of(strategy, "c", 3.0)], states)
    assert set(merged) == {"global"}
    for key, old in states["global"].items():
        if not old.is_floating_point():
            continue
        in_a, in_c = covered(strategy, LEVELS[0].spec, key), covered(strategy, LEVELS[2].spec, key)
        expected = torch.where(in_a & in_c, 2.0, torch.where(in_a, 1.0, torch.where(in_c, 3.0, old)))
        torch.testing.assert_close(merged["global"][key], expected, msg=key)
    # BN statistics are not in the updates: they keep their values.
    torch.testing.assert_close(merged["global"]["bn1.running_var"], states["global"]["bn1.running_var"])


def test_sample_weighting(make):
    uniform, weighted = make("heterofl"), make("heterofl", weighting="samples")
    small, big = result_of(uniform, "a", 1.0, samples=1), result_of(uniform, "a", 4.0, samples=3)
    assert uniform.weight(big) == 1.0 and weighted.weight(big) == 3.0
    assert weighted.weight(result_of(uniform, "a", 1.0, samples=0)) == 1.0
    states = weighted.initial_states(0)
    merged = weighted.aggregate(1, [small, big], states)["global"]
    torch.testing.assert_close(merged["conv1.weight"], torch.full_like(merged["conv1.weight"], 3.25))
    merged = uniform.aggregate(1, [small, big], states)["global"]
    torch.testing.assert_close(merged["conv1.weight"], torch.full_like(merged["conv1.weight"], 2.5))


def test_masked_cross_entropy_plans_leave_absent_classes_rows_out(make):
    cfg_masked = make("heterofl")
    cfg_masked.config.recipe.masked_ce = True
    result = result_of(cfg_masked, "a", 1.0, labels=[2, 5])
    assert result.task.plan.uses_masked_ce
    assert result.task.plan.loss == (LossTerm.ce(masked=True),)
    states = cfg_masked.initial_states(0)
    merged = cfg_masked.aggregate(1, [result], states)["global"]
    old = states["global"]
    for row in range(10):
        if row in (2, 5):
            assert torch.all(merged["classifier.weight"][row] == 1.0) and merged["classifier.bias"][row] == 1.0
        else:
            torch.testing.assert_close(merged["classifier.weight"][row], old["classifier.weight"][row])
            torch.testing.assert_close(merged["classifier.bias"][row], old["classifier.bias"][row])
    assert torch.all(merged["conv1.weight"] == 1.0)  # the body is aggregated whatever the labels


def test_observe_learns_nothing_by_default(make):
    strategy = make("heterofl")
    task = TaskPlan("x", "a", SubmodelSpec.full(), base_plan(strategy.config.recipe))
    strategy.observe(1, [TaskOutcome(task, "declined", None, {})])
    assert strategy.state_dict() == {}


# ---------------------------------------------------------------------------------------------- FedAvg
@pytest.mark.parametrize("assignment", ["fix", "dynamic"])
def test_fedavg_always_assigns_full_model_regardless_of_budget(make, make_agent, assignment):
    strategy = make("fedavg", level_assignment=assignment)
    plan = strategy.configure_round(1, [make_agent("poor", 1), make_agent("rich", 10**9),
                                        make_agent("starved", 10**6, available=0)], random.Random(0))
    assert plan.skipped == []
    assert [(t.agent_id, t.level, t.group) for t in plan.tasks] == [
        ("poor", "a", "global"), ("rich", "a", "global"), ("starved", "a", "global")]
    assert all(t.spec.is_full and t.adaptation is None for t in plan.tasks)
    assert all(t.plan == base_plan(strategy.config.recipe) for t in plan.tasks)
    assert strategy.groups() == ["global"]
    assert [level.name for level in strategy.levels] == ["a"]  # config.levels do not matter


def test_fedavg_eval_targets_are_full_model_only(make):
    strategy = make("fedavg")
    targets = strategy.eval_targets()
    assert set(targets) == {"global", "a"}
    assert all(t.group == "global" and t.spec.is_full for t in targets.values())
    assert targets["global"].store_bn and not targets["a"].store_bn


def test_fedavg_at_a_thin_width_trains_it_whatever_the_budget(make):
    strategy = make("fedavg", fedavg=FedAvgConfig(width=0.25))
    assert strategy.levels[0].spec == SubmodelSpec.uniform(0.25)
    full = strategy.training_cost(SubmodelSpec.full(), base_plan(strategy.config.recipe))
    tier = strategy.plan_for_budget(full // 2)
    assert tier["spec"] == "width=0.25" and tier["fits"] is True
    assert strategy.plan_for_budget(1)["fits"] is False


# ---------------------------------------------------------------------------------------------- Decoupled
def test_decoupled_keeps_one_group_per_level(make, make_agent):
    strategy = make("decoupled")
    assert strategy.groups() == ["a", "b", "c", "d", "e"]
    plan = strategy.configure_round(1, [make_agent("x", 600), make_agent("y", 100)], random.Random(0))
    assert [(t.level, t.group) for t in plan.tasks] == [("b", "b"), ("e", "e")]
    assert all(t.adaptation is None for t in plan.tasks)  # no falling to another level's model


def test_decoupled_initial_states_are_independent_copies(make):
    strategy = make("decoupled")
    states = strategy.initial_states(0)
    assert list(states) == ["a", "b", "c", "d", "e"]
    for group in "bcde":
        assert all(torch.equal(states["a"][k], v) for k, v in states[group].items())
        assert states[group]["conv1.weight"].data_ptr() != states["a"]["conv1.weight"].data_ptr()


def test_decoupled_aggregates_each_level_into_its_own_group(make):
    strategy = make("decoupled")
    states = strategy.initial_states(0)
    merged = strategy.aggregate(1, [result_of(strategy, "b", 1.0), result_of(strategy, "e", 5.0)], states)
    for group in "acd":
        assert all(torch.equal(merged[group][k], v) for k, v in states[group].items())
    for group, fill, spec in (("b", 1.0, BY_NAME["b"].spec), ("e", 5.0, BY_NAME["e"].spec)):
        mask = covered(strategy, spec, "conv1.weight")
        torch.testing.assert_close(merged[group]["conv1.weight"],
                                   torch.where(mask, fill, states[group]["conv1.weight"]))


def test_decoupled_eval_targets_use_level_groups_and_global_is_level_a(make):
    targets = make("decoupled").eval_targets()
    assert set(targets) == {"global", "a", "b", "c", "d", "e"}
    assert targets["global"].group == "a" and targets["global"].spec.is_full and targets["global"].store_bn
    for level in LEVELS:
        assert targets[level.name].group == level.name
        assert targets[level.name].spec == level.spec


@pytest.mark.parametrize(("name", "masked"), [("heterofl", True), ("fedavg", False), ("decoupled", False)])
def test_masked_cross_entropy_follows_each_paper_unless_configured(make, name, masked):
    assert make(name).masked_ce is masked
    assert make(name).level_plan(make(name).levels[0], 1).uses_masked_ce is masked
    for configured in (True, False):
        strategy = make(name, recipe=RecipeConfig(masked_ce=configured))
        assert strategy.level_plan(strategy.levels[0], 1).uses_masked_ce is configured


# ---------------------------------------------------------------------------------------------- state
@pytest.mark.parametrize("name", ["heterofl", "fedavg", "decoupled"])
def test_strategy_without_state_refuses_a_non_empty_state(make, name):
    strategy = make(name)
    assert strategy.state_dict() == {}
    strategy.load_state_dict({})
    with pytest.raises(ValueError, match=rf"strategy '{name}' keeps no state.*\['x'\]"):
        strategy.load_state_dict({"x": 1})


# ---------------------------------------------------------------------------------------------- registry
@pytest.mark.parametrize("name", ["heterofl", "fedavg", "decoupled"])
def test_make_strategy_builds_known_strategies(make, name):
    proportions = [1, 2, 3, 4, 5] if name != "fedavg" else [7]
    strategy = make(name, level_assignment="dynamic", level_proportions=proportions)
    assert type(strategy) is STRATEGIES[name] and strategy.name == name
    assert strategy.config.level_assignment == "dynamic"
    names = [level.name for level in strategy.levels]
    assert strategy.proportions == dict(zip(names, proportions))


def test_registry_names():
    assert ALGORITHM_NAMES == ("heterofl", "fedavg", "decoupled", "scalefl", "fedepth", "flexfl", "adaptivefl",
                               "fedrolex", "depthfl", "fjord")
    assert STRATEGIES["heterofl"] is HeteroFL and STRATEGIES["fedavg"] is FedAvg
    assert STRATEGIES["decoupled"] is Decoupled
    for name in ALGORITHM_NAMES:
        check_algorithm(name)


def test_make_strategy_default_proportions_are_uniform(make):
    assert make("heterofl").proportions == {name: 1.0 for name in "abcde"}


def test_make_strategy_unknown_name_lists_known_ones(make_context):
    with pytest.raises(ValueError, match="unknown algorithm 'fedprox'") as info:
        make_strategy("fedprox", make_context(config()))
    assert "heterofl, fedavg, decoupled, scalefl" in str(info.value)
    with pytest.raises(ValueError, match="unknown algorithm 'HeteroFL'"):
        check_algorithm("HeteroFL")


def test_task_plan_is_immutable():
    task = TaskPlan("x", "a", SubmodelSpec.full(), base_plan(config().recipe))
    assert task.group == "global" and task.adaptation is None
    with pytest.raises(AttributeError):
        task.level = "b"  # type: ignore[misc]
    assert replace(task, level="b").level == "b"
