"""The training-plan interpreter: one pure-torch implementation of a :class:`protocol.TrainingPlan`.

It runs wherever training happens or is predicted: the agent's training child and its warm-up step, the memory
estimator (which traces :func:`forward_loss` on meta tensors, so exits, teachers and stages are counted) and the
coordinator's own training on server data. A plan says nothing about the paper it comes from.

A run is a sequence of stages: one stage training the whole sub-model for ``plan.epochs`` epochs, or, for a
spec with segments, one per segment in order (:class:`models.depthwise.SegmentModel`), each for its
``plan.schedule`` entry's epochs. Every stage makes its own SGD optimizer over the parameters it trains, so
momentum does not leak from one segment into the next, and starts from the weights the previous stage left.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from models.depthwise import SegmentModel
from models.family import ModelFamily
from models.net import FamilyNet
from models.spec import SubmodelSpec
from protocol.plan import LossTerm, Stage, TrainingPlan

__all__ = ["TrainResult", "check_plan", "forward_loss", "label_mask", "loss_of", "masked_cross_entropy", "stages", "train"]


@dataclass(frozen=True)
class TrainResult:
    """What a local training run reports back (``loss`` is the sample-weighted mean over all stages)."""

    loss: float
    steps: int
    samples: int
    seconds: float
    stages: int = 1


def label_mask(labels: Sequence[int], num_classes: int) -> torch.Tensor:
    """Boolean vector of the classes present in the local data."""
    mask = torch.zeros(num_classes, dtype=torch.bool)
    mask[torch.as_tensor([label for label in labels if 0 <= label < num_classes], dtype=torch.long)] = True
    return mask


def masked_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """HeteroFL's masked cross-entropy: logits of classes absent locally are set to 0 (not -inf)."""
    return F.cross_entropy(logits.masked_fill(~mask, 0.0), targets)


def _output(outputs: Sequence[torch.Tensor], index: int) -> torch.Tensor:
    if not -len(outputs) <= index < len(outputs):
        raise ValueError(f"a loss term reads output {index}, but the model has {len(outputs)} output(s).")
    return outputs[index]


def loss_of(outputs: Sequence[torch.Tensor], targets: torch.Tensor, terms: Sequence[LossTerm],
            mask: torch.Tensor | None = None) -> torch.Tensor:
    """The weighted sum of ``terms`` over the model's ``outputs`` (see :mod:`protocol.plan` for each kind).

    ``kd`` is ``tau^2 * KL(softmax(t / tau) || softmax(s / tau))`` averaged over the batch (ScaleFL Eq. 5's
    ``L_KL(y_s, y_t)``); ``mask`` is the local label set, needed by masked cross-entropy terms.
    """
    total: torch.Tensor | None = None
    for term in terms:
        if term.kind == "ce":
            logits = _output(outputs, term.output)
            if term.masked:
                if mask is None:
                    raise ValueError("a masked cross-entropy term needs the local label mask.")
                value = masked_cross_entropy(logits, targets, mask)
            else:
                value = F.cross_entropy(logits, targets)
        elif term.kind == "kd":
            assert term.teacher is not None and term.tau is not None
            student, teacher = _output(outputs, term.output), _output(outputs, term.teacher)
            if term.detach_teacher:
                teacher = teacher.detach()
            tau = term.tau
            value = F.kl_div(F.log_softmax(student / tau, dim=1), F.log_softmax(teacher / tau, dim=1),
                             reduction="batchmean", log_target=True) * (tau * tau)
        else:
            raise ValueError(f"unknown loss term kind {term.kind!r}.")
        weighted = value * term.weight
        total = weighted if total is None else total + weighted
    if total is None:
        raise ValueError("a training plan needs at least one loss term.")
    return total


def forward_loss(net: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, terms: Sequence[LossTerm],
                 mask: torch.Tensor | None = None) -> torch.Tensor:
    """One forward pass of ``net`` (a :class:`FamilyNet` or :class:`SegmentModel`) over every output the model
    has, and the plan's loss: the part of a training step the estimator traces too."""
    outputs = net.forward_exits(inputs)  # type: ignore[operator]
    return loss_of(outputs, targets, terms, mask)


