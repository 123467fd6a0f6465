"""FlexFL's server half: pre-processing on proxy data carved from the training split (its length in rounds), the
nested APoZ-guided pool with adaptive variants Gamma x the global model's size (checked against a model whose
parameters are counted by hand), dispatch of the pool models P only with the pool below as the ladder, Eq. 4's
teachers, sample-weighted aggregation, and a restart that restores the pool without redoing it."""

from __future__ import annotations

import itertools
import math
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
    """The test model's FlexFL settings. With a ``tmp_path`` (a real coordinator, whose memory estimate is this
    CPU's) the pool is sized in parameters: figures that do not depend on the host."""
    settings = {"proxy_fraction": 0.3, "pretrain_rounds": 1, "tolerance": 0.03,
                **({"size": "params"} if tmp_path is not None else {}), **flexfl}
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
    assert summary["steps"] > 0 and summary["rounds"] == 1


def test_the_pool_is_nested_near_its_targets_with_adaptive_variants(strategy: FlexFL) -> None:
    family, levels = strategy.family, strategy.levels
    # The paper's order of adaptive pruning, "M3', M2, M2', and M1": no M1'.
    assert [level.name for level in levels] == ["M3", "M3'", "M2", "M2'", "M1"]
    full = family.param_count()
    for level in levels:
        share = family.param_count(level.spec) / full
        assert share == pytest.approx(level.info["share"], abs=1e-6)
        assert abs(share - level.info["target"]) <= 0.03
    for larger, smaller in itertools.pairwise(levels):
        assert family.is_nested(smaller.spec, larger.spec)
    by_name = {level.name: level for level in levels}
    for name in ("M2", "M3"):  # Gamma x size(global): 0.5 - 0.1 and 1 - 0.1 of the full model
        assert by_name[f"{name}'"].info["adaptive_of"] == name
        assert by_name[f"{name}'"].info["target"] == pytest.approx(by_name[name].info["target"] - 0.1)
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
    assert strategy.teachers(by_name["M1"]) == []
    plan = strategy.level_plan(by_name["M3"], 1)
    kinds = [term.kind for term in plan.loss]
    assert kinds == ["ce", "nested_kd", "nested_kd"]
    for term in plan.loss[1:]:  # lambda 10 over two teachers, the KL averaged over the ten classes (the default)
        assert term.weight == pytest.approx(10.0 / 2 / 10) and term.tau == 3.0
    teachers = {SubmodelSpec.from_dict(dict(term.teacher_spec)) for term in plan.loss[1:]}
    assert teachers == {by_name["M1"].spec, by_name["M2"].spec}
    assert [term.kind for term in strategy.level_plan(by_name["M1"], 1).loss] == ["ce"]


def test_the_papers_sum_over_classes_is_the_reference_weight_times_the_classes(digits) -> None:
    # The default is the reference code's KLDivLoss() (a mean over the classes too): the paper's sum, ten times as
    # strong, made a one-channel M1 pull the larger models down (Fashion-MNIST, docs/results.md).
    assert FlexFLConfig().kd_reduction == "mean"
    plans = {reduction: make_strategy("flexfl", context(flexfl_config(kd_reduction=reduction), digits))
             for reduction in ("mean", "batchmean")}
    weights = {reduction: made.level_plan(made.levels[0], 1).loss[1].weight for reduction, made in plans.items()}
    assert weights["batchmean"] == pytest.approx(10.0 / 2) and weights["mean"] == pytest.approx(10.0 / 2 / 10)


