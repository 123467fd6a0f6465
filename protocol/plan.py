"""The training plan: how an agent trains the sub-model of a task, as data (the agent never learns the paper).

A :class:`TrainingPlan` holds the optimizer settings, the data loop (epochs, batch size, seed), the loss as a
list of terms over the model's outputs, and the schedule of the spec's depth-wise stages. The outputs of a
sub-model are its exits in depth order, the deepest last (index -1); a model without early exits has one.

Loss term kinds (``LOSS_KINDS``):

- ``"ce"``: ``weight * CE(outputs[output], y)``; ``masked`` is HeteroFL's masked cross-entropy (the logits of
  classes absent from the local data are set to 0 before the loss).
- ``"kd"``: self-distillation between two outputs, ``weight * tau^2 * KL(softmax(t / tau) || softmax(s / tau))``
  averaged over the batch, with ``s = outputs[output]`` the student and ``t = outputs[teacher]`` the teacher
  (ScaleFL Eq. 5); ``detach_teacher`` stops the gradient through the teacher.
- ``"mutual_kd"``: mutual distillation among the plan's ``copies`` (m-FeDepth, after Zhang et al. 2018's deep
  mutual learning): every copy adds ``weight * tau^2 * mean_{other copies} KL(softmax(h' / tau) || softmax(h /
  tau))`` of its output ``output`` to its own loss, the other copies' predictions taken as fixed targets. With
  one copy the term is 0.
- ``"nested_kd"``: self-distillation from a nested sub-model (FlexFL Eq. 4), ``weight * tau^2 * KL(softmax(t /
  tau) || softmax(s / tau))`` averaged over the batch, with ``s = outputs[output]`` and ``t`` the last output of
  the sub-model ``teacher_spec`` (a sub-model spec in wire form, ``SubmodelSpec.to_dict()``, nested in the
  trained one) run on the same batch with the trained model's current weights cut to its shapes (leading
  prefixes), without gradient: the smaller model's predictions are fixed targets. One term per teacher.
- ``"width_kd"``: FjORD's self-distillation under ordered dropout (a plan with ``widths``): ``weight * tau^2 *
  KL(softmax(t / tau) || softmax(s / tau))`` averaged over the batch, with ``s = outputs[output]`` of the width
  drawn for the batch and ``t`` the last output of the whole sub-model on the same batch, without gradient. With
  such terms every batch first trains the whole sub-model on the plan's other terms, then the drawn width on
  these (nothing more when the drawn width is the whole sub-model's).

``widths`` (default empty) is ordered dropout (FjORD): uniform width rates of the global model, each giving a
sub-model nested in the spec (the spec with that ``width``); every batch trains one of them, drawn uniformly at
random (seeded by the plan's seed), or, with ``width_kd`` terms, the spec itself and then the drawn one. It is
written only when not empty, so that agents that predate it still read every other plan.

``copies`` (default 1) is how many models of the spec the agent trains side by side on the same batches: the
first starts from the task's weights and is the one uploaded, the others are the device's own auxiliary models,
kept between rounds and never sent. It is written on the wire only when above 1, so that agents that predate it
still read every other plan; so is a loss term's ``teacher_spec`` (only ``nested_kd`` terms have one). Further
kinds are added here (an agent that predates a kind refuses a plan using it, whatever fields the kind brings);
the version is bumped only when the meaning of something already on the wire changes. An agent that meets a
kind, field or version it does not know rejects the task with one :class:`~protocol.ProtocolError` that names
it.

``update_clip`` (revision 9, written only when set) is client-level differential privacy on the device: after
training, the update's change from the task's weights (every tensor it uploads, as one vector) is scaled down to
L2 norm ``bound`` when it is longer, and with ``noise_multiplier`` above 0 (local DP) Gaussian noise of standard
deviation ``noise_multiplier * bound`` is added to every value the device sends, drawn from the operating system's
randomness.

The plan is versioned (``PLAN_VERSION``). Tasks from coordinators that predate plans carry a
:class:`~protocol.Recipe` instead; :meth:`TrainingPlan.from_recipe` gives the plan that recipe always meant.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

from protocol._frozen import freeze
from protocol._ids import shown
from protocol._plain import plain
from protocol._reader import FieldReader, check_int, check_number
from protocol.errors import ProtocolError
from protocol.limits import DEFAULT_LIMITS, Limits

__all__ = [
    "LOSS_KINDS",
    "MAX_COPIES",
    "MAX_WIDTHS",
    "PLAN_VERSION",
    "ROUTES",
    "LossTerm",
    "OptimizerSettings",
    "Recipe",
    "Stage",
    "TrainingPlan",
    "UpdateClip",
    "read_training_plan",
]

PLAN_VERSION = 1
LOSS_KINDS: tuple[str, ...] = ("ce", "kd", "mutual_kd", "nested_kd", "width_kd")
OPTIMIZERS: tuple[str, ...] = ("sgd",)
#: How a depth-wise stage's output reaches a classifier: FeDepth's skip connection to the final head
#: (spatial subsampling, zero-padded channels) or the early exit after the stage's last block.
ROUTES: tuple[str, ...] = ("skip", "exit")
MAX_LOSS_TERMS = 64
MAX_STAGES = 1024
MAX_COPIES = 8
MAX_WIDTHS = 32


@dataclass
class Recipe:
    """The training settings of tasks from coordinators that predate training plans (plain or masked CE)."""

    epochs: int
    batch_size: int
    lr: float
    momentum: float
    weight_decay: float
    clip_norm: float | None
    masked_ce: bool
    seed: int


@dataclass(frozen=True)
class OptimizerSettings:
    """SGD with momentum and weight decay, gradients clipped to ``clip_norm`` (None: not clipped)."""

    kind: str = "sgd"
    lr: float = 0.02
    momentum: float = 0.9
    weight_decay: float = 5e-4
    clip_norm: float | None = 1.0


@dataclass(frozen=True)
class LossTerm:
    """One term of the loss (see the module docstring); fields a kind does not use stay at their defaults.

    ``teacher_spec`` is kept frozen (a hashable :class:`~protocol._frozen.FrozenMap`), so terms and plans stay
    usable as dict keys.
    """

    #: Written only when not at their default, so that agents that predate them still read other plans.
    OMITTED_AT_DEFAULT: ClassVar[tuple[str, ...]] = ("teacher_spec",)

    kind: str
    weight: float = 1.0
    output: int = -1
    masked: bool = False
    teacher: int | None = None
    tau: float | None = None
    detach_teacher: bool = False
    teacher_spec: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.teacher_spec is not None:
            object.__setattr__(self, "teacher_spec", freeze(self.teacher_spec))

    @classmethod
    def ce(cls, weight: float = 1.0, output: int = -1, masked: bool = False) -> LossTerm:
        """Cross-entropy of one output."""
        return cls("ce", weight=weight, output=output, masked=masked)

    @classmethod
    def kd(cls, student: int, teacher: int, *, weight: float, tau: float,
           detach_teacher: bool = False) -> LossTerm:
        """Self-distillation of output ``student`` towards output ``teacher``."""
        return cls("kd", weight=weight, output=student, teacher=teacher, tau=tau, detach_teacher=detach_teacher)

    @classmethod
    def mutual_kd(cls, *, weight: float = 1.0, tau: float = 1.0, output: int = -1) -> LossTerm:
        """Mutual distillation of output ``output`` among the plan's copies."""
        return cls("mutual_kd", weight=weight, output=output, tau=tau)

    @classmethod
    def nested_kd(cls, teacher_spec: Mapping[str, Any], *, weight: float, tau: float, output: int = -1) -> LossTerm:
        """Distillation of output ``output`` towards the nested sub-model ``teacher_spec`` (``SubmodelSpec.to_dict()``
        of a spec nested in the trained one)."""
        return cls("nested_kd", weight=weight, output=output, tau=tau, teacher_spec=teacher_spec)

    @classmethod
    def width_kd(cls, *, weight: float = 1.0, tau: float = 1.0, output: int = -1) -> LossTerm:
        """Distillation of output ``output`` of the width drawn for a batch towards the whole sub-model's last
        output (ordered dropout's self-distillation: a plan with ``widths``)."""
        return cls("width_kd", weight=weight, output=output, tau=tau)


