"""Training in a child process, so that an out-of-memory kill or a crash takes down the child, not the agent.

Children come from a multiprocessing *forkserver* that has already imported this module, and with it torch
and the models (the agent stays warm, unlike per-message processes that re-import torch every round). The
server also runs one tiny training step (``child_warmup``) so that torch's one-time initialisation (the lazy
import behind the first optimizer, kernel set-up) is shared by every child instead of inflating each measured
peak; it starts no threads that would make forking unsafe (one intra-op thread). Nothing crosses the process
boundary pickled: the parent writes the task (protocol msgpack) and a small JSON plan into a work directory,
the child reads its data from an ``.npz`` written once by the agent (``allow_pickle=False``), and answers with
an encoded update or an error text.

The child first sets up its heap as the plan says (``edge_agent.allocator``; the estimate was made for the
same setting). The task file holds exactly the weights of the spec to train (the runner cuts an adapted spec
out of the received one beforehand), so every child runs the same code after its baseline. Before the baseline
it maps that code and creates its per-shape runtime objects with one step of a throwaway copy on one batch,
and trims the heap (:func:`warm_up_training`). It measures its own peak: the resident-set high-water mark is
reset (``/proc/self/clear_refs``) right before the model is built, so ``peak - baseline`` is what training
allocated (model, gradients, optimizer state, activations, workspace, and small runtime structures,
``models.memory.CPU_RUNTIME_BYTES``); on CUDA the allocator's peak is used instead.

Training-memory estimates are made in children of the same forkserver too (:func:`estimate_in_child`).
"""

from __future__ import annotations

import gc
import json
import multiprocessing
import os
import resource
import signal
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from edge_agent import allocator as heap
from edge_agent.copies import read_copies, write_copies
from models import (
    FamilyNet,
    MemoryEstimate,
    ModelFamily,
    SubmodelSpec,
    estimate_plan_memory,
    get_family,
    train,
)
from protocol import ModelRef, Task, TrainingPlan, Update, decode, encode

TASK_FILE = "task.msgpack"
PLAN_FILE = "plan.json"
UPDATE_FILE = "update.msgpack"
#: The auxiliary copies of a plan with ``copies`` > 1 (edge_agent.copies), before and after training.
COPIES_FILE = "copies.safetensors"
TRAINED_COPIES_FILE = "copies-trained.safetensors"
ERROR_FILE = "error.txt"
#: How far the measured CPU peak of identical tasks moves between runs (the smallest ``benchmarks/memory.py``
#: rows: about 0.3 MB between invocations; two agents of one simulation training the same sub-MB task: 0.37 and
#: 0.73 MB); the calibration does not learn from tasks that are small against it.
CPU_PEAK_RESOLUTION_BYTES = 300_000

_context: Any = None


def process_context() -> Any:
    """The forkserver context (preloading torch and the trainer), or spawn where fork is unavailable."""
    global _context
    if _context is None:
        if "forkserver" in multiprocessing.get_all_start_methods():
            forkserver = multiprocessing.get_context("forkserver")
            forkserver.set_forkserver_preload(["edge_agent.child", "edge_agent.child_warmup"])
            _context = forkserver
        else:
            _context = multiprocessing.get_context("spawn")
    return _context


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


@dataclass(frozen=True)
class ChildOutcome:
    """How a training child ended: the encoded update, or why there is none."""

    update: bytes | None
    exitcode: int | None
    error: str | None
    timed_out: bool = False
    out_of_memory: bool | None = None
    """For a child killed by SIGKILL (not for its deadline): whether the kernel counted an OOM kill meanwhile
    (None: not known; see :mod:`edge_agent.oom`)."""

    @property
    def killed_by(self) -> str | None:
        """The signal's name when the child was killed by one."""
        if self.exitcode is not None and self.exitcode < 0:
            try:
                return signal.Signals(-self.exitcode).name
            except ValueError:
                return f"signal {-self.exitcode}"
        return None


def run_in_child(workdir: Path, timeout: float, on_start: Any = None) -> ChildOutcome:
    """Run :func:`child_main` on ``workdir`` in a child process and wait at most ``timeout`` seconds."""
    process = process_context().Process(target=child_main, args=(str(workdir),), daemon=True)
    process.start()
    if on_start is not None:
        on_start(process.pid)
    process.join(timeout)
    if process.is_alive():
        process.kill()
        process.join(10)
        return ChildOutcome(None, process.exitcode, f"training did not finish within {timeout:.0f} s",
                            timed_out=True)
    update_path, error_path = workdir / UPDATE_FILE, workdir / ERROR_FILE
    if process.exitcode == 0 and update_path.exists():
        return ChildOutcome(update_path.read_bytes(), 0, None)
    error = error_path.read_text(errors="replace")[-2000:] if error_path.exists() else None
    return ChildOutcome(None, process.exitcode, error)


def estimate_in_child(model: ModelRef, options: list[tuple[SubmodelSpec, TrainingPlan]], *,
                      input_size: tuple[int, int], device: str, allocator: str,
                      samples: int = 0) -> list[MemoryEstimate]:
    """Training-memory estimates of running each (spec, plan) (``models.memory.estimate_plan_memory``), made in
    a child of the forkserver.

    The estimator's first use in a process imports what meta tensors need (about 160 MB of RSS, see
    ``models.memory``); the forkserver has paid that, so a child adds about 25 MB for a moment and the agent
    process does not grow at all. Specs and plans cross as their plain wire forms. ``samples`` is the local data's
    size (what a stage's buffer of frozen outputs holds).
    """
    arguments = (model.family, model.num_classes, model.in_channels, dict(model.options),
                 [(spec.to_dict(), plan.to_dict()) for spec, plan in options], tuple(input_size), device, allocator,
                 samples)
    with process_context().Pool(1) as pool:
        parts = pool.apply(_estimate, arguments)
    return [MemoryEstimate(**part) for part in parts]


