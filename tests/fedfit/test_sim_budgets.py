"""Budget scenarios: width tiers admit exactly the r-width model through the agent's own check, share tiers are
shares of the full model's training memory, one anchor for every method."""

from __future__ import annotations

import pytest

from coordinator.config import RecipeConfig
from coordinator.strategies.base import base_plan
from edge_agent.calibration import INITIAL_FACTOR, Calibration
from fedfit.sim.budgets import (
    BUDGET_GRANULE,
    BudgetAnchor,
    DeviceBudget,
    Tier,
    assign_tiers,
    device_budgets,
    fraction_name,
    parse_fractions,
    scenario_tiers,
    smallest_width,
    width_for_all,
)
from models import SubmodelSpec, estimate_plan_memory, get_family
from protocol import LossTerm, TrainingPlan


def fake_anchor() -> BudgetAnchor:
    """Overhead 1000, the full model 1 000 000, the r-width model 950 000 r + 50 000 (a part that does not
    shrink)."""
    return BudgetAnchor(1000, 1_000_000, lambda width: int(950_000 * width) + 50_000, margin=1.1)


def granules(exact: int) -> int:
    return -(-exact // BUDGET_GRANULE) * BUDGET_GRANULE


def test_fedepths_scenarios_are_width_tiers_of_a_quarter_each() -> None:
    fair = scenario_tiers("fair")
    assert [(t.name, t.width, t.percent) for t in fair] == [("r=1/6", 1 / 6, None), ("r=1/3", 1 / 3, None),
                                                           ("r=1/2", 0.5, None), ("r=1", 1.0, None)]
    assert all(t.share == 0.25 for t in fair)
    assert [t.width for t in scenario_tiers("lack")] == [1 / 8, 1 / 6, 0.5, 1.0]
    assert [t.width for t in scenario_tiers("surplus")] == [1 / 6, 1 / 3, 0.5, 2.0]
    assert scenario_tiers("widths:1/6,1/3,1/2,1") == fair


def test_share_tiers() -> None:
    assert [(t.name, t.share, t.percent) for t in scenario_tiers("tiers")] == [
        ("weak", 0.4, 35.0), ("medium", 0.3, 60.0), ("strong", 0.3, 110.0)]
    assert scenario_tiers("tiers-fluctuating") == scenario_tiers("tiers")
    assert [(t.name, t.percent) for t in scenario_tiers("uniform")] == [("uniform", 110.0)]
    halves = scenario_tiers("fractions:0.5,3/2")
    assert [(t.name, t.share, t.percent, t.width) for t in halves] == [("1/2 of full", 0.5, 50.0, None),
                                                                      ("3/2 of full", 0.5, 150.0, None)]


@pytest.mark.parametrize(("scenario", "said"), [
    ("fractions:1/0", "--budgets fractions: needs positive numbers or p/q with q > 0"),
    ("fractions:0", "got '0'"), ("widths:a", "--budgets widths: needs positive numbers"),
    ("fractions:", "got ''"), ("halves", "--budgets must be one of uniform, tiers"),
])  # fmt: skip
def test_a_bad_scenario_is_one_sentence(scenario: str, said: str) -> None:
    with pytest.raises(ValueError, match=said):
        scenario_tiers(scenario)


def test_fraction_names() -> None:
    assert [fraction_name(v) for v in (1.0, 0.5, 1 / 6, 1 / 16, 2.0, 0.3)] == ["1", "1/2", "1/6", "1/16", "2", "0.3"]
    assert parse_fractions("1/6, 0.25") == (1 / 6, 0.25)


def test_width_tier_budgets_by_hand() -> None:
    anchor = fake_anchor()
    # r < 1: the r-width model's own need, with the margin and the overhead: what the agent's check asks for,
    # rounded up to whole granules.
    assert anchor.tier_bytes(Tier("r=1/4", 1.0, width=0.25)) == granules(1000 + int((237_500 + 50_000) * 1.1))
    assert anchor.tier_bytes(Tier("r=1", 1.0, width=1.0)) == granules(1000 + int(1_000_000 * 1.1))
    assert anchor.tier_bytes(Tier("r=2", 1.0, width=2.0)) == granules(1000 + int(2_000_000 * 1.1))  # two copies
    assert anchor.tier_bytes(Tier("35%", 1.0, percent=35.0)) == granules(1000 + 350_000)  # shares: no margin
    assert anchor.tier_bytes(Tier("35%", 1.0, percent=35.0), shortfall=5.0) == granules(1000 + 300_000)
    assert all(anchor.tier_bytes(tier) % BUDGET_GRANULE == 0 for tier in scenario_tiers("surplus"))


def test_a_width_tier_admits_exactly_its_width_model_through_the_agents_check() -> None:
    family = get_family("cnn", 10, 1, hidden=(32, 64, 128))
    plan = base_plan(RecipeConfig(batch_size=32))
    anchor = BudgetAnchor.estimate(family, plan, input_size=(28, 28))
    agent = Calibration()  # a device's factor before it has measured anything
    assert agent.factor == anchor.margin == INITIAL_FACTOR

    def need(width: float, loss_plan: TrainingPlan = plan) -> int:  # what the agent asks for the width model
        estimate = estimate_plan_memory(family, SubmodelSpec.uniform(width), loss_plan, input_size=(28, 28))
        return agent.corrected(estimate.total, estimate.overhead)

    masked = base_plan(RecipeConfig(batch_size=32), masked=True)  # HeteroFL's loss: a few KB of logits more
    for width, wider in ((1 / 8, 1 / 4), (1 / 6, 1 / 4), (1 / 3, 1 / 2), (1 / 2, 1.0)):
        budget = anchor.tier_bytes(Tier("r", 1.0, width=width))
        assert need(width) <= budget < need(wider)  # its width, and no more
        assert need(width, masked) <= budget < need(wider, masked)  # with either loss (the dearer is budgeted)
    assert need(1.0) <= anchor.tier_bytes(Tier("r=1", 1.0, width=1.0))
    assert need(1.0, masked) <= anchor.tier_bytes(Tier("r=1", 1.0, width=1.0))


def test_every_method_is_measured_against_plain_cross_entropy_of_the_full_model() -> None:
    family = get_family("cnn", 10, 1, hidden=(8, 16))
    masked = base_plan(RecipeConfig(batch_size=16), (LossTerm.ce(masked=True), LossTerm.ce(output=0)))
    plain = base_plan(RecipeConfig(batch_size=16))
    a = BudgetAnchor.estimate(family, masked, input_size=(8, 8))
    b = BudgetAnchor.estimate(family, plain, input_size=(8, 8))
    assert (a.overhead, a.full_bytes) == (b.overhead, b.full_bytes)


def test_smallest_width_of_a_scenario() -> None:
    assert smallest_width("fair") == pytest.approx(1 / 6)
    assert smallest_width("lack") == pytest.approx(1 / 8)
    assert smallest_width("widths:2") == 1.0
    assert smallest_width("tiers") is None


def test_device_budgets_follow_the_shares_and_fluctuate_only_when_asked() -> None:
    anchor = fake_anchor()
    fleet = device_budgets("fair", 8, anchor, seed=3)
    assert sorted(budget.tier.name for budget in fleet).count("r=1/6") == 2
    assert all(budget(1) == budget(7) for budget in fleet)
    moving = device_budgets("tiers-fluctuating", 10, anchor, seed=3, variance=10.0)
    assert any(budget(1) != budget(2) for budget in moving)
    assert all(budget(r) <= anchor.tier_bytes(budget.tier) for budget in moving for r in range(1, 5))
    with pytest.raises(ValueError, match="non-negative"):
        device_budgets("tiers", 3, anchor, seed=0, variance=-1.0)


def test_a_fluctuating_device_is_planned_for_the_budget_it_has_in_all_but_its_rarest_rounds() -> None:
    anchor = fake_anchor()
    steady = device_budgets("tiers", 10, anchor, seed=3)
    assert all(budget.dependable() == budget(1) == anchor.tier_bytes(budget.tier) for budget in steady)
    moving = device_budgets("tiers-fluctuating", 10, anchor, seed=3, variance=10.0)
    for budget in moving:
        assert budget.dependable() < anchor.tier_bytes(budget.tier)  # the shortfall is never negative
        rounds = [budget(r) for r in range(1, 201)]
        assert sum(got >= budget.dependable() for got in rounds) >= 180  # |u| < 2 sigma in 95.4% of rounds


def test_sized_for_typical_a_fluctuating_device_has_its_budget_in_about_half_its_rounds() -> None:
    anchor = BudgetAnchor(0, 100 * 2**20, lambda width: int(100 * 2**20 * width))  # a point: 1 MiB, 16 granules
    steady = device_budgets("tiers", 10, anchor, seed=3)
    assert all(budget.sized_for("typical") == budget.dependable() for budget in steady)  # nothing to size for
    for budget in device_budgets("tiers-fluctuating", 10, anchor, seed=3, variance=10.0):
        assert budget.sized_for("dip") == budget.dependable() < budget.sized_for("typical") < anchor.tier_bytes(
            budget.tier)
        rounds = [budget(r) for r in range(1, 401)]
        assert 140 <= sum(got >= budget.sized_for("typical") for got in rounds) <= 260  # the median round's
    with pytest.raises(ValueError, match="dip or typical"):
        device_budgets("tiers", 1, anchor, seed=0)[0].sized_for("mean")


def test_the_start_of_run_statement_gives_each_tier_the_budget_it_is_sized_for() -> None:
    from coordinator.serving import TierService
    from fedfit.sim.harness import tier_services

    anchor = BudgetAnchor(0, 100 * 2**20, lambda width: int(100 * 2**20 * width))
    fleet = device_budgets("tiers-fluctuating", 10, anchor, seed=3, variance=10.0)

    class Told:  # whatever a method answers: the statement's budgets are what is checked
        def serve(self, tiers: list[tuple[str, int, int]]) -> list[TierService]:
            return [TierService(name, budget, devices, {"trains": "a"}) for name, budget, devices in tiers]

    for size_for in ("dip", "typical"):
        told = {service.tier: service.budget for service in tier_services(Told(), fleet, size_for)}
        assert told == {budget.tier.name: budget.sized_for(size_for) for budget in fleet}
    assert all(told[budget.tier.name] > budget.dependable() for budget in fleet)  # typical, above the dip


def test_fedavgs_width_for_all_fits_the_weakest_budget_a_fluctuating_device_can_count_on() -> None:
    anchor = BudgetAnchor(0, 100 * 2**20, lambda width: int(100 * 2**20 * width))  # no part that does not shrink
    widths = [1.0, 0.5, 0.3, 0.25, 0.125]
    steady = width_for_all("tiers", anchor, widths, variance=10.0)
    moving = width_for_all("tiers-fluctuating", anchor, widths, variance=10.0)
    assert moving < steady  # the weak tier's 35% is 35% - 2 sigma in all but its rarest rounds
    weak = min(device_budgets("tiers-fluctuating", 10, anchor, seed=0, variance=10.0), key=lambda b: b.dependable())
    assert anchor.width_bytes(moving) * anchor.margin <= weak.dependable() < anchor.width_bytes(steady) * anchor.margin
    assert width_for_all("tiers-fluctuating", anchor, widths, variance=0.0) == steady


def test_assign_tiers_by_largest_remainders() -> None:
    tiers = scenario_tiers("tiers")
    assigned = assign_tiers(10, tiers, seed=0)
    assert [assigned.count(t) for t in tiers] == [4, 3, 3]
    assert sorted(map(id, assign_tiers(10, tiers, seed=1))) == sorted(map(id, assigned))


def test_a_device_budget_is_its_tiers_every_round() -> None:
    budget = DeviceBudget(Tier("r=1/2", 1.0, width=0.5), fake_anchor(), variance=10.0, seed=1)
    assert budget(1) == budget(9) == fake_anchor().tier_bytes(Tier("r=1/2", 1.0, width=0.5))  # widths never move