@dataclass(frozen=True)
class Stage:
    """Settings of one depth-wise stage (one segment of the spec), in the spec's segment order.

    ``cache``: the frozen blocks before the segment run once over the local data at the stage's start and
    their outputs are reused for all its epochs (FeDepth's buffered activations), instead of running again for
    every batch. It saves compute from the second epoch on and costs memory for the whole data's activations;
    the agent sets it when that fits.

    ``micro_batch``: when above 1 and below the plan's batch size, every batch is split evenly into micro-batches
    of at most this many samples (a trailing single sample is left out), each run forward and backward
    with its loss scaled by its share of the batch, the gradients accumulated, and one optimizer step per batch:
    the gradient of the whole batch (but batch normalisation sees each micro-batch's statistics), at the memory
    of a micro-batch. 0: whole batches. The agent sets it for blocks that do not fit at the batch size.
    """

    OMITTED_AT_DEFAULT: ClassVar[tuple[str, ...]] = ("cache", "micro_batch")

    epochs: int = 1
    route: str = "skip"
    cache: bool = False
    micro_batch: int = 0


@dataclass(frozen=True)
class UpdateClip:
    """Differential privacy on the device (see the module docstring): the update's change clipped to L2 norm
    ``bound``, plus Gaussian noise of standard deviation ``noise_multiplier * bound`` (0: none; the coordinator adds
    it to the sum)."""

    bound: float
    noise_multiplier: float = 0.0


