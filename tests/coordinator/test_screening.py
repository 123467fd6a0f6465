"""Screening updates before aggregation: the plan's reach (a bound no honest run exceeds, checked against real
training runs), like-with-like comparison per trained spec, non-finite weights."""

from __future__ import annotations

import math

import pytest
import torch

from coordinator.config import ScreeningConfig
from coordinator.screening import (
    REACH_TOLERANCE,
    change_of,
    local_noise_reach,
    momentum_reach,
    plan_steps,
    screen,
)
from coordinator.strategies import TaskPlan, TaskResult
from models import SubmodelSpec, get_family, train
from protocol import Adaptation, Candidate, OptimizerSettings, TrainingPlan, UpdateClip

SENT = {"w": torch.ones(4, 4), "b": torch.zeros(4)}  # norm 4
PLAN = TrainingPlan(optimizer=OptimizerSettings(lr=0.1, momentum=0.0, weight_decay=0.0, clip_norm=1.0), epochs=1,
                    batch_size=10)  # 10 samples: one step, reach 0.1 = the bound (no momentum, no weight decay)
LOOSE = TrainingPlan(optimizer=OptimizerSettings(lr=1.0, momentum=0.0, clip_norm=1.0), batch_size=10)


def result(agent: str, delta: float, *, spec: SubmodelSpec | None = None, samples: int = 10,
           plan: TrainingPlan = PLAN, adaptation: Adaptation | None = None) -> TaskResult:
    """An update that moved every element of ``w`` by ``delta`` (norm 4 |delta|)."""
    spec = spec or SubmodelSpec.full()
    task = TaskPlan(agent, "a", SubmodelSpec.full(), plan, "global", adaptation)
    return TaskResult(task, spec, {"w": SENT["w"] + delta, "b": SENT["b"].clone()}, {}, samples, [0])


def sent_of(_result: TaskResult) -> dict[str, torch.Tensor]:
    return SENT


def names(results: list[TaskResult]) -> list[str]:
    return [r.task.agent_id for r in results]


def test_momentum_builds_up_from_nothing_in_every_stage() -> None:
    assert momentum_reach(5, 0.0) == 5.0
    assert momentum_reach(1, 0.9) == pytest.approx(1.0)  # the first step: the gradient alone
    assert momentum_reach(2, 0.9) == pytest.approx(1.0 + 1.9)
    assert momentum_reach(3, 0.9) == pytest.approx(1.0 + 1.9 + 2.71)
    assert momentum_reach(1000, 0.9) < 1000 / (1 - 0.9)  # never the full 1 / (1 - beta) from the start


def test_change_reach_and_bound_by_hand() -> None:
    change = change_of({"w": SENT["w"] + 0.01, "b": SENT["b"]}, SENT, PLAN, [3])
    assert change.norm == pytest.approx(0.04) and change.steps == 3
    assert change.reach == pytest.approx(0.3) and change.bound == pytest.approx(0.3)  # lr R clip
    assert change.score == pytest.approx(0.04 / 0.3)
    assert change_of(SENT, SENT, PLAN, [2, 1]).reach == pytest.approx(0.3)  # stages add up
    with_momentum = TrainingPlan(optimizer=OptimizerSettings(lr=0.1, momentum=0.9, weight_decay=0.0, clip_norm=1.0))
    assert change_of(SENT, SENT, with_momentum, [2]).reach == pytest.approx(0.1 * 2.9)
    decayed = TrainingPlan(optimizer=OptimizerSettings(lr=0.1, momentum=0.0, weight_decay=0.5, clip_norm=1.0))
    # B = reach (clip + wd (|sent| + B)) with reach 0.3: B = 0.3 (1 + 0.5 * 4) / (1 - 0.15)
    assert change_of(SENT, SENT, decayed, [3]).bound == pytest.approx(0.3 * 3 / 0.85)
    unclipped = TrainingPlan(optimizer=OptimizerSettings(clip_norm=None))
    assert change_of(SENT, SENT, unclipped, [3]).bound is None
    broken = change_of({"w": SENT["w"] * math.nan}, SENT, PLAN, [1])
    assert math.isnan(broken.norm) and broken.as_dict()["norm"] is None  # standard JSON: no NaN


def test_plan_steps_count_every_batch_of_every_epoch() -> None:
    assert plan_steps(epochs=2, batch_size=32, samples=100) == 8
    assert plan_steps(epochs=1, batch_size=32, samples=0) == 1


@pytest.mark.parametrize(("spec", "clip"), [(SubmodelSpec.full(), 1.0), (SubmodelSpec.uniform(0.25), 1.0),
                                            (SubmodelSpec(segments=((0, 1), (1, 3))), 0.5),
                                            (SubmodelSpec(depth=2, exits=(0, 1)), 1.0)])
