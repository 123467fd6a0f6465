"""Adaptation: the options a task's hint gives, choosing the first that fits, and the runner adapting a task.

Options are (spec, plan) pairs: the sent spec with the task's plan first, then a ``ladder`` hint's candidates,
each with its own plan run with the task's seed (HeteroFL's smaller levels, ScaleFL's lower exits), or, from
coordinators that predate ladders, the ``width-levels`` hint's smaller uniform widths with the task's plan.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from common.device_need import INITIAL_FACTOR
from coordinator.strategies.scalefl import self_distillation_loss
from edge_agent.adaptation import Choice, Option, choose, cut_nested, options
from edge_agent.decision import Decider, estimate_key
from edge_agent.depthwise_cut import shortfall
from edge_agent.memory import size_text
from edge_agent.workdir import DataShape, DecisionRequest
from models import MemoryEstimate, SubmodelSpec, get_family
from protocol import Adaptation, Candidate, LossTerm, ModelRef, Stage, TrainingPlan

U = SubmodelSpec.uniform
WIDTH_LEVELS = Adaptation("width-levels", rates=[1.0, 0.5, 0.25])


def levels(*rates: float) -> Adaptation:
    return Adaptation("width-levels", rates=list(rates))


def ladder(*candidates: tuple[SubmodelSpec, TrainingPlan]) -> Adaptation:
    return Adaptation("ladder", [Candidate(spec.to_dict(), plan) for spec, plan in candidates])


def eq5(outputs: int) -> tuple:
    """ScaleFL's Eq. 5 over ``outputs`` exits: CE at every exit and KD from the last one (non-negative output
    indices: the loss of a plan for 3 outputs cannot run on a model with 2)."""
    return self_distillation_loss(outputs, beta=0.5, tau=2.0)


# ScaleFL-like levels of the three-block CNN (floor rounding, a depth cut closed by the exit after its last block,
# every lower level's exit kept); each trains Eq. 5 over its own exits.
L3 = SubmodelSpec(width=1.0, rounding="floor", exits=(0, 1))
L2 = SubmodelSpec(width=0.5, rounding="floor", depth=2, exits=(0, 1))
L1 = SubmodelSpec(width=0.25, rounding="floor", depth=1, exits=(0,))
CANDIDATE_SEED = 99  # what the coordinator wrote into a candidate's plan; the agent runs the task's seed


@pytest.fixture(scope="module")
def plan(task_plan) -> TrainingPlan:
    """The plan of the tests' tasks."""
    return task_plan()


@pytest.fixture(scope="module")
def scalefl(task_plan) -> dict[SubmodelSpec, TrainingPlan]:
    """Each level's plan: the task's plan for level 3, plans of their own (another seed) for the candidates."""
    return {L3: task_plan(loss=eq5(3)), L2: task_plan(loss=eq5(2), seed=CANDIDATE_SEED),
            L1: task_plan(loss=eq5(1), seed=CANDIDATE_SEED)}


def opts(plan: TrainingPlan, *specs: SubmodelSpec) -> list[Option]:
    return [Option(spec, plan) for spec in specs]


# ---------------------------------------------------------------------------------------------- width levels
def test_width_levels_start_with_the_sent_spec_then_smaller_rates_largest_first(family, plan):
    assert options(family, U(1.0), plan, WIDTH_LEVELS) == opts(plan, U(1.0), U(0.5), U(0.25))


def test_width_levels_never_offer_a_rate_larger_than_sent_nor_the_sent_one_twice(family, plan):
    hint = levels(1.0, 0.5, 0.25, 0.125)
    assert options(family, U(0.5), plan, hint) == opts(plan, U(0.5), U(0.25), U(0.125))
    assert options(family, U(0.125), plan, hint) == opts(plan, U(0.125))


def test_width_levels_sort_and_deduplicate_the_rates(family, plan):
    assert options(family, U(1.0), plan, levels(0.25, 0.5, 0.25, 0.125)) == opts(plan, U(1.0), U(0.5), U(0.25), U(0.125))


def test_width_levels_keep_a_sent_width_that_is_not_a_level(family, plan):
    assert options(family, U(0.75), plan, WIDTH_LEVELS) == opts(plan, U(0.75), U(0.5), U(0.25))


