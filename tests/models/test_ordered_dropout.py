"""Ordered dropout (FjORD) in the training-plan interpreter: the per-batch width draw, the D-KD step against a
hand-computed gradient, plans it refuses, and the estimator's count."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest
import torch
from torch.nn import functional as F

from models import SubmodelSpec, get_family
from models.memory import estimate_plan_memory
from models.training import OrderedDropout, WidthNet, check_plan, ordered_dropout_step, train, width_spec
from protocol import LossTerm, TrainingPlan

FAMILY = get_family("cnn", 5, 1, hidden=[4, 8])
FULL = SubmodelSpec.full()


def test_each_batch_draws_a_width_uniformly_from_the_plans_widths():
    student = FAMILY.build(FULL, track_bn_stats=False)
    dropout = OrderedDropout(FAMILY, FULL, (1.0, 0.75, 0.5, 0.25), student, seed=3)
    draws = Counter(1.0 if net is None else net.width for net in (dropout.draw() for _ in range(8000)))
    assert set(draws) == {1.0, 0.75, 0.5, 0.25}
    assert all(abs(count / 8000 - 0.25) < 0.02 for count in draws.values()), draws  # 4 sigma is 0.019
    # The spec's own width is the student itself; a narrower one a sub-model of the width's shapes.
    assert dropout.nets[1.0] is None and dropout.widest_narrower() is dropout.nets[0.75]


def test_draws_are_seeded():
    student = FAMILY.build(FULL, track_bn_stats=False)

    def widths(seed: int) -> list[float]:
        dropout = OrderedDropout(FAMILY, FULL, (1.0, 0.5, 0.25), student, seed=seed)
        return [1.0 if net is None else net.width for net in (dropout.draw() for _ in range(40))]

    assert widths(5) == widths(5) and widths(5) != widths(6)


def _narrowed(student: torch.nn.Module, width: float) -> torch.nn.Module:
    """The width's sub-model as a separate model holding copies of the student's leading slices."""
    model = FAMILY.build(width_spec(FAMILY, FULL, width), track_bn_stats=False).train()
    keys = list(model.state_dict())
    model.load_state_dict(FAMILY.extract(student.state_dict(), width_spec(FAMILY, FULL, width), keys=keys))
    return model


def _half_step(seed: int) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor, WidthNet]:
    """A whole student, a batch and the student's half width (as ordered dropout runs it)."""
    torch.manual_seed(seed)
    student = FAMILY.build(FULL, track_bn_stats=False).train()
    x, y = torch.randn(6, 1, 8, 8), torch.tensor([0, 1, 2, 3, 4, 0])
    with torch.device("meta"):
        net = FAMILY.build(width_spec(FAMILY, FULL, 0.5), track_bn_stats=False).train()
    return student, x, y, WidthNet(student, net, 0.5)


def test_the_distillation_step_matches_the_papers_d_kd_by_hand():
    student, x, y, half_width = _half_step(0)
    loss = ordered_dropout_step(student, x, y, (LossTerm.ce(), LossTerm.width_kd(tau=1.0)), None, half_width)

    # By hand: CE of the whole model on the labels, then KL(p_whole || p_half) with the whole model's prediction
    # fixed, each backpropagated into the weights it reads (the half model's into the leading slices).
    reference = FAMILY.build(FULL, track_bn_stats=False).train()
    reference.load_state_dict(student.state_dict())
    half = _narrowed(reference, 0.5)
    whole = reference(x)
    ce = F.cross_entropy(whole, y)
    p = torch.softmax(whole.detach(), dim=1)
    kl = (p * (torch.log(p) - torch.log_softmax(half(x), dim=1))).sum(dim=1).mean()
    assert torch.allclose(loss, ce.detach() + kl.detach(), atol=1e-6)
    ce.backward()
    kl.backward()
    half_grads = dict(half.named_parameters())
    for name, parameter in student.named_parameters():
        expected = dict(reference.named_parameters())[name].grad.clone()
        region = expected
        for dim, size in enumerate(half_grads[name].shape):
            region = region.narrow(dim, 0, size)
        region += half_grads[name].grad
        assert torch.allclose(parameter.grad, expected, atol=1e-6), name


