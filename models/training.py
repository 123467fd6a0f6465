"""The training-plan interpreter: one pure-torch implementation of a :class:`protocol.TrainingPlan`.

It runs wherever training happens or is predicted: the agent's training child and its warm-up step, the memory
estimator (which traces :func:`forward_loss` on meta tensors, so exits, teachers and stages are counted) and the
coordinator's own training on server data. A plan says nothing about the paper it comes from.

A run is a sequence of stages: one stage training the whole sub-model for ``plan.epochs`` epochs, or, for a
spec with segments, one per segment in order (:class:`models.depthwise.SegmentModel`), each for its
``plan.schedule`` entry's epochs. Every stage makes its own SGD optimizer over the parameters it trains, so
momentum does not leak from one segment into the next, and starts from the weights the previous stage left. A
stage with ``cache`` runs its frozen blocks once over the local data at its start and trains from their
buffered outputs (:func:`models.depthwise.frozen_outputs`); the batches are drawn as without it. A stage with
``micro_batch`` runs every batch in even micro-batches (:func:`micro_batches`), each backpropagating its loss
times its share of the batch, and steps once per batch on the accumulated gradient.

A plan with ``copies`` M > 1 trains M models of the spec side by side (whole, never depth-wise). Every batch
first runs through the other copies without autograd (their predictions before this step), then each copy in
turn runs forward and backward on its own loss: the plan's terms on its outputs, ``mutual_kd`` terms towards
the others' predictions as fixed targets (deep mutual learning). One optimizer step follows, so each copy steps
on the gradient of its own loss at the plan's learning rate, and only one copy's activations are alive at a
time: M copies cost M times the parameters, gradients and optimizer state, not M times the activations. The
loss reported is the mean over the copies (m-FeDepth's objective).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from models.depthwise import SegmentModel, frozen_outputs
from models.family import ModelFamily
from models.net import FamilyNet
from models.spec import SubmodelSpec
from protocol.plan import LossTerm, Stage, TrainingPlan

__all__ = ["TrainResult", "backward_step", "check_plan", "forward_loss", "label_mask", "loss_of", "masked_cross_entropy", "stages", "train"]


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


def _kl(student: torch.Tensor, teacher: torch.Tensor, tau: float) -> torch.Tensor:
    """``tau^2 * KL(softmax(teacher / tau) || softmax(student / tau))``, averaged over the batch."""
    return F.kl_div(F.log_softmax(student / tau, dim=1), F.log_softmax(teacher / tau, dim=1),
                    reduction="batchmean", log_target=True) * (tau * tau)


def loss_of(outputs: Sequence[torch.Tensor], targets: torch.Tensor, terms: Sequence[LossTerm],
            mask: torch.Tensor | None = None, peers: Sequence[Sequence[torch.Tensor]] = ()) -> torch.Tensor:
    """The weighted sum of ``terms`` over the model's ``outputs`` (see :mod:`protocol.plan` for each kind).

    ``kd`` is ``tau^2 * KL(softmax(t / tau) || softmax(s / tau))`` averaged over the batch (ScaleFL Eq. 5's
    ``L_KL(y_s, y_t)``); ``mask`` is the local label set, needed by masked cross-entropy terms; ``peers`` are
    the outputs of the other copies, the fixed targets of ``mutual_kd`` terms (0 without peers).
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
            value = _kl(student, teacher, term.tau)
        elif term.kind == "mutual_kd":
            assert term.tau is not None
            own = _output(outputs, term.output)
            if not peers:
                continue
            value = sum((_kl(own, _output(peer, term.output).detach(), term.tau) for peer in peers),
                        own.new_zeros(())) / len(peers)
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
    has, and the plan's loss."""
    outputs = net.forward_exits(inputs)  # type: ignore[operator]
    return loss_of(outputs, targets, terms, mask)


def backward_step(net: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, terms: Sequence[LossTerm],
                  mask: torch.Tensor | None = None, copies: Sequence[nn.Module] = (),
                  after_forward: Callable[[], None] | None = None, scale: float = 1.0) -> torch.Tensor:
    """Forward and backward of one batch, gradients accumulated, no optimizer step: the part of a training step
    the estimator traces too (``after_forward`` is called after every forward pass, before its backward).
    ``scale`` multiplies the loss that is backpropagated (a micro-batch's share of its batch), not the one returned.

    With further ``copies`` of the model, each copy's loss is taken towards the others' predictions (see the
    module docstring); the result is the detached sum of the losses (the caller checks it is finite before it
    steps).
    """
    models = [net, *copies]
    fixed: list[Sequence[torch.Tensor]] = [()]
    if copies:
        with torch.no_grad():  # the other copies' predictions before this step
            fixed += [copy.forward_exits(inputs) for copy in copies]  # type: ignore[operator]
    total: torch.Tensor | None = None
    for index, model in enumerate(models):
        outputs = model.forward_exits(inputs)  # type: ignore[operator]
        peers = [fixed[j] for j in range(len(models)) if j != index]
        loss = loss_of(outputs, targets, terms, mask, peers)
        if copies:  # this copy's prediction, a fixed target for the copies after it
            fixed[index] = [output.detach() for output in outputs]
        del outputs  # what backward needs the graph keeps; the rest goes before backward runs
        if after_forward is not None:
            after_forward()
        (loss * scale if scale != 1.0 else loss).backward()
        total = loss.detach() if total is None else total + loss.detach()
        del loss
    assert total is not None
    return total