def test_width_levels_keep_a_non_uniform_sent_spec_first(family, plan):
    sent = SubmodelSpec(width=0.5, layer_widths={"conv2": 0.25})
    assert options(family, sent, plan, WIDTH_LEVELS) == opts(plan, sent, U(0.25))


def test_width_levels_use_the_sent_rounding_and_the_task_plan(family, task_plan):
    plan = task_plan(batch_size=4, seed=7, loss=eq5(1))
    sent = U(1.0, "floor")
    assert options(family, sent, plan, WIDTH_LEVELS) == opts(plan, sent, U(0.5, "floor"), U(0.25, "floor"))


def test_width_levels_drop_a_level_that_is_not_nested_in_the_sent_spec(family, plan):
    # conv2 keeps 1 of 8 channels in the sent spec; uniform 0.25 keeps 2: it cannot be cut out of what was sent.
    sent = SubmodelSpec(width=0.5, layer_widths={"conv2": 0.125})
    assert not family.is_nested(U(0.25), sent)
    assert options(family, sent, plan, WIDTH_LEVELS) == opts(plan, sent)


def test_width_levels_leave_out_a_level_narrower_than_a_nested_teacher(family, task_plan):
    plan = task_plan(loss=(LossTerm.ce(), LossTerm.nested_kd(U(0.5).to_dict(), weight=10.0, tau=3.0)))
    assert options(family, U(1.0), plan, WIDTH_LEVELS) == opts(plan, U(1.0), U(0.5))  # not 0.25: the teacher is wider
    with pytest.raises(ValueError, match="is not nested"):
        options(family, U(0.25), plan, WIDTH_LEVELS)


@pytest.mark.parametrize("hint", [None, Adaptation("none")], ids=["no hint", "none"])
def test_no_hint_or_none_offers_only_the_sent_spec(family, hint, plan):
    assert options(family, U(0.5), plan, hint) == opts(plan, U(0.5))


# ---------------------------------------------------------------------------------------------- ladders
def test_ladder_candidates_follow_the_sent_spec_in_order_each_with_its_own_plan_and_the_task_seed(deep_family,
                                                                                                 scalefl):
    sent_plan = replace(scalefl[L3], seed=5)
    found = options(deep_family, L3, sent_plan, ladder((L2, scalefl[L2]), (L1, scalefl[L1])))
    assert [option.spec for option in found] == [L3, L2, L1]
    assert found[0] == Option(L3, sent_plan)
    for option, outputs in zip(found[1:], (2, 1)):
        assert scalefl[option.spec].seed == CANDIDATE_SEED
        assert option.plan == replace(scalefl[option.spec], seed=5)  # its own plan, the task's seed
        assert option.plan.loss == eq5(outputs) != sent_plan.loss  # its own loss terms


def test_ladder_keeps_the_candidates_order_even_when_a_later_one_is_larger(family, plan):
    # The coordinator orders its ladder; the agent does not reorder it (each candidate has its own plan).
    found = options(family, U(1.0), plan, ladder((U(0.25), plan), (U(0.5), plan)))
    assert [option.spec for option in found] == [U(1.0), U(0.25), U(0.5)]


def test_ladder_drops_candidates_not_nested_in_the_sent_spec(deep_family, scalefl):
    wide_and_shallow = SubmodelSpec(width=1.0, rounding="floor", depth=1, exits=(0,))  # 4 channels, L2 keeps 2
    ceil_rounded = SubmodelSpec(width=0.375, depth=1, exits=(0,))  # another rounding, still 2 channels: nested
    other_exit = SubmodelSpec(width=0.5, rounding="floor", exits=(1,))  # block 3 and the final head: L2 has none
    for spec in (L3, wide_and_shallow, other_exit):
        assert not deep_family.is_nested(spec, L2), spec
    assert deep_family.is_nested(ceil_rounded, L2) and deep_family.is_nested(L1, L2)
    hint = ladder(*[(spec, scalefl[L1]) for spec in (L3, wide_and_shallow, other_exit, ceil_rounded, L1)])
    found = options(deep_family, L2, scalefl[L2], hint)
    assert [option.spec for option in found] == [L2, ceil_rounded, L1]


def test_ladder_never_repeats_the_sent_spec_nor_an_option(family, plan, task_plan):
    other_plan = task_plan(batch_size=4)
    hint = ladder((U(0.5), other_plan), (U(0.25), plan), (U(0.25), plan), (U(0.25), other_plan))
    found = options(family, U(0.5), plan, hint)
    # the sent spec with another plan is not another option; the same (spec, plan) is offered once
    assert found == [Option(U(0.5), plan), Option(U(0.25), plan), Option(U(0.25), other_plan)]


