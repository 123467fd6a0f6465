"""The training-plan interpreter: one pure-torch implementation of a :class:`protocol.TrainingPlan`.

It runs wherever training happens or is predicted: the agent's training child and its warm-up step, the memory
estimator (which traces :func:`backward_step` on meta tensors, so exits, teachers and stages are counted) and the
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

A plan with ``nested_kd`` terms (FlexFL's self-distillation from nested sub-models) needs the model family
(``train(..., family=...)``): every distinct ``teacher_spec`` is built once per run, on the meta device (it holds
no weights of its own), and every batch first runs through each teacher without autograd, with the student's
current weights cut to the teacher's shapes as views (leading prefixes, as :meth:`ModelFamily.extract` cuts), in
train mode (batch statistics) like the student (:class:`NestedTeachers`). Their last outputs are the terms'
fixed targets; they are computed before the student's forward pass, so their activations are gone before the
student's pile up. Not with copies or depth-wise stages (:func:`check_plan` refuses both).

A plan with ``widths`` (FjORD's ordered dropout) needs the model family too: every width's sub-model (the spec at
that uniform width, nested in it) is built once on the meta device, and every batch draws one width uniformly
(seeded by the plan's seed) and runs it through ``functional_call`` with the model's own weights narrowed to its
shapes, with autograd: its gradients land in the leading slices of the model's (:class:`OrderedDropout`). With
``width_kd`` terms, each batch trains the whole spec first and then the drawn width towards it
(:func:`ordered_dropout_step`). One optimizer step per batch either way. Not with copies, depth-wise stages or
``nested_kd`` terms.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn
from torch.func import functional_call
from torch.nn import functional as F

from models.depthwise import SegmentModel, frozen_outputs
from models.family import ModelFamily
from models.layers import dropout_off
from models.net import FamilyNet
from models.spec import SubmodelSpec
from protocol.plan import LossTerm, Stage, TrainingPlan

__all__ = ["NestedTeachers", "OrderedDropout", "TrainResult", "WidthNet", "backward_step", "check_plan", "forward_loss",
           "label_mask", "loss_of", "masked_cross_entropy", "nested_teachers", "ordered_dropout",
           "ordered_dropout_step", "stages", "train", "width_spec"]

#: The last outputs of a plan's nested teachers, by the ``teacher_spec`` of their terms.
TeacherLogits = Mapping[Mapping[str, Any], torch.Tensor]


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
            mask: torch.Tensor | None = None, peers: Sequence[Sequence[torch.Tensor]] = (),
            teacher_logits: TeacherLogits | None = None, width_teacher: torch.Tensor | None = None) -> torch.Tensor:
    """The weighted sum of ``terms`` over the model's ``outputs`` (see :mod:`protocol.plan` for each kind).

    ``kd`` is ``tau^2 * KL(softmax(t / tau) || softmax(s / tau))`` averaged over the batch (ScaleFL Eq. 5's
    ``L_KL(y_s, y_t)``); ``mask`` is the local label set, needed by masked cross-entropy terms; ``peers`` are
    the outputs of the other copies, the fixed targets of ``mutual_kd`` terms (0 without peers);
    ``teacher_logits`` those of ``nested_kd`` terms, by their ``teacher_spec`` (:class:`NestedTeachers`);
    ``width_teacher`` the whole sub-model's last output, the target of ``width_kd`` terms (0 without it).
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
        elif term.kind == "nested_kd":
            assert term.tau is not None and term.teacher_spec is not None
            if teacher_logits is None or term.teacher_spec not in teacher_logits:
                raise ValueError("a nested_kd term needs its teacher's logits (train with the model family).")
            value = _kl(_output(outputs, term.output), teacher_logits[term.teacher_spec].detach(), term.tau)
        elif term.kind == "width_kd":
            assert term.tau is not None
            if width_teacher is None:
                continue  # the spec's own pass: it is the teacher
            value = _kl(_output(outputs, term.output), width_teacher.detach(), term.tau)
        else:
            raise ValueError(f"unknown loss term kind {term.kind!r}.")
        weighted = value * term.weight
        total = weighted if total is None else total + weighted
    if total is None:
        raise ValueError("a training plan needs at least one loss term.")
    return total


