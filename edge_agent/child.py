"""The training child: trains one task in a process of its own, so that an out-of-memory kill or a crash takes
down the child, not the agent.

It is forked from the agent's training forkserver (``edge_agent.forkserver``), which has already imported this
module, and with it torch and the models, and run one tiny training step (``child_warmup``) so that torch's
one-time initialisation (the lazy import behind the first optimizer, kernel set-up) is shared by every child
instead of inflating each measured peak; the server starts no threads that would make forking unsafe (one
intra-op thread). Nothing crosses the process boundary pickled: the agent writes the task (protocol msgpack) and
a :class:`~edge_agent.workdir.TrainingRequest` (JSON) into a work directory, the child reads its data from an
``.npz`` written once by the agent (``allow_pickle=False``), and answers with an encoded update or an error text.

The child first sets up its heap as the request says (``edge_agent.allocator``; the estimate was made for the
same setting). The task file holds exactly the weights of the spec to train (the decision child cut an adapted
spec out of the received one beforehand), so every child runs the same code after its baseline. Before the
baseline it maps that code and creates its per-shape runtime objects with one step of a throwaway copy on one
batch, and trims the heap (:func:`warm_up_training`). It measures its own peak: the resident-set high-water mark
is reset (``/proc/self/clear_refs``) right before the model is built, so ``peak - baseline`` is what training
allocated (model, gradients, optimizer state, activations, workspace, and small runtime structures,
``models.memory.CPU_RUNTIME_BYTES``); on CUDA the allocator's peak is used instead. A plan with several copies
(m-FeDepth) loads the device's own auxiliary copies from its store and saves them back once trained.
"""

from __future__ import annotations

import gc
import json
import os
import resource
import warnings
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path

import numpy as np
import torch

from common.blas_threads import guard_blas_threads
from edge_agent import allocator as heap
from edge_agent import gpu_stack
from edge_agent.copies import CopyStore
from edge_agent.memory import gpu_free_memory
from edge_agent.update_clip import clip_update
from edge_agent.workdir import (
    CUDA_START_FILE,
    TASK_FILE,
    UPDATE_FILE,
    ProgressBeacon,
    TrainingRequest,
    write_message,
)
from models import FamilyNet, ModelFamily, SubmodelSpec, TrainResult, get_family, train
from protocol import ModelRef, Task, TrainingPlan, Update, UpdateStatus, decode


