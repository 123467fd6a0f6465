"""``--speeds``: slowdown factors parsed (each at least 1) and handed to the devices by budget tier."""

from __future__ import annotations

from collections import Counter

import pytest

from fedfit.sim.budgets import assign_tiers, scenario_tiers
from fedfit.sim.speeds import device_speeds, parse_speeds, speeds_line, speeds_text


def test_factors_are_numbers_of_at_least_one() -> None:
    assert parse_speeds("1,3,10") == (1.0, 3.0, 10.0)
    assert parse_speeds(" 2.5 , 1 ") == (2.5, 1.0)
    assert speeds_text(parse_speeds("10,1.5,1")) == "10,1.5,1"


@pytest.mark.parametrize(("text", "said"), [
    ("", "--speeds takes slowdown factors separated by commas, each at least 1 (e.g. 1,3,10), got ''"),
    ("1,,3", "--speeds takes slowdown factors separated by commas"),
    ("0.5,1", ("--speeds: every factor is a number of at least 1 (1: this machine's speed, 10: ten times slower), "
               "got '0.5'")),
    ("fast", "got 'fast'"), ("nan", "got 'nan'"), ("inf", "got 'inf'"), ("-3", "got '-3'"),
])  # fmt: skip
def test_a_bad_factor_is_refused_with_one_sentence(text: str, said: str) -> None:
    with pytest.raises(ValueError, match="^--speeds") as refused:
        parse_speeds(text)
    assert said in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.parametrize(("scenario", "count", "seed"), [("tiers", 8, 0), ("tiers", 20, 3), ("fair", 9, 1),
                                                         ("surplus", 4, 7), ("fractions:1/4,1/2,1", 7, 2)])
def test_as_many_factors_as_tiers_give_each_tier_its_own_in_the_scenarios_order(scenario, count, seed) -> None:
    tiers = scenario_tiers(scenario)
    factors = [float(10 * (position + 1)) for position in range(len(tiers))]
    speeds = device_speeds(factors, count, scenario, seed)
    assigned = assign_tiers(count, tiers, seed)  # the tiers the budgets give the same devices
    assert [factors[[tier.name for tier in tiers].index(tier.name)] for tier in assigned] == speeds


def test_other_counts_split_the_devices_in_tier_order_into_equal_shares() -> None:
    # tiers: weak, medium, strong = 40/30/30% of the fleet, shuffled among the indices by the seed
    names = [tier.name for tier in assign_tiers(8, scenario_tiers("tiers"), 0)]
    speeds = device_speeds([1.0, 10.0], 8, "tiers", 0)
    assert Counter(speeds) == {1.0: 4, 10.0: 4}
    rank = {"weak": 0, "medium": 1, "strong": 2}
    slowest_fast = max(rank[name] for name, speed in zip(names, speeds) if speed == 1.0)
    fastest_slow = min(rank[name] for name, speed in zip(names, speeds) if speed == 10.0)
    assert slowest_fast <= fastest_slow  # the weaker tiers first
    assert Counter(device_speeds([1.0, 2.0, 3.0, 4.0], 10, "uniform", 0)) == {1.0: 3, 2.0: 3, 3.0: 2, 4.0: 2}
    # one tier: by index, contiguous
    assert device_speeds([1.0, 10.0], 5, "uniform", 4) == [1.0, 1.0, 1.0, 10.0, 10.0]
    assert device_speeds([3.0], 3, "tiers", 0) == [3.0, 3.0, 3.0]


def test_two_equal_tiers_are_two_tiers() -> None:
    assert Counter(device_speeds([1.0, 10.0], 4, "widths:1,1", 0)) == {1.0: 2, 10.0: 2}


def test_the_start_of_run_line_says_how_many_devices_of_which_tiers_train_at_each_factor() -> None:
    speeds = device_speeds([10.0, 1.0], 4, "fair", 0)
    assert speeds_line(speeds, "fair", 0) == (
        "training speeds (a device of factor f takes f times this machine's time for a task): "
        "x1: 2 devices (r=1/2, r=1), x10: 2 devices (r=1/6, r=1/3)")
