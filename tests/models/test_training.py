"""Tests for models.training: the training-plan interpreter (loss terms, label masks, stages, train)."""

from __future__ import annotations

import gc
import math
import re
from dataclasses import replace
from typing import Any, ClassVar

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from models import (
    FamilyNet,
    ModelFamily,
    SegmentModel,
    SubmodelSpec,
    TrainResult,
    estimate_plan_memory,
    get_family,
)
from models.training import (
    NestedTeachers,
    backward_step,
    check_plan,
    forward_loss,
    label_mask,
    loss_of,
    masked_cross_entropy,
    micro_batches,
    nested_teachers,
    stages,
    train,
)
from protocol.plan import LossTerm, OptimizerSettings, Recipe, Stage, TrainingPlan

Case = tuple[ModelFamily, tuple[int, int]]


def plan(*, epochs: int = 1, batch_size: int = 8, lr: float = 0.05, momentum: float = 0.9,
         weight_decay: float = 0.0, clip_norm: float | None = None, masked_ce: bool = False, seed: int = 0,
         loss: tuple[LossTerm, ...] | None = None, schedule: tuple[Stage, ...] = ()) -> TrainingPlan:
    return TrainingPlan(
        optimizer=OptimizerSettings(lr=lr, momentum=momentum, weight_decay=weight_decay, clip_norm=clip_norm),
        epochs=epochs, batch_size=batch_size, seed=seed,
        loss=(LossTerm.ce(masked=masked_ce),) if loss is None else loss, schedule=schedule,
    )