@dataclass(frozen=True)
class TrainingPlan:
    """Everything about local training but the weights and the spec (see the module docstring).

    ``schedule`` is empty for a spec trained whole; for a spec with segments it is empty (every stage runs
    ``epochs`` epochs through the skip path) or has one :class:`Stage` per segment.
    """

    optimizer: OptimizerSettings = field(default_factory=OptimizerSettings)
    epochs: int = 1
    batch_size: int = 32
    seed: int = 0
    loss: tuple[LossTerm, ...] = (LossTerm("ce"),)
    schedule: tuple[Stage, ...] = ()
    version: int = PLAN_VERSION
    copies: int = 1
    widths: tuple[float, ...] = ()
    update_clip: UpdateClip | None = None

    #: Written only when not at their default, so that agents that predate them still read the plan.
    OMITTED_AT_DEFAULT: ClassVar[tuple[str, ...]] = ("copies", "widths", "update_clip")

    @property
    def ordered_dropout(self) -> bool:
        """Whether the plan draws a width per batch (``widths``) or distils towards the whole sub-model from one
        (``width_kd`` terms): what agents before `ORDERED_DROPOUT_REVISION` cannot read."""
        return bool(self.widths) or any(term.kind == "width_kd" for term in self.loss)

    def without_ordered_dropout(self) -> TrainingPlan:
        """The plan without ``widths`` and ``width_kd`` terms: the spec itself trained on the other terms (what an
        agent that predates ordered dropout is sent), or the plan itself when it has neither."""
        if not self.ordered_dropout:
            return self
        loss = tuple(term for term in self.loss if term.kind != "width_kd") or (LossTerm("ce"),)
        return replace(self, widths=(), loss=loss)

    @classmethod
    def from_recipe(cls, recipe: Recipe) -> TrainingPlan:
        """The plan a pre-plan task's :class:`Recipe` stands for: one plain (or masked) CE term."""
        return cls(
            optimizer=OptimizerSettings("sgd", recipe.lr, recipe.momentum, recipe.weight_decay, recipe.clip_norm),
            epochs=recipe.epochs,
            batch_size=recipe.batch_size,
            seed=recipe.seed,
            loss=(LossTerm.ce(masked=recipe.masked_ce),),
        )

    @property
    def uses_masked_ce(self) -> bool:
        """Whether a cross-entropy term masks absent classes (their classifier rows are then not aggregated)."""
        return any(term.kind == "ce" and term.masked for term in self.loss)

    def outputs_needed(self) -> int:
        """How many of the deepest outputs the loss reads at least (``-1`` needs 1, ``-3`` needs 3; a
        non-negative index ``i`` needs ``i + 1``)."""
        needed = 1
        for term in self.loss:
            for index in (term.output, term.teacher):
                if index is not None:
                    needed = max(needed, -index if index < 0 else index + 1)
        return needed

    def to_dict(self) -> dict[str, object]:
        """Msgpack-friendly form, as the codec writes it inside a task."""
        result = plain(self)
        assert isinstance(result, dict)
        return result

    @classmethod
    def from_dict(cls, data: object, limits: Limits = DEFAULT_LIMITS) -> TrainingPlan:
        """Strict inverse of :meth:`to_dict`; raises :class:`ProtocolError` naming what is wrong."""
        return read_training_plan(data, "plan", limits)