def test_dispatch_sends_pool_models_only_with_the_pool_below_as_ladder(strategy: FlexFL, make_agent) -> None:
    levels = strategy.levels
    costs = {level.name: strategy.cost(level) for level in levels}
    agents = [make_agent("rich", costs["M3"]), make_agent("mid", costs["M2"] + 1),
              make_agent("between", costs["M2'"]), make_agent("poor", costs["M1"]),
              make_agent("none", costs["M1"] - 1)]
    plan = strategy.configure_round(1, agents, random.Random(0))
    given = {task.agent_id: task for task in plan.tasks}
    assert given["rich"].level == "M3" and given["mid"].level == "M2" and given["poor"].level == "M1"
    # Only P = {M1, M2, M3} is sent (Alg. 2: "m in P"): a budget that fits M2' but not M2 is sent M2, and the
    # device prunes it to M2' itself, the first rung of M2's ladder.
    assert costs["M2'"] < costs["M2"]
    assert given["between"].level == "M2" and given["between"].spec == {lv.name: lv for lv in levels}["M2"].spec
    assert {task.level for task in plan.tasks} <= {"M1", "M2", "M3"}
    assert [skip.agent_id for skip in plan.skipped] == ["none"]
    names = {level.spec: level.name for level in levels}
    ladder = given["rich"].adaptation
    assert ladder is not None and ladder.kind == "ladder"
    assert [names[SubmodelSpec.from_dict(c.spec)] for c in ladder.candidates] == ["M3'", "M2", "M2'", "M1"]
    # Each rung carries its own plan: its own teachers.
    assert [len(c.plan.loss) for c in ladder.candidates] == [3, 2, 2, 1]
    between = given["between"].adaptation
    assert between is not None and names[SubmodelSpec.from_dict(between.candidates[0].spec)] == "M2'"
    assert given["poor"].adaptation is None
    # `fedfit plan` says what such a device trains and what it is sent.
    assert strategy.plan_for_budget(costs["M2'"])["trains"] == "M2'"
    assert strategy.plan_for_budget(costs["M2'"])["sent"] == "M2"
    assert "sent" not in strategy.plan_for_budget(costs["M2"])


def test_dynamic_assignment_draws_from_the_pool_models_only(digits, make_agent) -> None:
    config = flexfl_config()
    config.level_assignment = "dynamic"
    config.level_proportions = [1.0, 1.0, 1.0]  # one weight per model of P (M3, M2, M1)
    made = make_strategy("flexfl", context(config, digits))
    rng = random.Random(0)
    drawn = {made.choose_level(make_agent("a", None), rng, 1).name for _ in range(200)}
    assert drawn == {"M1", "M2", "M3"}


def test_the_full_variant_option_adds_m1_prime_reached_only_from_m1(digits, make_agent) -> None:
    made = make_strategy("flexfl", context(flexfl_config(full_variant=True), digits))
    assert [level.name for level in made.levels] == ["M3", "M3'", "M2", "M2'", "M1", "M1'"]
    by_name = {level.name: level for level in made.levels}
    assert by_name["M1'"].info["target"] == pytest.approx(0.25 - 0.1) and by_name["M1'"].info["adaptive_of"] == "M1"
    assert made.family.is_nested(by_name["M1'"].spec, by_name["M1"].spec)
    cost = made.cost(by_name["M1'"])
    plan = made.configure_round(1, [make_agent("poor", cost), make_agent("none", cost - 1)], random.Random(0))
    assert [(task.agent_id, task.level) for task in plan.tasks] == [("poor", "M1")]
    ladder = plan.tasks[0].adaptation
    assert ladder is not None and [SubmodelSpec.from_dict(c.spec) for c in ladder.candidates] == [by_name["M1'"].spec]
    assert [skip.agent_id for skip in plan.skipped] == ["none"]


def test_aggregation_weights_updates_by_their_samples(strategy: FlexFL) -> None:
    level = strategy.levels[-1]
    task = TaskPlan("a", level.name, level.spec, strategy.level_plan(level, 1))
    result = TaskResult(task, level.spec, {}, {}, 37, [0])
    assert strategy.weight(result) == 37.0


def test_describe_lists_the_pool_with_teachers_and_ladders(strategy: FlexFL) -> None:
    rows = {row["name"]: row for row in strategy.describe()}
    assert rows["M3"]["ladder"] == ["M3'", "M2", "M2'", "M1"] and rows["M3"]["teachers"] == ["M2", "M1"]
    assert rows["M1"]["params_share"] < rows["M2"]["params_share"] < rows["M3"]["params_share"] == 1
    assert [name for name, row in rows.items() if row["sent"]] == ["M3", "M2", "M1"]
    summary = strategy.setup_summary()
    assert set(summary) == {"pool_size", "adaptive_cut", "pretraining", "apoz_at", "apoz", "adjustment"}
    # `fedfit plan` says the unit the pool is sized in: the devices' (memory) by default.
    assert summary["pool_size"].startswith("memory") and summary["apoz_at"] == "after_relu"
    assert "global" in summary["adaptive_cut"]