def rss_bytes() -> int:
    """Current resident set size of this process."""
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak_rss() -> bool:
    """Reset the kernel's RSS high-water mark (VmHWM); False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    """The RSS high-water mark (VmHWM since the last reset, else the lifetime maximum)."""
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def warm_up_training(build: Callable[[], FamilyNet], spec: SubmodelSpec, x: torch.Tensor, y: torch.Tensor,
                     plan: TrainingPlan, labels: list[int], num_classes: int, device: str, allocator: str, *,
                     family: ModelFamily | None = None, on_step: Callable[[], None] | None = None) -> None:
    """One step of every stage of ``plan`` on a throwaway model from ``build`` and one batch, and one more on a
    batch of the size the epoch ends with when that is shorter (learning rate 0), then the heap settled for ``allocator`` (:func:`edge_agent.allocator.settle`).

    Run before the baseline, it maps the code the run will execute and creates what the runtime keeps per batch
    shape (oneDNN's primitives and JIT kernels). libtorch's and oneDNN's code pages are file-backed, not copied on
    fork, and how many of them a first execution adds to the RSS depends on the page cache (the same CNN task
    measured 40 MB above the baseline in one virtualenv and 101 MB in a freshly installed one without a warm-up
    step); the per-shape objects landed in the heap wherever it had room, which moved the smallest benchmark rows
    by 0.5 MB from run to run while the warm-up ran at another shape. The trim then gives back what the step
    freed, above all the working set glibc's default heap would keep below the baseline. Afterwards the peak above
    the baseline is the memory training allocates, which is what the estimate predicts. The warm-up's own peak is
    that of one training step, so it needs no more memory than the run. Ordered dropout (the plan's ``widths``)
    draws a width per batch, each width its own shapes: the warm-up runs every width once (with ``width_kd``
    terms, the spec's pass and then that width's), not the one or two the run's first batches would draw.
    ``family`` (the model's) is needed by a plan with ``nested_kd`` terms or ``widths``; ``on_step`` is called
    after each of its steps.
    """
    warm, others = build(), [build() for _ in range(plan.copies - 1)]
    batch = max(2, plan.batch_size)
    # The epoch's last, shorter batch too: its shapes get their own oneDNN primitives, which would otherwise be
    # created after the baseline, at the end of the first stage, and raise every later stage's peak (0.76 MB on
    # PreResNet-20 blocks 5-8 with a last batch of 9).
    rest = len(x) % batch if len(x) > batch else 0
    take = batch + (rest if rest >= 2 else 0)
    still = replace(plan, epochs=1, batch_size=batch, optimizer=replace(plan.optimizer, lr=0.0),
                    schedule=tuple(replace(stage, epochs=1) for stage in plan.schedule))
    for each in [replace(still, widths=(width,)) for width in plan.widths] or [still]:
        train(warm, spec, x[:take], y[:take], each, labels=labels, num_classes=num_classes, device=device,
              copies=others, family=family, on_step=on_step)
    del warm, others
    gc.collect()
    if device != "cuda":
        heap.settle(allocator)


def _reset_peak(device: str) -> None:
    """Start a new high-water mark (where the kernel refuses, VmHWM stays the lifetime peak: an upper bound)."""
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    else:
        reset_peak_rss()


def _peak_above(device: str, baseline: int) -> int:
    """The peak since the last reset above ``baseline`` (CUDA: the allocator's; CPU: the RSS high-water mark)."""
    if device == "cuda":
        return int(torch.cuda.max_memory_allocated() - baseline)
    return max(0, peak_rss_bytes() - baseline)


def _load_copies(store: CopyStore, model_ref: ModelRef, family: ModelFamily, spec: SubmodelSpec,
                 plan: TrainingPlan) -> list[FamilyNet]:
    """The plan's further copies (``copies - 1`` models): the device's stored ones, new ones where it has none."""
    if plan.copies == 1:
        return []
    models = []
    for state in store.load(model_ref, family, spec, plan.copies - 1, plan.seed):
        copy = family.build(spec, track_bn_stats=False)
        copy.load_state_dict({key: torch.from_numpy(value) for key, value in state.items()}, strict=True)
        models.append(copy)
    return models


def _tensors_to_load(weights: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """Torch views of a decoded task's weights (read-only numpy views on the task file's bytes), for
    ``load_state_dict``, which copies them into the model's own parameters and writes nothing to them: torch's
    warning that they are not writable is silenced here only."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return {key: torch.from_numpy(value) for key, value in weights.items()}


def _built(family: ModelFamily, spec: SubmodelSpec, weights: dict[str, torch.Tensor], device: str) -> FamilyNet:
    """The model of ``spec`` with the received ``weights``: copied into its own parameters, except on CPU for a
    spec that trains the head alone (FeDepth where no block fits), whose frozen body runs from the received
    weights themselves (views on the task's bytes, already in the baseline; nothing writes to them) and only the
    head gets a copy of its own, as the memory estimate counts it."""
    if device == "cuda" or not spec.head_only or any(value.dtype != torch.float32 for value in weights.values()):
        # (weights of another float type are cast by the copy: the estimate counts float32 parameters)
        model = family.build(spec, track_bn_stats=False)
        model.load_state_dict(weights, strict=True)
        return model
    with torch.device("meta"):
        model = family.build(spec, track_bn_stats=False)
    trained = set(family.trainable_keys(spec))
    model.load_state_dict({key: value.clone() if key in trained else value for key, value in weights.items()},
                          strict=True, assign=True)
    return model.train()


def train_in_workdir(workdir: Path) -> None:
    """The training child's work: read task, request and data; train; write the update. Its progress goes into
    the work directory as it trains (:class:`~edge_agent.workdir.ProgressBeacon`)."""
    beacon = ProgressBeacon(workdir)
    try:
        _train(workdir, beacon)
    finally:
        beacon.close()


def _train(workdir: Path, beacon: ProgressBeacon) -> None:
    request = TrainingRequest.read(workdir)
    torch.set_num_threads(request.torch_threads)
    guard_blas_threads()  # the server did (its children inherit it); again, for a child started without one
    applied = heap.configure(request.allocator) if request.device != "cuda" else None
    task, x, y = _read_inputs(workdir, request)
    family = get_family(task.model.family, task.model.num_classes, task.model.in_channels, **task.model.options)
    spec = SubmodelSpec.from_dict(request.spec)
    device = request.device
    if request.spec != task.spec:
        raise ValueError(f"the plan says {request.spec}, the task holds weights for {task.spec}")
    training = task.training_plan()
    weights = _tensors_to_load(task.weights)
    gpu_free_before = gpu_free_memory() if device == "cuda" else None  # NVML: CUDA is not started yet
    beacon.beat()
    # The throwaway copy is built as the model will be (a head-only model's first build on the meta device costs
    # about 1 MB of one-off runtime objects, paid here, before the baseline).
    build = partial(_built, family, spec, weights, device)
    warm_up_training(build, spec, x, y, training, request.labels,
                     task.model.num_classes, device, request.allocator, family=family, on_step=beacon.beat)
    cuda = _cuda_start(gpu_free_before) if device == "cuda" else {}
    if cuda:  # for the agent even if training then fails (an out-of-memory error the CUDA start caused, say)
        (workdir / CUDA_START_FILE).write_text(json.dumps(cuda))
    baseline = torch.cuda.memory_allocated() if device == "cuda" else rss_bytes()
    reserved_baseline = torch.cuda.memory_reserved() if device == "cuda" else 0
    _reset_peak(device)
    model = build()
    del weights, build
    store = CopyStore(Path(request.copies_dir))
    copies = _load_copies(store, task.model, family, spec, training)
    peaks: list[int] = [_peak_above(device, baseline)]  # building and loading the model

    def on_stage(_index: int, phase: str) -> None:
        # Each stage's own peak: the high-water mark is reset when it starts and read when it ends.
        beacon.beat()
        if phase == "start":
            if device != "cuda":
                heap.start_stage(request.allocator)
            _reset_peak(device)
        else:
            peaks.append(_peak_above(device, baseline))

    result = train(model, spec, x, y, training, labels=request.labels, num_classes=task.model.num_classes,
                   device=device, on_stage=on_stage, copies=copies, family=family, on_step=beacon.beat)
    trained = model.state_dict()
    state = {key: trained[key].detach().cpu().numpy().astype(np.float32) for key in family.trainable_keys(spec)}
    if training.update_clip is not None:  # differential privacy: the change clipped (and noised) here
        state, _ = clip_update(state, task.weights, training.update_clip)
    metrics = _metrics(result, peaks, spec, device, reserved_baseline, cuda, request.allocator, applied)
    if copies:  # the device keeps its auxiliary copies for the next round; only the first model is uploaded
        metrics["copies"] = float(training.copies)
        store.save(task.model, spec, [
            {key: weights[key].detach().cpu().numpy().astype(np.float32) for key in family.state_keys(spec)}
            for weights in (copy.state_dict() for copy in copies)])
    update = Update(task.task_id, task.round, task.agent_id, UpdateStatus.OK, spec.to_dict(), len(y),
                    list(request.labels), state, metrics, None)
    write_message(workdir / UPDATE_FILE, update)


def _read_inputs(workdir: Path, request: TrainingRequest) -> tuple[Task, torch.Tensor, torch.Tensor]:
    """The task the agent wrote and the shard it trains on (a numpy archive, read without pickle)."""
    task = decode((workdir / TASK_FILE).read_bytes(), expected=Task)
    assert isinstance(task, Task)
    with np.load(request.data_path, allow_pickle=False) as archive:
        x = torch.from_numpy(np.array(archive["x"], dtype=np.float32))
        y = torch.from_numpy(np.array(archive["y"], dtype=np.int64))
    return task, x, y


def _metrics(result: TrainResult, peaks: list[int], spec: SubmodelSpec, device: str, reserved_baseline: int,
             cuda: dict[str, float], allocator: str, applied: str | None) -> dict[str, float]:
    """What the update reports of its training: loss, steps, time, the memory peak (of every stage where it was
    trained depth-wise), on CUDA what the caching allocator and CUDA itself held, whether the pooled heap served."""
    metrics = {"loss": result.loss, "steps": float(result.steps), "seconds": result.seconds,
               "stages": float(result.stages), "peak_bytes": float(max(peaks))}
    if device == "cuda":  # what the caching allocator held beyond its peak of allocations, and CUDA's own cost
        metrics["cuda_reserved_peak_bytes"] = float(torch.cuda.max_memory_reserved() - reserved_baseline)
        metrics.update(cuda)
    if allocator == "pooled" and applied is not None:  # 0: the pool was not loaded (compact instead)
        metrics["pooled_heap"] = float(applied == "pooled")
    if spec.segments is not None:  # depth-wise: the peak of every stage, in order
        metrics.update({f"stage_peak_bytes.{i}": float(value) for i, value in enumerate(peaks[1:])})
    return metrics


def _cuda_start(free_before: int | None) -> dict[str, float]:
    """What starting CUDA cost this warm process on the GPU beyond the allocations training will make
    (``cuda_context_bytes``): the drop of the GPU's free memory from before CUDA started (``free_before``) to now,
    both read from NVML on the GPU the agent watches, less the blocks torch's caching allocator holds free for
    training to reuse. It is the context and what the warm-up left allocated (cuBLAS's workspace); another
    process allocating on the GPU meanwhile moves it. Empty where NVML is missing (a Jetson: its GPU memory is the
    system's RAM)."""
    free_now = gpu_free_memory() if free_before is not None else None
    if free_before is None or free_now is None:
        return {}
    cached_free = torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
    return {"cuda_context_bytes": float(max(0, free_before - free_now - cached_free))}


def probe_cuda(workdir: Path) -> None:
    """A child's work that only tells whether torch can train on a CUDA device (``cuda.json``): CUDA is started
    here (not counted through NVML, which its server sets up for its other children) and one tensor allocated, so
    a driver too old for torch's CUDA, or a GPU it has no code for, answers no."""
    os.environ.pop(gpu_stack.NVML_CHECK_ENV, None)
    try:
        usable = bool(torch.cuda.is_available()) and torch.zeros(1, device="cuda").item() == 0.0
    except (RuntimeError, AssertionError):
        usable = False
    (workdir / "cuda.json").write_text(json.dumps({"available": usable}))
