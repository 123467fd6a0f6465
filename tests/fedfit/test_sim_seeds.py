"""Means and spreads over seeds, and whether a curve has flattened."""

from __future__ import annotations

import statistics

import pytest

from fedfit.sim.seeds import late_change, mean_curve, mean_spread, stat_text


def test_mean_and_sample_spread() -> None:
    values = [0.81, 0.84, 0.78]
    assert mean_spread(values) == (pytest.approx(statistics.mean(values)), pytest.approx(statistics.stdev(values)))
    assert mean_spread([0.5]) == (0.5, None)
    with pytest.raises(ValueError):
        mean_spread([])


def test_late_change_is_zero_on_a_flat_tail_and_positive_on_a_rising_one() -> None:
    rising = [n / 100 for n in range(40)]
    assert late_change(rising) == pytest.approx(0.05)  # the last five against the five before: 5 rounds apart
    assert late_change([0.3] * 10 + [0.9] * 30) == pytest.approx(0.0)
    assert late_change([0.1, 0.2, 0.3, 0.4]) == pytest.approx(0.1)  # a quarter of the rounds each
    assert late_change([0.1, 0.2, 0.3]) == pytest.approx(0.1)  # at least one round each
    assert late_change([n / 10 for n in range(12)]) == pytest.approx(0.3)  # 12 rounds: the last 3 and the 3 before
    assert late_change([0.4, 0.5]) == pytest.approx(0.1) and late_change([0.4]) is None


def test_a_mean_curve_averages_every_seed_over_the_rounds_they_all_reached() -> None:
    def report(*accuracies: float) -> dict:
        return {"rounds": [{"round": n, "global_accuracy": a, "level_accuracy": {"a": a / 2}}
                           for n, a in enumerate(accuracies, start=1)]}

    rounds, means, spreads = mean_curve([report(0.2, 0.4, 0.6), report(0.4, 0.6)], "global")
    assert rounds == [1, 2] and means == pytest.approx([0.3, 0.5])
    assert spreads == pytest.approx([statistics.stdev([0.2, 0.4])] * 2)
    rounds, means, spreads = mean_curve([report(0.2, 0.4, 0.6)], "levels")
    assert rounds == [1, 2, 3] and means == pytest.approx([0.1, 0.2, 0.3]) and spreads == [0.0] * 3


def test_figures_with_and_without_a_spread() -> None:
    assert stat_text({"mean": 0.81234, "spread": 0.00412}) == "0.8123 ±0.0041"
    assert stat_text({"mean": 0.81234, "spread": None}) == "0.8123"
    assert stat_text({"mean": -0.0123, "spread": 0.004}, 1, 100.0, sign=True) == "-1.2 ±0.4"
    assert stat_text(None) == "-"
