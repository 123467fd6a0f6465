"""Complexity levels: naming, affordability and fixed/dynamic picking."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from coordinator.config import HETEROFL_RATES
from coordinator.levels import LEVEL_NAMES, affordable, make_levels, pick_dynamic, pick_fixed
from models import SubmodelSpec


def cost(spec: SubmodelSpec) -> int:
    """Training cost proportional to the width: 1000 bytes for the full model."""
    return int(spec.width * 1000)


def test_make_levels_names_a_to_e_with_rates_and_specs():
    levels = make_levels(HETEROFL_RATES)
    assert [level.name for level in levels] == ["a", "b", "c", "d", "e"]
    assert [level.rate for level in levels] == list(HETEROFL_RATES)
    assert [level.spec for level in levels] == [SubmodelSpec.uniform(r) for r in HETEROFL_RATES]


def test_make_levels_rejects_more_levels_than_names():
    with pytest.raises(ValueError, match="at most"):
        make_levels([1.0] * (len(LEVEL_NAMES) + 1))


def test_affordable_keeps_order_and_filters_by_budget():
    levels = make_levels(HETEROFL_RATES)  # costs 1000, 500, 250, 125, 62
    assert [level.name for level in affordable(levels, 300, cost)] == ["c", "d", "e"]
    assert [level.name for level in affordable(levels, 500, cost)] == ["b", "c", "d", "e"]  # boundary fits
    assert affordable(levels, 10, cost) == []


def test_affordable_with_unknown_budget_is_every_level():
    levels = make_levels(HETEROFL_RATES)
    assert affordable(levels, None, cost) == levels


def test_pick_fixed_is_the_largest_candidate():
    levels = make_levels(HETEROFL_RATES)
    assert pick_fixed(affordable(levels, 300, cost)).name == "c"
    assert pick_fixed(levels).name == "a"


def test_pick_dynamic_follows_proportions_among_candidates():
    levels = make_levels(HETEROFL_RATES)
    candidates = affordable(levels, 300, cost)  # c, d, e
    rng = random.Random(0)
    proportions = {"a": 5.0, "b": 5.0, "c": 1.0, "d": 3.0, "e": 0.0}
    counts = Counter(pick_dynamic(candidates, proportions, rng).name for _ in range(4000))
    assert set(counts) == {"c", "d"}  # never an unaffordable level, never a zero-weight one
    assert 2.5 < counts["d"] / counts["c"] < 3.5


def test_pick_dynamic_is_reproducible_with_a_seeded_rng():
    levels = make_levels(HETEROFL_RATES)
    proportions = {level.name: 1.0 for level in levels}
    rng_a, rng_b = random.Random(7), random.Random(7)
    seq_a = [pick_dynamic(levels, proportions, rng_a).name for _ in range(50)]
    seq_b = [pick_dynamic(levels, proportions, rng_b).name for _ in range(50)]
    assert seq_a == seq_b
    assert len(set(seq_a)) > 1


def test_pick_dynamic_falls_back_to_uniform_when_candidates_have_no_weight():
    levels = make_levels(HETEROFL_RATES)
    candidates = affordable(levels, 300, cost)
    rng = random.Random(1)
    picked = Counter(pick_dynamic(candidates, {"a": 1.0}, rng).name for _ in range(600))
    assert set(picked) == {"c", "d", "e"}
    assert min(picked.values()) > 100
