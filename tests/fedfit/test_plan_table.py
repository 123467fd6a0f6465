"""fedfit.plan_table: the tiers of a budget scenario and what each method hands them, with the methods whose
largest model no tier trains named with what it needs."""

from __future__ import annotations

from fedfit.plan_table import format_tiers

MIB = 1 << 20


def rows(strongest_trains: str) -> list[dict]:
    largest = {"scalefl": {"name": "3", "train_bytes": 60 * MIB}, "fedepth": {"name": None, "train_bytes": None}}
    return [{"tier": "r=1/2", "budget_bytes": 20 * MIB, "largest": largest,
             "methods": {"scalefl": {"trains": "1"}, "fedepth": {"trains": "depth-wise"}}},
            {"tier": "r=1", "budget_bytes": 42 * MIB, "largest": largest,
             "methods": {"scalefl": {"trains": strongest_trains}, "fedepth": {"trains": "whole"}}}]


def test_a_largest_model_no_tier_trains_is_said_with_what_it_needs() -> None:
    text = format_tiers(rows("2"))
    assert ("scalefl: no tier trains its largest model (3, which needs 60.0 MiB to train; the strongest tier, r=1, "
            "has 42.0 MiB): the parts only it holds learn from no device") in text.splitlines()
    assert "fedepth: no tier" not in text
    assert "no tier trains" not in format_tiers(rows("3"))


def test_the_plan_shows_a_fluctuating_tier_with_the_budget_the_run_sizes_for() -> None:
    from common.data import load_dataset
    from coordinator.config import CoordinatorConfig
    from fedfit.plan_table import scenario_budgets
    from fedfit.sim.budgets import SIZE_FOR

    config = CoordinatorConfig()
    dataset = load_dataset("digits", None)
    dip = dict(scenario_budgets(config, dataset, "tiers-fluctuating"))
    typical = dict(scenario_budgets(config, dataset, "tiers-fluctuating", size_for="typical"))
    assert dip == dict(scenario_budgets(config, dataset, "tiers-fluctuating", size_for="dip"))
    assert set(dip) == set(typical) and all(typical[tier] > dip[tier] for tier in dip)
    assert SIZE_FOR["typical"] < SIZE_FOR["dip"]  # the median round's shortfall is the smaller
    steady = dict(scenario_budgets(config, dataset, "tiers", size_for="typical"))
    assert all(steady[tier] > typical[tier] for tier in dip)  # a fluctuating tier never has its whole share