def separable_data(n: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Class 0: bright top half; class 1: bright bottom half (8x8, one channel)."""
    generator = torch.Generator().manual_seed(0)
    y = torch.arange(n) % 2
    x = torch.randn(n, 1, 8, 8, generator=generator) * 0.1
    x[y == 0, :, :4, :] += 1.0
    x[y == 1, :, 4:, :] += 1.0
    return x, y


def tiny_model(num_classes: int = 2) -> FamilyNet:
    torch.manual_seed(0)
    return get_family("cnn", num_classes, 1, hidden=(4, 8)).build(track_bn_stats=False)


FULL = SubmodelSpec()


def full_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.train()  # static BN: batch statistics, as in training
    with torch.no_grad():
        return float(nn.functional.cross_entropy(model(x), y))


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ---------------------------------------------------------------------------------------------- masked CE
def test_label_mask_marks_present_classes_and_ignores_out_of_range() -> None:
    mask = label_mask([0, 2, 2, 7, -1], 5)
    assert mask.dtype == torch.bool
    assert mask.tolist() == [True, False, True, False, False]
    assert label_mask([], 3).tolist() == [False, False, False]


def test_masked_cross_entropy_sets_absent_logits_to_zero() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 5) * 3
    targets = torch.tensor([0, 2, 3, 0, 2, 3])
    mask = torch.tensor([True, False, True, True, False])
    manual_logits = logits.clone()
    manual_logits[:, 1] = 0.0
    manual_logits[:, 4] = 0.0
    log_probs = manual_logits - torch.logsumexp(manual_logits, dim=1, keepdim=True)
    expected = -log_probs[torch.arange(6), targets].mean()
    got = masked_cross_entropy(logits, targets, mask)
    torch.testing.assert_close(got, expected)
    # zero, not -inf: absent classes still take probability mass
    minus_inf = nn.functional.cross_entropy(logits.masked_fill(~mask, float("-inf")), targets)
    assert not torch.isclose(got, minus_inf)


def test_masked_cross_entropy_with_all_classes_is_plain_cross_entropy() -> None:
    torch.manual_seed(1)
    logits, targets = torch.randn(4, 3), torch.tensor([0, 1, 2, 1])
    torch.testing.assert_close(masked_cross_entropy(logits, targets, torch.ones(3, dtype=torch.bool)),
                               nn.functional.cross_entropy(logits, targets))


def test_masked_cross_entropy_gives_no_gradient_to_absent_logits() -> None:
    logits = torch.randn(3, 4, requires_grad=True)
    masked_cross_entropy(logits, torch.tensor([0, 1, 0]), torch.tensor([True, True, False, False])).backward()
    assert logits.grad is not None
    assert torch.all(logits.grad[:, 2:] == 0) and torch.any(logits.grad[:, :2] != 0)


# ---------------------------------------------------------------------------------------------- loss terms
STUDENT = [[1.0, 2.0, 0.5], [0.0, -1.0, 1.5]]
TEACHER = [[2.0, 0.0, 1.0], [0.5, 0.5, -0.5]]


def _softmax(row: list[float], tau: float) -> list[float]:
    exps = [math.exp(v / tau) for v in row]
    return [e / sum(exps) for e in exps]


def test_loss_of_ce_and_kd_by_hand() -> None:
    tau = 2.0
    student = torch.tensor(STUDENT)
    teacher = torch.tensor(TEACHER)
    targets = torch.tensor([1, 2])
    terms = (LossTerm.ce(weight=0.5), LossTerm.kd(0, 1, weight=0.3, tau=tau))
    got = loss_of([student, teacher], targets, terms)
    # CE of the last output (the teacher here), by hand.
    ce = -sum(math.log(_softmax(row, 1.0)[t]) for row, t in zip(TEACHER, (1, 2))) / 2
    # tau^2 * KL(softmax(t / tau) || softmax(s / tau)), averaged over the batch, by hand.
    kl = 0.0
    for s_row, t_row in zip(STUDENT, TEACHER):
        p_t, p_s = _softmax(t_row, tau), _softmax(s_row, tau)
        kl += sum(pt * (math.log(pt) - math.log(ps)) for pt, ps in zip(p_t, p_s))
    kd = tau * tau * kl / 2
    assert kd > 0.1  # a real difference between the two distributions
    assert float(got) == pytest.approx(0.5 * ce + 0.3 * kd, rel=1e-6)
    # Each term alone, and the direction of the divergence (teacher || student, not the reverse).
    assert float(loss_of([student, teacher], targets, terms[1:])) == pytest.approx(0.3 * kd, rel=1e-6)
    reverse = loss_of([teacher, student], targets, (LossTerm.kd(1, 0, weight=1.0, tau=tau),))
    assert float(reverse) == pytest.approx(kd, rel=1e-6)
    swapped = loss_of([student, teacher], targets, (LossTerm.kd(1, 0, weight=1.0, tau=tau),))
    assert float(swapped) != pytest.approx(kd, rel=1e-3)


def test_kd_of_equal_outputs_is_zero_and_output_indices_may_be_negative() -> None:
    logits = torch.tensor(STUDENT)
    targets = torch.tensor([0, 1])
    assert float(loss_of([logits, logits], targets, (LossTerm.kd(-2, -1, weight=1.0, tau=3.0),))) == \
        pytest.approx(0.0, abs=1e-7)
    first = loss_of([logits, torch.tensor(TEACHER)], targets, (LossTerm.ce(output=0),))
    assert float(first) == pytest.approx(float(F.cross_entropy(logits, targets)))


@pytest.mark.parametrize("detach", [True, False])
def test_detach_teacher_stops_the_gradient_into_the_teacher(detach: bool) -> None:
    student = torch.tensor(STUDENT, requires_grad=True)
    teacher = torch.tensor(TEACHER, requires_grad=True)
    term = LossTerm.kd(0, 1, weight=1.0, tau=2.0, detach_teacher=detach)
    value = loss_of([student, teacher], torch.tensor([0, 1]), (term,))
    value.backward()
    assert student.grad is not None and float(student.grad.abs().sum()) > 0
    if detach:
        assert teacher.grad is None
    else:
        assert teacher.grad is not None and float(teacher.grad.abs().sum()) > 0
    other = loss_of([student, teacher], torch.tensor([0, 1]), (LossTerm.kd(0, 1, weight=1.0, tau=2.0,
                                                                           detach_teacher=not detach),))
    assert float(other.detach()) == pytest.approx(float(value.detach()))  # detaching changes the gradient, not the value


def test_masked_ce_term() -> None:
    torch.manual_seed(2)
    logits, targets = torch.randn(4, 5), torch.tensor([0, 2, 0, 2])
    mask = label_mask([0, 2], 5)
    got = loss_of([logits], targets, (LossTerm.ce(masked=True, weight=2.0),), mask)
    torch.testing.assert_close(got, 2.0 * masked_cross_entropy(logits, targets, mask))
    assert not torch.isclose(got, 2.0 * F.cross_entropy(logits, targets))
    with pytest.raises(ValueError, match="needs the local label mask"):
        loss_of([logits], targets, (LossTerm.ce(masked=True),))
    # An unmasked term ignores the mask.
    torch.testing.assert_close(loss_of([logits], targets, (LossTerm.ce(),), mask), F.cross_entropy(logits, targets))


@pytest.mark.parametrize(
    "term",
    [LossTerm.ce(output=1), LossTerm.ce(output=-2), LossTerm.kd(0, 1, weight=1.0, tau=1.0),
     LossTerm.kd(-2, -1, weight=1.0, tau=1.0)],
    ids=["ce-1", "ce--2", "kd-teacher-1", "kd-student--2"],
)
def test_a_term_reading_a_missing_output_is_an_error(term: LossTerm) -> None:
    with pytest.raises(ValueError, match=r"reads output -?\d, but the model has 1 output"):
        loss_of([torch.randn(2, 3)], torch.tensor([0, 1]), (term,))


def test_forward_loss_reads_every_output_of_the_model() -> None:
    family = get_family("cnn", 3, 1, hidden=(4, 8, 8))
    torch.manual_seed(0)
    model = family.build(SubmodelSpec(exits=(0, 1)), track_bn_stats=False)
    x, y = torch.randn(4, 1, 8, 8), torch.tensor([0, 1, 2, 0])
    terms = (LossTerm.ce(output=0), LossTerm.kd(1, -1, weight=0.5, tau=3.0), LossTerm.ce())
    outputs = model.forward_exits(x)
    assert len(outputs) == 3
    torch.testing.assert_close(forward_loss(model, x, y, terms), loss_of(outputs, y, terms))
    with pytest.raises(ValueError, match="reads output -4, but the model has 3 output"):
        forward_loss(model, x, y, (LossTerm.ce(output=-4),))
    with pytest.raises(ValueError, match="reads output 1, but the model has 1 output"):
        forward_loss(family.build(track_bn_stats=False), x, y, (LossTerm.kd(0, 1, weight=1.0, tau=1.0),))


def test_loss_needs_known_terms() -> None:
    with pytest.raises(ValueError, match="at least one loss term"):
        loss_of([torch.randn(2, 3)], torch.tensor([0, 1]), ())
    with pytest.raises(ValueError, match="unknown loss term kind 'mse'"):
        loss_of([torch.randn(2, 3)], torch.tensor([0, 1]), (LossTerm("mse"),))


# ---------------------------------------------------------------------------------------------- stages
def test_stages() -> None:
    p = plan(epochs=3)
    assert stages(FULL, p) == [(None, Stage(epochs=3))]
    spec = SubmodelSpec(segments=((2, 4), (0, 2)))
    assert stages(spec, p) == [((2, 4), Stage(epochs=3)), ((0, 2), Stage(epochs=3))]
    schedule = (Stage(epochs=1, route="exit"), Stage(epochs=2))
    assert stages(spec, plan(schedule=schedule)) == [((2, 4), schedule[0]), ((0, 2), schedule[1])]


def test_stages_must_fit_the_segments() -> None:
    with pytest.raises(ValueError, match="schedules depth-wise stages, but the spec trains the whole model"):
        stages(FULL, plan(schedule=(Stage(),)))
    spec = SubmodelSpec(segments=((0, 1), (1, 2)))
    with pytest.raises(ValueError, match=r"schedules 1 stage\(s\) for the spec's 2 segment\(s\)"):
        stages(spec, plan(schedule=(Stage(),)))
    with pytest.raises(ValueError, match=r"schedules 3 stage\(s\) for the spec's 2 segment\(s\)"):
        stages(spec, plan(schedule=(Stage(),) * 3))
    with pytest.raises(ValueError, match="schedules"):
        train(tiny_model(), FULL, *separable_data(8), plan(schedule=(Stage(),)), labels=[0, 1], num_classes=2)


def test_check_plan() -> None:
    family = get_family("cnn", 3, 1, hidden=(4, 8, 8))
    two_outputs = SubmodelSpec(exits=(1,))
    distil = plan(loss=(LossTerm.ce(output=0), LossTerm.ce(output=1), LossTerm.kd(0, 1, weight=0.1, tau=3.0)))
    check_plan(family, two_outputs, distil)
    check_plan(family, SubmodelSpec(depth=2, exits=(0, 1)), distil)  # two exits, the last one the output
    check_plan(family, FULL, plan())
    with pytest.raises(ValueError, match=r"reads 2 output\(s\), but width=1 has 1"):
        check_plan(family, FULL, distil)
    with pytest.raises(ValueError, match=r"reads 3 output\(s\)"):
        check_plan(family, two_outputs, plan(loss=(LossTerm.ce(output=-3),)))
    with pytest.raises(ValueError, match=r"reads 3 output\(s\)"):
        check_plan(family, two_outputs, plan(loss=(LossTerm.ce(output=2),)))
    # A depth-wise stage has one output, whatever exits the spec has.
    segments = SubmodelSpec(exits=(0, 1), segments=((0, 1), (1, 3)))
    check_plan(family, segments, plan())
    with pytest.raises(ValueError, match=r"reads 2 output\(s\), but a depth-wise stage has 1"):
        check_plan(family, segments, distil)
    with pytest.raises(ValueError, match="schedules"):
        check_plan(family, segments, plan(schedule=(Stage(),)))
    with pytest.raises(ValueError, match="exceeds"):
        check_plan(family, SubmodelSpec(depth=9), plan())


# ---------------------------------------------------------------------------------------------- train
def test_train_reduces_loss_on_separable_problem() -> None:
    x, y = separable_data()
    model = tiny_model()
    before = full_loss(model, x, y)
    result = train(model, FULL, x, y, plan(epochs=15, lr=0.1), labels=[0, 1], num_classes=2)
    after = full_loss(model, x, y)
    assert isinstance(result, TrainResult)
    assert after < 0.5 * before
    assert result.steps == 15 * 4 and result.samples == 15 * 32 and result.stages == 1
    assert math.isfinite(result.loss) and result.seconds >= 0
    assert model.training


def test_train_with_masked_ce_also_learns() -> None:
    x, y = separable_data()
    model = get_family("cnn", 5, 1, hidden=(4, 8)).build(track_bn_stats=False)
    result = train(model, FULL, x, y, plan(epochs=10, lr=0.1, masked_ce=True), labels=[0, 1], num_classes=5)
    with torch.no_grad():
        predictions = model(x).argmax(1)
    assert math.isfinite(result.loss)
    assert float((predictions == y).float().mean()) > 0.9


def test_train_plan_from_a_recipe_is_the_same_run() -> None:
    x, y = separable_data(16)
    recipe = Recipe(epochs=2, batch_size=8, lr=0.05, momentum=0.9, weight_decay=5e-4, clip_norm=1.0,
                    masked_ce=True, seed=4)
    models = [tiny_model(), tiny_model()]
    train(models[0], FULL, x, y, TrainingPlan.from_recipe(recipe), labels=[0, 1], num_classes=2)
    train(models[1], FULL, x, y, plan(epochs=2, weight_decay=5e-4, clip_norm=1.0, masked_ce=True, seed=4),
          labels=[0, 1], num_classes=2)
    for key, value in models[0].state_dict().items():
        torch.testing.assert_close(value, models[1].state_dict()[key])


def test_train_is_deterministic_for_a_seed() -> None:
    x, y = separable_data()
    states = []
    for _ in range(2):
        model = tiny_model()
        train(model, FULL, x, y, plan(epochs=2, seed=5), labels=[0, 1], num_classes=2)
        states.append(model.state_dict())
    for key in states[0]:
        torch.testing.assert_close(states[0][key], states[1][key])
    other = tiny_model()
    train(other, FULL, x, y, plan(epochs=2, seed=6), labels=[0, 1], num_classes=2)
    assert any(not torch.equal(states[0][k], v) for k, v in other.state_dict().items())


def test_train_skips_trailing_single_sample_batch() -> None:
    x, y = separable_data(9)
    result = train(tiny_model(), FULL, x, y, plan(batch_size=4), labels=[0, 1], num_classes=2)
    assert result.steps == 2 and result.samples == 8


def test_train_reports_the_sample_weighted_mean_loss() -> None:
    """With a zero learning rate nothing changes, so the reported loss can be recomputed batch by batch."""
    x, y = separable_data(10)
    model = tiny_model()
    before = _snapshot(model)
    result = train(model, FULL, x, y, plan(batch_size=4, lr=0.0, momentum=0.0, seed=3), labels=[0, 1],
                   num_classes=2)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    order = torch.randperm(10, generator=torch.Generator().manual_seed(3))
    batches = [order[i:i + 4] for i in range(0, 10, 4)]
    with torch.no_grad():
        losses = [float(F.cross_entropy(model(x[b]), y[b])) * len(b) for b in batches]
    assert [len(b) for b in batches] == [4, 4, 2]
    assert result.loss == pytest.approx(sum(losses) / 10, rel=1e-5)
    assert result.steps == 3 and result.samples == 10


@pytest.mark.parametrize("clip_norm", [0.01, 0.5])
def test_train_clips_gradients_to_clip_norm(monkeypatch: pytest.MonkeyPatch, clip_norm: float) -> None:
    original = nn.utils.clip_grad_norm_
    calls: list[float] = []

    def spy(parameters: Any, max_norm: float, *args: Any, **kwargs: Any) -> torch.Tensor:
        parameters = list(parameters)
        calls.append(max_norm)
        total = original(parameters, max_norm, *args, **kwargs)
        clipped = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in parameters if p.grad is not None]))
        assert float(clipped) <= max_norm * 1.01 + 1e-6
        return total

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", spy)
    x, y = separable_data(16)
    result = train(tiny_model(), FULL, x, y, plan(epochs=2, clip_norm=clip_norm), labels=[0, 1], num_classes=2)
    assert calls == [clip_norm] * result.steps
    assert result.steps == 4


def test_train_does_not_clip_without_clip_norm(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[float] = []
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", lambda *a, **k: calls.append(1.0))
    x, y = separable_data(16)
    train(tiny_model(), FULL, x, y, plan(clip_norm=None), labels=[0, 1], num_classes=2)
    assert calls == []


def test_train_rejects_empty_data() -> None:
    with pytest.raises(ValueError, match="no local training data"):
        train(tiny_model(), FULL, torch.zeros(0, 1, 8, 8), torch.zeros(0, dtype=torch.long), plan(),
              labels=[], num_classes=2)


def test_train_raises_on_divergence() -> None:
    x, y = separable_data(8)
    x[0, 0, 0, 0] = float("nan")
    with pytest.raises(FloatingPointError, match="diverged"):
        train(tiny_model(), FULL, x, y, plan(), labels=[0, 1], num_classes=2)


def test_train_refuses_batch_size_one() -> None:
    """Static BN normalises with batch statistics: a batch of one cannot be trained, and the plan is refused."""
    x, y = separable_data(8)
    model = tiny_model()
    before = _snapshot(model)
    with pytest.raises(ValueError, match="batch_size must be at least 2"):
        train(model, FULL, x, y, plan(batch_size=1), labels=[0, 1], num_classes=2)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_train_with_exits_and_self_distillation_trains_every_head() -> None:
    family = get_family("cnn", 2, 1, hidden=(4, 8, 8))
    spec = SubmodelSpec(exits=(0, 1))
    torch.manual_seed(0)
    model = family.build(spec, track_bn_stats=False)
    before = _snapshot(model)
    x, y = separable_data(16)
    loss = (LossTerm.ce(weight=1 / 6, output=0), LossTerm.ce(weight=2 / 6, output=1), LossTerm.ce(weight=3 / 6),
            LossTerm.kd(0, -1, weight=0.1 / 6, tau=3.0), LossTerm.kd(1, -1, weight=0.2 / 6, tau=3.0))
    result = train(model, spec, x, y, plan(epochs=2, loss=loss, weight_decay=5e-4), labels=[0, 1],
                   num_classes=2)
    assert math.isfinite(result.loss) and result.stages == 1
    changed = {k for k, v in model.state_dict().items() if not torch.equal(before[k], v)}
    assert changed == set(family.trainable_keys(spec))
    assert {"exits.0.classifier.weight", "exits.1.classifier.weight", "classifier.weight"} <= changed


# ---------------------------------------------------------------------------------------------- depth-wise
class _Recorder(SegmentModel):
    made: ClassVar[list[tuple[int, int, str]]] = []

    def __init__(self, model: FamilyNet, start: int, stop: int, input_shape: tuple[int, ...],
                 route: str = "skip", *, frozen_input: bool = False) -> None:
        super().__init__(model, start, stop, input_shape, route, frozen_input=frozen_input)
        _Recorder.made.append((start, stop, route) + (("buffered",) if frozen_input else ()))


def test_train_runs_one_stage_per_segment(case: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    family, size = case
    n = family.num_blocks
    spec = SubmodelSpec(width=0.5, segments=((2, n), (0, 1)))  # block 1 stays frozen
    torch.manual_seed(0)
    model = family.build(spec, track_bn_stats=False)
    before = _snapshot(model)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(8, family.in_channels, *size, generator=generator)
    y = torch.arange(8) % family.num_classes
    _Recorder.made = []
    monkeypatch.setattr("models.training.SegmentModel", _Recorder)
    schedule = (Stage(epochs=1), Stage(epochs=2))
    result = train(model, spec, x, y, plan(batch_size=4, weight_decay=5e-4, schedule=schedule),
                   labels=list(range(family.num_classes)), num_classes=family.num_classes)
    assert _Recorder.made == [(2, n, "skip"), (0, 1, "skip")]  # in the spec's order
    assert result.stages == 2
    assert result.steps == (1 + 2) * 2 and result.samples == (1 + 2) * 8
    assert all(p.requires_grad for p in model.parameters())  # restored after the last stage
    after = model.state_dict()
    changed = {k for k in after if not torch.equal(before[k], after[k])}
    assert changed == set(family.trainable_keys(spec))
    frozen = {name for name, p in model.named_parameters()
              if any(p is q for q in model.blocks[1].parameters())}
    assert frozen and not frozen & changed
    assert set(family.state_keys(spec)) - changed == frozen


def test_train_exit_route_trains_the_exit_after_the_segment() -> None:
    family = get_family("cnn", 2, 1, hidden=(4, 8, 8))
    spec = SubmodelSpec(exits=(0,), segments=((0, 1), (1, 3)))
    torch.manual_seed(0)
    model = family.build(spec, track_bn_stats=False)
    before = _snapshot(model)
    x, y = separable_data(8)
    result = train(model, spec, x, y, plan(batch_size=4, weight_decay=5e-4, schedule=(Stage(route="exit"),
                                                                                      Stage())),
                   labels=[0, 1], num_classes=2)
    assert result.stages == 2
    changed = {k for k, v in model.state_dict().items() if not torch.equal(before[k], v)}
    assert changed == set(family.trainable_keys(spec)) == set(family.state_keys(spec))
    assert {"exits.0.classifier.weight", "conv1.weight", "conv3.weight", "classifier.weight"} <= changed


def test_train_restores_requires_grad_when_a_stage_fails() -> None:
    family = get_family("cnn", 2, 1, hidden=(4, 8))
    model = family.build(track_bn_stats=False)
    x, y = separable_data(8)
    x[:, :, 0, 0] = float("nan")
    with pytest.raises(FloatingPointError, match="diverged"):
        train(model, SubmodelSpec(segments=((1, 2),)), x, y, plan(batch_size=4), labels=[0, 1], num_classes=2)
    assert all(p.requires_grad for p in model.parameters())


def test_train_restores_requires_grad_when_the_optimizer_is_refused() -> None:
    """Whatever a stage fails on, the caller's model is not left frozen (here torch refuses the learning rate,
    after the stage's view has frozen the blocks outside its segment)."""
    model = get_family("cnn", 2, 1, hidden=(4, 8)).build(track_bn_stats=False)
    x, y = separable_data(8)
    with pytest.raises(ValueError, match="learning rate"):
        train(model, SubmodelSpec(segments=((1, 2),)), x, y, plan(batch_size=4, lr=-0.1), labels=[0, 1],
              num_classes=2)
    assert all(p.requires_grad for p in model.parameters())


def test_frozen_blocks_get_no_optimizer_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each stage's optimizer holds exactly the parameters that stage trains."""
    family = get_family("cnn", 2, 1, hidden=(4, 8, 8))
    spec = SubmodelSpec(segments=((0, 1), (2, 3)))
    torch.manual_seed(0)
    model = family.build(spec, track_bn_stats=False)
    names = {id(p): name for name, p in model.named_parameters()}
    groups: list[set[str]] = []
    original = torch.optim.SGD

    def spy(params: Any, **kwargs: Any) -> torch.optim.Optimizer:
        params = list(params)
        groups.append({names[id(p)] for p in params})
        return original(params, **kwargs)

    monkeypatch.setattr(torch.optim, "SGD", spy)
    x, y = separable_data(8)
    train(model, spec, x, y, plan(batch_size=4), labels=[0, 1], num_classes=2)
    head = {"classifier.weight", "classifier.bias"}
    assert groups == [{"conv1.weight", "conv1.bias", "bn1.weight", "bn1.bias"} | head,
                      {"conv3.weight", "conv3.bias", "bn3.weight", "bn3.bias"} | head]


def test_train_takes_the_plans_optimizer_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[dict[str, Any]] = []
    original = torch.optim.SGD

    def spy(params: Any, **kwargs: Any) -> torch.optim.Optimizer:
        seen.append(kwargs)
        return original(params, **kwargs)

    monkeypatch.setattr(torch.optim, "SGD", spy)
    x, y = separable_data(8)
    train(tiny_model(), FULL, x, y, plan(lr=0.03, momentum=0.5, weight_decay=1e-3), labels=[0, 1], num_classes=2)
    assert seen == [{"lr": 0.03, "momentum": 0.5, "weight_decay": 1e-3}]


# ------------------------------------------------------------------------------------- copies (m-FeDepth)
MUTUAL = (LossTerm.ce(), LossTerm.mutual_kd(weight=1.0, tau=2.0))


def test_mutual_kd_by_hand_and_zero_without_peers() -> None:
    torch.manual_seed(0)
    own, peer_a, peer_b = (torch.randn(4, 3) for _ in range(3))
    targets = torch.tensor([0, 1, 2, 0])
    terms = (LossTerm.mutual_kd(weight=0.5, tau=2.0),)

    def kl(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
        p = F.softmax(teacher / 2.0, dim=1)
        return (p * (p.log() - F.log_softmax(student / 2.0, dim=1))).sum(dim=1).mean() * 4.0

    expected = 0.5 * (kl(own, peer_a) + kl(own, peer_b)) / 2
    assert torch.allclose(loss_of([own], targets, terms, peers=[[peer_a], [peer_b]]), expected)
    both = loss_of([own], targets, (LossTerm.ce(), *terms), peers=[[peer_a]])
    assert torch.allclose(both, F.cross_entropy(own, targets) + 0.5 * kl(own, peer_a))
    assert torch.allclose(loss_of([own], targets, (LossTerm.ce(), *terms)), F.cross_entropy(own, targets))


def test_backward_step_gives_each_copy_the_gradient_of_its_own_loss() -> None:
    x, y = separable_data(8)
    models = [tiny_model() for _ in range(3)]
    for index, model in enumerate(models):  # three different copies
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.1 * index)
        model.train()
    total = backward_step(models[0], x, y, MUTUAL, copies=models[1:])
    with torch.no_grad():
        outputs = [m(x) for m in models]
    for index, model in enumerate(models):
        reference = tiny_model()
        reference.load_state_dict(model.state_dict())
        reference.train()
        peers = [[o] for j, o in enumerate(outputs) if j != index]
        own_loss = loss_of([reference(x)], y, MUTUAL, peers=peers)
        own_loss.backward()
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            assert torch.allclose(p.grad, q.grad, atol=1e-6), (index, name)
    expected = sum(loss_of([o], y, MUTUAL, peers=[[p] for j, p in enumerate(outputs) if j != i])
                   for i, o in enumerate(outputs))
    assert torch.allclose(total, expected, atol=1e-6)


def test_train_with_copies_trains_all_of_them_and_reports_the_mean_loss() -> None:
    x, y = separable_data()
    model, others = tiny_model(), [tiny_model(), tiny_model()]
    with torch.no_grad():
        for index, other in enumerate(others, 1):
            for p in other.parameters():
                p.add_(0.05 * index)
    before = [_snapshot(m) for m in (model, *others)]
    mutual = replace(plan(epochs=3, lr=0.1, loss=MUTUAL), copies=3)
    result = train(model, FULL, x, y, mutual, labels=[0, 1], num_classes=2, copies=others)
    for m, snapshot in zip((model, *others), before):
        assert any(not torch.equal(v, snapshot[k]) for k, v in m.state_dict().items())
        assert all(p.grad is None for p in m.parameters())
    assert math.isfinite(result.loss) and result.steps == 3 * 4
    # Against one copy alone, the mutual term changes what the first copy learns.
    alone = tiny_model()
    train(alone, FULL, x, y, plan(epochs=3, lr=0.1, loss=MUTUAL), labels=[0, 1], num_classes=2)
    assert any(not torch.equal(v, alone.state_dict()[k]) for k, v in model.state_dict().items())
    with pytest.raises(ValueError, match="the plan trains 3 copies, 1 model"):
        train(tiny_model(), FULL, x, y, mutual, labels=[0, 1], num_classes=2)


def test_copies_are_trained_whole_only() -> None:
    family = get_family("cnn", 2, 1, hidden=(4, 8))
    mutual = replace(plan(loss=MUTUAL), copies=2)
    check_plan(family, FULL, mutual)
    with pytest.raises(ValueError, match="only a spec trained whole"):
        check_plan(family, SubmodelSpec(segments=((0, 1), (1, 2))), mutual)


def test_each_copy_is_clipped_on_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    original = nn.utils.clip_grad_norm_
    groups: list[int] = []

    def spy(parameters: Any, max_norm: float, *args: Any, **kwargs: Any) -> torch.Tensor:
        parameters = list(parameters)
        groups.append(len(parameters))
        return original(parameters, max_norm, *args, **kwargs)

    monkeypatch.setattr(nn.utils, "clip_grad_norm_", spy)
    x, y = separable_data(8)
    model, other = tiny_model(), tiny_model()
    train(model, FULL, x, y, replace(plan(loss=MUTUAL, clip_norm=0.1), copies=2), labels=[0, 1], num_classes=2,
          copies=[other])
    per_model = len(list(model.parameters()))
    assert groups == [per_model, per_model]  # one step (8 samples, batch 8): each copy's gradient on its own


def test_a_buffered_stage_trains_as_the_recomputed_one_when_a_batch_holds_all_the_data(case: Case,
                                                                                       monkeypatch) -> None:
    family, size = case
    n = family.num_blocks
    spec = SubmodelSpec(width=0.5, segments=((0, 1), (1, n)))
    x = torch.randn(8, family.in_channels, *size, generator=torch.Generator().manual_seed(2))
    y = torch.arange(8) % family.num_classes
    trained = {}
    _Recorder.made = []
    monkeypatch.setattr("models.training.SegmentModel", _Recorder)
    for cache in (False, True):
        torch.manual_seed(0)
        model = family.build(spec, track_bn_stats=False)
        # One batch of all 8 samples: the frozen blocks see the same batch statistics either way.
        schedule = (Stage(epochs=2, cache=cache), Stage(epochs=3, cache=cache))
        result = train(model, spec, x, y, plan(batch_size=8, schedule=schedule),
                       labels=list(range(family.num_classes)), num_classes=family.num_classes)
        assert result.steps == 5
        trained[cache] = model.state_dict()
    # The first stage has nothing frozen before it: only the second runs on buffered outputs.
    assert _Recorder.made == [(0, 1, "skip"), (1, n, "skip"), (0, 1, "skip"), (1, n, "skip", "buffered")]
    for key, value in trained[False].items():
        torch.testing.assert_close(trained[True][key], value, msg=key)


# ---------------------------------------------------------------------------------------------- micro-batches
@pytest.mark.parametrize(("size", "micro", "expected"), [
    (32, 0, [32]), (32, 32, [32]), (32, 64, [32]), (32, 16, [16, 16]), (32, 12, [11, 11, 10]), (9, 4, [3, 3, 3]),
    (5, 4, [3, 2]), (3, 2, [2]), (7, 2, [2, 2, 2]),
])  # fmt: skip
def test_micro_batches_split_a_batch_evenly_never_above_the_size_nor_of_one_sample(size: int, micro: int,
                                                                                   expected: list[int]) -> None:
    batch = torch.arange(size)
    parts = micro_batches(batch, micro)
    assert [len(part) for part in parts] == expected
    torch.testing.assert_close(torch.cat(parts), batch[:sum(expected)])  # a single trailing sample is left out
    for size_, micro_ in ((n, m) for n in range(2, 70) for m in range(2, 40)):  # by construction, everywhere
        sizes = [len(part) for part in micro_batches(torch.arange(size_), micro_)]
        assert all(2 <= s <= max(micro_, 2) for s in sizes) and sum(sizes) >= size_ - 1, (size_, micro_)


def test_accumulated_micro_batches_give_the_batch_gradient_where_their_statistics_are_the_batchs() -> None:
    # Two identical halves: each micro-batch has the batch's BN statistics, so the scaled, accumulated gradients
    # are the whole batch's.
    x, y = separable_data(4)
    x, y = torch.cat([x, x]), torch.cat([y, y])
    whole, micro = tiny_model(), tiny_model()
    whole.train()
    micro.train()
    backward_step(whole, x, y, (LossTerm.ce(),))
    for part in (slice(0, 4), slice(4, 8)):
        backward_step(micro, x[part], y[part], (LossTerm.ce(),), scale=0.5)
    for (name, a), b in zip(whole.named_parameters(), micro.parameters()):
        assert a.grad is not None and b.grad is not None
        torch.testing.assert_close(b.grad, a.grad, msg=name)


def test_a_micro_batched_stage_steps_once_per_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    family = get_family("cnn", 2, 1, hidden=(4, 8))
    spec = SubmodelSpec(segments=((0, 1), (1, 2)))
    x, y = separable_data(32)
    seen: list[int] = []
    real = backward_step

    def counting(net, inputs, *args, **kwargs):
        seen.append(len(inputs))
        return real(net, inputs, *args, **kwargs)

    monkeypatch.setattr("models.training.backward_step", counting)
    torch.manual_seed(0)
    model = family.build(spec, track_bn_stats=False)
    result = train(model, spec, x, y, plan(batch_size=16, schedule=(Stage(micro_batch=4), Stage())),
                   labels=[0, 1], num_classes=2)
    assert result.steps == 4 and result.samples == 64  # two batches a stage, whatever the micro-batches
    assert seen == [4] * 8 + [16] * 2 and math.isfinite(result.loss)


def test_a_stage_starts_with_no_optimizer_state_of_the_stage_before() -> None:
    """What a stage's peak counts (the child resets its high-water mark at the stage's start, the estimator traces
    the stage alone) holds none of the previous stage's momentum: its optimizer is gone when the next starts."""
    family = get_family("cnn", 2, 1, hidden=(4, 8))
    spec = SubmodelSpec(segments=((0, 1), (1, 2)))
    alive: dict[tuple[int, str], int] = {}

    def on_stage(index: int, phase: str) -> None:
        gc.collect()
        alive[(index, phase)] = sum(1 for o in gc.get_objects() if issubclass(type(o), torch.optim.Optimizer))

    torch.manual_seed(0)
    model = family.build(spec, track_bn_stats=False)
    train(model, spec, *separable_data(32), plan(batch_size=16, epochs=2, schedule=(Stage(), Stage(cache=True))),
          labels=[0, 1], num_classes=2, on_stage=on_stage)
    assert alive == {(0, "start"): 0, (0, "end"): 0, (1, "start"): 0, (1, "end"): 0}


def test_a_micro_batched_stage_is_estimated_at_its_micro_batch_with_the_gradients_beside() -> None:
    family = get_family("cnn", 10, 1, hidden=(8, 16))
    spec = SubmodelSpec(segments=((0, 1),))

    def estimate(stage: Stage, batch_size: int = 64):
        return estimate_plan_memory(family, spec, plan(batch_size=batch_size, schedule=(stage,)), input_size=(28, 28))

    whole, micro, alone = estimate(Stage()), estimate(Stage(micro_batch=16)), estimate(Stage(), batch_size=16)
    assert micro.activations < whole.activations and micro.total < whole.total  # activations scale with the batch
    assert micro.parameters == whole.parameters and micro.gradients == whole.gradients
    assert micro.total >= alone.total  # a micro-batch of 16 costs at least a batch of 16: the gradients stay
    assert estimate(Stage(micro_batch=64)) == whole  # not below the batch: whole batches


# ------------------------------------------------------------------------------- nested teachers (FlexFL)
NESTED_FAMILY = get_family("cnn", 3, 1, hidden=(4, 6))
STUDENT_SPECS = {
    "full": SubmodelSpec(),
    "layer-widths": SubmodelSpec(layer_widths={"conv1": 0.75, "conv2": 1.0}, rounding="floor"),
}
TEACHER_SPEC = SubmodelSpec(layer_widths={"conv1": 0.5, "conv2": 0.5}, rounding="floor")  # 2 and 3 channels


def _nested_student(spec: SubmodelSpec) -> tuple[FamilyNet, dict[str, torch.Tensor]]:
    """A student at ``spec`` cut out of a fixed global model, and that global model's state."""
    torch.manual_seed(3)
    global_state = NESTED_FAMILY.build(track_bn_stats=False).state_dict()
    global_state["classifier.weight"] *= 10  # confident logits: the softened distributions differ visibly
    student = NESTED_FAMILY.build(spec, track_bn_stats=False)
    student.load_state_dict(NESTED_FAMILY.extract(global_state, spec, keys=NESTED_FAMILY.state_keys(spec)))
    return student, global_state


def _separate_teacher(student: FamilyNet, spec: SubmodelSpec, global_state: dict[str, torch.Tensor],
                      teacher_spec: SubmodelSpec = TEACHER_SPEC) -> FamilyNet:
    """The teacher built on its own, its weights extracted (a prefix of the student's, so of the global ones)."""
    keys = NESTED_FAMILY.state_keys(teacher_spec)
    source = student.state_dict() if spec.is_full else global_state
    teacher = NESTED_FAMILY.build(teacher_spec, track_bn_stats=False)
    teacher.load_state_dict(NESTED_FAMILY.extract(source, teacher_spec, keys=keys))
    return teacher.train()


def _kl_by_hand(student: torch.Tensor, teacher: torch.Tensor, tau: float) -> float:
    """``tau^2 * mean over the batch of KL(softmax(t / tau) || softmax(s / tau))`` with explicit formulas."""
    total = 0.0
    for s_row, t_row in zip(student.tolist(), teacher.tolist()):
        p_t, p_s = _softmax(t_row, tau), _softmax(s_row, tau)
        total += sum(pt * (math.log(pt) - math.log(ps)) for pt, ps in zip(p_t, p_s))
    return tau * tau * total / len(student.tolist())


@pytest.mark.parametrize("name", list(STUDENT_SPECS))
def test_nested_kd_by_hand(name: str) -> None:
    spec = STUDENT_SPECS[name]
    student, global_state = _nested_student(spec)
    teacher = _separate_teacher(student, spec, global_state)
    x, y = torch.randn(6, 1, 8, 8, generator=torch.Generator().manual_seed(1)), torch.tensor([0, 1, 2, 0, 1, 2])
    tau, weight = 3.0, 5.0
    term = LossTerm.nested_kd(TEACHER_SPEC.to_dict(), weight=weight, tau=tau)
    terms = (LossTerm.ce(), term)
    teachers = nested_teachers(NESTED_FAMILY, spec, terms, student)
    assert isinstance(teachers, NestedTeachers)
    with torch.no_grad():
        expected_teacher = teacher(x)
        logits = teachers(x)
        outputs = student.forward_exits(x)
    assert list(logits) == [term.teacher_spec]
    torch.testing.assert_close(logits[term.teacher_spec], expected_teacher)  # the prefix of the current weights
    kd = _kl_by_hand(outputs[-1], expected_teacher, tau)
    assert kd > 1e-3  # the teacher really differs from the student
    ce = float(F.cross_entropy(outputs[-1], y))
    got = loss_of(outputs, y, terms, teacher_logits=logits)
    assert float(got) == pytest.approx(ce + weight * kd, rel=1e-5)
    assert float(loss_of(outputs, y, (term,), teacher_logits=logits)) == pytest.approx(weight * kd, rel=1e-5)
    value = forward_loss(student, x, y, terms, teachers=teachers).detach()
    assert float(value) == pytest.approx(ce + weight * kd, rel=1e-5)
    student.zero_grad()
    assert float(backward_step(student, x, y, terms, teachers=teachers)) == pytest.approx(ce + weight * kd, rel=1e-5)
    with pytest.raises(ValueError, match="needs its teacher's logits"):
        loss_of(outputs, y, terms)


def test_no_gradient_flows_through_the_nested_teacher() -> None:
    spec = STUDENT_SPECS["layer-widths"]
    student, global_state = _nested_student(spec)
    reference, _ = _nested_student(spec)
    x, y = torch.randn(6, 1, 8, 8, generator=torch.Generator().manual_seed(2)), torch.tensor([0, 1, 2, 0, 1, 2])
    terms = (LossTerm.ce(), LossTerm.nested_kd(TEACHER_SPEC.to_dict(), weight=10.0, tau=3.0))
    order: list[str] = []
    teachers = nested_teachers(NESTED_FAMILY, spec, terms, student)
    assert teachers is not None

    def recording(inputs: torch.Tensor) -> Any:
        order.append("teachers")
        return teachers(inputs)

    student.conv1.register_forward_pre_hook(lambda *_: order.append("student"))
    backward_step(student, x, y, terms, teachers=recording)  # type: ignore[arg-type]
    assert order == ["teachers", "student"]  # the teachers' activations are gone before the student's exist
    # The same loss with the teacher's logits as a constant: the same gradients, so none went through the teacher.
    with torch.no_grad():
        fixed = _separate_teacher(reference, spec, global_state)(x)
    logits = reference(x)
    p_t = F.softmax(fixed / 3.0, dim=1)
    kl = (p_t * (p_t.log() - F.log_softmax(logits / 3.0, dim=1))).sum(dim=1).mean() * 9.0
    (F.cross_entropy(logits, y) + 10.0 * kl).backward()
    for (key, p), q in zip(student.named_parameters(), reference.parameters()):
        assert p.grad is not None and q.grad is not None
        torch.testing.assert_close(p.grad, q.grad, msg=key)
    assert all(p.grad is None for net in teachers.nets.values() for p in net.parameters())
    assert all(p.device.type == "meta" for net in teachers.nets.values() for p in net.parameters())  # no weights


def test_nested_teachers_are_built_once_per_distinct_spec_and_none_without_terms() -> None:
    spec = SubmodelSpec()
    model = NESTED_FAMILY.build(spec, track_bn_stats=False)
    half = SubmodelSpec.uniform(0.5)
    terms = (LossTerm.ce(), LossTerm.nested_kd(half.to_dict(), weight=1.0, tau=3.0, output=-1),
             LossTerm.nested_kd({"width": 0.5, "rounding": "ceil"}, weight=2.0, tau=1.0),  # the same spec
             LossTerm.nested_kd(SubmodelSpec.uniform(0.25).to_dict(), weight=1.0, tau=3.0))
    teachers = nested_teachers(NESTED_FAMILY, spec, terms, model)
    assert teachers is not None and list(teachers.nets) == [half, SubmodelSpec.uniform(0.25)]
    logits = teachers(torch.randn(4, 1, 8, 8))
    assert len(logits) == 3 and logits[terms[1].teacher_spec] is logits[terms[2].teacher_spec]
    assert all(value.shape == (4, 3) and not value.requires_grad for value in logits.values())
    assert nested_teachers(NESTED_FAMILY, spec, (LossTerm.ce(),), model) is None


def test_check_plan_refuses_nested_teachers_that_cannot_run() -> None:
    family = NESTED_FAMILY
    spec = SubmodelSpec(layer_widths={"conv1": 0.5, "conv2": 0.5})

    def nested(teacher: dict[str, Any], **changes: Any) -> TrainingPlan:
        return replace(plan(loss=(LossTerm.ce(), LossTerm.nested_kd(teacher, weight=1.0, tau=3.0))), **changes)

    check_plan(family, spec, nested({"width": 0.25}))
    check_plan(family, spec, nested(spec.to_dict()))  # the model itself is nested in itself
    refusals = [
        (spec, nested({"width": 2.0}), "a nested_kd teacher is not a valid spec of family 'cnn'"),
        (spec, nested({"layer_widths": {"conv9": 0.5}}), "unknown layer 'conv9'"),
        (spec, nested({"wide": 0.5}), "unknown sub-model spec key 'wide'"),
        (spec, nested({"width": 0.75}), "the nested_kd teacher width=0.75 is not nested in the trained spec"),
        (spec, nested({"layer_widths": {"conv2": 1.0}}), "is not nested"),
        (spec, nested({"width": 0.25}, copies=2), "nested_kd terms do not support"),
        (SubmodelSpec(width=0.5, segments=((0, 1), (1, 2))), nested({"width": 0.25}),
         "not supported in depth-wise training"),
        (spec, nested({"width": 0.25, "segments": [[0, 1]]}), "has segments"),
    ]
    for trained, bad, said in refusals:
        with pytest.raises(ValueError, match=re.escape(said)) as caught:
            check_plan(family, trained, bad)
        assert str(caught.value).count(". ") == 0 and str(caught.value).endswith("."), str(caught.value)
    x, y = separable_data(8)
    model = family.build(spec, track_bn_stats=False)
    with pytest.raises(ValueError, match=r"needs the model family \(train\(\.\.\., family=\.\.\.\)\)"):
        train(model, spec, x, y, nested({"width": 0.25}), labels=[0, 1], num_classes=3)
    with pytest.raises(ValueError, match="is not nested"):
        train(model, spec, x, y, nested({"width": 0.75}), labels=[0, 1], num_classes=3, family=family)
    with pytest.raises(ValueError, match="not supported with copies"):
        backward_step(model, x, y, nested({"width": 0.25}).loss, copies=[model],
                      teachers=nested_teachers(family, spec, nested({"width": 0.25}).loss, model))


def test_train_with_nested_teachers_learns_and_distils() -> None:
    family = get_family("cnn", 2, 1, hidden=(4, 8))
    spec = SubmodelSpec(layer_widths={"conv1": 1.0, "conv2": 0.75}, rounding="floor")
    teacher_specs = [SubmodelSpec(layer_widths={"conv1": 0.5, "conv2": 0.5}, rounding="floor"),
                     SubmodelSpec(layer_widths={"conv1": 0.25, "conv2": 0.25}, rounding="floor")]
    terms = (LossTerm.ce(), *(LossTerm.nested_kd(t.to_dict(), weight=1.0, tau=3.0) for t in teacher_specs))
    wire = TrainingPlan.from_dict(plan(epochs=8, lr=0.05, loss=terms).to_dict())  # as the agent reads it
    x, y = separable_data()

    def built() -> FamilyNet:
        torch.manual_seed(0)
        return family.build(spec, track_bn_stats=False)

    model = built()
    teachers = nested_teachers(family, spec, wire.loss, model)
    model.train()
    with torch.no_grad():
        before = float(forward_loss(model, x, y, wire.loss, teachers=teachers))
    result = train(model, spec, x, y, wire, labels=[0, 1], num_classes=2, family=family)
    with torch.no_grad():
        after = float(forward_loss(model, x, y, wire.loss, teachers=teachers))
    assert math.isfinite(result.loss) and result.steps == 8 * 4
    assert after < 0.75 * before, (before, after)
    assert full_loss(model, x, y) < 0.5
    # The terms change what is learnt: CE alone ends elsewhere; a family given to a plan without them changes nothing.
    alone, also = built(), built()
    train(alone, spec, x, y, plan(epochs=8, lr=0.05), labels=[0, 1], num_classes=2)
    train(also, spec, x, y, plan(epochs=8, lr=0.05), labels=[0, 1], num_classes=2, family=family)
    assert any(not torch.equal(v, alone.state_dict()[k]) for k, v in model.state_dict().items())
    assert all(torch.equal(v, alone.state_dict()[k]) for k, v in also.state_dict().items())



def test_a_vgg_teacher_runs_without_dropout_and_leaves_the_random_stream_alone() -> None:
    family = get_family("vgg11", 3, 1, config=(4, "M", 8, "M", 8, "M"), head=(16, 16), dropout=0.5)
    spec, teacher_spec = SubmodelSpec.full(), SubmodelSpec(layer_widths={"conv2": 0.5, "fc1": 0.5})
    torch.manual_seed(0)
    student = family.build(spec, track_bn_stats=False)
    term = LossTerm.nested_kd(teacher_spec.to_dict(), weight=1.0, tau=3.0)
    teachers = nested_teachers(family, spec, (LossTerm.ce(), term), student)
    assert teachers is not None
    x = torch.randn(6, 1, 8, 8, generator=torch.Generator().manual_seed(2))
    torch.manual_seed(5)
    first = teachers(x)[term.teacher_spec]
    after_first = torch.rand(1)
    torch.manual_seed(5)
    second = teachers(x)[term.teacher_spec]
    assert torch.equal(first, second)  # no dropout mask: the same target every time
    assert torch.equal(torch.rand(1), after_first)  # ... and no draw from the stream the student's dropout uses
    # The student itself still trains with dropout: two passes differ.
    assert not torch.equal(student(x), student(x))