# ---------------------------------------------------------------------------------------------- nested teachers
def _state_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """A model's parameters and buffers by name."""
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def _narrowed(tensors: Mapping[str, torch.Tensor], shapes: Sequence[tuple[str, tuple[int, ...]]],
              prefix: str = "") -> dict[str, torch.Tensor]:
    """Each named tensor cut to its shape's leading prefix (views), keyed ``prefix + name``."""
    out = {}
    for name, shape in shapes:
        tensor = tensors[name]
        for dim, size in enumerate(shape):
            tensor = tensor.narrow(dim, 0, size)
        out[prefix + name] = tensor
    return out


class NestedTeachers:
    """The nested sub-models a plan's ``nested_kd`` terms distil from, run on the student's current weights.

    Built by :func:`nested_teachers`. Called with a batch, it gives each teacher's last output (no autograd) by
    the ``teacher_spec`` of its terms: every teacher net (built on the meta device, once) runs through
    ``torch.func.functional_call`` with the student's parameters and buffers detached and narrowed to the
    teacher's shapes (leading prefixes: views, no weight copies held; a convolution may copy a non-contiguous
    slice for the duration of its call), in train mode as built (batch-statistics BN, the teacher's own Scaler
    rates) but with dropout off: the targets are the teacher's prediction, not a noisy draw, and the teachers take
    nothing from the random stream the student's dropout uses.
    """

    def __init__(self, student: nn.Module, nets: Mapping[SubmodelSpec, nn.Module],
                 specs: Mapping[Mapping[str, Any], SubmodelSpec]) -> None:
        self.student = student
        self.nets = dict(nets)
        self.specs = dict(specs)
        self._shapes = {spec: [(name, tuple(t.shape)) for name, t in (*net.named_parameters(), *net.named_buffers())]
                        for spec, net in self.nets.items()}

    def __call__(self, inputs: torch.Tensor) -> dict[Mapping[str, Any], torch.Tensor]:
        current = {name: tensor.detach() for name, tensor in _state_tensors(self.student).items()}
        logits: dict[SubmodelSpec, torch.Tensor] = {}
        with torch.no_grad():
            for spec, net in self.nets.items():
                logits[spec] = functional_call(net, _narrowed(current, self._shapes[spec]), (inputs,), strict=True)
        return {key: logits[spec] for key, spec in self.specs.items()}


def _nested_specs(family: ModelFamily, spec: SubmodelSpec,
                  terms: Sequence[LossTerm]) -> dict[Mapping[str, Any], SubmodelSpec]:
    """The teacher of every ``nested_kd`` term, by its ``teacher_spec``; ``ValueError`` (one sentence) for a
    teacher that is not a valid spec of ``family``, has segments or is not nested in ``spec``, or for a ``spec``
    with segments."""
    found: dict[Mapping[str, Any], SubmodelSpec] = {}
    for term in terms:
        if term.kind != "nested_kd" or term.teacher_spec in found:
            continue
        if spec.segments is not None:
            raise ValueError("nested_kd terms are not supported in depth-wise training (a spec with segments).")
        assert term.teacher_spec is not None
        try:
            teacher = family.validate_spec(SubmodelSpec.from_dict(term.teacher_spec))
        except ValueError as exc:
            raise ValueError(f"a nested_kd teacher is not a valid spec of family {family.name!r}: "
                             f"{str(exc).rstrip('.')}.") from None
        if teacher.segments is not None:
            raise ValueError(f"the nested_kd teacher {teacher.describe()} has segments, which a teacher (run, not "
                             "trained) cannot have.")
        if not family.is_nested(teacher, spec):
            raise ValueError(f"the nested_kd teacher {teacher.describe()} is not nested in the trained spec "
                             f"{spec.describe()}.")
        found[term.teacher_spec] = teacher
    return found


def nested_teachers(family: ModelFamily, spec: SubmodelSpec, terms: Sequence[LossTerm],
                    model: nn.Module) -> NestedTeachers | None:
    """The teachers of the ``nested_kd`` terms among ``terms`` for ``model`` (the student, built from ``spec``),
    each distinct spec built once on the meta device; None without such terms. ``ValueError`` as
    :func:`check_plan` for a teacher that cannot run."""
    specs = _nested_specs(family, spec, terms)
    if not specs:
        return None
    nets: dict[SubmodelSpec, nn.Module] = {}
    with torch.device("meta"):
        for teacher in specs.values():
            if teacher not in nets:
                net = family.build(teacher, track_bn_stats=False).train()
                dropout_off(net)
                nets[teacher] = net
    return NestedTeachers(model, nets, specs)


