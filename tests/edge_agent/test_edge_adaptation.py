"""Adaptation: candidates from a task's hint, choosing the first that fits, and the runner adapting a task."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from edge_agent.adaptation import Choice, NoAdaptation, WidthLevels, adaptation_from_hint, choose, cut_nested
from models import SubmodelSpec

U = SubmodelSpec.uniform
WIDTH_LEVELS = {"kind": "width-levels", "rates": [1.0, 0.5, 0.25]}


# ---------------------------------------------------------------------------------------------- candidates
def test_width_levels_start_with_the_sent_spec_then_smaller_rates_largest_first():
    assert WidthLevels((1.0, 0.5, 0.25)).candidates(U(1.0)) == [U(1.0), U(0.5), U(0.25)]


def test_width_levels_never_offer_a_rate_larger_than_sent_nor_the_sent_one_twice():
    levels = WidthLevels((1.0, 0.5, 0.25, 0.125))
    assert levels.candidates(U(0.5)) == [U(0.5), U(0.25), U(0.125)]
    assert levels.candidates(U(0.125)) == [U(0.125)]


def test_width_levels_sort_and_deduplicate_the_rates():
    assert WidthLevels((0.25, 0.5, 0.25, 0.125)).candidates(U(1.0)) == [U(1.0), U(0.5), U(0.25), U(0.125)]


def test_width_levels_keep_a_sent_width_that_is_not_a_level():
    assert WidthLevels((1.0, 0.5, 0.25)).candidates(U(0.75)) == [U(0.75), U(0.5), U(0.25)]


def test_width_levels_keep_a_non_uniform_sent_spec_first():
    sent = SubmodelSpec(width=0.5, layer_widths={"conv2": 0.25})
    assert WidthLevels((1.0, 0.5, 0.25)).candidates(sent) == [sent, U(0.25)]


def test_no_adaptation_offers_only_the_sent_spec():
    sent = U(0.5)
    assert NoAdaptation().candidates(sent) == [sent]


def test_kinds():
    assert NoAdaptation.kind == "none"
    assert WidthLevels((1.0,)).kind == "width-levels"


# ---------------------------------------------------------------------------------------------- hints
@pytest.mark.parametrize("hint", [None, {"kind": "none"}, {}, {"kind": None}])
def test_no_hint_or_none_means_no_adaptation(hint):
    assert isinstance(adaptation_from_hint(hint), NoAdaptation)


def test_width_levels_hint():
    adaptation = adaptation_from_hint({"kind": "width-levels", "rates": [1, 0.5, 0.25]})
    assert adaptation == WidthLevels((1.0, 0.5, 0.25))
    assert all(isinstance(rate, float) for rate in adaptation.rates)


@pytest.mark.parametrize("rates", [
    "missing", None, [], "0.5", [0], [-0.5], [1.5], [0.5, True], ["0.5"], [math.nan], [math.inf],
    {"a": 0.5},
], ids=repr)
def test_malformed_width_levels_hint_is_a_value_error(rates):
    hint = {"kind": "width-levels"} if rates == "missing" else {"kind": "width-levels", "rates": rates}
    with pytest.raises(ValueError, match="'rates'"):
        adaptation_from_hint(hint)


@pytest.mark.parametrize("kind", ["prune", "WIDTH-LEVELS", 3])
def test_unknown_adaptation_kind_is_a_value_error(kind):
    with pytest.raises(ValueError, match=f"unknown adaptation kind {kind!r}"):
        adaptation_from_hint({"kind": kind})


# ---------------------------------------------------------------------------------------------- choose
def test_choose_takes_the_first_candidate_that_fits():
    sizes = {U(1.0): 400, U(0.5): 200, U(0.25): 100}
    asked = []

    def estimate(spec):
        asked.append(spec)
        return sizes[spec]

    choice = choose([U(1.0), U(0.5), U(0.25)], estimate, 250)
    assert choice == Choice(U(0.5), 200, (("width=1", 400), ("width=0.5", 200)))
    assert asked == [U(1.0), U(0.5)]  # it stops at the first fit


def test_choose_accepts_an_estimate_equal_to_what_is_available():
    assert choose([U(1.0)], lambda spec: 100, 100).spec == U(1.0)


def test_choose_returns_none_with_everything_it_tried_when_nothing_fits():
    sizes = {U(1.0): 400, U(0.5): 200, U(0.25): 100}
    choice = choose([U(1.0), U(0.5), U(0.25)], sizes.__getitem__, 99)
    assert choice.spec is None
    assert choice.tried == (("width=1", 400), ("width=0.5", 200), ("width=0.25", 100))
    assert choice.estimate == 100  # the smallest it tried


def test_choose_without_candidates():
    assert choose([], lambda spec: 1, 10) == Choice(None, 0, ())


# ---------------------------------------------------------------------------------------------- runner
def corrected_estimates(runner, model_ref, rates) -> dict[float, int]:
    estimates = {rate: runner.raw_estimate(model_ref, U(rate), 8, 0.9) for rate in rates}
    return {rate: runner.calibration.corrected(e.total, e.overhead) for rate, e in estimates.items()}


def test_runner_adapts_to_the_largest_level_that_fits(family, model_ref, make_task, make_runner):
    probe = make_runner(name="probe")
    estimates = corrected_estimates(probe, model_ref, (1.0, 0.5, 0.25))
    assert estimates[0.25] < estimates[0.5] < estimates[1.0]
    budget = (estimates[0.25] + estimates[0.5]) // 2

    task = make_task(U(1.0), adaptation=WIDTH_LEVELS)
    runner = make_runner(budget=budget)
    update = runner.run(task)

    assert update.status == "adapted", update.reason
    assert update.spec_trained == U(0.25).to_dict() == {"width": 0.25}
    assert "adapted width=1 -> width=0.25" in update.reason
    shapes = {key: tuple(len(index) for index in indices)
              for key, indices in family.index_map(U(0.25)).items()}
    assert set(update.weights) == set(family.trainable_keys(U(0.25)))
    for key, array in update.weights.items():
        assert array.shape == shapes[key], key
        assert np.isfinite(array).all()
    assert update.weights["conv1.weight"].shape[0] == 1  # 4 channels at width 0.25
    assert update.metrics["estimated_bytes"] == estimates[0.25]
    assert update.metrics["raw_estimate_bytes"] == runner.raw_estimate(model_ref, U(0.25), 8, 0.9).total
    assert update.metrics["budget_bytes"] == budget
    assert update.metrics["calibration"] == pytest.approx(1.10)
    assert update.metrics["peak_bytes"] > 0


def test_runner_declines_without_a_hint(model_ref, make_task, make_runner):
    probe = make_runner(name="probe")
    estimates = corrected_estimates(probe, model_ref, (0.5, 0.25))
    budget = (estimates[0.25] + estimates[0.5]) // 2
    update = make_runner(budget=budget).run(make_task(U(1.0)))
    assert update.status == "declined"
    assert update.reason.startswith("nothing fits") and "width=1" in update.reason
    assert "width=0.5" not in update.reason  # nothing else was tried
    assert update.weights == {} and update.spec_trained is None


def test_runner_declines_when_even_the_smallest_level_does_not_fit(family, make_task, make_runner):
    update = make_runner(budget=1000).run(make_task(U(1.0), adaptation=WIDTH_LEVELS))
    assert update.status == "declined"
    for name in ("width=1 ", "width=0.5 ", "width=0.25 "):
        assert name in update.reason


def test_runner_adapts_a_sub_model_it_received_to_a_smaller_one(family, model_ref, make_task, make_runner):
    # The weights received are already a slice (width 0.5); the adapted level is cut out of that slice.
    probe = make_runner(name="probe")
    estimates = corrected_estimates(probe, model_ref, (0.5, 0.25))
    task = make_task(U(0.5), adaptation=WIDTH_LEVELS)
    update = make_runner(budget=(estimates[0.25] + estimates[0.5]) // 2).run(task)
    assert update.status == "adapted", update.reason
    assert update.spec_trained == {"width": 0.25}
    shapes = {key: tuple(len(index) for index in indices) for key, indices in family.index_map(U(0.25)).items()}
    assert {key: array.shape for key, array in update.weights.items()} == {
        key: shapes[key] for key in family.trainable_keys(U(0.25))}


# ---------------------------------------------------------------------------------------------- cut_nested
def test_cut_nested_takes_the_smaller_slice_out_of_a_received_one(family):
    torch.manual_seed(0)
    global_state = family.build().state_dict()
    keys = family.trainable_keys(U(0.25))
    half = family.extract(global_state, U(0.5), keys=family.trainable_keys(U(0.5)))
    received = {key: value.numpy() for key, value in half.items()}
    cut = cut_nested(received, family.index_map(U(0.25)), keys)
    expected = family.extract(global_state, U(0.25), keys=keys)
    assert set(cut) == set(keys)
    for key in keys:
        np.testing.assert_array_equal(cut[key], expected[key].numpy())
        assert cut[key].flags.c_contiguous and not np.shares_memory(cut[key], received[key])


def test_cut_nested_refuses_a_spec_that_is_not_inside_the_received_one(family):
    torch.manual_seed(0)
    received = {k: v.numpy() for k, v in family.extract(family.build().state_dict(), U(0.25),
                                                         keys=family.trainable_keys(U(0.25))).items()}
    with pytest.raises(ValueError, match="not nested inside the received one"):
        cut_nested(received, family.index_map(U(0.5)), family.trainable_keys(U(0.5)))