def test_a_restart_restores_the_pool_without_redoing_it(tmp_path: Path, digits, monkeypatch) -> None:
    first = Coordinator(flexfl_config(tmp_path), dataset=digits)
    pool = [(level.name, level.spec) for level in first.strategy.levels]
    save_checkpoint(first.files.checkpoint_path, first.states,
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


def test_the_defaults_are_the_papers_rules_in_the_devices_unit() -> None:
    settings = FlexFLConfig()
    assert (settings.adaptive_mode, settings.full_variant, settings.apoz_at, settings.size) == (
        "global", False, "after_relu", "memory")
    # Gamma x size(global): the reference's targets [0.25, 0.4, 0.5, 0.9, 1]; the relative cut is an option.
    assert [settings.adaptive_target(r) for r in (0.5, 1.0)] == pytest.approx([0.4, 0.9])
    assert FlexFLConfig(adaptive_mode="relative").adaptive_target(0.5) == pytest.approx(0.45)


def test_an_adaptive_cut_wider_than_the_gap_between_pool_models_is_refused() -> None:
    # Global: 0.5 - 0.3 = 0.2 is below M1 (0.25): Gamma x size(M) must be smaller than the gap between models.
    with pytest.raises(ValueError, match=r"0.3 of the full model's size \(global\).*outside the gap"):
        FlexFLConfig(adaptive_cut=0.3).validate()
    FlexFLConfig(adaptive_cut=0.3, adaptive_mode="relative").validate()  # 0.35 and 0.7: inside their gaps
    FlexFLConfig(adaptive_cut=0.1).validate()
    FlexFLConfig(adaptive_cut=0.0).validate()
    # M1' only exists with full_variant, and then it must stay above 0.
    FlexFLConfig(ratios=[0.05, 0.5, 1.0], adaptive_cut=0.1).validate()
    with pytest.raises(ValueError, match="outside the gap"):
        FlexFLConfig(ratios=[0.05, 0.5, 1.0], adaptive_cut=0.1, full_variant=True).validate()


def test_pretraining_is_counted_in_rounds_of_one_pass_over_the_proxy_training_part(digits) -> None:
    summaries = {rounds: make_strategy("flexfl", context(flexfl_config(pretrain_rounds=rounds), digits))
                 .setup_summary()["pretraining"] for rounds in (0, 1, 3)}
    assert summaries[3]["rounds"] == 3 and summaries[1]["rounds"] == 1
    passes = math.ceil(summaries[1]["train_samples"] / 16)  # batches of recipe.batch_size (16) over the part
    assert summaries[1]["steps"] == passes and summaries[3]["steps"] == 3 * passes
    assert summaries[0]["rounds"] == 0 and "steps" not in summaries[0]  # 0: score the initial model


# --------------------------------------------------------------------- a pool counted by hand (params unit)
# cnn hidden (8, 16), 1 input channel, 10 classes, keeping a conv1 and b conv2 channels:
#   conv1 9a + a (bias) + bn1 2a = 12a;  conv2 9ab + b + bn2 2b = 9ab + 3b;  classifier 10b + 10
#   size(a, b) = 12a + 9ab + 13b + 10; size(8, 16) = 96 + 1152 + 208 + 10 = 1466.
# With APoZ 0 for conv1 and 0.5 for conv2 (the largest layer: AdjW 1), Algorithm 1 keeps s1 = gamma and
# s2 = 0.5 gamma: a = b = floor(8 gamma) up to gamma 1, then a = 8, b = floor(8 gamma). Sizes up the gamma grid:
#   (4, 4) 254 (0.173), (5, 5) 360 (0.246), (6, 6) 484 (0.330), (7, 7) 626 (0.427), (8, 8) 786 (0.536), ...
#   (8, 13) 1211 (0.826), (8, 14) 1296 (0.884), ...
# Within 0.04 of each target, first up the grid: 0.25 -> (5, 5); 0.4 = 0.5 - 0.1 -> (7, 7) (0.330 misses by
# 0.07); 0.5 -> (8, 8); 0.9 = 1 - 0.1 -> (8, 14) (0.826 misses by 0.074); 1 -> (8, 16).
TINY = (8, 16)


def _by_hand(a: int, b: int) -> int:
    return 12 * a + 9 * a * b + 13 * b + 10


def _tiny_pool(digits, monkeypatch, **flexfl: object) -> dict[str, tuple[tuple[int, int], int, float]]:
    monkeypatch.setattr("coordinator.strategies.flexfl.apoz_scores",
                        lambda *_args, **_kw: {"conv1": 0.0, "conv2": 0.5})
    settings = {"proxy_fraction": 0.05, "pretrain_rounds": 0, "tolerance": 0.04, "size": "params", **flexfl}
    config = CoordinatorConfig(algorithm="flexfl", model=ModelConfig("cnn", {"hidden": list(TINY)}),
                               data=DataConfig(dataset="digits", bn_samples=50, eval_samples=50),
                               recipe=RecipeConfig(batch_size=16), flexfl=FlexFLConfig(**settings))
    made = make_strategy("flexfl", StrategyContext(
        family=get_family("cnn", 10, 1, hidden=TINY), config=config, input_size=(8, 8),
        server_x=torch.zeros(4, 1, 8, 8), server_y=torch.zeros(4, dtype=torch.long),
        training_memory=lambda spec, plan: MemoryEstimate(0, 0, 0, 0, 0, 0),
        training_sample=lambda count: (torch.tensor(digits.x_train[:count]),
                                       torch.tensor(digits.y_train[:count], dtype=torch.long)),
        training_size=len(digits.x_train)))
    assert made.family.param_count() == _by_hand(*TINY) == 1466
    pool = {}
    for level in made.levels:
        kept = made.family.kept_channels(level.spec)
        channels = (kept["conv1"], kept["conv2"])
        assert made.family.param_count(level.spec) == _by_hand(*channels)
        assert level.info["share"] == pytest.approx(_by_hand(*channels) / 1466, abs=1e-6)
        pool[level.name] = (channels, _by_hand(*channels), level.info["target"])
    return pool


def test_the_pool_order_and_gamma_rule_against_sizes_counted_by_hand(digits, monkeypatch) -> None:
    pool = _tiny_pool(digits, monkeypatch)
    assert list(pool) == ["M3", "M3'", "M2", "M2'", "M1"]  # largest first: M3, M3', M2, M2', M1
    assert {name: entry[0] for name, entry in pool.items()} == {
        "M3": (8, 16), "M3'": (8, 14), "M2": (8, 8), "M2'": (7, 7), "M1": (5, 5)}
    assert {name: entry[1] for name, entry in pool.items()} == {
        "M3": 1466, "M3'": 1296, "M2": 786, "M2'": 626, "M1": 360}
    # M2' and M3' are Gamma x size(M) = 0.1 x 1466 parameters below M2's and M3's targets.
    assert pool["M2'"][2] == pytest.approx(0.4) and pool["M3'"][2] == pytest.approx(0.9)


def test_the_relative_cut_is_an_option_that_cuts_a_share_of_the_pool_models_own_size(digits, monkeypatch) -> None:
    # Gamma 0.15: global puts M2' at 0.5 - 0.15 = 0.35 -> (6, 6) (0.330); relative at 0.5 x 0.85 = 0.425 -> (7, 7)
    # (0.427). M3': 0.85 either way -> (8, 13) (0.826).
    glob = _tiny_pool(digits, monkeypatch, adaptive_cut=0.15)
    relative = _tiny_pool(digits, monkeypatch, adaptive_cut=0.15, adaptive_mode="relative")
    assert glob["M2'"][:2] == ((6, 6), 484) and relative["M2'"][:2] == ((7, 7), 626)
    assert glob["M3'"][:2] == relative["M3'"][:2] == ((8, 13), 1211)
    assert glob["M2'"][2] == pytest.approx(0.35) and relative["M2'"][2] == pytest.approx(0.425)
    with_m1 = _tiny_pool(digits, monkeypatch, full_variant=True)
    assert list(with_m1) == ["M3", "M3'", "M2", "M2'", "M1", "M1'"] and with_m1["M1'"][2] == pytest.approx(0.15)


# ----------------------------------------------------------------------- ratios: auto (sized to the fleet)
def test_auto_sizes_a_pool_model_for_every_cluster_of_budgets(digits) -> None:
    made = make_strategy("flexfl", context(flexfl_config(), digits))
    assert isinstance(made, FlexFL) and made.awaits_fleet
    full = made.training_cost(SubmodelSpec.full(), made.recipe_plan())
    budgets = [full // 10, full // 3, full]
    told = made.fit_to_fleet(budgets)
    assert told is not None and "auto" in told and not made.awaits_fleet
    for budget in budgets:  # every device trains a pool model (or a variant of one), by the device's rule
        assert made.plan_for_budget(budget)["trains"] != "nothing", budget
    sent = [level for level in made.levels if made.sends(level)]
    assert len(sent) == 3  # one per cluster below the full model, and the full model
    restored = make_strategy("flexfl", context(flexfl_config(), digits))
    restored.load_state_dict(made.state_dict())
    assert not restored.awaits_fleet and [lv.spec for lv in restored.levels] == [lv.spec for lv in made.levels]


def test_fixed_ratios_or_the_paper_unit_are_not_sized_by_the_fleet(digits) -> None:
    for settings in ({"ratios": [0.25, 0.5, 1.0]}, {"size": "params"}):
        made = make_strategy("flexfl", context(flexfl_config(**settings), digits))
        assert not made.awaits_fleet and made.fit_to_fleet([1, 2]) is None