# ---------------------------------------------------------------------------------------------- ordered dropout
class WidthNet:
    """One width of ordered dropout: a net of that width (built on the meta device) run through
    ``torch.func.functional_call`` with the student's parameters and buffers narrowed to its shapes (leading
    prefixes: views, whose gradients flow into the student's)."""

    def __init__(self, student: nn.Module, net: FamilyNet, width: float) -> None:
        self.student = student
        self.outputs = _AllOutputs(net)
        self.width = width
        self._shapes = [(name, tuple(t.shape)) for name, t in (*net.named_parameters(), *net.named_buffers())]

    def forward_exits(self, inputs: torch.Tensor) -> list[torch.Tensor]:
        """Every output of the width's sub-model on ``inputs``, from the student's current weights."""
        weights = _narrowed(_state_tensors(self.student), self._shapes, prefix="net.")
        return list(functional_call(self.outputs, weights, (inputs,), strict=True))


class _AllOutputs(nn.Module):
    """A net whose ``forward`` gives every output (``functional_call`` runs ``forward``)."""

    def __init__(self, net: FamilyNet) -> None:
        super().__init__()
        self.net = net

    def forward(self, inputs: torch.Tensor) -> list[torch.Tensor]:
        return self.net.forward_exits(inputs)


class OrderedDropout:
    """FjORD's ordered dropout over a plan's ``widths``: :meth:`draw` picks one uniformly at random per batch (a
    generator seeded by the plan's seed, apart from the data order's), and gives the :class:`WidthNet` to train,
    or None when the drawn width is the spec's own (the student itself)."""

    def __init__(self, family: ModelFamily, spec: SubmodelSpec, widths: Sequence[float], student: nn.Module,
                 seed: int) -> None:
        self.widths = tuple(widths)
        self.rng = random.Random(seed)
        self.nets: dict[float, WidthNet | None] = {}
        with torch.device("meta"):
            for width in self.widths:
                sub = width_spec(family, spec, width)
                if sub == spec:
                    self.nets[width] = None
                    continue
                net = family.build(sub, track_bn_stats=False).train()
                self.nets[width] = WidthNet(student, net, width)

    def draw(self) -> WidthNet | None:
        """The width a batch trains, drawn uniformly from the plan's widths."""
        return self.nets[self.rng.choice(self.widths)]

    def widest_narrower(self) -> WidthNet | None:
        """The widest width narrower than the spec (the estimator traces it: the costliest second pass)."""
        narrower = [net for net in self.nets.values() if net is not None]
        return max(narrower, key=lambda net: net.width) if narrower else None


def width_spec(family: ModelFamily, spec: SubmodelSpec, width: float) -> SubmodelSpec:
    """The sub-model of ordered dropout's ``width``: ``spec`` at that uniform width; ``ValueError`` (one sentence)
    unless it is a valid spec nested in ``spec``."""
    try:
        sub = family.validate_spec(replace(spec, width=width))
    except ValueError as exc:
        raise ValueError(f"ordered dropout's width {width:g} is not a valid sub-model of {spec.describe()}: "
                         f"{str(exc).rstrip('.')}.") from None
    if not family.is_nested(sub, spec):
        raise ValueError(f"ordered dropout's width {width:g} ({sub.describe()}) is not nested in the trained spec "
                         f"{spec.describe()}.")
    return sub


def ordered_dropout(family: ModelFamily, spec: SubmodelSpec, plan: TrainingPlan,
                    model: nn.Module) -> OrderedDropout | None:
    """The ordered dropout of ``plan`` for ``model`` (built from ``spec``), or None when the plan has no
    ``widths``."""
    if not plan.widths:
        return None
    return OrderedDropout(family, spec, plan.widths, model, plan.seed)


# ---------------------------------------------------------------------------------------------- steps
def forward_loss(net: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, terms: Sequence[LossTerm],
                 mask: torch.Tensor | None = None, teachers: NestedTeachers | None = None) -> torch.Tensor:
    """One forward pass of ``net`` (a :class:`FamilyNet` or :class:`SegmentModel`) over every output the model
    has, and the plan's loss (``teachers``: those of its ``nested_kd`` terms, run first)."""
    fixed = teachers(inputs) if teachers is not None else None
    outputs = net.forward_exits(inputs)  # type: ignore[operator]
    return loss_of(outputs, targets, terms, mask, teacher_logits=fixed)