# ------------------------------------------------------------------------------------------------ readers
def _read_optimizer(obj: object, where: str, limits: Limits) -> OptimizerSettings:
    r = FieldReader(obj, where, limits, OptimizerSettings)
    return OptimizerSettings(
        kind=r.text("kind", OPTIMIZERS),
        lr=r.number("lr", above=0.0),
        momentum=r.number("momentum", minimum=0.0, below=1.0),
        weight_decay=r.number("weight_decay", minimum=0.0),
        clip_norm=r.opt_number("clip_norm", above=0.0),
    )


def _read_loss_term(obj: object, where: str, limits: Limits) -> LossTerm:
    if isinstance(obj, dict) and "kind" in obj and obj["kind"] not in LOSS_KINDS:
        raise ProtocolError(f"{where}.kind: unknown loss term kind {shown(obj.get('kind'))}; this side knows "
                            f"{', '.join(LOSS_KINDS)} (upgrade it to run this plan)")
    r = FieldReader(obj, where, limits, LossTerm, optional=("teacher_spec",))
    kind = r.text("kind", LOSS_KINDS)
    teacher_spec = r.opt_tree("teacher_spec")
    if teacher_spec is not None and _entries(teacher_spec) > limits.max_list_len:
        raise ProtocolError(f"{r.label('teacher_spec')} holds more than the limit of {limits.max_list_len} entries")
    term = LossTerm(
        kind=kind,
        weight=r.number("weight", minimum=0.0),
        output=r.integer("output"),
        masked=r.boolean("masked"),
        teacher=r.opt_integer("teacher"),
        tau=r.opt_number("tau", above=0.0),
        detach_teacher=r.boolean("detach_teacher"),
        teacher_spec=teacher_spec,
    )
    if kind != "nested_kd" and teacher_spec is not None:
        raise ProtocolError(f"{where}: only a 'nested_kd' term takes a 'teacher_spec'")
    if kind == "kd" and (term.teacher is None or term.tau is None or term.masked):
        raise ProtocolError(f"{where}: a 'kd' term needs 'teacher' and 'tau' and cannot be 'masked'")
    if kind == "ce" and (term.teacher is not None or term.tau is not None or term.detach_teacher):
        raise ProtocolError(f"{where}: a 'ce' term takes no 'teacher', 'tau' or 'detach_teacher'")
    if kind == "mutual_kd" and (term.tau is None or term.teacher is not None or term.masked or term.detach_teacher):
        raise ProtocolError(f"{where}: a 'mutual_kd' term needs 'tau' and takes no 'teacher', 'masked' or "
                            "'detach_teacher' (the other copies are the teachers, always detached)")
    if kind == "width_kd" and (term.tau is None or term.teacher is not None or term.masked or term.detach_teacher):
        raise ProtocolError(f"{where}: a 'width_kd' term needs 'tau' and takes no 'teacher', 'masked' or "
                            "'detach_teacher' (the whole sub-model is the teacher, always detached)")
    if kind == "nested_kd" and (term.teacher_spec is None or term.tau is None or term.teacher is not None
                                or term.masked or term.detach_teacher):
        raise ProtocolError(f"{where}: a 'nested_kd' term needs 'teacher_spec' (a map) and 'tau' and takes no "
                            "'teacher', 'masked' or 'detach_teacher' (the nested sub-model is the teacher, always "
                            "detached)")
    return term


