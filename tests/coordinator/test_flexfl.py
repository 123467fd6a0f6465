"""FlexFL's server half: pre-processing on proxy data carved from the training split, the nested APoZ-guided pool
with adaptive variants, dispatch by the reported budget with the pool below as the ladder, Eq. 4's teachers,
sample-weighted aggregation, and a restart that restores the pool without redoing it."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from common.data import load_dataset
from coordinator.checkpoint import save_checkpoint
from coordinator.config import CoordinatorConfig, DataConfig, FlexFLConfig, ModelConfig, RecipeConfig
from coordinator.daemon import Coordinator
from coordinator.strategies import STRATEGIES, StrategyContext, TaskPlan, TaskResult, make_strategy
from coordinator.strategies.flexfl import FlexFL
from models import MemoryEstimate, SubmodelSpec, get_family
from models.pruning import adjustment_weights, prune_to_ratio

HIDDEN = [8, 16, 32, 64]


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits")


def flexfl_config(tmp_path: Path | None = None, **flexfl: object) -> CoordinatorConfig:
    settings = {"proxy_fraction": 0.3, "pretrain_epochs": 1, "tolerance": 0.03, **flexfl}
    return CoordinatorConfig(algorithm="flexfl", model=ModelConfig("cnn", {"hidden": HIDDEN}),
                             data=DataConfig(dataset="digits", bn_samples=50, eval_samples=50),
                             recipe=RecipeConfig(batch_size=16), flexfl=FlexFLConfig(**settings),
                             state_dir=str(tmp_path or "unused"))


def context(config: CoordinatorConfig, digits, drawn: list[int] | None = None) -> StrategyContext:
    family = get_family("cnn", 10, 1, hidden=HIDDEN)

    def memory(spec, plan):  # a cost that grows with the parameters and with every teacher run
        return MemoryEstimate(family.param_count(spec) * (1 + len(plan.loss)), 0, 0, 0, 0, 0)

    def sample(count: int):
        if drawn is not None:
            drawn.append(count)
        return torch.tensor(digits.x_train[:count]), torch.tensor(digits.y_train[:count], dtype=torch.long)

    return StrategyContext(family=family, config=config, input_size=(8, 8), server_x=torch.zeros(4, 1, 8, 8),
                           server_y=torch.zeros(4, dtype=torch.long), training_memory=memory,
                           training_sample=sample, training_size=len(digits.x_train))


@pytest.fixture(scope="module")
def strategy(digits) -> FlexFL:
    made = make_strategy("flexfl", context(flexfl_config(), digits))
    assert isinstance(made, FlexFL)
    return made


def test_registry_knows_flexfl(strategy: FlexFL) -> None:
    assert STRATEGIES["flexfl"] is FlexFL


def test_the_proxy_set_is_a_share_of_the_training_split(digits) -> None:
    drawn: list[int] = []
    made = make_strategy("flexfl", context(flexfl_config(), digits, drawn))
    summary = made.setup_summary()["pretraining"]
    assert drawn == [round(0.3 * len(digits.x_train))]
    assert summary["train_samples"] + summary["score_samples"] == drawn[0]
    assert summary["train_samples"] == round(0.8 * drawn[0])
    assert summary["steps"] > 0 and summary["epochs"] == 1


def test_the_pool_is_nested_near_its_targets_with_adaptive_variants(strategy: FlexFL) -> None:
    family, levels = strategy.family, strategy.levels
    assert [level.name for level in levels] == ["M3", "M3'", "M2", "M2'", "M1", "M1'"]
    full = family.param_count()
    for level in levels:
        share = family.param_count(level.spec) / full
        assert share == pytest.approx(level.info["share"], abs=1e-6)
        assert abs(share - level.info["target"]) <= 0.03
    for larger, smaller in itertools.pairwise(levels):
        assert family.is_nested(smaller.spec, larger.spec)
    by_name = {level.name: level for level in levels}
    for name in ("M1", "M2", "M3"):
        assert by_name[f"{name}'"].info["adaptive_of"] == name
        assert by_name[f"{name}'"].info["target"] == pytest.approx(0.9 * by_name[name].info["target"])
    assert levels[0].spec.is_full
    assert len(set(dict(by_name["M1"].spec.layer_widths).values())) > 1  # APoZ guidance: rates differ per layer


def test_the_pool_is_what_algorithm_1_gives_for_the_saved_scores(strategy: FlexFL) -> None:
    # The server's pool and the ladder an agent walks come from one function: recomputing from the stored
    # scores gives the same specs.
    setup = strategy.setup()
    weights = adjustment_weights(strategy.family)
    assert setup["adjustment"] == pytest.approx(weights)
    for level in strategy.levels:
        again = prune_to_ratio(strategy.family, setup["apoz"], weights, level.info["target"], step=0.01,
                               tolerance=0.03)
        assert strategy.family.kept_channels(again.spec) == strategy.family.kept_channels(level.spec)


def test_each_pool_model_distils_from_the_smaller_pool_models_nested_in_it(strategy: FlexFL) -> None:
    by_name = {level.name: level for level in strategy.levels}
    assert [t.name for t in strategy.teachers(by_name["M3"])] == ["M2", "M1"]
    assert [t.name for t in strategy.teachers(by_name["M3'"])] == ["M2", "M1"]
    assert [t.name for t in strategy.teachers(by_name["M2'"])] == ["M1"]
    assert strategy.teachers(by_name["M1"]) == [] and strategy.teachers(by_name["M1'"]) == []
    plan = strategy.level_plan(by_name["M3"], 1)
    kinds = [term.kind for term in plan.loss]
    assert kinds == ["ce", "nested_kd", "nested_kd"]
    for term in plan.loss[1:]:
        assert term.weight == pytest.approx(10.0 / 2) and term.tau == 3.0
    teachers = {SubmodelSpec.from_dict(dict(term.teacher_spec)) for term in plan.loss[1:]}
    assert teachers == {by_name["M1"].spec, by_name["M2"].spec}
    assert [term.kind for term in strategy.level_plan(by_name["M1"], 1).loss] == ["ce"]


def test_the_reference_reduction_divides_the_kd_weight_by_the_classes(digits) -> None:
    made = make_strategy("flexfl", context(flexfl_config(kd_reduction="mean"), digits))
    top = made.levels[0]
    assert made.level_plan(top, 1).loss[1].weight == pytest.approx(10.0 / 2 / 10)


def test_dispatch_gives_the_largest_pool_model_the_budget_allows_and_the_pool_below_as_ladder(
        strategy: FlexFL, make_agent) -> None:
    levels = strategy.levels
    costs = {level.name: strategy.cost(level) for level in levels}
    agents = [make_agent("rich", costs["M3"]), make_agent("mid", costs["M2"] + 1), make_agent("poor", costs["M1'"]),
              make_agent("none", costs["M1'"] - 1)]
    plan = strategy.configure_round(1, agents, random.Random(0))
    given = {task.agent_id: task for task in plan.tasks}
    assert given["rich"].level == "M3" and given["mid"].level == "M2" and given["poor"].level == "M1'"
    assert [skip.agent_id for skip in plan.skipped] == ["none"]
    ladder = given["rich"].adaptation
    assert ladder is not None and ladder.kind == "ladder"
    names = {level.spec: level.name for level in levels}
    assert [names[SubmodelSpec.from_dict(c.spec)] for c in ladder.candidates] == ["M3'", "M2", "M2'", "M1", "M1'"]
    # Each rung carries its own plan: its own teachers.
    assert [len(c.plan.loss) for c in ladder.candidates] == [3, 2, 2, 1, 1]
    assert given["poor"].adaptation is None


def test_aggregation_weights_updates_by_their_samples(strategy: FlexFL) -> None:
    level = strategy.levels[-1]
    task = TaskPlan("a", level.name, level.spec, strategy.level_plan(level, 1))
    result = TaskResult(task, level.spec, {}, {}, 37, [0])
    assert strategy.weight(result) == 37.0


def test_describe_lists_the_pool_with_teachers_and_ladders(strategy: FlexFL) -> None:
    rows = {row["name"]: row for row in strategy.describe()}
    assert rows["M3"]["ladder"] == ["M3'", "M2", "M2'", "M1", "M1'"] and rows["M3"]["teachers"] == ["M2", "M1"]
    assert rows["M1"]["params_share"] < rows["M2"]["params_share"] < rows["M3"]["params_share"] == 1
    assert set(strategy.setup_summary()) == {"pretraining", "apoz", "adjustment"}


def test_a_restart_restores_the_pool_without_redoing_it(tmp_path: Path, digits, monkeypatch) -> None:
    first = Coordinator(flexfl_config(tmp_path), dataset=digits)
    pool = [(level.name, level.spec) for level in first.strategy.levels]
    save_checkpoint(first.checkpoint_path, first.states,
                    {"round": 2, "algorithm": "flexfl", "family": "cnn", "strategy": first.strategy.state_dict()})

    def redo(_self: FlexFL) -> dict:
        raise AssertionError("the pre-processing ran again on resume")

    monkeypatch.setattr(FlexFL, "_preprocess", redo)
    resumed = Coordinator(_resumed(flexfl_config(tmp_path, init="pretrained")), dataset=digits)
    assert [(level.name, level.spec) for level in resumed.strategy.levels] == pool
    assert resumed.completed_rounds == 2
    for key, value in first.states["global"].items():
        assert torch.equal(resumed.states["global"][key], value)
    # A pool made with other settings is refused, not silently reused.
    with pytest.raises(ValueError, match="another model or other flexfl settings"):
        Coordinator(_resumed(flexfl_config(tmp_path, ratios=[0.3, 1.0])), dataset=digits)


def _resumed(config: CoordinatorConfig) -> CoordinatorConfig:
    config.resume = True
    return config


def test_the_pretrained_weights_start_the_global_model_only_when_asked(tmp_path: Path, digits) -> None:
    fresh = Coordinator(flexfl_config(tmp_path / "a"), dataset=digits)
    pretrained = Coordinator(flexfl_config(tmp_path / "b", init="pretrained"), dataset=digits)
    assert fresh.strategy._pretrained is not None  # pre-processed at set-up
    key = "conv1.weight"
    torch.testing.assert_close(pretrained.states["global"][key], fresh.strategy._pretrained[key])
    assert not torch.equal(fresh.states["global"][key], fresh.strategy._pretrained[key])
    assert np.isfinite(fresh.strategy.setup_summary()["pretraining"]["loss"])


def test_an_adaptive_cut_wider_than_the_gap_between_pool_models_is_refused() -> None:
    with pytest.raises(ValueError, match="outside the gap to the next smaller pool model"):
        FlexFLConfig(adaptive_cut=0.3, adaptive_mode="absolute").validate()
    FlexFLConfig(adaptive_cut=0.1, adaptive_mode="absolute").validate()
    FlexFLConfig(adaptive_cut=0.0).validate()