def micro_batch_size(stage: Stage, batch_size: int) -> int:
    """The micro-batch a stage runs in: its ``micro_batch`` when that is at least 2 and below ``batch_size``,
    else the whole batch (the estimator traces the same)."""
    return stage.micro_batch if 2 <= stage.micro_batch < batch_size else batch_size


def micro_batches(batch: torch.Tensor, micro_batch: int) -> list[torch.Tensor]:
    """``batch`` (sample indices) split evenly into micro-batches of at most ``micro_batch`` samples (0, or not
    below the batch: the batch itself). None is larger than ``micro_batch``; a trailing single sample, which only
    ``micro_batch`` 2 with an odd batch leaves, is left out of the step (batch normalisation needs two samples),
    as :func:`train` leaves out a last batch of one."""
    if micro_batch < 2 or len(batch) <= micro_batch:
        return [batch]
    chunks = list(torch.tensor_split(batch, math.ceil(len(batch) / micro_batch)))
    return chunks[:-1] if len(chunks[-1]) < 2 else chunks


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
    if plan.copies > 1 and spec.segments is not None:
        raise ValueError(f"the plan trains {plan.copies} copies, which only a spec trained whole can do.")
    for segment, _ in stages(spec, plan):
        available = outputs if segment is None else 1
        if plan.outputs_needed() > available:
            where = "a depth-wise stage has" if segment is not None else f"{spec.describe()} has"
            raise ValueError(f"the plan's loss reads {plan.outputs_needed()} output(s), but {where} {available}.")


def train(model: FamilyNet, spec: SubmodelSpec, x: torch.Tensor, y: torch.Tensor, plan: TrainingPlan, *,
          labels: Sequence[int], num_classes: int, device: torch.device | str = "cpu",
          on_stage: Callable[[int, str], None] | None = None, copies: Sequence[FamilyNet] = ()) -> TrainResult:
    """Run ``plan`` on ``model`` (built from ``spec``) over the local data, in train mode (static BN).

    ``on_stage(index, "start" | "end")`` is called around every stage (the training child measures each stage's
    peak with it). ``copies`` are the plan's further copies (``plan.copies - 1`` models of ``spec``), trained
    alongside ``model`` and left trained in place.
    """
    if len(copies) != plan.copies - 1:
        raise ValueError(f"the plan trains {plan.copies} copies, {len(copies) + 1} model(s) were given")
    if len(x) == 0:
        raise ValueError("no local training data")
    if plan.batch_size < 2:
        raise ValueError("batch_size must be at least 2: static BN normalises with batch statistics")
    started = time.monotonic()
    generator = torch.Generator().manual_seed(plan.seed)
    model.to(device).train()
    for copy in copies:
        copy.to(device).train()
    mask = label_mask(labels, num_classes).to(device)
    settings = plan.optimizer
    total_loss, steps, seen = 0.0, 0, 0
    planned = stages(spec, plan)
    for index, (segment, stage) in enumerate(planned):
        if on_stage is not None:
            on_stage(index, "start")
        cached = segment is not None and stage.cache and segment[0] > 0
        net: nn.Module = model if segment is None else SegmentModel(model, *segment, tuple(x.shape), stage.route,
                                                                    frozen_input=cached)
        inputs_of = x
        try:
            if cached:
                assert segment is not None
                inputs_of = frozen_outputs(model, segment[0], x, micro_batch_size(stage, plan.batch_size), device)
            # Each model's parameters on their own: a copy's gradient is clipped as if it trained alone.
            groups = [[p for p in m.parameters() if p.requires_grad] for m in (model, *copies)]
            params = [p for group in groups for p in group]
            optimizer = torch.optim.SGD(params, lr=settings.lr, momentum=settings.momentum,
                                        weight_decay=settings.weight_decay)
            for _ in range(stage.epochs):
                order = torch.randperm(len(x), generator=generator)
                for start in range(0, len(x), plan.batch_size):
                    batch = order[start:start + plan.batch_size]
                    if len(batch) < 2:
                        continue  # a last batch of one sample: batch-statistics BN cannot normalise it
                    optimizer.zero_grad(set_to_none=True)
                    parts = micro_batches(batch, micro_batch_size(stage, plan.batch_size))
                    used = sum(len(part) for part in parts)
                    loss: torch.Tensor | None = None
                    for part in parts:
                        share = len(part) / used
                        inputs, targets = inputs_of[part].to(device), y[part].to(device)
                        step = backward_step(net, inputs, targets, plan.loss, mask, copies, scale=share) * share
                        loss = step if loss is None else loss + step
                        del inputs, targets
                    assert loss is not None
                    if not torch.isfinite(loss):
                        raise FloatingPointError(f"training diverged (loss {loss.item()}) at step {steps}")
                    if settings.clip_norm is not None:
                        for group in groups:
                            nn.utils.clip_grad_norm_(group, settings.clip_norm)
                    optimizer.step()
                    total_loss += loss.item() / plan.copies * used
                    seen += used
                    steps += 1
        finally:
            # The stage's gradients and optimizer state go with it: the next stage freezes these parameters.
            for m in (model, *copies):
                for p in m.parameters():
                    p.grad = None
            if isinstance(net, SegmentModel):
                net.release()
            del inputs_of  # the stage's buffer, if any
        if on_stage is not None:
            on_stage(index, "end")
    mean_loss = total_loss / seen if seen else math.nan
    return TrainResult(loss=mean_loss, steps=steps, samples=seen, seconds=time.monotonic() - started,
                       stages=len(planned))
