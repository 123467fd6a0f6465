"""Complexity levels: naming, affordability and dynamic picking."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from coordinator.config import HETEROFL_RATES
from coordinator.levels import (
    LEVEL_NAMES,
    Level,
    affordable,
    affordable_share,
    fleet_shares,
    pick_dynamic,
    width_levels,
)
from models import SubmodelSpec


def cost(level: Level) -> int:
    """Training cost proportional to the width: 1000 bytes for the full model."""
    return int(level.spec.width * 1000)


def test_width_levels_names_a_to_e_with_rates_and_specs():
    levels = width_levels(HETEROFL_RATES)
    assert [level.name for level in levels] == ["a", "b", "c", "d", "e"]
    assert [level.info["rate"] for level in levels] == list(HETEROFL_RATES)
    assert [level.spec for level in levels] == [SubmodelSpec.uniform(r) for r in HETEROFL_RATES]
    assert all(level.spec.rounding == "ceil" for level in levels)


def test_width_levels_pass_the_rounding_on():
    levels = width_levels([1.0, 0.5], rounding="floor")
    assert [level.spec for level in levels] == [SubmodelSpec(width=1.0, rounding="floor"),
                                               SubmodelSpec(width=0.5, rounding="floor")]


def test_width_levels_rejects_more_levels_than_names():
    with pytest.raises(ValueError, match="at most"):
        width_levels([1.0] * (len(LEVEL_NAMES) + 1))


def test_level_is_immutable_and_info_defaults_to_empty():
    level = Level("1", SubmodelSpec.full())
    assert dict(level.info) == {}
    with pytest.raises(AttributeError):
        level.name = "2"  # type: ignore[misc]


def test_affordable_keeps_order_and_filters_by_budget():
    levels = width_levels(HETEROFL_RATES)  # costs 1000, 500, 250, 125, 62
    assert [level.name for level in affordable(levels, 300, cost)] == ["c", "d", "e"]
    assert [level.name for level in affordable(levels, 500, cost)] == ["b", "c", "d", "e"]  # boundary fits
    assert affordable(levels, 10, cost) == []


def test_affordable_first_is_the_largest_that_fits():
    levels = width_levels(HETEROFL_RATES)
    assert affordable(levels, 300, cost)[0].name == "c"
    assert affordable(levels, 10**6, cost)[0].name == "a"


def test_affordable_with_unknown_budget_is_every_level():
    levels = width_levels(HETEROFL_RATES)
    assert affordable(levels, None, cost) == levels


def test_pick_dynamic_follows_proportions_among_candidates():
    levels = width_levels(HETEROFL_RATES)
    candidates = affordable(levels, 300, cost)  # c, d, e
    rng = random.Random(0)
    proportions = {"a": 5.0, "b": 5.0, "c": 1.0, "d": 3.0, "e": 0.0}
    counts = Counter(pick_dynamic(candidates, proportions, rng).name for _ in range(4000))
    assert set(counts) == {"c", "d"}  # never an unaffordable level, never a zero-weight one
    assert 2.5 < counts["d"] / counts["c"] < 3.5


def test_pick_dynamic_is_reproducible_with_a_seeded_rng():
    levels = width_levels(HETEROFL_RATES)
    proportions = {level.name: 1.0 for level in levels}
    rng_a, rng_b = random.Random(7), random.Random(7)
    seq_a = [pick_dynamic(levels, proportions, rng_a).name for _ in range(50)]
    seq_b = [pick_dynamic(levels, proportions, rng_b).name for _ in range(50)]
    assert seq_a == seq_b
    assert len(set(seq_a)) > 1


def test_pick_dynamic_falls_back_to_uniform_when_candidates_have_no_weight():
    levels = width_levels(HETEROFL_RATES)
    candidates = affordable(levels, 300, cost)
    rng = random.Random(1)
    picked = Counter(pick_dynamic(candidates, {"a": 1.0}, rng).name for _ in range(600))
    assert set(picked) == {"c", "d", "e"}
    assert min(picked.values()) > 100


# ------------------------------------------------------------------------- sizing from the fleet's budgets
def test_affordable_share_applies_the_devices_rule():
    # overhead + variable * factor <= budget  <=>  variable <= (budget - overhead) / factor
    assert affordable_share(1100 + 500, 500, 1000.0, 1.1) == pytest.approx(1.0)
    assert affordable_share(550 + 500, 500, 1000.0, 1.1) == pytest.approx(0.5)
    assert affordable_share(400, 500, 1000.0, 1.1) == 0.0  # not even the overhead


def test_fleet_shares_cluster_the_budgets_and_keep_the_weakest():
    assert fleet_shares([0.1, 0.105, 0.3, 0.31, 2.0], most=3) == [0.1, 0.3, 1.0]
    assert fleet_shares([1.5, 1.0], most=3) == [1.0]  # everyone trains the full model
    assert fleet_shares([0.0, 0.2], most=3) == [0.2, 1.0]  # a device without room for anything adds no level
    spread = fleet_shares([0.1, 0.2, 0.4, 0.6, 0.8], most=3)
    assert spread[0] == 0.1 and len(spread) == 4 and spread[-1] == 1.0 and spread == sorted(spread)