def _estimate(family_name: str, num_classes: int, in_channels: int, options: dict[str, Any],
              pairs: list[tuple[dict[str, Any], dict[str, Any]]], input_size: tuple[int, int], device: str,
              allocator: str, samples: int) -> list[dict[str, Any]]:
    family = get_family(family_name, num_classes, in_channels, **options)
    estimates = [estimate_plan_memory(family, SubmodelSpec.from_dict(spec), TrainingPlan.from_dict(plan),
                                      input_size=input_size, device=device, allocator=allocator, samples=samples)
                 for spec, plan in pairs]
    return [{key: value for key, value in e.as_dict().items() if key != "total"} for e in estimates]


def child_main(workdir_text: str) -> None:
    """Entry point of the training child: read task, plan and data; train; write the update or the error."""
    workdir = Path(workdir_text)
    try:
        _train(workdir)
    except BaseException as exc:  # noqa: BLE001 - everything becomes a reported failure
        (workdir / ERROR_FILE).write_text(f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=5)}")
        sys.stderr.flush()
        os._exit(1)
    os._exit(0)


def warm_up_training(build: Callable[[], FamilyNet], spec: SubmodelSpec, x: torch.Tensor, y: torch.Tensor,
                     plan: TrainingPlan, labels: list[int], num_classes: int, device: str, allocator: str) -> None:
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
    that of one training step, so it needs no more memory than the run.
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
    train(warm, spec, x[:take], y[:take], still, labels=labels, num_classes=num_classes, device=device,
          copies=others)
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


def _load_copies(workdir: Path, family: ModelFamily, spec: SubmodelSpec, count: int) -> list[FamilyNet]:
    """The plan's further copies (``count - 1`` models), from the weights the runner wrote."""
    if count == 1:
        return []
    models = []
    for state in read_copies(workdir / COPIES_FILE, count - 1, family.state_keys(spec)):
        copy = family.build(spec, track_bn_stats=False)
        copy.load_state_dict({key: torch.from_numpy(value) for key, value in state.items()}, strict=True)
        models.append(copy)
    return models


def _train(workdir: Path) -> None:
    plan = json.loads((workdir / PLAN_FILE).read_text())
    torch.set_num_threads(int(plan["torch_threads"]))
    if plan["device"] != "cuda":
        heap.configure(plan["allocator"])
    task = decode((workdir / TASK_FILE).read_bytes(), expected=Task)
    assert isinstance(task, Task)
    with np.load(plan["data_path"], allow_pickle=False) as archive:
        x = torch.from_numpy(np.array(archive["x"], dtype=np.float32))
        y = torch.from_numpy(np.array(archive["y"], dtype=np.int64))
    family = get_family(task.model.family, task.model.num_classes, task.model.in_channels, **task.model.options)
    spec = SubmodelSpec.from_dict(plan["spec"])
    device = plan["device"]
    if plan["spec"] != task.spec:
        raise ValueError(f"the plan says {plan['spec']}, the task holds weights for {task.spec}")
    training = task.training_plan()
    weights = {key: torch.from_numpy(np.ascontiguousarray(value)) for key, value in task.weights.items()}
    warm_up_training(lambda: family.build(spec, track_bn_stats=False), spec, x, y, training, plan["labels"],
                     task.model.num_classes, device, plan["allocator"])
    baseline = torch.cuda.memory_allocated() if device == "cuda" else rss_bytes()
    _reset_peak(device)
    model = family.build(spec, track_bn_stats=False)
    model.load_state_dict(weights, strict=True)
    del weights
    copies = _load_copies(workdir, family, spec, training.copies)
    peaks: list[int] = [_peak_above(device, baseline)]  # building and loading the model

    def on_stage(_index: int, phase: str) -> None:
        # Each stage's own peak: the high-water mark is reset when it starts and read when it ends.
        if phase == "start":
            _reset_peak(device)
        else:
            peaks.append(_peak_above(device, baseline))

    result = train(model, spec, x, y, training, labels=plan["labels"], num_classes=task.model.num_classes,
                   device=device, on_stage=on_stage, copies=copies)
    peak = max(peaks)
    trained = model.state_dict()
    state = {key: trained[key].detach().cpu().numpy().astype(np.float32) for key in family.trainable_keys(spec)}
    metrics = {"loss": result.loss, "steps": float(result.steps), "seconds": result.seconds,
               "stages": float(result.stages), "peak_bytes": float(peak)}
    if copies:  # the device's auxiliary copies go back to the runner, which keeps them for the next round
        metrics["copies"] = float(training.copies)
        write_copies(workdir / TRAINED_COPIES_FILE, [
            {key: weights[key].detach().cpu().numpy().astype(np.float32) for key in family.state_keys(spec)}
            for weights in (copy.state_dict() for copy in copies)])
    if spec.segments is not None:  # depth-wise: the peak of every stage, in order
        metrics.update({f"stage_peak_bytes.{i}": float(value) for i, value in enumerate(peaks[1:])})
    update = Update(task.task_id, task.round, task.agent_id, "ok", spec.to_dict(), len(y),
                    [int(v) for v in plan["labels"]], state, metrics, None)
    (workdir / UPDATE_FILE).write_bytes(encode(update))