@pytest.mark.parametrize(("spec", "detail"), [
    ({"bogus": 1}, "unknown sub-model spec key 'bogus'"),
    ({"width": 2.0}, "width must be a number in (0, 1]"),
    ({"width": "half"}, "'width' must be a number"),
    ({"depth": 5, "exits": [0]}, "depth 5 exceeds the 2 blocks"),
    ({"exits": [1]}, "no exit point after block 1"),
    ({"depth": 1}, "needs an exit there"),
], ids=repr)
def test_a_malformed_ladder_candidate_is_a_value_error_naming_it(family, spec, detail, plan):
    hint = Adaptation("ladder", [Candidate(U(0.25).to_dict(), plan), Candidate(spec, plan)])
    with pytest.raises(ValueError, match="adaptation candidate 1: ") as raised:
        options(family, U(1.0), plan, hint)
    assert detail in str(raised.value)


@pytest.mark.parametrize(("spec", "schedule", "detail"), [
    (L1, (Stage(),), "the plan schedules depth-wise stages, but the spec trains the whole model at once"),
    (SubmodelSpec(width=0.5, rounding="floor", depth=2, exits=(1,), segments=((0, 1), (1, 2))), (Stage(),),
     "the plan schedules 1 stage(s) for the spec's 2 segment(s)"),
], ids=["schedule without segments", "one stage for two segments"])
def test_a_ladder_candidate_whose_plan_does_not_fit_its_spec_is_a_value_error_naming_it(deep_family, scalefl,
                                                                                       spec, schedule, detail):
    hint = ladder((L2, scalefl[L2]), (spec, replace(scalefl[L1], schedule=schedule)))
    with pytest.raises(ValueError, match="adaptation candidate 1: ") as raised:
        options(deep_family, L3, scalefl[L3], hint)
    assert detail in str(raised.value)


# ---------------------------------------------------------------------------------------------- choose
def test_choose_takes_the_first_candidate_that_fits(plan):
    candidates = opts(plan, U(1.0), U(0.5), U(0.25))
    sizes = {U(1.0): 400, U(0.5): 200, U(0.25): 100}
    asked = []

    def estimate(option):
        asked.append(option)
        return sizes[option.spec]

    choice = choose(candidates, estimate, 250)
    assert choice == Choice(Option(U(0.5), plan), 200, (("width=1", 400), ("width=0.5", 200)))
    assert asked == candidates[:2]  # it stops at the first fit


def test_choose_keeps_the_plan_of_the_option_it_takes(plan, task_plan):
    small_batch = task_plan(batch_size=2)
    candidates = [Option(U(0.5), plan), Option(U(0.5), small_batch)]
    sizes = {plan: 300, small_batch: 100}
    assert choose(candidates, lambda option: sizes[option.plan], 200).option == Option(U(0.5), small_batch)


def test_choose_accepts_an_estimate_equal_to_what_is_available(plan):
    assert choose(opts(plan, U(1.0)), lambda option: 100, 100).option == Option(U(1.0), plan)


def test_choose_returns_none_with_everything_it_tried_when_nothing_fits(plan):
    sizes = {U(1.0): 400, U(0.5): 200, U(0.25): 100}
    choice = choose(opts(plan, U(1.0), U(0.5), U(0.25)), lambda option: sizes[option.spec], 99)
    assert choice.option is None
    assert choice.tried == (("width=1", 400), ("width=0.5", 200), ("width=0.25", 100))
    assert choice.estimate == 100  # the smallest it tried


def test_choose_without_candidates():
    assert choose([], lambda option: 1, 10) == Choice(None, 0, ())


# ---------------------------------------------------------------------------------------------- runner
def raw(runner, model_ref, spec: SubmodelSpec, plan: TrainingPlan) -> MemoryEstimate:
    """The estimate a decision of ``runner`` makes for ``spec`` and ``plan``."""
    return Decider(DecisionRequest(runner.device, runner.allocator, runner.available(1), runner.calibration.factor,
                                   runner.data)).raw_estimate(model_ref, spec, plan)


def corrected(runner, model_ref, spec: SubmodelSpec, plan: TrainingPlan) -> int:
    estimate = raw(runner, model_ref, spec, plan)
    return runner.calibration.corrected(estimate.total, estimate.overhead)


