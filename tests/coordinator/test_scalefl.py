"""ScaleFL: the self-distillation loss of Eq. 5 (weights by hand, and numerically through the plan interpreter),
and the strategy on a tiny CNN (levels, exits, plans, KD warm-up, ladder, evaluation targets, fedfit plan rows,
Eq. 2 aggregation, memory cost, impossible ratios)."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

from coordinator.aggregation import grid
from coordinator.config import CoordinatorConfig, ModelConfig, RecipeConfig, ScaleFLConfig
from coordinator.split_search import search_levels
from coordinator.strategies import STRATEGIES, StrategyContext, TaskPlan, TaskResult, make_strategy
from coordinator.strategies.scalefl import ScaleFL, self_distillation_loss
from models import MemoryEstimate, SubmodelSpec, get_family
from models.training import loss_of
from protocol import Adaptation, Candidate, LossTerm

BETA, TAU = 0.1, 3.0


# ---------------------------------------------------------------------------------------------- Eq. 5 terms
def test_one_output_is_plain_cross_entropy_with_weight_one_half():
    # l = 1: 1/(1*2) * 1 * CE(y_1); the only output is its own teacher, so no KD term.
    assert self_distillation_loss(1, beta=BETA, tau=TAU) == (LossTerm.ce(weight=0.5, output=0),)
    assert self_distillation_loss(1, beta=BETA, tau=TAU, normalization="reference") == (
        LossTerm.ce(weight=1.0, output=0),)


def test_two_outputs_weights_by_hand():
    # l = 2: c = 1/6; CE weights 1/6, 2/6; KD of y_1 towards y_2 weighted beta * 1/6.
    assert self_distillation_loss(2, beta=BETA, tau=TAU) == (
        LossTerm.ce(weight=1 / 6, output=0), LossTerm.ce(weight=2 / 6, output=1),
        LossTerm.kd(0, 1, weight=BETA / 6, tau=TAU))


def test_three_outputs_weights_by_hand():
    # l = 3: c = 1/12; CE weights 1/12, 2/12, 3/12; KD y_1 -> y_3 beta/12, y_2 -> y_3 2 beta/12.
    terms = self_distillation_loss(3, beta=BETA, tau=TAU)
    assert terms == (
        LossTerm.ce(weight=1 / 12, output=0), LossTerm.ce(weight=2 / 12, output=1),
        LossTerm.ce(weight=3 / 12, output=2),
        LossTerm.kd(0, 2, weight=BETA / 12, tau=TAU), LossTerm.kd(1, 2, weight=2 * BETA / 12, tau=TAU))
    assert sum(t.weight for t in terms if t.kind == "ce") == pytest.approx(0.5)  # paper: sum i / (l(l+1)) = 1/2


def test_reference_normalization_doubles_every_weight():
    for outputs in (1, 2, 3, 5):
        paper = self_distillation_loss(outputs, beta=BETA, tau=TAU)
        reference = self_distillation_loss(outputs, beta=BETA, tau=TAU, normalization="reference")
        assert [t.weight for t in reference] == pytest.approx([2 * t.weight for t in paper])
        assert [(t.kind, t.output, t.teacher) for t in reference] == [(t.kind, t.output, t.teacher) for t in paper]
        assert sum(t.weight for t in reference if t.kind == "ce") == pytest.approx(1.0)


def test_without_distillation_only_cross_entropy_remains():
    for outputs in (1, 2, 3):
        ce = tuple(t for t in self_distillation_loss(outputs, beta=BETA, tau=TAU) if t.kind == "ce")
        assert self_distillation_loss(outputs, beta=BETA, tau=TAU, distill=False) == ce
        assert self_distillation_loss(outputs, beta=0.0, tau=TAU) == ce
        assert len(ce) == outputs


def test_masking_and_teacher_detaching_reach_the_right_terms():
    terms = self_distillation_loss(3, beta=BETA, tau=2.0, masked=True, detach_teacher=True)
    assert all(t.masked for t in terms if t.kind == "ce")
    kd = [t for t in terms if t.kind == "kd"]
    assert len(kd) == 2 and all(t.detach_teacher and t.tau == 2.0 and not t.masked and t.teacher == 2 for t in kd)


def test_bad_arguments():
    with pytest.raises(ValueError, match="at least one output"):
        self_distillation_loss(0, beta=BETA, tau=TAU)
    with pytest.raises(ValueError, match="normalization"):
        self_distillation_loss(2, beta=BETA, tau=TAU, normalization="sum")


# ---------------------------------------------------------------------------------------------- Eq. 5 numbers
Y1 = [[1.0, 0.0, 0.0], [0.0, 2.0, 0.0]]
Y2 = [[0.5, 0.5, 0.0], [0.0, 0.0, 1.0]]
Y3 = [[2.0, 0.0, 1.0], [0.0, 1.0, 3.0]]
TARGETS = [0, 2]


def softmax(row: list[float], tau: float = 1.0) -> list[float]:
    exps = [math.exp(v / tau) for v in row]
    return [e / sum(exps) for e in exps]


def ce(logits: list[list[float]]) -> float:
    """Mean cross-entropy over the batch, by hand."""
    return sum(-math.log(softmax(row)[t]) for row, t in zip(logits, TARGETS)) / len(logits)


def kd(student: list[list[float]], teacher: list[list[float]], tau: float) -> float:
    """tau^2 * mean over the batch of KL(softmax(t / tau) || softmax(s / tau)), by hand."""
    total = 0.0
    for s_row, t_row in zip(student, teacher):
        p_s, p_t = softmax(s_row, tau), softmax(t_row, tau)
        total += sum(pt * math.log(pt / ps) for pt, ps in zip(p_t, p_s))
    return tau * tau * total / len(student)


def outputs() -> list[torch.Tensor]:
    return [torch.tensor(y, dtype=torch.float64, requires_grad=True) for y in (Y1, Y2, Y3)]


def test_eq5_on_explicit_logits():
    # L = 1/(3*4) * [1 * (beta KL(y1||y3) + CE(y1)) + 2 * (beta KL(y2||y3) + CE(y2)) + 3 * CE(y3)]
    expected = (1 * (BETA * kd(Y1, Y3, TAU) + ce(Y1)) + 2 * (BETA * kd(Y2, Y3, TAU) + ce(Y2)) + 3 * ce(Y3)) / 12
    targets = torch.tensor(TARGETS)
    value = loss_of(outputs(), targets, self_distillation_loss(3, beta=BETA, tau=TAU)).item()
    assert value == pytest.approx(expected, rel=1e-9)
    reference = loss_of(outputs(), targets, self_distillation_loss(3, beta=BETA, tau=TAU, normalization="reference"))
    assert reference.item() == pytest.approx(2 * expected, rel=1e-9)
    plain = loss_of(outputs(), targets, self_distillation_loss(3, beta=BETA, tau=TAU, distill=False))
    assert plain.item() == pytest.approx((ce(Y1) + 2 * ce(Y2) + 3 * ce(Y3)) / 12, rel=1e-9)
    assert kd(Y1, Y3, TAU) > 0 and kd(Y2, Y3, TAU) > 0  # the distillation terms matter in this example


def test_detached_teacher_gets_gradient_from_its_own_cross_entropy_only():
    targets = torch.tensor(TARGETS)
    detached = outputs()
    loss_of(detached, targets, self_distillation_loss(3, beta=BETA, tau=TAU, detach_teacher=True)).backward()
    # d/dy3 of 3/12 * CE(y3) = 3/12 * (softmax(y3) - onehot) / batch
    onehot = torch.nn.functional.one_hot(targets, 3).double()
    expected = 3 / 12 * (torch.softmax(detached[2].detach(), dim=1) - onehot) / 2
    torch.testing.assert_close(detached[2].grad, expected)
    attached = outputs()
    loss_of(attached, targets, self_distillation_loss(3, beta=BETA, tau=TAU)).backward()
    assert not torch.allclose(attached[2].grad, expected)  # the reference code lets KD reach the teacher
    torch.testing.assert_close(attached[0].grad, detached[0].grad)  # students are unaffected


# ---------------------------------------------------------------------------------------------- the strategy
HIDDEN = [4, 8, 16, 32]
ROUNDS, WARMUP = 8, 0.25  # KD off in rounds 1 and 2


def memory_cost(family):
    """A stand-in for the estimator: 16 bytes per parameter, 64 per loss term (so KD costs memory)."""
    return lambda spec, plan: family.param_count(spec) * 16 + 64 * len(plan.loss)


def scalefl_config(**scalefl: object) -> CoordinatorConfig:
    settings = {"ratios": [0.25, 0.5, 1.0], "cost": "flops", "grid_step": 0.05, "kd_warmup": WARMUP, **scalefl}
    return CoordinatorConfig(algorithm="scalefl", model=ModelConfig("cnn", {"hidden": HIDDEN}), rounds=ROUNDS,
                             recipe=RecipeConfig(batch_size=8), scalefl=ScaleFLConfig(**settings))


def context(config: CoordinatorConfig, cost=None, overhead: int = 0) -> StrategyContext:
    family = get_family("cnn", 10, 1, **config.model.options)
    cost = cost or memory_cost(family)

    def memory(spec, plan):
        return MemoryEstimate(cost(spec, plan), 0, 0, 0, 0, overhead)

    return StrategyContext(family=family, config=config, input_size=(8, 8), server_x=torch.zeros(4, 1, 8, 8),
                           server_y=torch.zeros(4, dtype=torch.long), training_memory=memory,
                           device_factor=1.0)  # devices need what is estimated: the costs read as written


@pytest.fixture(scope="module")
def strategy() -> ScaleFL:
    made = make_strategy("scalefl", context(scalefl_config()))
    assert isinstance(made, ScaleFL)
    return made


def outputs_of(strategy: ScaleFL, spec: SubmodelSpec) -> int:
    return strategy.family.build(spec).num_outputs


def test_registry_knows_scalefl(strategy):
    assert STRATEGIES["scalefl"] is ScaleFL and strategy.name == "scalefl"


def test_levels_are_listed_largest_first_and_nest_their_exits(strategy):
    family = strategy.family
    levels = strategy.levels
    assert [level.name for level in levels] == ["3", "2", "1"]
    top = levels[0]
    assert top.spec.full_width and top.spec.depth is None
    for higher, lower in itertools.pairwise(levels):
        assert set(lower.spec.exits) <= set(higher.spec.exits)
        assert lower.info["s_d"] <= higher.info["s_d"]
        assert family.param_count(lower.spec) < family.param_count(higher.spec)
    for level in levels:
        spec, info = level.spec, level.info
        assert spec.width == info["s_w"] and spec.rounding == "floor"
        blocks = math.floor(info["s_d"] * family.num_blocks + 1e-9)
        assert spec.depth == (blocks if blocks < family.num_blocks else None)
        assert info["blocks"] == f"{blocks}/{family.num_blocks}"
        assert info["exit_block"] == (blocks - 1 if blocks < family.num_blocks else "final")
        assert abs(info["cost_ratio"] / info["target_ratio"] - 1) <= info["tolerance"] + 1e-9
        # The cost ratio (FLOPs here) is the level's own against the global model's.
        assert info["cost_ratio"] == pytest.approx(family.flops(spec, (8, 8)) / family.flops(top.spec, (8, 8)))
    assert [level.info["target_ratio"] for level in levels] == [1.0, 0.5, 0.25]


def test_global_spec_is_the_full_model_with_every_exit(strategy):
    spec = strategy.global_spec()
    assert spec == strategy.levels[0].spec
    assert spec.full_width and spec.depth is None
    every_exit = set().union(*(level.spec.exits for level in strategy.levels))
    assert every_exit and set(spec.exits) == every_exit
    state = strategy.initial_states(0)["global"]
    assert set(state) == set(strategy.family.build(spec).state_dict())
    for block in spec.exits:
        assert f"exits.{block}.classifier.weight" in state
    assert outputs_of(strategy, spec) == len(every_exit) + 1


def test_level_plans_have_as_many_outputs_as_the_level_model(strategy):
    for round_number in (1, ROUNDS):
        for level in strategy.levels:
            plan = strategy.level_plan(level, round_number)
            count = outputs_of(strategy, level.spec)
            assert plan.outputs_needed() == count
            assert sorted(t.output for t in plan.loss if t.kind == "ce") == list(range(count))
            assert all(t.teacher == count - 1 for t in plan.loss if t.kind == "kd")
            assert plan.loss == self_distillation_loss(count, beta=BETA, tau=TAU, distill=round_number > 2,
                                                       normalization="reference")  # the default: weights sum to 1
            assert sum(t.weight for t in plan.loss if t.kind == "ce") == pytest.approx(1.0)
            assert (plan.epochs, plan.batch_size, plan.optimizer.lr) == (1, 8, strategy.config.recipe.lr)


def test_kd_reduction_mean_weighs_each_kl_a_class_count_times_less() -> None:
    # The reference code's KLDivLoss() averages over the classes too; Eq. 5 as written sums over them.
    plans = {reduction: make_strategy("scalefl", context(scalefl_config(kd_reduction=reduction)))
             for reduction in ("batchmean", "mean")}
    for reduction, made in plans.items():
        top = made.levels[0]
        count = outputs_of(made, top.spec)
        beta = BETA / (10 if reduction == "mean" else 1)
        assert made.level_plan(top, ROUNDS).loss == self_distillation_loss(count, beta=beta, tau=TAU,
                                                                           normalization="reference")
    summed, averaged = (plans[r].level_plan(plans[r].levels[0], ROUNDS).loss for r in ("batchmean", "mean"))
    assert [t.weight for t in summed if t.kind == "ce"] == [t.weight for t in averaged if t.kind == "ce"]
    kd = [(s.weight, a.weight) for s, a in zip(summed, averaged) if s.kind == "kd"]
    assert kd and all(a == pytest.approx(s / 10) for s, a in kd)


def test_distillation_is_off_during_the_warmup_share_of_the_rounds(strategy, make_agent):
    assert [strategy.distilling(r) for r in range(1, ROUNDS + 1)] == [False, False] + [True] * 6
    agents = [make_agent("big", 10**9)]
    for round_number, distilling in ((1, False), (2, False), (3, True)):
        task = strategy.configure_round(round_number, agents, random.Random(0)).tasks[0]
        assert task.level == "3"
        assert any(t.kind == "kd" for t in task.plan.loss) is distilling
        for candidate, lower in zip(task.adaptation.candidates, strategy.levels[1:]):  # so do the ladder's plans
            assert candidate.plan == strategy.level_plan(lower, round_number)
            several = outputs_of(strategy, lower.spec) > 1
            assert any(t.kind == "kd" for t in candidate.plan.loss) is (distilling and several)
    no_warmup = make_strategy("scalefl", context(scalefl_config(kd_warmup=0.0)))
    assert no_warmup.distilling(1)


def test_fix_assignment_uses_the_rounds_plan_cost(strategy, make_agent):
    top, middle, bottom = strategy.levels
    assert strategy.cost(top, 3) == strategy.cost(top, 1) + 64 * 2  # two KD terms from round 3 on
    budget = strategy.cost(top, 1)
    assert strategy.cost(top, 3) > budget >= strategy.cost(middle, 3)
    for round_number, expected in ((1, "3"), (3, "2")):
        plan = strategy.configure_round(round_number, [make_agent("x", budget)], random.Random(0))
        assert [t.level for t in plan.tasks] == [expected]
    plan = strategy.configure_round(3, [make_agent("y", strategy.cost(bottom, 3) - 1)], random.Random(0))
    assert plan.tasks == [] and "level 1" in plan.skipped[0].reason


def test_ladder_offers_only_the_lower_levels(strategy, make_agent):
    budgets = {level.name: strategy.cost(level, 3) for level in strategy.levels}
    plan = strategy.configure_round(3, [make_agent(f"agent-{name}", cost) for name, cost in budgets.items()],
                                    random.Random(0))
    by_level = {task.level: task for task in plan.tasks}
    assert set(by_level) == {"1", "2", "3"}
    levels = strategy.levels
    for index, level in enumerate(levels):
        expected = None if index == len(levels) - 1 else Adaptation(
            "ladder", [Candidate(lower.spec.to_dict(), strategy.level_plan(lower, 3)) for lower in levels[index + 1:]])
        assert by_level[level.name].adaptation == expected
        assert by_level[level.name].spec == level.spec and by_level[level.name].group == "global"


def test_eval_targets_are_each_level_and_the_global_model(strategy):
    targets = strategy.eval_targets()
    assert set(targets) == {"1", "2", "3", "global"}
    assert targets["global"].spec == strategy.global_spec() and targets["global"].store_bn
    for level in strategy.levels:
        assert targets[level.name].spec == level.spec and targets[level.name].group == "global"
        assert not targets[level.name].store_bn


def test_describe_rows_for_fedfit_plan(strategy):
    rows = strategy.describe()
    assert [row["name"] for row in rows] == ["3", "2", "1"]
    for row, level in zip(rows, strategy.levels):
        assert {"name", "spec", "params", "macs", "train_bytes", "s_d", "s_w"} <= set(row)
        assert row["spec"] == level.spec.describe()
        assert row["params"] == strategy.family.param_count(level.spec)
        assert row["macs"] == strategy.family.flops(level.spec, (8, 8))
        # The plan of the last round: distilling, after the KD warm-up of the first rounds.
        assert row["train_bytes"] == strategy.cost(level, strategy.config.rounds) >= strategy.cost(level, 1)
        assert (row["s_d"], row["s_w"]) == (level.info["s_d"], level.info["s_w"])
    assert rows[0]["s_d"] == rows[0]["s_w"] == 1.0


def test_the_top_level_is_the_global_model_and_costs_most_with_its_distilling_plan(strategy):
    # The full model with every exit, trained with Eq. 5 including the KD terms (handed out from round 3 on;
    # they cost memory), even though round 1 does not distil.
    top = strategy.levels[0]
    assert top.spec == strategy.global_spec()
    assert strategy.cost(top, ROUNDS) == max(strategy.cost(top, r) for r in range(1, ROUNDS + 1))


def test_state_is_empty_with_fixed_ratios(strategy):
    assert strategy.state_dict() == {}
    with pytest.raises(ValueError, match="expected only 'fitted'"):
        strategy.load_state_dict({"round": 3})


def test_level_proportions_are_one_per_scalefl_level():
    cfg = scalefl_config()
    cfg.level_proportions = [1.0, 1.0, 1.0, 1.0, 1.0]  # HeteroFL's five levels: wrong for three ScaleFL levels
    with pytest.raises(ValueError, match=r"level_proportions needs one weight per level of scalefl \(3\), got 5"):
        make_strategy("scalefl", context(cfg))
    cfg.level_proportions = [0.0, 0.0, 1.0]
    cfg.level_assignment = "dynamic"
    dynamic = make_strategy("scalefl", context(cfg))
    assert dynamic.proportions == {"3": 0.0, "2": 0.0, "1": 1.0}


# ---------------------------------------------------------------------------------------------- aggregation
def result(strategy: ScaleFL, level_name: str, fill: float, labels=tuple(range(10))) -> TaskResult:
    level = next(level for level in strategy.levels if level.name == level_name)
    family = strategy.family
    shapes = family.shapes(level.spec, track_bn_stats=False)
    state = {key: torch.full(shapes[key], fill) for key in family.trainable_keys(level.spec)}
    index_map = family.index_map(level.spec)
    task = TaskPlan("dev", level.name, level.spec, strategy.level_plan(level, 3), "global")
    return TaskResult(task, level.spec, state, {k: index_map[k] for k in state}, 10, list(labels))


def holds(strategy: ScaleFL, spec: SubmodelSpec, key: str) -> torch.Tensor:
    mask = torch.zeros(strategy.family.global_shapes()[key], dtype=torch.bool)
    if key in strategy.family.trainable_keys(spec):
        mask[grid(strategy.family.index_map(spec)[key])] = True
    return mask


def test_aggregation_touches_only_the_elements_each_level_holds(strategy):
    # Eq. 2: each element the mean over the participants whose sub-model holds it; the others unchanged.
    states = strategy.initial_states(0)
    small, middle = strategy.levels[2], strategy.levels[1]
    merged = strategy.aggregate(3, [result(strategy, "1", 1.0), result(strategy, "2", 3.0)], states)["global"]
    untouched = both = 0
    for key, old in states["global"].items():
        if not old.is_floating_point():
            continue
        in_small, in_middle = holds(strategy, small.spec, key), holds(strategy, middle.spec, key)
        expected = torch.where(in_small & in_middle, 2.0, torch.where(in_small, 1.0, torch.where(in_middle, 3.0, old)))
        torch.testing.assert_close(merged[key], expected, msg=key)
        untouched += int((~(in_small | in_middle)).sum())
        both += int((in_small & in_middle).sum())
    assert untouched > 0 and both > 0
    # The final classifier lies beyond both levels' exits: untouched.
    assert small.spec.depth is not None and middle.spec.depth is not None
    torch.testing.assert_close(merged["classifier.weight"], states["global"]["classifier.weight"])


def test_masked_cross_entropy_leaves_absent_classes_rows_of_every_exit_out():
    cfg = scalefl_config()
    cfg.recipe.masked_ce = True
    masked = make_strategy("scalefl", context(cfg))
    assert all(t.masked for level in masked.levels for t in masked.level_plan(level, 3).loss if t.kind == "ce")
    states = masked.initial_states(0)
    merged = masked.aggregate(3, [result(masked, "3", 1.0, labels=[1, 3])], states)["global"]
    heads = [f"exits.{b}.classifier" for b in masked.global_spec().exits] + ["classifier"]
    for head in heads:
        for row in range(10):
            new, old = merged[f"{head}.weight"][row], states["global"][f"{head}.weight"][row]
            if row in (1, 3):
                assert torch.all(new == 1.0), head
            else:
                torch.testing.assert_close(new, old, msg=head)


# ---------------------------------------------------------------------------------------------- costs and errors
def test_memory_cost_leaves_the_fixed_overhead_out_and_plans_with_distillation():
    family = get_family("cnn", 10, 1, hidden=HIDDEN)
    seen = []

    def params_cost(spec, plan):
        seen.append((spec, plan))
        return family.param_count(spec) * 16

    # With a fixed overhead of 1 GB counted, no level could come near 25% of the full model.
    made = make_strategy("scalefl", context(scalefl_config(cost="memory"), cost=params_cost, overhead=10**9))
    expected = search_levels(family, [0.25, 0.5, 1.0], [0.1] * 3, cost="params", step=0.05)
    assert [level.spec for level in made.levels] == [level.spec for level in reversed(expected)]
    assert seen
    for spec, plan in seen:  # the split search's costs: each spec trained as a level, with distillation
        count = len(spec.exits) + (spec.depth is None)
        assert plan.loss == self_distillation_loss(count, beta=BETA, tau=TAU, distill=True,
                                                   normalization="reference")
    # Budgets are compared with the whole estimate, overhead included.
    assert made.cost(made.levels[0]) == family.param_count(made.levels[0].spec) * 16 + 10**9


def test_impossible_ratios_give_a_clear_error():
    with pytest.raises(ValueError, match=r"ScaleFL cannot split model 'cnn'.*scalefl\.ratios.*scalefl\.tolerance"):
        make_strategy("scalefl", context(scalefl_config(ratios=[0.001, 1.0], tolerance=0.01)))


# ----------------------------------------------------------------------- ratios: auto (sized to the fleet)
def auto_strategy() -> ScaleFL:
    made = make_strategy("scalefl", context(scalefl_config(ratios="auto", cost="memory")))
    assert isinstance(made, ScaleFL)
    return made


def test_auto_waits_for_the_fleet_and_then_gives_every_budget_a_level():
    strategy = auto_strategy()
    assert strategy.awaits_fleet
    fixed = [level.spec for level in strategy.levels]  # before the fleet: the fixed default ratios
    smallest = min(strategy.cost(level) for level in strategy.levels)
    budgets = [smallest // 3, smallest // 2, smallest * 2, strategy.cost(strategy.levels[0])]
    told = strategy.fit_to_fleet(budgets)
    assert told is not None and "auto" in told and not strategy.awaits_fleet
    assert [level.spec for level in strategy.levels] != fixed
    for budget in budgets:  # every device trains a level, by the device's rule
        assert strategy.plan_for_budget(budget)["trains"] != "nothing", budget


def test_auto_levels_survive_a_restart():
    strategy = auto_strategy()
    full = strategy.cost(strategy.levels[0])
    strategy.fit_to_fleet([full // 2, full // 9, full])  # (its best sizing is not its last, and the search
    # started from that sizing's top: restored from the plain model, other levels)
    restored = auto_strategy()
    restored.load_state_dict(strategy.state_dict())
    assert not restored.awaits_fleet and restored.start_exits == strategy.start_exits != ()  # where its search began
    assert [level.spec for level in restored.levels] == [level.spec for level in strategy.levels]


def test_fixed_ratios_are_not_sized_by_the_fleet():
    strategy = make_strategy("scalefl", context(scalefl_config(cost="memory")))
    assert not strategy.awaits_fleet and strategy.fit_to_fleet([1, 2, 3]) is None and strategy.state_dict() == {}


def test_auto_shares_are_of_the_top_level_the_search_settles_on(monkeypatch: pytest.MonkeyPatch):
    """Shares of the full model with an exit after every block understated what devices can train: sized again
    against the top each search settles on, the fleet is served better (here every device trains a level either
    way, and larger ones sized again), and never worse than by that first sizing."""
    from coordinator.strategies import scalefl as module

    strategy = auto_strategy()
    full = strategy.cost(strategy.levels[0])
    budgets = [full // 12, full // 5, full // 2]
    strategy.fit_to_fleet(budgets)
    monkeypatch.setattr(module, "SIZING_ROUNDS", 1)
    first_only = auto_strategy()
    first_only.fit_to_fleet(budgets)
    served, first_served = strategy._service(budgets), first_only._service(budgets)
    assert served > first_served and served[0] == first_served[0] == len(budgets)


def test_auto_levels_reach_up_to_what_each_cluster_can_afford():
    """Each level is searched in a window that ends at its cluster's share of the top level's memory, so the
    smallest device of a cluster trains a level of at least (1 - eps) / (1 + eps) of the memory it can give it (a
    level searched again in the widest window, or a merged cluster's larger devices, less). (The window once ended a
    tolerance below the share: here the smallest cluster's level came out at 58% of what its device could train, and
    on the small-too-small fleet's PreResNet-20 the r=1 tier trained 21 of its 42 MiB.)"""
    strategy = auto_strategy()
    full = strategy.cost(strategy.levels[0])
    budgets = [full // 5, full // 2, int(full * 0.8)]
    strategy.fit_to_fleet(budgets)
    top = strategy.global_spec()
    overhead = strategy.context.training_memory(top, strategy._plan(strategy.family.num_outputs(top),
                                                                     distill=True)).overhead
    eps = strategy.settings.tolerances()[0]
    for budget in budgets:
        trains = strategy.plan_for_budget(budget)["trains"]
        level = next(level for level in strategy.levels if level.name == trains)
        affordable = (budget - overhead) / strategy.context.device_factor
        assert (1 - eps) / (1 + eps) <= strategy.memory_cost(level.spec) / affordable <= 1, (budget, trains)


def test_auto_levels_are_searched_from_the_top_their_shares_are_of():
    """A share of the top level (exits included), read against the plain model as a search that starts there reads
    it, reaches no split: here the middle device's level was dropped, and it trained the smallest one."""
    strategy = auto_strategy()
    full = strategy.cost(strategy.levels[0])
    strategy.fit_to_fleet([full // 6, full // 14, full])
    assert len(strategy.levels) == 4  # one level per device, and the top


def test_auto_gives_a_device_that_can_afford_the_top_level_the_top_level():
    """Issue 48, item 1: the strongest cluster's level is the top level (the global model, with the exits the levels
    below give it) where that cluster can train it, down to a budget of exactly its cost, whatever the weaker
    devices' shares make of the levels below."""
    for weak in ([6, 2], [12, 5], [9]):
        strategy = auto_strategy()
        full = strategy.cost(strategy.levels[0])
        strategy.fit_to_fleet([full // share for share in weak] + [full * 3])
        top = strategy.levels[0]
        assert top.spec == strategy.global_spec(), weak
        assert strategy.plan_for_budget(full * 3)["trains"] == top.name, weak
        assert strategy.plan_for_budget(strategy.cost(top))["trains"] == top.name, weak  # (exactly its cost)
        for share in weak:  # each weak device trains a level of its own below the top
            assert strategy.plan_for_budget(full // share)["trains"] not in (top.name, "nothing"), (weak, share)
