"""Training-memory estimates: the peak bytes of training a sub-model with its training plan, before training.

:func:`estimate_plan_memory` is the entry (:func:`estimate_plan_stages` gives each stage's estimate): the peak a
training child of the edge agent measures above its baseline, in the parts of a :class:`MemoryEstimate`. One
training step of the plan (:func:`models.training.backward_step`, every stage of a depth-wise plan) runs on the
``meta`` device, shapes without data, under a dispatch mode that follows every storage's live bytes (and, on CPU,
oneDNN's convolution copies); the optimizer step is added analytically, then the device terms (the CPU runtime and
heap, the CUDA allocator's rounding).

What it counts, how, and how its constants were measured: ``docs/edge-runtime.md``, section "Memory estimator:
what it counts and how it was measured".
"""

from __future__ import annotations

import json
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from models._checks import check_input_size, check_positive_int
from models.conv_workspace import convolution_workspace
from models.depthwise import SegmentModel
from models.family import ModelFamily
from models.net import FamilyNet
from models.spec import SubmodelSpec
from models.training import (
    NestedTeachers,
    OrderedDropout,
    WidthNet,
    backward_step,
    micro_batch_size,
    nested_teachers,
    stages,
)
from protocol.plan import LossTerm, TrainingPlan

__all__ = [
    "CPU_ALLOCATORS",
    "CPU_HEAP_RETENTION",
    "CPU_RUNTIME_BYTES",
    "CUDA_BLOCK_BYTES",
    "MemoryEstimate",
    "estimate_plan_memory",
    "estimate_plan_stages",
]

#: Memory a training child of the agent's warm forkserver needs beyond tensors (small blocks, page rounding).
CPU_RUNTIME_BYTES = 120_000
#: Extra heap glibc keeps with its default settings, as a multiple of the per-step working set
#: (docs/edge-runtime.md).
CPU_HEAP_RETENTION = 1.0
#: How the training process's C heap is managed (see docs/edge-runtime.md): ``"compact"`` returns every freed
#: block of a page or more to the system at once (``edge_agent.allocator``), ``"pooled"`` keeps their pages for
#: reuse within the live high-water mark (the same peak), ``"default"`` is glibc's default.
CPU_ALLOCATORS = ("pooled", "compact", "default")
#: Heaps whose peaks are estimated alike (one cache entry, one retention).
_SAME_ESTIMATE = {"pooled": "compact"}
_RETENTION = {"compact": 0.0, "default": CPU_HEAP_RETENTION}
#: Granularity of the CUDA caching allocator.
CUDA_BLOCK_BYTES = 512

_DEVICES = ("cpu", "cuda")

# Per model (two instances of one family with the same classes, channels and options are one model: the start-of-run
# checks, a coordinator and each run of a comparison make their own), each step's estimate and bytes per sample.
_cache: dict[tuple[Any, ...], dict[_Step, tuple[MemoryEstimate, int]]] = {}
_lock = threading.Lock()


def _model_of(family: ModelFamily) -> tuple[Any, ...]:
    """What a family's estimates depend on: its class, classes, input channels and options."""
    return (type(family).__module__, type(family).__qualname__, family.num_classes, family.in_channels,
            json.dumps(family.options, sort_keys=True, default=str))