def stages(spec: SubmodelSpec, plan: TrainingPlan) -> list[tuple[tuple[int, int] | None, Stage]]:
    """The stages a plan runs on ``spec``: ``(segment or None, stage settings)`` in order.

    Raises ``ValueError`` when the schedule does not fit the spec (one entry per segment, or none).
    """
    if spec.segments is None:
        if plan.schedule:
            raise ValueError("the plan schedules depth-wise stages, but the spec trains the whole model at once.")
        return [(None, Stage(epochs=plan.epochs))]
    schedule = plan.schedule or tuple(Stage(epochs=plan.epochs) for _ in spec.segments)
    if len(schedule) != len(spec.segments):
        raise ValueError(f"the plan schedules {len(schedule)} stage(s) for the spec's {len(spec.segments)} "
                         "segment(s).")
    return list(zip(spec.segments, schedule))


def check_plan(family: ModelFamily, spec: SubmodelSpec, plan: TrainingPlan) -> None:
    """Raise ``ValueError`` (one sentence) unless ``plan`` can run on ``spec``: its schedule fits the spec's
    segments, and its loss reads only outputs the model has in every stage (a depth-wise stage has one)."""
    outputs = family.num_outputs(spec)
    for segment, _ in stages(spec, plan):
        available = outputs if segment is None else 1
        if plan.outputs_needed() > available:
            where = "a depth-wise stage has" if segment is not None else f"{spec.describe()} has"
            raise ValueError(f"the plan's loss reads {plan.outputs_needed()} output(s), but {where} {available}.")


def train(model: FamilyNet, spec: SubmodelSpec, x: torch.Tensor, y: torch.Tensor, plan: TrainingPlan, *,
          labels: Sequence[int], num_classes: int, device: torch.device | str = "cpu",
          on_stage: Callable[[int, str], None] | None = None) -> TrainResult:
    """Run ``plan`` on ``model`` (built from ``spec``) over the local data, in train mode (static BN).

    ``on_stage(index, "start" | "end")`` is called around every stage (the training child measures each stage's
    peak with it).
    """
    if len(x) == 0:
        raise ValueError("no local training data")
    if plan.batch_size < 2:
        raise ValueError("batch_size must be at least 2: static BN normalises with batch statistics")
    started = time.monotonic()
    generator = torch.Generator().manual_seed(plan.seed)
    model.to(device).train()
    mask = label_mask(labels, num_classes).to(device)
    settings = plan.optimizer
    total_loss, steps, seen = 0.0, 0, 0
    planned = stages(spec, plan)
    for index, (segment, stage) in enumerate(planned):
        if on_stage is not None:
            on_stage(index, "start")
        net: nn.Module = model if segment is None else SegmentModel(model, *segment, tuple(x.shape), stage.route)
        try:
            params = [p for p in model.parameters() if p.requires_grad]
            optimizer = torch.optim.SGD(params, lr=settings.lr, momentum=settings.momentum,
                                        weight_decay=settings.weight_decay)
            for _ in range(stage.epochs):
                order = torch.randperm(len(x), generator=generator)
                for start in range(0, len(x), plan.batch_size):
                    batch = order[start:start + plan.batch_size]
                    if len(batch) < 2:
                        continue  # a last batch of one sample: batch-statistics BN cannot normalise it
                    inputs, targets = x[batch].to(device), y[batch].to(device)
                    optimizer.zero_grad(set_to_none=True)
                    loss = forward_loss(net, inputs, targets, plan.loss, mask)
                    if not torch.isfinite(loss):
                        raise FloatingPointError(f"training diverged (loss {loss.item()}) at step {steps}")
                    loss.backward()
                    if settings.clip_norm is not None:
                        nn.utils.clip_grad_norm_(params, settings.clip_norm)
                    optimizer.step()
                    total_loss += loss.item() * len(batch)
                    seen += len(batch)
                    steps += 1
        finally:
            # The stage's gradients and optimizer state go with it: the next stage freezes these parameters.
            for p in model.parameters():
                p.grad = None
            if isinstance(net, SegmentModel):
                net.release()
        if on_stage is not None:
            on_stage(index, "end")
    mean_loss = total_loss / seen if seen else math.nan
    return TrainResult(loss=mean_loss, steps=steps, samples=seen, seconds=time.monotonic() - started,
                       stages=len(planned))