def test_no_real_training_run_moves_its_weights_beyond_the_bound(spec: SubmodelSpec, clip: float) -> None:
    # A learning rate far too large, momentum, weight decay and random labels: the run moves as far as it can.
    family = get_family("cnn", 10, 1, hidden=(4, 8, 8))
    plan = TrainingPlan(optimizer=OptimizerSettings(lr=0.5, momentum=0.9, weight_decay=5e-3, clip_norm=clip),
                        epochs=3, batch_size=8, seed=1)
    torch.manual_seed(0)
    model = family.build(spec, track_bn_stats=False)
    sent = {key: value.clone() for key, value in model.state_dict().items()}
    x, y = torch.randn(20, 1, 8, 8), torch.randint(0, 10, (20,))
    run = train(model, spec, x, y, plan, labels=list(range(10)), num_classes=10)
    keys = family.trainable_keys(spec)
    trained = {key: model.state_dict()[key] for key in keys}
    stages = len(spec.segments) if spec.segments else 1
    steps = plan_steps(plan.epochs, plan.batch_size, len(x))
    assert run.steps <= steps * stages
    change = change_of(trained, {key: sent[key] for key in keys}, plan, [steps] * stages)
    assert change.bound is not None and 0 < change.norm <= change.bound


def test_the_forged_update_of_the_fault_benchmark_exceeds_the_plan_reach() -> None:
    forged = TaskResult(TaskPlan("evil", "a", SubmodelSpec.full(), PLAN, "global"), SubmodelSpec.full(),
                        {key: value * -50 for key, value in SENT.items()}, {}, 10, [0])
    kept, rejected, _ = screen([result("a", 0.001), forged], sent_of, ScreeningConfig())
    assert names(kept) == ["a"]
    [(bad, reason)] = rejected
    assert bad is forged
    assert reason == ("update rejected: its change (norm 204) is 2040.0 times the most its training plan can move "
                      "the weights (0.1: 1 steps at lr 0.1, momentum 0, gradients clipped to 1)")


def test_alone_the_bound_still_applies() -> None:
    kept, rejected, changes = screen([result("a", 0.05)], sent_of, ScreeningConfig())  # norm 0.2 > 0.1
    assert kept == [] and "the most its training plan can move the weights" in rejected[0][1]
    assert changes[0].as_dict() == {"norm": pytest.approx(0.2), "steps": 1.0, "per_step": pytest.approx(2.0),
                                    "bound": pytest.approx(0.1)}


def test_more_samples_widen_the_reach() -> None:
    # 0.2 is twice what one step can do, and well within 3 steps' reach.
    assert screen([result("a", 0.05, samples=30)], sent_of, ScreeningConfig())[1] == []


def test_a_stage_per_segment_and_the_adaptation_candidates_count() -> None:
    depthwise = result("d", 0.05, spec=SubmodelSpec(segments=((0, 1), (1, 2), (2, 3))))
    assert screen([depthwise], sent_of, ScreeningConfig())[1] == []  # 3 stages: reach 0.3 >= 0.2
    longer = TrainingPlan(optimizer=PLAN.optimizer, epochs=3, batch_size=10)
    ladder = Adaptation("ladder", [Candidate(SubmodelSpec.uniform(0.5).to_dict(), longer)])
    assert screen([result("l", 0.05, adaptation=ladder)], sent_of, ScreeningConfig())[1] == []


def test_like_with_like_the_median_of_the_same_spec_is_the_yardstick() -> None:
    loose = LOOSE
    thin = SubmodelSpec.uniform(0.25)
    results = [result("f1", 0.001, plan=loose), result("f2", 0.0012, plan=loose), result("f3", 0.0011, plan=loose),
               # a thin slice moves much further than the full models: not their outlier, it has no peer
               result("t1", 0.1, spec=thin, plan=loose),
               # an outsized full-width update among full-width peers is
               result("f4", 0.02, plan=loose)]
    kept, rejected, _ = screen(results, sent_of, ScreeningConfig(max_ratio=10))
    assert names(kept) == ["f1", "f2", "f3", "t1"]
    [(bad, reason)] = rejected
    assert bad.task.agent_id == "f4"
    assert reason == ("update rejected: its change per step (0.08) is 18.2 times and its change (0.08) 18.2 times "
                      "the medians of the round's 3 other updates of width=1 (0.0044, 0.0044), both above "
                      "screening.max_ratio 10")


def test_an_update_beyond_its_reach_is_no_yardstick_for_the_others() -> None:
    # Blunt forgeries (beyond the reach) and a moderate one: were the blunt ones in the median, it would sit
    # between them and the honest, and the moderate one would pass.
    results = [result("h1", 0.001, plan=LOOSE), result("h2", 0.0012, plan=LOOSE), result("blunt1", 10.0, plan=LOOSE),
               result("blunt2", 11.0, plan=LOOSE), result("sly", 0.05, plan=LOOSE)]
    kept, rejected, _ = screen(results, sent_of, ScreeningConfig(max_ratio=10))
    assert names(kept) == ["h1", "h2"]
    assert [r.task.agent_id for r, _ in rejected] == ["blunt1", "blunt2", "sly"]