def _entries(tree: object) -> int:
    """How many map entries and list items a decoded tree holds, at every level."""
    if isinstance(tree, dict):
        return len(tree) + sum(_entries(value) for value in tree.values())
    if isinstance(tree, list):
        return len(tree) + sum(_entries(value) for value in tree)
    return 0


def _read_stage(obj: object, where: str, limits: Limits) -> Stage:
    r = FieldReader(obj, where, limits, Stage, optional=("cache", "micro_batch"))
    micro = r.opt_integer("micro_batch", minimum=0)
    if micro == 1:
        raise ProtocolError(f"{r.label('micro_batch')} must be 0 (whole batches) or at least 2: batch "
                            "normalisation needs two samples")
    return Stage(epochs=r.integer("epochs", minimum=1), route=r.text("route", ROUTES),
                 cache=r.raw("cache") is not None and r.boolean("cache"), micro_batch=micro or 0)


def _read_list(value: object, where: str, most: int) -> list[object]:
    if not isinstance(value, list):
        raise ProtocolError(f"{where} must be a list, got {shown(value)}")
    if len(value) > most:
        raise ProtocolError(f"{where} has {len(value)} entries, more than the limit of {most}")
    return value


def read_training_plan(obj: object, where: str, limits: Limits) -> TrainingPlan:
    """Read and validate a training plan (a decoded msgpack map); raises :class:`ProtocolError`."""
    if isinstance(obj, dict) and "version" in obj:
        version = obj["version"]
        if type(version) is not int or version != PLAN_VERSION:
            raise ProtocolError(f"{where}.version: the training plan is version {shown(version)}, this side "
                                f"runs version {PLAN_VERSION}: upgrade the older side")
    r = FieldReader(obj, where, limits, TrainingPlan, optional=("copies", "widths", "update_clip"))
    terms = _read_list(r.raw("loss"), r.label("loss"), MAX_LOSS_TERMS)
    if not terms:
        raise ProtocolError(f"{r.label('loss')} must hold at least one term")
    stages = _read_list(r.raw("schedule"), r.label("schedule"), MAX_STAGES)
    return TrainingPlan(
        optimizer=r.nested("optimizer", _read_optimizer),
        epochs=r.integer("epochs", minimum=1),
        batch_size=r.integer("batch_size", minimum=2),
        seed=check_int(r.raw("seed"), r.label("seed")),
        loss=tuple(_read_loss_term(term, f"{r.label('loss')}[{i}]", limits) for i, term in enumerate(terms)),
        schedule=tuple(_read_stage(stage, f"{r.label('schedule')}[{i}]", limits) for i, stage in enumerate(stages)),
        version=PLAN_VERSION,
        copies=_read_copies(r),
        widths=_read_widths(r),
        update_clip=r.opt_nested("update_clip", _read_update_clip),
    )


def _read_update_clip(obj: object, where: str, limits: Limits) -> UpdateClip:
    r = FieldReader(obj, where, limits, UpdateClip)
    return UpdateClip(bound=r.number("bound", above=0.0), noise_multiplier=r.number("noise_multiplier", minimum=0.0))


def _read_widths(r: FieldReader) -> tuple[float, ...]:
    value = r.raw("widths")
    if value is None:
        return ()
    items = _read_list(value, r.label("widths"), MAX_WIDTHS)
    widths = tuple(check_number(item, f"{r.label('widths')} item", above=0.0) for item in items)
    if any(width > 1.0 for width in widths) or len(set(widths)) != len(widths):
        raise ProtocolError(f"{r.label('widths')} must hold distinct width rates in (0, 1], got {list(widths)}")
    return widths


def _read_copies(r: FieldReader) -> int:
    copies = r.opt_integer("copies", minimum=1)
    if copies is not None and copies > MAX_COPIES:
        raise ProtocolError(f"{r.label('copies')} is {copies}, more than the limit of {MAX_COPIES}")
    return 1 if copies is None else copies