def corrected_estimates(runner, model_ref, rates, plan: TrainingPlan) -> dict[float, int]:
    return {rate: corrected(runner, model_ref, U(rate), plan) for rate in rates}


@pytest.mark.parametrize("style", ["old-style recipe and width levels", "plan and ladder"])
def test_runner_adapts_to_the_largest_level_that_fits(family, model_ref, make_task, make_runner, style, plan):
    probe = make_runner(name="probe")
    estimates = corrected_estimates(probe, model_ref, (1.0, 0.5, 0.25), plan)
    assert estimates[0.25] < estimates[0.5] < estimates[1.0]
    budget = (estimates[0.25] + estimates[0.5]) // 2

    if style.startswith("old"):  # a coordinator that predates plans: a recipe, HeteroFL's width levels
        task = make_task(U(1.0), legacy=True, adaptation=WIDTH_LEVELS)
        assert task.plan is None and task.recipe is not None
        assert task.training_plan() == plan  # the recipe means the same training as the plan of the other case
    else:
        task = make_task(U(1.0), adaptation=ladder((U(0.5), plan), (U(0.25), plan)))
    runner = make_runner(budget=budget)
    update = runner.run(task)

    assert update.status == "adapted", update.reason
    assert update.spec_trained == U(0.25).to_dict() == {"width": 0.25}
    assert "adapted width=1 -> width=0.25" in update.reason
    shapes = family.shapes(U(0.25), track_bn_stats=False)
    assert set(update.weights) == set(family.trainable_keys(U(0.25)))
    for key, array in update.weights.items():
        assert array.shape == shapes[key], key
        assert np.isfinite(array).all()
    assert update.weights["conv1.weight"].shape[0] == 1  # 4 channels at width 0.25
    assert update.metrics["estimated_bytes"] == estimates[0.25]
    assert update.metrics["raw_estimate_bytes"] == raw(runner, model_ref, U(0.25), plan).total
    assert update.metrics["budget_bytes"] == budget
    assert update.metrics["calibration"] == pytest.approx(1.10)
    assert update.metrics["peak_bytes"] > 0
    assert update.metrics["steps"] == 2.0 and update.metrics["stages"] == 1.0


def test_runner_declines_without_a_hint(model_ref, make_task, make_runner, plan):
    probe = make_runner(name="probe")
    estimates = corrected_estimates(probe, model_ref, (0.5, 0.25), plan)
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