def test_too_few_peers_no_comparison() -> None:
    loose = LOOSE
    pair = [result("a", 0.001, plan=loose), result("b", 0.05, plan=loose)]
    assert screen(pair, sent_of, ScreeningConfig())[1] == []  # one peer each: min_peers is 2
    assert names(screen(pair, sent_of, ScreeningConfig(min_peers=1))[0]) == ["a"]


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_a_non_finite_update_is_rejected_and_does_not_count_for_the_others(value: float) -> None:
    loose = LOOSE
    results = [result("a", 0.001, plan=loose), result("bad", value, plan=loose), result("b", 0.0012, plan=loose)]
    kept, rejected, _ = screen(results, sent_of, ScreeningConfig(min_peers=1))
    assert names(kept) == ["a", "b"]
    assert [(r.task.agent_id, why) for r, why in rejected] == [("bad", "update rejected: its weights are not finite")]


def test_disabled_screening_keeps_everything_and_still_measures() -> None:
    results = [result("a", 0.01), result("bad", math.nan)]
    kept, rejected, changes = screen(results, sent_of, ScreeningConfig(enabled=False))
    assert kept == results and rejected == [] and len(changes) == 2


@pytest.mark.parametrize("ratio", [1.0, 0.5, -3.0])
def test_max_ratio_must_be_above_one(ratio: float) -> None:
    with pytest.raises(ValueError, match="screening.max_ratio must be above 1"):
        ScreeningConfig(max_ratio=ratio).validate()


def test_min_peers_must_be_positive() -> None:
    with pytest.raises(ValueError, match="screening.min_peers must be at least 1"):
        ScreeningConfig(min_peers=0).validate()


def test_a_device_with_little_data_is_not_an_outlier_among_those_with_much() -> None:
    # 3 steps against 100: per step it moved far more (an honest change grows more slowly than its steps), in all
    # it moved less. Only an update beyond both medians is an outlier.
    many = [result(f"m{i}", 0.01 + 0.001 * i, plan=LOOSE, samples=1000) for i in range(3)]
    few = result("few", 0.005, plan=LOOSE, samples=30)
    kept, rejected, changes = screen([*many, few], sent_of, ScreeningConfig(max_ratio=10))
    assert changes[3].score > 10 * changes[0].score  # the per-step figure alone would have rejected it
    assert rejected == [] and names(kept) == ["m0", "m1", "m2", "few"]
    big = result("big", 0.2, plan=LOOSE, samples=1000)  # 20 times the others' change, with as many steps
    assert [r.task.agent_id for r, _ in screen([*many, big], sent_of, ScreeningConfig(max_ratio=10))[1]] == ["big"]


def test_an_update_that_used_its_whole_reach_passes_despite_rounding() -> None:
    # One clipped step without weight decay moves exactly lr * clip: float32 lands it a few parts per million
    # above (seen: 1.0000018 to 1.0000034 times the bound).
    sent = {"w": torch.randn(64, 64)}
    step = torch.randn(64, 64)
    step *= PLAN.optimizer.lr * PLAN.optimizer.clip_norm / step.norm()  # the clipped step: norm lr * clip
    task = TaskPlan("a", "a", SubmodelSpec.full(), PLAN, "global")

    def moved(factor: float) -> TaskResult:
        return TaskResult(task, SubmodelSpec.full(), {"w": sent["w"] - factor * step}, {}, 10, [0])

    assert change_of(moved(1.0).state, sent, PLAN, [1]).norm == pytest.approx(0.1, rel=1e-5)  # the bound
    assert screen([moved(1 + 5e-6)], lambda _r: sent, ScreeningConfig())[1] == []
    assert len(screen([moved(1 + 10 * REACH_TOLERANCE)], lambda _r: sent, ScreeningConfig())[1]) == 1


def test_the_reach_leaves_room_for_the_noise_a_device_adds_under_local_privacy() -> None:
    state = {"w": torch.zeros(100), "n": torch.zeros(1, dtype=torch.long)}  # counters are not noised
    task = TaskPlan("a", "a", SubmodelSpec(), TrainingPlan(update_clip=UpdateClip(0.5, noise_multiplier=2.0)))
    result = TaskResult(task, SubmodelSpec(), state, {}, 1, [0])
    assert local_noise_reach(result) == pytest.approx(2.0 * 0.5 * (math.sqrt(100) + 5))
    for plan in (TrainingPlan(), TrainingPlan(update_clip=UpdateClip(0.5))):  # no noise of the device's own
        assert local_noise_reach(TaskResult(TaskPlan("a", "a", SubmodelSpec(), plan), SubmodelSpec(), state, {}, 1,
                                            [0])) == 0.0