# ---------------------------------------------------------------------------------------------------- tracking
class _LiveBytes(TorchDispatchMode):
    """Live bytes of the tensor storages created while active (each storage once, until it is freed)."""

    def __init__(self, granularity: int = 1, workspace: Callable[[Any, Any, Any], int] | None = None) -> None:
        super().__init__()
        self.granularity = granularity
        self.workspace = workspace
        self.live = 0
        self.peak = 0
        self._refs: dict[int, Any] = {}

    def _rounded(self, nbytes: int) -> int:
        g = self.granularity
        return nbytes if g <= 1 else max(g, -(-nbytes // g) * g)

    def _freed(self, key: int, size: int) -> None:
        self.live -= size
        self._refs.pop(key, None)

    def _watch(self, storage: Any, size: int) -> None:
        key: int = storage._cdata

        def freed(_ref: object) -> None:
            self._freed(key, size)

        self._refs[key] = weakref.ref(storage, freed)

    def ignore(self, tensors: Sequence[torch.Tensor]) -> None:
        """Count the storages of ``tensors`` (created earlier, e.g. the parameters) as zero bytes."""
        for t in tensors:
            self._watch(t.untyped_storage(), 0)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                if storage._cdata in self._refs:
                    continue  # a view or an in-place result
                size = self._rounded(storage.nbytes())
                self._watch(storage, size)
                self.live += size
                self.peak = max(self.peak, self.live)
        if self.workspace is not None:
            self.peak = max(self.peak, self.live + self.workspace(func, args, out))
        return out


@dataclass(frozen=True)
class _Trace:
    """One simulated forward/backward pass (bytes; tensor sizes rounded as the device allocator does)."""

    parameters: int
    trainable: tuple[int, ...]  # bytes of every trainable parameter
    activations: int  # batch tensors alive at the end of forward (incl. input batch, labels)
    fb_peak: int  # peak live bytes of forward + backward, parameters and optimizer state excluded
    after_backward: int  # live bytes after backward (gradients, the batch), parameters excluded
    frozen_peak: int  # peak live bytes of the frozen blocks' forward pass above the batch (block training)
    segment_input: int = 0  # bytes of the input batch of the trained segment (block training)


_CE = (LossTerm("ce"),)


class _Nets(NamedTuple):
    """What one traced step runs: the model, the copies trained beside it, the module the batch enters (the model,
    or a segment of it), the nested teachers and ordered dropout's narrower width, of its second pass."""

    model: FamilyNet
    others: list[FamilyNet]
    net: nn.Module
    teachers: NestedTeachers | None
    width: WidthNet | None


def _nets(family: ModelFamily, step: _Step) -> _Nets:
    """The step's modules, built on the meta device as the interpreter builds them."""
    with torch.device("meta"):
        model = family.build(step.spec, track_bn_stats=False)
        others = [family.build(step.spec, track_bn_stats=False).train() for _ in range(step.copies - 1)]
    teachers = nested_teachers(family, step.spec, step.loss, model)  # the interpreter's own, built alike
    if teachers is not None and (step.segment is not None or step.copies > 1):
        raise ValueError("nested_kd terms are not supported with copies or in depth-wise training.")
    # Ordered dropout: with width_kd terms a batch's second pass trains a narrower width beside the gradients the
    # first left; the widest narrower one is the costliest. Without them a batch trains one width, the spec's the
    # largest: the spec alone is traced.
    distils = any(term.kind == "width_kd" for term in step.loss)
    dropout = OrderedDropout(family, step.spec, step.widths, model, 0) if step.widths and distils else None
    width = dropout.widest_narrower() if dropout is not None else None
    # Inputs the model cannot take are a ValueError here; any other failure of the traced pass (torch refusing
    # autograd, say) is not about the input and reaches the caller as itself.
    family.check_input(step.input_size)
    net: nn.Module = model if step.segment is None else SegmentModel(model, *step.segment, step.shape(family),
                                                                     step.route)
    net.train()
    return _Nets(model, others, net, teachers, width)


def _trace(family: ModelFamily, step: _Step) -> _Trace:
    """One forward and backward pass of ``step`` (two with ``accumulate``) on the meta device, its live bytes
    followed."""
    granularity = CUDA_BLOCK_BYTES if step.device == "cuda" else 1
    model, others, net, teachers, width = _nets(family, step)
    params = [p for m in (model, *others) for p in m.parameters()]
    workspace = partial(convolution_workspace, threads=step.threads) if step.device == "cpu" else None
    tracker = _LiveBytes(granularity, workspace)
    tracker.ignore(params)
    marks: dict[str, int] = {}

    def segment_starts(_module: nn.Module, args: Any) -> None:
        # The peak so far when the trained segment starts is the peak of the frozen blocks' forward pass.
        marks.setdefault("frozen", tracker.peak)
        marks.setdefault("segment_input", int(args[0].nbytes))

    if isinstance(net, SegmentModel):  # the segment's first block, or the head when it trains alone
        (model.blocks[net.start] if net.start < net.stop else net.classifier).register_forward_pre_hook(
            segment_starts)
    with torch.enable_grad(), tracker:
        inputs = torch.empty(*step.shape(family), device="meta")
        targets = torch.empty(step.batch_size, dtype=torch.long, device="meta")
        mask = torch.ones(family.num_classes, dtype=torch.bool, device="meta")
        batch = tracker.live
        held_gradients = 0  # left by an earlier micro-batch: counted as gradients, not as activations

        def forwarded() -> None:  # the most alive at the end of a forward pass (of any copy or width)
            # (What an earlier copy's or ordered-dropout pass's gradients add stays in: the measured peaks of those
            # plans are above the estimate without it.)
            marks["activations"] = max(marks.get("activations", 0), tracker.live - held_gradients)

        value = backward_step(net, inputs, targets, step.loss, mask, others, after_forward=forwarded,
                              teachers=teachers, width=width)
        if step.accumulate:  # a second micro-batch: its pass runs beside the gradients the first left
            held_gradients = sum(tracker._rounded(p.grad.nbytes) for p in params if p.grad is not None)
            value = backward_step(net, inputs, targets, step.loss, mask, others, after_forward=forwarded,
                                  teachers=teachers, width=width)
        activations = marks["activations"]
        after_backward = tracker.live
        del value, inputs, targets, mask
    # A CPU task that trains no body block runs the body from the weights it received (no copy of its own).
    shared = step.device == "cpu" and step.spec.head_only
    return _Trace(
        parameters=sum(tracker._rounded(p.nbytes) for p in params if p.requires_grad or not shared),
        trainable=tuple(tracker._rounded(p.nbytes) for p in params if p.requires_grad),
        activations=activations,
        fb_peak=tracker.peak,
        after_backward=after_backward,
        frozen_peak=marks.get("frozen", batch) - batch,
        segment_input=marks.get("segment_input", 0),
    )


def _step_temporaries(trainable: Sequence[int], slots: int, device: str) -> int:
    """Bytes of the temporaries alive at the peak of ``optimizer.step()`` (weight decay > 0 assumed).

    CPU runs torch's per-parameter implementation: weight decay makes ``grad + wd * param`` for one parameter at
    a time; Adam (``slots >= 2``) also makes ``sqrt(exp_avg_sq)`` and its quotient for that parameter. CUDA runs
    the ``foreach`` implementation: weight decay makes the decayed gradients of all parameters at once (Adam frees
    them before it makes the square roots of all parameters, which are as large). Checked against torch's
    optimizers on meta tensors in the tests.
    """
    if not trainable:
        return 0
    if device == "cuda":
        return sum(trainable)
    return (1 if slots < 2 else 3) * max(trainable)


# ---------------------------------------------------------------------------------------------------- estimate
@dataclass(frozen=True)
class MemoryEstimate:
    """Estimated peak training memory in bytes, and its parts (each explained in docs/edge-runtime.md, "The parts
    of ``MemoryEstimate``").

    ``total`` is the sum of the seven parts (``cache``: the buffered outputs of frozen blocks, depth-wise stages
    only).
    """

    parameters: int
    gradients: int
    optimizer_state: int
    activations: int
    workspace: int
    overhead: int
    device: str = "cpu"
    cache: int = 0
    total: int = field(init=False)

    def __post_init__(self) -> None:
        parts = (
            self.parameters,
            self.gradients,
            self.optimizer_state,
            self.activations,
            self.workspace,
            self.overhead,
            self.cache,
        )
        object.__setattr__(self, "total", sum(parts))

    def as_dict(self) -> dict[str, int | str]:
        """The parts and the total, e.g. for a task report."""
        return {
            "parameters": self.parameters,
            "gradients": self.gradients,
            "optimizer_state": self.optimizer_state,
            "activations": self.activations,
            "workspace": self.workspace,
            "overhead": self.overhead,
            "cache": self.cache,
            "total": self.total,
            "device": self.device,
        }


def _check_device(device: object) -> str:
    if isinstance(device, torch.device):
        device = device.type
    if not isinstance(device, str):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}.")  # noqa: TRY004
    kind = device.split(":", 1)[0]
    if kind not in _DEVICES:
        raise ValueError(f"device must be 'cpu' or 'cuda' (optionally 'cuda:N'), got {device!r}.")
    return kind


def _check_segment(segment: object) -> tuple[int, int] | None:
    if segment is None:
        return None
    if (not isinstance(segment, (tuple, list)) or len(segment) != 2
            or any(isinstance(v, bool) or not isinstance(v, int) for v in segment)):
        raise ValueError(f"segment must be a block range (start, stop) or None, got {segment!r}.")
    return int(segment[0]), int(segment[1])


@dataclass(frozen=True)
class _Step:
    """One training step to estimate, checked and normalised: the estimates' cache key.

    A training construct the estimator learns is a field here, checked in :meth:`checked` and run in the traced
    pass (:func:`_nets`, :func:`_trace`), as the interpreter (:mod:`models.training`) runs it.

    ``spec``: the sub-model. ``batch_size``: the training batch. ``input_size``: the images' height and width.
    ``optimizer_slots``: state tensors per trainable parameter (SGD with momentum 1, plain SGD 0, Adam 2).
    ``device``: ``"cpu"`` (process RSS) or ``"cuda"`` (caching-allocator peak, CUDA context excluded).
    ``allocator``: CPU only (None on CUDA), how the training process's heap is managed, as estimated: ``"compact"``
    (no heap retention; the ``"pooled"`` heap is estimated alike) or ``"default"`` (glibc's default settings,
    :data:`CPU_HEAP_RETENTION`); docs/edge-runtime.md. ``loss``: the step's loss terms.
    ``segment``, ``route``: ``None``, the whole sub-model trained; a block range ``(start, stop)``, depth-wise
    training of those blocks and a head, reached through ``route`` (:class:`models.depthwise.SegmentModel`).
    ``copies``: models of ``spec`` trained side by side on every batch (m-FeDepth's mutual distillation), only
    whole. ``accumulate``: ``batch_size`` is a micro-batch whose gradients accumulate with others' before the
    optimizer steps (``Stage.micro_batch``): two passes, the second beside the gradients of the first.
    ``widths``: ordered dropout's widths (``TrainingPlan.widths``): with ``width_kd`` terms the batch's second pass,
    at the widest width narrower than ``spec``, follows the spec's; only whole. ``threads``: CPU only, the torch
    threads the step runs with (some oneDNN kernels keep scratch per thread:
    :func:`models.conv_workspace.gemm_weight_gradient`).
    """

    spec: SubmodelSpec
    batch_size: int
    input_size: tuple[int, int]
    optimizer_slots: int
    device: str
    allocator: str | None
    loss: tuple[LossTerm, ...]
    segment: tuple[int, int] | None
    route: str
    copies: int
    accumulate: bool
    widths: tuple[float, ...]
    threads: int

    @classmethod
    def checked(cls, family: ModelFamily, spec: SubmodelSpec | None, *, batch_size: int, input_size: tuple[int, int],
                optimizer_slots: int, device: str, allocator: str, loss: Sequence[LossTerm],
                segment: tuple[int, int] | None, route: str, copies: int, accumulate: bool, widths: Sequence[float],
                threads: int) -> _Step:
        """The step the arguments describe; ValueError with one sentence for any that cannot go together."""
        spec = family.validate_spec(spec)
        batch_size = check_positive_int("batch_size", batch_size)
        if isinstance(optimizer_slots, bool) or not isinstance(optimizer_slots, int) or optimizer_slots < 0:
            raise ValueError(f"optimizer_slots must be a non-negative integer, got {optimizer_slots!r}.")
        size = check_input_size(input_size)
        kind = _check_device(device)
        if allocator not in CPU_ALLOCATORS:
            raise ValueError(f"allocator must be one of {', '.join(CPU_ALLOCATORS)}, got {allocator!r}.")
        terms = tuple(loss)
        if not terms or not all(isinstance(term, LossTerm) for term in terms):
            raise ValueError("loss must be a non-empty sequence of protocol.LossTerm.")
        segment = _check_segment(segment)
        copies = check_positive_int("copies", copies)
        if copies > 1 and (segment is not None or spec.segments is not None):
            raise ValueError("copies are trained whole: a spec with segments or a segment takes one copy.")
        widths = tuple(float(width) for width in widths)
        threads = check_positive_int("threads", threads) if kind == "cpu" else 1
        if widths and (copies > 1 or segment is not None or spec.segments is not None):
            raise ValueError("ordered dropout (widths) trains one copy of a spec trained whole.")
        estimated = _SAME_ESTIMATE.get(allocator, allocator) if kind == "cpu" else None
        return cls(spec, batch_size, size, optimizer_slots, kind, estimated, terms, segment, route, copies,
                   bool(accumulate), widths, threads)

    def shape(self, family: ModelFamily) -> tuple[int, ...]:
        """The input batch's shape."""
        return (self.batch_size, family.in_channels, *self.input_size)


def _estimate_training_memory(
    family: ModelFamily,
    spec: SubmodelSpec | None = None,
    *,
    batch_size: int,
    input_size: tuple[int, int] = (28, 28),
    optimizer_slots: int = 1,
    device: str = "cpu",
    allocator: str = "pooled",
    loss: Sequence[LossTerm] = _CE,
    segment: tuple[int, int] | None = None,
    route: str = "skip",
    copies: int = 1,
    cache_samples: int = 0,
    accumulate: bool = False,
    widths: Sequence[float] = (),
    threads: int = 1,
) -> MemoryEstimate:
    """Estimate the peak memory of one training step of ``family`` at ``spec`` (``None``: the full model),
    described by keywords, some of which go only together (a ``segment`` with its ``route`` and
    ``cache_samples``, ``copies`` only whole): :func:`estimate_plan_memory` derives them from a training plan,
    which is how the rest of FedFit asks. The keywords are :class:`_Step`'s fields; besides them
    ``cache_samples``: with a ``segment`` after block 0, the frozen blocks' outputs for this many samples are
    buffered for the stage (``Stage.cache``), their bytes the estimate's ``cache`` (0: recomputed every batch).
    A spec with segments and no ``segment``: every stage is traced through the skip path, the most expensive
    counts.

    Results are cached per model (family class, classes, channels, options) and step. The first call in a process
    takes about a second (torch loads its meta kernels; docs/edge-runtime.md says what memory this costs); later
    ones take about 40 ms for the CNN and 60-120 ms for PreResNet18 on one x86 core, a cached result microseconds.
    """
    step = _Step.checked(family, spec, batch_size=batch_size, input_size=input_size, optimizer_slots=optimizer_slots,
                         device=device, allocator=allocator, loss=loss, segment=segment, route=route, copies=copies,
                         accumulate=accumulate, widths=widths, threads=threads)
    if isinstance(cache_samples, bool) or not isinstance(cache_samples, int) or cache_samples < 0:
        raise ValueError(f"cache_samples must be a non-negative integer, got {cache_samples!r}.")
    if step.segment is None and step.spec.segments is not None:
        return max((_estimated(family, replace(step, segment=_check_segment(stage), route="skip"))[0]
                    for stage in step.spec.segments), key=lambda e: e.total)
    estimate, per_sample = _estimated(family, step)
    return _with_cache(estimate, per_sample, cache_samples, step.segment)


def _estimated(family: ModelFamily, step: _Step) -> tuple[MemoryEstimate, int]:
    """The estimate of ``step`` (cached) and the bytes per sample of its segment's input (a stage's cache)."""
    with _lock:
        cached = _cache.get(_model_of(family), {}).get(step)
    if cached is not None:
        return cached
    with torch.inference_mode(False):  # autograd must record, even when called under inference mode
        trace = _trace(family, step)
    gradients = sum(trace.trainable)
    state = step.optimizer_slots * gradients
    step_peak = trace.after_backward + _step_temporaries(trace.trainable, step.optimizer_slots, step.device)
    tensor_peak = trace.parameters + state + max(trace.fb_peak, step_peak)
    accounted = trace.parameters + gradients + state + trace.activations
    workspace = max(0, tensor_peak - accounted)
    overhead = 0  # on CUDA the context and cuBLAS's workspace are held before training: the agent counts them apart
    if step.device == "cpu":  # the heap the allocator retains, the runtime's own
        assert step.allocator is not None
        working_set = tensor_peak - trace.parameters - state + trace.frozen_peak
        workspace += round(_RETENTION[step.allocator] * working_set)
        overhead = CPU_RUNTIME_BYTES
    estimate = MemoryEstimate(parameters=trace.parameters, gradients=gradients, optimizer_state=state,
                              activations=trace.activations, workspace=workspace, overhead=overhead,
                              device=step.device)
    result = (estimate, trace.segment_input // step.batch_size)
    with _lock:
        _cache.setdefault(_model_of(family), {})[step] = result
    return result


def _with_cache(estimate: MemoryEstimate, per_sample: int, samples: int,
                segment: tuple[int, int] | None) -> MemoryEstimate:
    """``estimate`` with the buffer of ``samples`` frozen outputs of ``per_sample`` bytes each (none before block 0
    or without samples)."""
    if samples == 0 or segment is None or segment[0] == 0:
        return estimate
    return replace(estimate, cache=samples * per_sample)


def estimate_plan_memory(
    family: ModelFamily,
    spec: SubmodelSpec | None,
    plan: TrainingPlan,
    *,
    input_size: tuple[int, int] = (28, 28),
    device: str = "cpu",
    allocator: str = "pooled",
    samples: int = 0,
    threads: int = 1,
) -> MemoryEstimate:
    """The estimated peak of running ``plan`` on ``spec``: its batch size (a stage's micro-batches, with their
    accumulated gradients), its optimizer (SGD with momentum keeps one state tensor per parameter), its loss, and
    each of its stages; the most expensive stage counts. ``samples``: the local data's size, which the buffer of a
    stage with ``cache`` holds.

    ``device``: ``"cpu"`` (the process's RSS) or ``"cuda"`` (the caching allocator's peak, CUDA's context
    excluded); ``allocator``, on CPU: how the training process's heap is managed, ``"pooled"`` or ``"compact"``
    (no heap retention) or ``"default"`` (glibc's default settings); ``threads``, on CPU: the torch threads
    training runs with. Results are cached per model and arguments: the first estimate in a process takes about a
    second, later ones tens of milliseconds (docs/edge-runtime.md).
    """
    return max(estimate_plan_stages(family, spec, plan, input_size=input_size, device=device, allocator=allocator,
                                    samples=samples, threads=threads), key=lambda e: e.total)


def estimate_plan_stages(
    family: ModelFamily,
    spec: SubmodelSpec | None,
    plan: TrainingPlan,
    *,
    input_size: tuple[int, int] = (28, 28),
    device: str = "cpu",
    allocator: str = "pooled",
    samples: int = 0,
    threads: int = 1,
) -> list[MemoryEstimate]:
    """The estimate of each stage ``plan`` runs on ``spec``, in order (one for a spec trained whole); the
    arguments are :func:`estimate_plan_memory`'s, whose estimate is the largest of these."""
    spec = family.validate_spec(spec)
    slots = 1 if plan.optimizer.momentum > 0 else 0
    return [
        _estimate_training_memory(family, spec, batch_size=micro_batch_size(stage, plan.batch_size),
                                  input_size=input_size, optimizer_slots=slots, device=device, allocator=allocator,
                                  loss=plan.loss, segment=segment, route=stage.route, copies=plan.copies,
                                  widths=plan.widths, cache_samples=samples if stage.cache else 0,
                                  accumulate=micro_batch_size(stage, plan.batch_size) < plan.batch_size,
                                  threads=threads)
        for segment, stage in stages(spec, plan)
    ]