def test_runner_adapts_a_sub_model_it_received_to_a_smaller_one(family, model_ref, make_task, make_runner, plan):
    # The weights received are already a slice (width 0.5); the adapted level is cut out of that slice.
    probe = make_runner(name="probe")
    estimates = corrected_estimates(probe, model_ref, (0.5, 0.25), plan)
    task = make_task(U(0.5), adaptation=WIDTH_LEVELS)
    update = make_runner(budget=(estimates[0.25] + estimates[0.5]) // 2).run(task)
    assert update.status == "adapted", update.reason
    assert update.spec_trained == {"width": 0.25}
    shapes = family.shapes(U(0.25), track_bn_stats=False)
    assert {key: array.shape for key, array in update.weights.items()} == {
        key: shapes[key] for key in family.trainable_keys(U(0.25))}


@pytest.mark.parametrize("target", ["L2", "L1"])
def test_runner_trains_the_first_scalefl_candidate_that_fits(deep_family, deep_ref, make_deep_task, make_runner,
                                                           decider_for, scalefl, target):
    chosen = {"L2": L2, "L1": L1}[target]
    probe = make_runner(name="probe")
    needs = {spec: corrected(probe, deep_ref, spec, scalefl[spec]) for spec in (L3, L2, L1)}
    assert needs[L1] < needs[L2] < needs[L3]
    larger = {L2: L3, L1: L2}[chosen]
    budget = (needs[chosen] + needs[larger]) // 2

    task = make_deep_task(L3, plan=scalefl[L3], adaptation=ladder((L2, scalefl[L2]), (L1, scalefl[L1])))
    runner = make_runner(budget=budget)
    update = runner.run(task)

    assert update.status == "adapted", update.reason
    assert update.spec_trained == chosen.to_dict()
    assert update.reason == f"adapted {L3.describe()} -> {chosen.describe()} to fit {size_text(budget)}"
    # exactly the candidate's trainable tensors, at its shapes (a depth cut: no final head, its own exits)
    shapes = deep_family.shapes(chosen, track_bn_stats=False)
    assert list(update.weights) == list(deep_family.trainable_keys(chosen))
    assert "classifier.weight" not in update.weights and "conv3.weight" not in update.weights
    assert {f"exits.{b}.classifier.weight" for b in chosen.exits} <= set(update.weights)
    for key, array in update.weights.items():
        assert array.shape == shapes[key], key
        assert np.isfinite(array).all()
    assert update.metrics["estimated_bytes"] == needs[chosen]
    assert update.metrics["raw_estimate_bytes"] == raw(runner, deep_ref, chosen, scalefl[chosen]).total

    # The decision re-wrote the task for the candidate: its spec, its plan with the task's seed, no recipe, no
    # hint, and the weights cut out of those received; the training child trained that.
    decision, written = decider_for(runner).decide(task)
    assert decision.status == "adapted" and decision.spec == chosen.to_dict() == written.spec
    assert written.plan == replace(scalefl[chosen], seed=scalefl[L3].seed) != scalefl[chosen]
    assert written.recipe is None and written.adaptation is None
    assert list(written.weights) == list(deep_family.state_keys(chosen))
    for key, array in written.weights.items():
        np.testing.assert_array_equal(array, task.weights[key][tuple(slice(0, n) for n in shapes[key])])
    # and trained it: the weights moved away from what was cut out for it
    assert all(not np.array_equal(update.weights[k], written.weights[k]) for k in update.weights
               if k.endswith("classifier.weight"))


def test_runner_never_chooses_a_candidate_not_nested_in_the_sent_spec(deep_family, deep_ref, make_deep_task,
                                                                      make_runner, decider_for, scalefl, task_plan):
    # Sent level 2; the ladder offers the larger level 3, a full-width block (not nested either, but tiny with
    # its batch of 2) and then level 1. Only level 1 may be trained.
    wide = SubmodelSpec(width=1.0, rounding="floor", depth=1, exits=(0,))
    wide_plan = task_plan(batch_size=2, loss=eq5(1))
    probe = make_runner(name="probe")
    needs = {spec: corrected(probe, deep_ref, spec, spec_plan) for spec, spec_plan in
             ((L2, scalefl[L2]), (L1, scalefl[L1]), (wide, wide_plan))}
    budget = (max(needs[L1], needs[wide]) + needs[L2]) // 2
    assert needs[wide] <= budget and needs[L1] <= budget < needs[L2]  # the wide block would fit

    runner = make_runner(budget=budget)
    hint = ladder((L3, scalefl[L3]), (wide, wide_plan), (L1, scalefl[L1]))
    update = runner.run(make_deep_task(L2, plan=scalefl[L2], adaptation=hint))
    assert update.status == "adapted", update.reason
    assert update.spec_trained == L1.to_dict()
    assert set(update.weights) == set(deep_family.trainable_keys(L1))
    decider = decider_for(runner)
    decider.decide(make_deep_task(L2, plan=scalefl[L2], adaptation=hint))
    # the others were not even estimated
    assert list(decider.made) == [estimate_key(deep_ref, Option(L2, scalefl[L2])),
                                  estimate_key(deep_ref, Option(L1, replace(scalefl[L1], seed=scalefl[L2].seed)))]

    # With only candidates that are not nested, nothing but the sent spec is tried: declined.
    declined = runner.run(make_deep_task(L2, plan=scalefl[L2], task_id="r1-agent-0002",
                                         adaptation=ladder((wide, wide_plan), (L3, scalefl[L3]))))
    assert declined.status == "declined"
    assert declined.reason.startswith("nothing fits") and L2.describe() in declined.reason
    assert "width=1 " not in declined.reason
    assert declined.weights == {} and declined.spec_trained is None


def test_runner_fails_a_task_with_a_malformed_ladder_candidate(make_task, make_runner, plan):
    hint = Adaptation("ladder", [Candidate({"width": 0.25, "exits": [1]}, plan)])
    update = make_runner().run(make_task(U(1.0), adaptation=hint))
    assert update.status == "failed"
    assert update.reason.startswith("invalid task: adaptation candidate 0: ")
    assert "no exit point after block 1" in update.reason


def test_runner_fails_a_task_whose_ladder_candidate_plan_does_not_fit_its_spec(make_deep_task, make_runner,
                                                                              scalefl):
    # A depth-wise schedule for a candidate that trains the whole model at once cannot run: the task is invalid,
    # like one whose candidate spec is malformed, and the reason says which candidate.
    bad_plan = replace(scalefl[L1], schedule=(Stage(),))
    hint = ladder((L2, scalefl[L2]), (L1, bad_plan))
    update = make_runner().run(make_deep_task(L3, plan=scalefl[L3], adaptation=hint))
    assert update.status == "failed"
    assert update.reason.startswith("invalid task: adaptation candidate 1: "), update.reason
    assert "the plan schedules depth-wise stages, but the spec trains the whole model at once" in update.reason


# ---------------------------------------------------------------------------------------------- cut_nested
def test_cut_nested_takes_the_smaller_slice_out_of_a_received_one(family):
    torch.manual_seed(0)
    global_state = family.build().state_dict()
    keys = family.state_keys(U(0.25))
    half = family.extract(global_state, U(0.5), keys=family.state_keys(U(0.5)))
    received = {key: value.numpy() for key, value in half.items()}
    cut = cut_nested(received, family.index_map(U(0.25)), keys)
    expected = family.extract(global_state, U(0.25), keys=keys)
    assert set(cut) == set(keys)
    for key in keys:
        np.testing.assert_array_equal(cut[key], expected[key].numpy())
        assert cut[key].flags.c_contiguous and not np.shares_memory(cut[key], received[key])


def test_cut_nested_cuts_a_lower_exit_out_of_a_scalefl_level(deep_family):
    torch.manual_seed(0)
    global_state = deep_family.build(SubmodelSpec(exits=deep_family.exit_points)).state_dict()
    received = {key: value.numpy() for key, value in
                deep_family.extract(global_state, L3, keys=deep_family.state_keys(L3)).items()}
    keys = deep_family.state_keys(L1)
    cut = cut_nested(received, deep_family.index_map(L1), keys)
    expected = deep_family.extract(global_state, L1, keys=keys)
    assert list(cut) == list(keys) and "exits.0.classifier.weight" in cut and "conv2.weight" not in cut
    for key in keys:
        np.testing.assert_array_equal(cut[key], expected[key].numpy())


def test_cut_nested_refuses_a_spec_that_is_not_inside_the_received_one(family):
    torch.manual_seed(0)
    received = {k: v.numpy() for k, v in family.extract(family.build().state_dict(), U(0.25),
                                                         keys=family.state_keys(U(0.25))).items()}
    with pytest.raises(ValueError, match="not nested inside the received one"):
        cut_nested(received, family.index_map(U(0.5)), family.state_keys(U(0.5)))


def test_cut_nested_refuses_a_spec_needing_a_tensor_the_task_did_not_carry(deep_family):
    torch.manual_seed(0)
    global_state = deep_family.build(SubmodelSpec(exits=deep_family.exit_points)).state_dict()
    received = {key: value.numpy() for key, value in
                deep_family.extract(global_state, L2, keys=deep_family.state_keys(L2)).items()}
    deeper = SubmodelSpec(width=0.5, rounding="floor", exits=(0, 1))  # L2's width, every block and the head
    with pytest.raises(ValueError, match="needs tensor 'conv3.weight', which the task did not carry"):
        cut_nested(received, deep_family.index_map(deeper), deep_family.state_keys(deeper))


def test_a_depthwise_hint_with_nested_teachers_is_an_invalid_task(family, task_plan):
    plan = task_plan(loss=(LossTerm.ce(), LossTerm.nested_kd(U(0.5).to_dict(), weight=10.0, tau=3.0)))
    with pytest.raises(ValueError, match="depth-wise adaptation cannot train a plan with nested_kd"):
        options(family, U(1.0), plan, Adaptation("depthwise"))
    assert options(family, U(1.0), replace(plan, loss=(LossTerm.ce(),)), Adaptation("depthwise"))


def test_a_depthwise_hint_with_ordered_dropout_is_an_invalid_task(family, task_plan):
    plan = replace(task_plan(loss=(LossTerm.ce(), LossTerm.width_kd())), widths=(1.0, 0.5))
    with pytest.raises(ValueError, match="depth-wise adaptation cannot train a plan with ordered dropout"):
        options(family, U(1.0), plan, Adaptation("depthwise"))
    assert options(family, U(1.0), plan, None)  # trained whole, it runs


# ---------------------------------------------------------------------------------------------- threads
def test_a_device_trains_the_sent_spec_with_fewer_threads_before_a_smaller_one(monkeypatch, make_task, plan):
    """Each further thread adds scratch to the CNN's weight gradients on 2x2 and 1x1 maps (AVX2's layouts, set
    here on any CPU): a 4-thread device whose memory affords the sent spec with fewer threads trains it so, with
    the most threads that fit; one that affords it with none trains the smaller level with all four."""
    monkeypatch.setattr("models.conv_workspace.channel_block", lambda: 8)
    monkeypatch.setattr("models.conv_workspace.X86_CPU", True)
    monkeypatch.setattr("models.memory._cache", {})
    family, ref = get_family("cnn", 10, 1), ModelRef("cnn", 10, 1, {})
    digits = DataShape(320, tuple(range(10)), 1, (8, 8))
    task = make_task(U(1.0), of=family, model=ref, adaptation=ladder((U(0.5), plan)))

    def decider(available: int) -> Decider:
        return Decider(DecisionRequest("cpu", "pooled", available, INITIAL_FACTOR, digits, threads=4))

    def need(spec: SubmodelSpec, threads: int) -> int:
        probe = decider(0)
        return probe.corrected(probe.raw_estimates(ref, [Option(spec, plan)], threads)[Option(spec, plan)])

    needs = {threads: need(U(1.0), threads) for threads in (1, 2, 3, 4)}
    assert needs[1] < needs[2] < needs[3] < needs[4]
    assert need(U(0.5), 4) < needs[1]

    decision, _ = decider(needs[4]).decide(task)  # enough for all four
    assert (decision.status, decision.threads, decision.reason) == ("ok", 0, None)

    decision, adapted = decider(needs[3] - 1).decide(task)
    assert (decision.status, decision.threads, adapted) == ("ok", 2, None)
    assert decision.estimate == needs[2] and decision.metrics["torch_threads"] == 2.0
    assert decision.reason == f"trained with 2 of 4 torch threads to fit {size_text(needs[3] - 1)}"

    decision, _ = decider(needs[1]).decide(task)
    assert (decision.status, decision.threads, decision.spec) == ("ok", 1, U(1.0).to_dict())

    decision, adapted = decider(needs[1] - 1).decide(task)  # the sent spec fits with no thread count
    assert (decision.status, decision.threads, decision.spec) == ("adapted", 0, U(0.5).to_dict())
    assert adapted is not None and "torch threads" not in decision.reason


def test_fedepth_decomposes_with_one_thread_where_more_leave_blocks_out(monkeypatch, make_task, plan):
    """A depth-wise task whose every block fits alone with one thread, not with four (the last blocks' weight
    gradients keep scratch per thread): the agent trains every block, one thread, rather than skip some."""
    monkeypatch.setattr("models.conv_workspace.channel_block", lambda: 8)
    monkeypatch.setattr("models.conv_workspace.X86_CPU", True)
    monkeypatch.setattr("models.memory._cache", {})
    family, ref = get_family("cnn", 10, 1), ModelRef("cnn", 10, 1, {})
    digits = DataShape(320, tuple(range(10)), 1, (8, 8))
    task = make_task(U(1.0), of=family, model=ref, adaptation=Adaptation("depthwise"))
    probe = Decider(DecisionRequest("cpu", "pooled", 0, INITIAL_FACTOR, digits, threads=4))
    stage = replace(plan, schedule=(Stage(plan.epochs, "skip", False, 0),))

    def need(block: int, threads: int) -> int:
        return probe.corrected(probe.raw_estimate(ref, replace(U(1.0), segments=((block, block + 1),)), stage,
                                                  threads))

    available = max(need(block, 1) for block in range(family.num_blocks))
    assert any(need(block, 4) > available for block in range(family.num_blocks))
    four = Decider(DecisionRequest("cpu", "pooled", available, INITIAL_FACTOR, digits, threads=4))
    assert shortfall(four.depthwise(ref, family, U(1.0), plan, "skip", available)) > (0, 0, 0)  # four skip some
    decision, _ = four.decide(task)
    assert decision.threads == 1 and decision.status == "adapted", decision.reason
    assert "skipped" not in decision.reason and decision.reason.endswith("with 1 of 4 torch threads")