def backward_step(net: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, terms: Sequence[LossTerm],
                  mask: torch.Tensor | None = None, copies: Sequence[nn.Module] = (),
                  after_forward: Callable[[], None] | None = None, scale: float = 1.0,
                  teachers: NestedTeachers | None = None, width: WidthNet | None = None) -> torch.Tensor:
    """Forward and backward of one batch, gradients accumulated, no optimizer step: the part of a training step
    the estimator traces too (``after_forward`` is called after every forward pass, before its backward).
    ``scale`` multiplies the loss that is backpropagated (a micro-batch's share of its batch), not the one returned.

    With further ``copies`` of the model, each copy's loss is taken towards the others' predictions (see the
    module docstring); the result is the detached sum of the losses (the caller checks it is finite before it
    steps). ``teachers`` (:func:`nested_teachers`, not with copies) run first, their outputs the targets of the
    ``nested_kd`` terms. ``width``: the width ordered dropout drew for the batch (:class:`OrderedDropout`; None:
    the spec's own), trained as :func:`ordered_dropout_step` says.
    """
    if width is not None or any(term.kind == "width_kd" for term in terms):
        if copies or teachers is not None:
            raise ValueError("ordered dropout is not supported with copies or nested_kd terms.")
        return ordered_dropout_step(net, inputs, targets, terms, mask, width, after_forward, scale)
    if teachers is not None and copies:
        raise ValueError("nested_kd terms are not supported with copies.")
    nested = teachers(inputs) if teachers is not None else None  # before the student's activations exist
    models = [net, *copies]
    fixed: list[Sequence[torch.Tensor]] = [()]
    if copies:
        with torch.no_grad():  # the other copies' predictions before this step
            fixed += [copy.forward_exits(inputs) for copy in copies]  # type: ignore[operator]
    total: torch.Tensor | None = None
    for index, model in enumerate(models):
        outputs = model.forward_exits(inputs)  # type: ignore[operator]
        peers = [fixed[j] for j in range(len(models)) if j != index]
        loss = loss_of(outputs, targets, terms, mask, peers, nested)
        if copies:  # this copy's prediction, a fixed target for the copies after it
            fixed[index] = [output.detach() for output in outputs]
        del outputs  # what backward needs the graph keeps; the rest goes before backward runs
        if after_forward is not None:
            after_forward()
        (loss * scale if scale != 1.0 else loss).backward()
        total = loss.detach() if total is None else total + loss.detach()
        del loss
    del nested
    assert total is not None
    return total


