"""AdaptiveFL's server half: the (r_w, I) pool (Table 1's counts on VGG-16), dispatch by the RL tables whatever
budget an agent reports, the nested pool as each task's ladder, learning from outcomes, sample-weighted
aggregation and a restart that restores the tables."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from common.data import load_dataset
from coordinator.checkpoint import save_checkpoint
from coordinator.config import AdaptiveFLConfig, CoordinatorConfig, DataConfig, ModelConfig, RecipeConfig
from coordinator.daemon import Coordinator
from coordinator.registry import AgentRecord
from coordinator.strategies import (
    STRATEGIES,
    StrategyContext,
    TaskOutcome,
    TaskPlan,
    TaskResult,
    make_strategy,
)
from coordinator.strategies.adaptivefl import AdaptiveFL
from models import MemoryEstimate, SubmodelSpec, get_family
from protocol import MEMORY_DECLINE_REASON, MEMORY_KILL_REASON, Capabilities

HIDDEN = [8, 16, 32, 64]
#: The paper's Table 1 (VGG-16, 32x32 RGB, 10 classes).
TABLE_1 = {"L1": 33.65e6, "M1": 16.81e6, "M2": 15.41e6, "M3": 14.84e6, "S1": 8.39e6, "S2": 6.48e6, "S3": 5.67e6}


def adaptivefl_config(tmp_path: Path | None = None, family: str = "cnn", options: dict | None = None,
                      **settings: object) -> CoordinatorConfig:
    return CoordinatorConfig(algorithm="adaptivefl", model=ModelConfig(family, {"hidden": HIDDEN} if options is None else options),
                             data=DataConfig(dataset="digits", bn_samples=50, eval_samples=50),
                             recipe=RecipeConfig(batch_size=16), adaptivefl=AdaptiveFLConfig(**settings),
                             fraction=0.5, state_dir=str(tmp_path or "unused"))


def context(config: CoordinatorConfig, in_channels: int = 1, input_size: tuple[int, int] = (8, 8)) -> StrategyContext:
    family = get_family(config.model.family, 10, in_channels, **config.model.options)

    def memory(spec, plan):  # a cost that grows with the parameters
        return MemoryEstimate(family.param_count(spec), 0, 0, 0, 0, 0)

    return StrategyContext(family=family, config=config, input_size=input_size, server_x=torch.zeros(4, 1, 8, 8),
                           server_y=torch.zeros(4, dtype=torch.long), training_memory=memory)


@pytest.fixture
def strategy() -> AdaptiveFL:
    made = make_strategy("adaptivefl", context(adaptivefl_config()))
    assert isinstance(made, AdaptiveFL)
    return made


def agents(*budgets: int | None) -> list[AgentRecord]:
    """Online agents reporting these budgets (None: no budget)."""
    return [AgentRecord(f"a{i}", "online", Capabilities(device_kind="generic", memory_total=10**9,
                                                         memory_available=10**9, budget_bytes=budget,
                                                         num_samples=10, labels=[0]), 0.0)
            for i, budget in enumerate(budgets)]


def test_the_vgg16_pool_is_table_1() -> None:
    made = make_strategy("adaptivefl", context(adaptivefl_config(family="vgg16", options={}), 3, (32, 32)))
    counts = {level.name: made.family.param_count(level.spec) for level in made.levels}
    assert list(counts) == ["L1", "M1", "M2", "M3", "S1", "S2", "S3"]
    for name, paper in TABLE_1.items():
        assert abs(counts[name] - paper) / paper < 0.05, (name, counts[name], paper)
    # The reference code's rule reproduces the table exactly.
    assert counts == {"L1": 33_646_666, "M1": 16_814_977, "M2": 15_410_557, "M3": 14_839_789, "S1": 8_397_106,
                      "S2": 6_483_040, "S3": 5_667_148}
    info = {level.name: (level.info["r_w"], level.info["I"]) for level in made.levels}
    assert info["M1"] == (0.66, 8) and info["S3"] == (0.4, 4) and info["L1"] == (1.0, "-")


def test_the_cnn_pool_keeps_the_shallow_layers_whole(strategy: AdaptiveFL) -> None:
    assert strategy.full_layers == [3, 2, 1] and strategy.per_type == 3
    for level in strategy.levels:
        assert level.spec.rate_for("conv1") == 1.0  # never pruned: I >= min_full_layers = 1
    by_name = {level.name: level for level in strategy.levels}
    assert by_name["M3"].spec.rate_for("conv2") == 0.66 and by_name["M1"].spec.rate_for("conv3") == 1.0
    with pytest.raises(ValueError, match="none below adaptivefl.min_full_layers"):
        AdaptiveFLConfig(full_layers=[3, 1], min_full_layers=2).validate()
    with pytest.raises(ValueError, match="I must be below the 4 prunable layers"):
        make_strategy("adaptivefl", context(adaptivefl_config(full_layers=[4, 2])))


def test_every_ladder_is_the_pool_nested_in_the_task_largest_first(strategy: AdaptiveFL) -> None:
    family = strategy.family
    for level in strategy.levels:
        ladder = strategy.ladder(level, 1)
        rungs = [SubmodelSpec.from_dict(candidate.spec) for candidate in (ladder.candidates if ladder else [])]
        nested = [other.spec for other in strategy.levels if other is not level
                  and family.is_nested(other.spec, level.spec)]
        assert sorted(map(str, rungs)) == sorted(map(str, nested))
        costs = [family.param_count(spec) for spec in rungs]
        assert costs == sorted(costs, reverse=True)
    rows = {row["name"]: row for row in strategy.describe()}
    assert rows["M3"]["ladder"] == ["S3"]  # S1 and S2 keep layers whole that M3 thins: not nested
    assert rows["L1"]["params_share"] == 1 and len(rows["L1"]["ladder"]) == 6


def test_dispatch_ignores_the_budgets_agents_report(strategy: AdaptiveFL) -> None:
    # Budgets far too small for anything would leave every agent out if they were used; AdaptiveFL never asks.
    plan = strategy.configure_round(1, agents(1, 1, None, 1), random.Random(0))
    assert len(plan.tasks) == 2 and not plan.skipped  # fraction 0.5 of 4 agents
    assert len({task.agent_id for task in plan.tasks}) == 2
    names = {level.name for level in strategy.levels}
    assert all(task.level in names for task in plan.tasks)
    for task in plan.tasks:
        assert task.spec == next(level.spec for level in strategy.levels if level.name == task.level)


def task_for(strategy: AdaptiveFL, agent: str, name: str) -> TaskPlan:
    level = next(level for level in strategy.levels if level.name == name)
    return TaskPlan(agent, name, level.spec, strategy.level_plan(level, 1), "global", strategy.ladder(level, 1))


def test_outcomes_teach_the_tables(strategy: AdaptiveFL) -> None:
    spec = {level.name: level.spec for level in strategy.levels}
    order = strategy.tables.names
    assert order == ["S3", "S2", "S1", "M3", "M2", "M1", "L1"]  # R: by type, then by I (p = 3)

    def row(agent: str) -> list[float]:
        return [strategy.tables.resource[agent][name] for name in order]

    whole, pruned = task_for(strategy, "a", "M2"), task_for(strategy, "b", "L1")
    declined, failed = task_for(strategy, "c", "M2"), task_for(strategy, "d", "S1")
    stray, late, killed = task_for(strategy, "e", "M1"), task_for(strategy, "f", "M2"), task_for(strategy, "g", "L1")
    assert [SubmodelSpec.from_dict(c.spec) for c in declined.adaptation.candidates][-1] == spec["S3"]
    strategy.observe(1, [
        TaskOutcome(whole, "ok", whole.spec, {}),
        TaskOutcome(pruned, "adapted", spec["S2"], {}),
        TaskOutcome(declined, "declined", None, {}, f"{MEMORY_DECLINE_REASON} the 9.0 MiB available"),
        TaskOutcome(failed, "failed", None, {}, "training process failed (exit code 1)", spec["S1"]),
        TaskOutcome(stray, "adapted", SubmodelSpec.uniform(0.3), {}),
        TaskOutcome(late, "declined", None, {}, "the task's deadline passed before training could start"),
        TaskOutcome(killed, "failed", None, {}, f"{MEMORY_KILL_REASON} (SIGKILL, out of memory)", spec["M1"])])
    assert row("a") == [1, 1, 1, 1, 2, 2, 4]  # M2 and larger +1, L1 p - 1 more
    assert row("b") == [1, 4, 0, 0, 0, 0, 0]  # S2 + p, then S2.. lose 0, 1, 2, ...
    assert row("c") == [0, 0, 0, 0, 0, 0, 0]  # nothing fit down to S3, the ladder's last rung: S3.. lose 1, 2, ...
    assert row("g") == [1, 1, 1, 1, 1, 0, 0]  # killed for memory training M1: M1, L1 lose 1, 2
    # A failure, a return of no pool model and a decline for the deadline say nothing of memory.
    assert row("d") == row("e") == row("f") == [1] * 7
    curiosity = strategy.tables.curiosity
    assert curiosity["a"] == {"L": 1, "M": 3, "S": 1} and curiosity["b"] == {"L": 2, "M": 1, "S": 2}
    assert curiosity["c"]["M"] == curiosity["d"]["S"] == curiosity["e"]["M"] == curiosity["f"]["M"] == 2


def test_aggregation_weights_updates_by_their_samples(strategy: AdaptiveFL) -> None:
    task = strategy.configure_round(1, agents(None, None), random.Random(0)).tasks[0]
    result = TaskResult(task, task.spec, {}, {}, num_samples=37, labels=[0])
    assert strategy.weight(result) == 37.0


def test_a_restart_restores_the_tables(tmp_path: Path) -> None:
    digits = load_dataset("digits")
    first = Coordinator(adaptivefl_config(tmp_path), dataset=digits)
    first.strategy.tables.record("sim-1", "M1", "S2")
    first.strategy.tables.record("sim-2", "L1", "L1")
    first.strategy.tables.record("sim-3", "M1", None, declined_from="S3")  # every score 0: out
    first.strategy.tables.readmit(3)
    saved = first.strategy.state_dict()
    save_checkpoint(first.files.checkpoint_path, first.states,
                    {"round": 3, "algorithm": "adaptivefl", "family": "cnn", "strategy": saved})
    resumed_config = adaptivefl_config(tmp_path)
    resumed_config.resume = True
    resumed = Coordinator(resumed_config, dataset=digits)
    assert resumed.completed_rounds == 3
    assert resumed.strategy.tables.resource == first.strategy.tables.resource
    assert resumed.strategy.tables.curiosity == first.strategy.tables.curiosity
    assert resumed.strategy.tables.out_since == first.strategy.tables.out_since == {"sim-3": 3}
    # Tables learnt for another pool are refused, not silently reused.
    other = adaptivefl_config(tmp_path, widths=[1.0, 0.5])
    other.resume = True
    with pytest.raises(ValueError, match="another pool"):
        Coordinator(other, dataset=digits)


def test_registry_knows_adaptivefl(strategy: AdaptiveFL) -> None:
    assert STRATEGIES["adaptivefl"] is AdaptiveFL
    assert strategy.setup_summary() == {"selection": "rl", "full_layers": [3, 2, 1], "p": 3, "readmit_after": 5,
                                        "large_divisor": "paper"}


def declined_once(strategy: AdaptiveFL, round_number: int, agent: str) -> None:
    """``agent`` declines its first task (M2, its ladder down to S3) for memory in ``round_number``."""
    task = task_for(strategy, agent, "M2")
    strategy.observe(round_number, [TaskOutcome(task, "declined", None, {},
                                                f"{MEMORY_DECLINE_REASON} the 9.0 MiB available")])


def given(plan_tasks: list[TaskPlan]) -> set[str]:
    return {task.agent_id for task in plan_tasks}


def test_a_device_that_declined_once_is_dispatched_again_after_readmit_after_rounds() -> None:
    config = adaptivefl_config(readmit_after=2)
    config.fraction = 1.0  # every agent with a positive reward gets a task: a draw cannot leave a0 out
    made = make_strategy("adaptivefl", context(config))
    assert isinstance(made, AdaptiveFL)
    fleet = agents(None, None)
    assert given(made.configure_round(1, fleet, random.Random(1)).tasks) == {"a0", "a1"}
    declined_once(made, 1, "a0")
    for round_number in (2, 3):  # out for K = 2 rounds
        assert given(made.configure_round(round_number, fleet, random.Random(round_number)).tasks) == {"a1"}
    assert given(made.configure_round(4, fleet, random.Random(4)).tasks) == {"a0", "a1"}  # round 1 + K + 1
    assert made.tables.resource["a0"] == dict.fromkeys(made.tables.names, 1.0)


@pytest.mark.parametrize("strict", [0, None])
def test_readmit_after_0_or_null_keeps_the_papers_rule(strict: int | None) -> None:
    config = adaptivefl_config(readmit_after=strict)
    config.fraction = 1.0
    made = make_strategy("adaptivefl", context(config))
    assert isinstance(made, AdaptiveFL)
    declined_once(made, 1, "a0")
    for round_number in range(2, 30):
        assert given(made.configure_round(round_number, agents(None, None), random.Random(round_number)).tasks) \
            == {"a1"}


def test_the_settings_reach_the_tables_and_are_validated() -> None:
    made = make_strategy("adaptivefl", context(adaptivefl_config(large_divisor="reference", readmit_after=7)))
    assert isinstance(made, AdaptiveFL)
    assert made.tables.large_divisor == "reference" and made.tables.readmit_after == 7
    assert (AdaptiveFLConfig().readmit_after, AdaptiveFLConfig().large_divisor) == (5, "paper")
    with pytest.raises(ValueError, match="adaptivefl.readmit_after must be"):
        AdaptiveFLConfig(readmit_after=-1).validate()
    with pytest.raises(ValueError, match="adaptivefl.large_divisor must be paper or reference"):
        AdaptiveFLConfig(large_divisor="half").validate()  # type: ignore[arg-type]


def test_the_state_carries_the_readmission_clock_and_reads_version_1(strategy: AdaptiveFL) -> None:
    declined_once(strategy, 1, "a0")
    strategy.configure_round(2, agents(None, None), random.Random(0))  # a0 out since round 2
    state = strategy.state_dict()
    assert state["version"] == 2 and state["tables"]["out_since"] == {"a0": 2}
    fresh = make_strategy("adaptivefl", context(adaptivefl_config()))
    fresh.load_state_dict(state)
    assert isinstance(fresh, AdaptiveFL) and fresh.tables.out_since == {"a0": 2}
    assert fresh.tables.readmit(6) == [] and fresh.tables.readmit(7) == ["a0"]  # K = 5 rounds out: 2 .. 6
    # A version-1 checkpoint (before re-admission) still loads; an unknown version is refused, naming both.
    old = {**state, "version": 1, "tables": {k: v for k, v in state["tables"].items() if k != "out_since"}}
    fresh.load_state_dict(old)
    assert fresh.tables.out_since == {}
    with pytest.raises(ValueError, match="no tables of version 1 or 2, got version 3"):
        fresh.load_state_dict({**state, "version": 3})


# ----------------------------------------------------------------------- widths: auto (sized to the fleet)
def test_auto_narrows_the_smallest_type_for_the_weakest_budget_it_can_serve() -> None:
    made = make_strategy("adaptivefl", context(adaptivefl_config()))
    assert isinstance(made, AdaptiveFL) and made.awaits_fleet
    paper_smallest = made.smallest_need(0.4)
    floor = made.smallest_need(0.01)
    weak = (floor + paper_smallest) // 2  # between what the narrowest and the paper's S type need
    told = made.fit_to_fleet([floor - 1, weak, made.cost(made.levels[0])])
    assert told is not None and "1 of 3 budgets lies below" in told and not made.awaits_fleet
    assert made.widths[:2] == [1.0, 0.66] and made.widths[2] < 0.4
    assert made.plan_for_budget(weak)["trains"] != "nothing"
    assert made.plan_for_budget(floor - 1)["trains"] == "nothing"  # the whole shallow layers alone need more
    assert "min_full_layers" in made.setting_to_shrink()
    restored = make_strategy("adaptivefl", context(adaptivefl_config()))
    restored.load_state_dict(made.state_dict())
    assert restored.widths == made.widths and not restored.awaits_fleet


def test_auto_keeps_the_papers_widths_where_they_serve_the_fleet() -> None:
    made = make_strategy("adaptivefl", context(adaptivefl_config()))
    made.fit_to_fleet([made.smallest_need(0.4), made.cost(made.levels[0])])
    assert made.widths == [1.0, 0.66, 0.4]
    fixed = make_strategy("adaptivefl", context(adaptivefl_config(widths=[1.0, 0.5])))
    assert not fixed.awaits_fleet and fixed.fit_to_fleet([1]) is None