def test_without_distillation_the_drawn_width_alone_trains_on_the_labels():
    student, x, y, half_width = _half_step(1)
    ordered_dropout_step(student, x, y, (LossTerm.ce(),), None, half_width)
    half = _narrowed(student, 0.5)
    F.cross_entropy(half(x), y).backward()
    for name, parameter in student.named_parameters():
        shape = dict(half.named_parameters())[name].shape
        inside = parameter.grad
        for dim, size in enumerate(shape):
            inside = inside.narrow(dim, 0, size)
        assert torch.allclose(inside, dict(half.named_parameters())[name].grad, atol=1e-6), name
        assert inside.abs().sum() == pytest.approx(parameter.grad.abs().sum().item())  # nothing outside the prefix


def test_train_runs_ordered_dropout_and_is_reproducible():
    x, y = torch.randn(40, 1, 8, 8), torch.randint(0, 5, (40,))
    plan = TrainingPlan(batch_size=8, epochs=2, seed=4, loss=(LossTerm.ce(), LossTerm.width_kd()),
                        widths=(1.0, 0.5, 0.25))

    def run() -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        model = FAMILY.build(FULL, track_bn_stats=False)
        result = train(model, FULL, x, y, plan, labels=list(range(5)), num_classes=5, family=FAMILY)
        assert result.steps == 10 and result.samples == 80
        return {key: value.clone() for key, value in model.state_dict().items()}

    first, second = run(), run()
    assert all(torch.equal(first[key], second[key]) for key in first)
    torch.manual_seed(0)
    whole = FAMILY.build(FULL, track_bn_stats=False)
    train(whole, FULL, x, y, replace(plan, widths=(1.0,), loss=(LossTerm.ce(),)), labels=list(range(5)),
          num_classes=5, family=FAMILY)  # the same batches, the whole model alone: other weights
    assert not all(torch.equal(first[key], value) for key, value in whole.state_dict().items())
    with pytest.raises(ValueError, match="needs the model family"):
        train(FAMILY.build(FULL, track_bn_stats=False), FULL, x, y, plan, labels=[0], num_classes=5)


def test_plans_ordered_dropout_cannot_run_are_refused():
    plan = TrainingPlan(loss=(LossTerm.ce(), LossTerm.width_kd()), widths=(0.5, 0.25))
    check_plan(FAMILY, SubmodelSpec.uniform(0.5), plan)
    with pytest.raises(ValueError, match="not nested in the trained spec"):
        check_plan(FAMILY, SubmodelSpec.uniform(0.25), plan)
    with pytest.raises(ValueError, match="need the plan's widths"):
        check_plan(FAMILY, FULL, replace(plan, widths=()))
    with pytest.raises(ValueError, match="one copy of a spec trained whole"):
        check_plan(FAMILY, FULL, replace(plan, copies=2))


def test_the_estimate_counts_the_second_pass_beside_the_first_ones_gradients():
    family = get_family("cnn", 10, 1, hidden=[16, 32])
    plain = TrainingPlan(batch_size=16)
    distilled = TrainingPlan(batch_size=16, loss=(LossTerm.ce(), LossTerm.width_kd()), widths=(1.0, 0.8, 0.2))
    alone = TrainingPlan(batch_size=16, widths=(1.0, 0.8, 0.2))
    base = estimate_plan_memory(family, FULL, plain, input_size=(8, 8))
    # Without distillation a batch trains one width, the spec's the largest: the spec alone is the estimate.
    assert estimate_plan_memory(family, FULL, alone, input_size=(8, 8)) == base
    # With it the second pass (at 0.8) runs beside the full gradients: never less than the spec's own pass.
    assert estimate_plan_memory(family, FULL, distilled, input_size=(8, 8)).total >= base.total
    # Where the gradients outweigh the activations (wide layers, two samples), that second pass is the peak.
    wide = get_family("cnn", 10, 1, hidden=[64, 256])
    tiny, tiny_distilled = replace(plain, batch_size=2), replace(distilled, batch_size=2)
    assert (estimate_plan_memory(wide, FULL, tiny_distilled, input_size=(8, 8)).total
            > estimate_plan_memory(wide, FULL, tiny, input_size=(8, 8)).total)