def ordered_dropout_step(net: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, terms: Sequence[LossTerm],
                         mask: torch.Tensor | None, width: WidthNet | None,
                         after_forward: Callable[[], None] | None = None, scale: float = 1.0) -> torch.Tensor:
    """Forward and backward of one batch under ordered dropout, gradients accumulated (FjORD). Without
    ``width_kd`` terms the drawn ``width`` (None: ``net`` itself) trains on the plan's terms. With them (D-KD),
    ``net`` first trains on the other terms (or, with none, only runs, without autograd), and then the drawn
    width, when it is narrower, on the ``width_kd`` terms towards ``net``'s last output, detached: two passes
    one after the other, the first's activations gone before the second's. Returns the detached sum of the
    losses."""
    own = tuple(term for term in terms if term.kind != "width_kd")
    distil = tuple(term for term in terms if term.kind == "width_kd")

    def run(model: Any, chosen: Sequence[LossTerm], teacher: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
        outputs = model.forward_exits(inputs)
        last = outputs[-1].detach()
        loss = loss_of(outputs, targets, chosen, mask, width_teacher=teacher)
        del outputs
        if after_forward is not None:
            after_forward()
        (loss * scale if scale != 1.0 else loss).backward()
        return loss.detach(), last

    if not distil:
        return run(width if width is not None else net, own)[0]
    if own:
        total, teacher = run(net, own)
    else:
        with torch.no_grad():
            teacher = net.forward_exits(inputs)[-1]  # type: ignore[operator]
        total = teacher.new_zeros(())
    if width is not None:
        total = total + run(width, distil, teacher)[0]
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
    segments, its loss reads only outputs the model has in every stage (a depth-wise stage has one), and every
    ``nested_kd`` teacher is a valid spec of ``family`` nested in ``spec`` (trained whole, one copy)."""
    outputs = family.num_outputs(spec)
    if plan.copies > 1 and spec.segments is not None:
        raise ValueError(f"the plan trains {plan.copies} copies, which only a spec trained whole can do.")
    if plan.copies > 1 and any(term.kind == "nested_kd" for term in plan.loss):
        raise ValueError(f"the plan trains {plan.copies} copies, which nested_kd terms do not support.")
    if plan.ordered_dropout:
        if not plan.widths:
            raise ValueError("width_kd terms need the plan's widths (ordered dropout).")
        if plan.copies > 1 or spec.segments is not None or any(term.kind == "nested_kd" for term in plan.loss):
            raise ValueError("ordered dropout (the plan's widths) trains one copy of a spec trained whole, "
                             "without nested_kd terms.")
        for width in plan.widths:
            width_spec(family, spec, width)
    _nested_specs(family, spec, plan.loss)
    for segment, _ in stages(spec, plan):
        available = outputs if segment is None else 1
        if plan.outputs_needed() > available:
            where = "a depth-wise stage has" if segment is not None else f"{spec.describe()} has"
            raise ValueError(f"the plan's loss reads {plan.outputs_needed()} output(s), but {where} {available}.")


def train(model: FamilyNet, spec: SubmodelSpec, x: torch.Tensor, y: torch.Tensor, plan: TrainingPlan, *,
          labels: Sequence[int], num_classes: int, device: torch.device | str = "cpu",
          on_stage: Callable[[int, str], None] | None = None, copies: Sequence[FamilyNet] = (),
          family: ModelFamily | None = None, on_step: Callable[[], None] | None = None) -> TrainResult:
    """Run ``plan`` on ``model`` (built from ``spec``) over the local data, in train mode (static BN).

    ``on_stage(index, "start" | "end")`` is called around every stage (the training child measures each stage's
    peak with it). ``copies`` are the plan's further copies (``plan.copies - 1`` models of ``spec``), trained
    alongside ``model`` and left trained in place. ``family`` (the model's) is needed by ``nested_kd`` terms and
    ordered dropout (the plan's ``widths``: every batch draws one, :class:`OrderedDropout`).
    ``on_step()`` is called after every optimizer step and every batch of a stage's buffered frozen outputs (the
    training child reports its progress with it).
    """
    _check_train(spec, x, plan, copies, family)
    started = time.monotonic()
    model.to(device).train()
    for copy in copies:
        copy.to(device).train()
    run = _Run(model, tuple(copies), x, y, plan, label_mask(labels, num_classes).to(device), device,
               nested_teachers(family, spec, plan.loss, model) if family is not None else None,
               ordered_dropout(family, spec, plan, model) if family is not None else None,
               torch.Generator().manual_seed(plan.seed), on_step)
    planned = stages(spec, plan)
    for index, (segment, stage) in enumerate(planned):
        if on_stage is not None:
            on_stage(index, "start")
        run.stage(segment, stage)
        if on_stage is not None:
            on_stage(index, "end")
    mean_loss = run.total_loss / run.seen if run.seen else math.nan
    return TrainResult(loss=mean_loss, steps=run.steps, samples=run.seen, seconds=time.monotonic() - started,
                       stages=len(planned))


def _check_train(spec: SubmodelSpec, x: torch.Tensor, plan: TrainingPlan, copies: Sequence[FamilyNet],
                 family: ModelFamily | None) -> None:
    """ValueError where :func:`train` cannot run ``plan``: a construct that needs the family without it, the wrong
    number of copies, no data, a batch too small for static BN."""
    if any(term.kind == "nested_kd" for term in plan.loss) or plan.ordered_dropout:
        if family is None:
            raise ValueError("a plan with nested_kd terms or ordered dropout needs the model family "
                             "(train(..., family=...)).")
        check_plan(family, spec, plan)
    if len(copies) != plan.copies - 1:
        raise ValueError(f"the plan trains {plan.copies} copies, {len(copies) + 1} model(s) were given")
    if len(x) == 0:
        raise ValueError("no local training data")
    if plan.batch_size < 2:
        raise ValueError("batch_size must be at least 2: static BN normalises with batch statistics")


@dataclass
class _Run:
    """One :func:`train`: what its stages and batches share, and its running totals.

    A training construct of the plan is interpreted here: per stage (:meth:`stage`: which blocks train, through
    which route, from which buffered inputs), per batch (:meth:`_batch_loss`: its micro-batches, the width ordered
    dropout draws) or per loss term (:func:`backward_step`, :func:`forward_loss`)."""

    model: FamilyNet
    copies: tuple[FamilyNet, ...]
    x: torch.Tensor
    y: torch.Tensor
    plan: TrainingPlan
    mask: torch.Tensor
    device: torch.device | str
    teachers: NestedTeachers | None
    dropout: OrderedDropout | None
    generator: torch.Generator
    on_step: Callable[[], None] | None
    total_loss: float = 0.0
    steps: int = 0
    seen: int = 0

    def stage(self, segment: tuple[int, int] | None, stage: Stage) -> None:
        """Train one stage of the plan (``segment``: the blocks it trains; None, the whole model) for its epochs."""
        cached = segment is not None and stage.cache and segment[0] > 0
        net: nn.Module = self.model if segment is None else SegmentModel(
            self.model, *segment, tuple(self.x.shape), stage.route, frozen_input=cached)
        micro = micro_batch_size(stage, self.plan.batch_size)
        inputs_of = self.x
        try:
            if cached:
                assert segment is not None
                inputs_of = frozen_outputs(self.model, segment[0], self.x, micro, self.device, on_batch=self.on_step)
            self._epochs(net, inputs_of, stage.epochs, micro)
        finally:
            # The stage's gradients and optimizer state go with it: the next stage freezes these parameters.
            for m in (self.model, *self.copies):
                for p in m.parameters():
                    p.grad = None
            if isinstance(net, SegmentModel):
                net.release()
            del inputs_of  # the stage's buffer, if any

    def _epochs(self, net: nn.Module, inputs_of: torch.Tensor, epochs: int, micro: int) -> None:
        settings = self.plan.optimizer
        # Each model's parameters on their own: a copy's gradient is clipped as if it trained alone.
        groups = [[p for p in m.parameters() if p.requires_grad] for m in (self.model, *self.copies)]
        optimizer = torch.optim.SGD([p for group in groups for p in group], lr=settings.lr,
                                    momentum=settings.momentum, weight_decay=settings.weight_decay)
        for _ in range(epochs):
            order = torch.randperm(len(self.x), generator=self.generator)
            for start in range(0, len(self.x), self.plan.batch_size):
                batch = order[start:start + self.plan.batch_size]
                if len(batch) < 2:
                    continue  # a last batch of one sample: batch-statistics BN cannot normalise it
                optimizer.zero_grad(set_to_none=True)
                loss, used = self._batch_loss(net, inputs_of, batch, micro)
                if not torch.isfinite(loss):
                    raise FloatingPointError(f"training diverged (loss {loss.item()}) at step {self.steps}")
                if settings.clip_norm is not None:
                    for group in groups:
                        nn.utils.clip_grad_norm_(group, settings.clip_norm)
                optimizer.step()
                self.total_loss += loss.item() / self.plan.copies * used
                self.seen += used
                self.steps += 1
                if self.on_step is not None:
                    self.on_step()

    def _batch_loss(self, net: nn.Module, inputs_of: torch.Tensor, batch: torch.Tensor,
                    micro: int) -> tuple[torch.Tensor, int]:
        """One batch's gradients, accumulated over its micro-batches, at one width for the whole batch; its loss
        and the samples it used."""
        parts = micro_batches(batch, micro)
        used = sum(len(part) for part in parts)
        width = self.dropout.draw() if self.dropout is not None else None
        loss: torch.Tensor | None = None
        for part in parts:
            share = len(part) / used
            inputs, targets = inputs_of[part].to(self.device), self.y[part].to(self.device)
            step = backward_step(net, inputs, targets, self.plan.loss, self.mask, self.copies, scale=share,
                                 teachers=self.teachers, width=width) * share
            loss = step if loss is None else loss + step
            del inputs, targets
        assert loss is not None
        return loss, used
