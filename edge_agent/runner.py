"""Turns one task into one update: check, decide, train in a child process, report.

The agent process holds no torch: the decision (checks against the model family, estimates corrected by this
device's calibration, adaptation) is made BEFORE training in a *decision child*, and training runs in a
*training child*, both forked from the agent's training forkserver (``edge_agent.forkserver``); they exchange
files in a work directory (``edge_agent.workdir``). The real peak is measured in the training child and fed back
into the calibration. A child that is killed or crashes becomes a ``failed`` update with the reason; the agent
itself carries on.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from edge_agent import allocator as heap
from edge_agent import forkserver, oom
from edge_agent.calibration import Calibration
from edge_agent.forkserver import ChildOutcome, DecisionFailed
from edge_agent.limits import TaskLimits
from edge_agent.memory import available_memory, gpu_free_memory
from edge_agent.workdir import (
    CUDA_START_FILE,
    TASK_FILE,
    DataShape,
    Decision,
    DecisionRequest,
    TaskRejected,
    TrainingRequest,
    model_key,
    write_message,
)
from protocol import (
    MEMORY_KILL_REASON,
    BytesLike,
    ModelRef,
    ProtocolError,
    Task,
    Update,
    UpdateStatus,
    decode,
)

__all__ = ["BudgetFn", "LocalData", "TaskRejected", "TaskRunner"]

# Seconds a training child gets beyond the task's deadline before it is stopped (its update would be late).
DEADLINE_GRACE_S = 30.0
#: How long closing waits for the task being served to end once its child is killed.
CLOSE_WAIT_S = 15.0
#: What a CUDA training child's start (its context and cuBLAS's workspace) is taken to cost until one measured it:
#: 832-869 MiB on an H100 with CUDA 13 (the runner keeps the figure its last CUDA child measured).
CUDA_CONTEXT_BYTES = 2**30
#: How a training child's error text starts when the CUDA caching allocator refused an allocation
#: (``torch.OutOfMemoryError``): the GPU's own out-of-memory, which kills nothing.
CUDA_OUT_OF_MEMORY = "OutOfMemoryError:"
#: Seconds a training child may go without a sign of progress (a step, a stage, a batch of frozen outputs)
#: before it is killed and its task failed: far above a step of the largest model on a Raspberry Pi 4, far below
#: a round's deadline (a child deadlocked in its first convolution was waited for until then).
STALL_TIMEOUT_S = 300.0
#: Raw estimates the runner remembers between tasks, per model (a FeDepth cut of a 9-block model makes about
#: 60), and the models it remembers them for.
ESTIMATES_KEPT = 1024
MODELS_KEPT = 4


@dataclass
class LocalData:
    """The agent's private training data, already normalised: ``x`` N x C x H x W float32, ``y`` int64 labels
    (numpy arrays; anything numpy can read, a torch tensor say, is converted)."""

    x: np.ndarray
    y: np.ndarray
    labels: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.x = np.ascontiguousarray(np.asarray(self.x, dtype=np.float32))
        self.y = np.ascontiguousarray(np.asarray(self.y)).astype(np.int64, copy=False)
        if self.x.ndim != 4 or self.y.ndim != 1 or len(self.x) != len(self.y) or len(self.x) == 0:
            raise ValueError(f"local data must be a non-empty N x C x H x W batch with N labels, got "
                             f"{tuple(self.x.shape)} and {tuple(self.y.shape)}")
        if int(self.y.min()) < 0:
            raise ValueError("local labels must be non-negative class indices")
        self.labels = sorted(int(v) for v in np.unique(self.y))

    @property
    def image_size(self) -> tuple[int, int]:
        return int(self.x.shape[2]), int(self.x.shape[3])

    @property
    def in_channels(self) -> int:
        return int(self.x.shape[1])

    def shape(self) -> DataShape:
        """What the decision needs to know of the data: size, labels, channels and image size."""
        return DataShape(len(self.y), tuple(self.labels), self.in_channels, self.image_size)


BudgetFn = Callable[[int], "int | None"]


def _killed(outcome: ChildOutcome) -> str:
    """Why a child killed by a signal failed, the OOM killer told from anyone else."""
    if outcome.killed_by != "SIGKILL" or outcome.timed_out:
        return f"training process was killed by {outcome.killed_by}"
    if outcome.out_of_memory:
        return f"{MEMORY_KILL_REASON} (SIGKILL, out of memory)"
    if outcome.out_of_memory is None:
        return "training process was killed by SIGKILL (no OOM-kill counter to tell whether for memory)"
    return "training process was killed by SIGKILL, not for memory (the kernel counted no OOM kill)"


def _constant(budget: int | None) -> BudgetFn:
    """A budget that does not change from round to round."""
    return lambda _round: budget


class TaskRunner:
    """Serves tasks for one agent: writes its data once for the children, keeps its calibration and the
    estimates made so far; holds no torch and, once the data file is written, not the data either."""

    def __init__(
        self,
        agent_id: str,
        data: LocalData,
        budget: BudgetFn | int | None = None,
        device: str = "cpu",
        *,
        state_dir: str | Path | None = None,
        calibration: Calibration | None = None,
        torch_threads: int = 1,
        allocator: str = "pooled",
        limits: TaskLimits | None = None,
        stall_timeout: float = STALL_TIMEOUT_S,
        unified_memory: bool = False,
    ) -> None:
        self.agent_id = agent_id
        #: A training child that makes no progress for this many seconds is killed and its task failed.
        self.stall_timeout = stall_timeout
        #: What a CUDA training child's start costs on the GPU (its context), outside the allocator's peak that the
        #: estimate predicts: :data:`CUDA_CONTEXT_BYTES` until a child measured it (``cuda_context_bytes``).
        self.cuda_context_bytes = CUDA_CONTEXT_BYTES
        #: The GPU trains in the system's RAM (a Jetson): its free memory is psutil's, not NVML's.
        self.unified_memory = unified_memory
        self.limits = limits or TaskLimits()
        self.data: DataShape = data.shape()
        self.budget_for: BudgetFn = budget if callable(budget) else _constant(budget)
        self.device = device
        self.torch_threads = torch_threads
        # What the children really run (glibc-only "compact" falls back; "pooled" needs the page pool in the
        # forkserver, which starts with it when asked before it starts), so the estimates match it.
        self.allocator = heap.resolve(allocator)
        if self.allocator == "pooled" and not forkserver.preload_page_pool():
            self.allocator = "compact"
        self._own_state_dir = state_dir is None
        self.state_dir = Path(state_dir) if state_dir is not None else Path(tempfile.mkdtemp(
            prefix=f"fedfit-{agent_id}-"))
        self.state_dir.mkdir(parents=True, exist_ok=True)
        #: How this device runs (the device, and on CPU the heap): a calibration learnt one way says nothing of another.
        #: (The pooled heap peaks as the compact one does: they share one, kept across the change of default.)
        heap_key = "compact" if self.allocator == "pooled" else self.allocator
        self.runtime = "cuda" if device == "cuda" else f"cpu-{heap_key}"
        self._given_calibration = calibration
        self._calibrations: dict[str, Calibration] = {}
        self._last_model: ModelRef | None = None
        self.data_path = self.state_dir / "local-data.npz"
        np.savez(self.data_path, x=data.x, y=data.y)
        #: The device's own auxiliary copies (m-FeDepth), kept between rounds by the training children.
        self.copies_dir = self.state_dir / "copies"
        #: Raw estimates of earlier decisions, per model (:func:`edge_agent.workdir.model_key`), oldest first.
        self._estimates: OrderedDict[str, OrderedDict[str, dict[str, Any]]] = OrderedDict()
        #: The training child running now, if any.
        self.child_pid: int | None = None
        self._closing = threading.Event()
        self._busy = threading.Lock()
        #: Reads the OOM-kill counter that tells the OOM killer's SIGKILL from any other (:mod:`edge_agent.oom`).
        self.oom_kills: Callable[[], oom.OomCount | None] = oom.oom_kills

    def close(self, timeout: float = CLOSE_WAIT_S) -> None:
        """Stop serving: a task being served loses its child (killed) and is answered ``failed``, later tasks are
        declined. Waits up to ``timeout`` s for that task to end, then removes what the runner wrote when it chose
        the directory itself (left in place when the task has not ended: a child may still be writing there)."""
        self._closing.set()
        if not self._busy.acquire(timeout=timeout):
            return
        try:
            if self._own_state_dir:
                shutil.rmtree(self.state_dir, ignore_errors=True)
        finally:
            self._busy.release()

    # ------------------------------------------------------------------ public
    def run(self, task: Task, payload: BytesLike | None = None) -> Update:
        """Run ``task``; any failure becomes an update with status declined/failed and the reason. The update's
        metrics say where the device's time went: ``seconds_task`` (all of it, from here to the update),
        ``seconds_decision`` (the decision child), ``seconds_child`` (the training child, from fork to its update)
        and ``seconds`` (its training loop)."""
        started = time.perf_counter()
        try:
            with self._busy:
                update = self._serve(task, payload)
        except TaskRejected as exc:
            update = self._answer(task, exc.status, reason=exc.reason)
        except Exception as exc:  # noqa: BLE001 - the agent outlives any task
            update = self._answer(task, UpdateStatus.FAILED, reason=f"{type(exc).__name__}: {exc}")
        update.metrics["seconds_task"] = time.perf_counter() - started
        return update

    def available(self, round_number: int) -> int:
        """Memory training may use now: the round's budget, the cgroup's headroom and psutil's available, and on
        CUDA the GPU's free memory (NVML) less what a training child's CUDA start costs (its context:
        :attr:`cuda_context_bytes`). A GPU with unified memory (a Jetson, :attr:`unified_memory`) trains in the
        system's RAM, which psutil already counts once: there the CUDA start comes out of that figure instead. A
        discrete GPU whose free memory NVML cannot tell (no NVML in a container, say) is left to the rest."""
        free = available_memory(self.budget_for(round_number))
        if self.device != "cuda":
            return free
        if self.unified_memory:  # CPU and GPU allocations come out of the same RAM
            return max(0, min(free, available_memory() - self.cuda_context_bytes))
        gpu = gpu_free_memory()
        if gpu is None:
            return free
        return max(0, min(free, gpu - self.cuda_context_bytes))

    def calibration_for(self, model: ModelRef) -> Calibration:
        """The calibration of ``model`` on this device: one per model (family and options, classes, channels), input
        size, heap and device, each in its own file, so that what one model teaches never scales another's
        estimates (the one given to the runner, if any, serves every model)."""
        if self._given_calibration is not None:
            return self._given_calibration
        key = json.dumps([model_key(model), list(self.data.image_size), self.runtime])
        if key not in self._calibrations:
            digest = hashlib.sha256(key.encode()).hexdigest()[:12]
            self._calibrations[key] = Calibration(
                self.state_dir / f"calibration-{self.runtime}-{digest}.json", label=key,
                resolution=0 if self.device == "cuda" else forkserver.CPU_PEAK_RESOLUTION_BYTES)
        return self._calibrations[key]

    @property
    def calibration(self) -> Calibration:
        """The calibration of the model served last (before any task: the given one, or a fresh one that no file
        backs)."""
        if self._last_model is not None or self._given_calibration is not None:
            return self.calibration_for(self._last_model)  # type: ignore[arg-type]
        return Calibration(resolution=0 if self.device == "cuda" else forkserver.CPU_PEAK_RESOLUTION_BYTES)

    @property
    def remembered_estimates(self) -> int:
        """How many raw estimates the runner keeps from earlier decisions."""
        return sum(len(known) for known in self._estimates.values())

    def estimates_of(self, model: ModelRef) -> dict[str, dict[str, Any]]:
        """The raw estimates remembered for ``model``, by estimate key."""
        return dict(self._estimates.get(model_key(model), {}))

    def _remember(self, model: ModelRef, made: dict[str, dict[str, Any]]) -> None:
        key = model_key(model)
        known = self._estimates.setdefault(key, OrderedDict())
        self._estimates.move_to_end(key)
        known.update(made)
        while len(known) > ESTIMATES_KEPT:  # the oldest go first
            known.popitem(last=False)
        while len(self._estimates) > MODELS_KEPT:
            self._estimates.popitem(last=False)

    # --------------------------------------------------------------- internals
    def _serve(self, task: Task, payload: BytesLike | None) -> Update:
        if self._closing.is_set():
            raise TaskRejected(UpdateStatus.DECLINED, "the agent is stopping")
        if time.time() > task.deadline:
            raise TaskRejected(UpdateStatus.DECLINED, "the task's deadline passed before training could start")
        self._check_compatible(task)
        self._last_model = task.model
        # Named by a digest: a task id is wire data and must never become a path ("..", say).
        workdir = self.state_dir / "tasks" / hashlib.sha256(task.task_id.encode()).hexdigest()[:24]
        shutil.rmtree(workdir, ignore_errors=True)
        workdir.mkdir(parents=True)
        try:
            write_message(workdir / TASK_FILE, payload if payload is not None else task)  # as it came: no copy
            available = self.available(task.round)
            deciding = time.perf_counter()
            decision = self._decide(task, workdir, available)
            decided = time.perf_counter() - deciding
            if not decision.trains:
                update = self._answer(task, decision.status, reason=decision.reason)
            else:
                update = self._train(task, workdir, decision, available)
            update.metrics["seconds_decision"] = decided
            return update
        finally:
            shutil.rmtree(workdir, ignore_errors=True)

    def _timeout(self, task: Task) -> float:
        return max(30.0, task.deadline - time.time() + DEADLINE_GRACE_S)

    def _decide(self, task: Task, workdir: Path, available: int) -> Decision:
        """What to train, decided in a decision child (``edge_agent.decision``) from the task and this device."""
        DecisionRequest(self.device, self.allocator, available, self.calibration_for(task.model).factor, self.data,
                        self.limits,
                        self.estimates_of(task.model), self.torch_threads if self.device == "cpu" else 1).write(workdir)
        try:
            decision = forkserver.run_decision(workdir, self._timeout(task), cancel=self._closing)
        except DecisionFailed as exc:
            raise TaskRejected(UpdateStatus.FAILED, str(exc)) from None
        self._remember(task.model, decision.estimates)
        return decision

    def _train(self, task: Task, workdir: Path, decision: Decision, available: int) -> Update:
        assert decision.spec is not None
        memory = {"estimated_bytes": float(decision.estimate), "raw_estimate_bytes": float(decision.raw_total),
                  "budget_bytes": float(available), "calibration": self.calibration_for(task.model).factor}
        TrainingRequest(decision.spec, self.device, list(self.data.labels), str(self.data_path),
                        str(self.copies_dir), decision.threads or self.torch_threads, self.allocator).write(workdir)
        before = self.oom_kills()
        forking = time.perf_counter()
        try:
            outcome = forkserver.run_training(workdir, self._timeout(task), on_start=self._started,
                                              cancel=self._closing, stall_timeout=self.stall_timeout,
                                              device=self.device)
        finally:
            self.child_pid = None
        memory["seconds_child"] = time.perf_counter() - forking
        if outcome.cancelled:
            return self._answer(task, UpdateStatus.FAILED, spec_trained=decision.spec, metrics=memory,
                                reason="the agent stopped while training")
        if outcome.stalled:
            return self._answer(task, UpdateStatus.FAILED, spec_trained=decision.spec, metrics=memory,
                                reason=outcome.error)
        if outcome.killed_by == "SIGKILL" and not outcome.timed_out:
            outcome = replace(outcome, out_of_memory=oom.struck(before, self.oom_kills()))
        assumed_cuda_start = self.cuda_context_bytes
        self._learn_cuda_start(workdir)
        if outcome.update is None:
            detail = (outcome.error or "").strip().splitlines()[:1]
            # Only the OOM killer's kills, and the CUDA allocator's refusal, say the estimate was too low; not a
            # refusal after a CUDA start that cost clearly more than the budget assumed (it moves by tens of MB).
            cuda_short = bool(detail) and detail[0].startswith(CUDA_OUT_OF_MEMORY)
            costlier_start = self.cuda_context_bytes > assumed_cuda_start + max(64 * 2**20, assumed_cuda_start // 20)
            if outcome.out_of_memory or (cuda_short and not costlier_start):
                self.calibration_for(task.model).observe_failure(decision.raw_total, available,
                                                                 decision.raw_overhead)
            why = _killed(outcome) if outcome.killed_by else f"training process failed (exit code {outcome.exitcode})"
            return self._answer(task, UpdateStatus.FAILED, spec_trained=decision.spec, metrics=memory,
                                reason=f"{why}: {detail[0]}" if detail else why)
        try:
            update = decode(outcome.update, expected=Update)
        except ProtocolError as exc:
            return self._answer(task, UpdateStatus.FAILED, metrics=memory,
                                reason=f"training child answered garbage: {exc}")
        assert isinstance(update, Update)
        self.calibration_for(task.model).observe(decision.raw_total, int(update.metrics.get("peak_bytes", 0)),
                                                 decision.raw_overhead)
        update.status = decision.status
        update.reason = decision.reason
        update.metrics.update(memory)
        update.metrics.update(decision.metrics)
        return update

    def _learn_cuda_start(self, workdir: Path) -> None:
        """Keep what the CUDA training child just measured its CUDA start to cost, if it did."""
        try:
            measured = json.loads((workdir / CUDA_START_FILE).read_text())["cuda_context_bytes"]
        except (OSError, ValueError, KeyError, TypeError):
            return
        if isinstance(measured, (int, float)) and measured > 0:
            self.cuda_context_bytes = int(measured)

    def _check_compatible(self, task: Task) -> None:
        if task.model.in_channels != self.data.in_channels:
            raise TaskRejected(UpdateStatus.FAILED, f"model expects {task.model.in_channels} input channels, local "
                                                    f"data has {self.data.in_channels}")
        if self.data.labels[-1] >= task.model.num_classes:
            raise TaskRejected(UpdateStatus.FAILED, f"local label {self.data.labels[-1]} is outside the model's "
                                                    f"{task.model.num_classes} classes")
        if task.training_plan().batch_size < 2:
            raise TaskRejected(UpdateStatus.FAILED,
                               "batch_size must be at least 2: static BN normalises with batch statistics")

    def _started(self, pid: int) -> None:
        self.child_pid = pid

    def _answer(self, task: Task, status: UpdateStatus, *, spec_trained: dict | None = None,
                metrics: dict[str, float] | None = None, reason: str | None = None) -> Update:
        return Update(task_id=task.task_id, round=task.round, agent_id=self.agent_id, status=status,
                      spec_trained=spec_trained, num_samples=self.data.samples, labels=list(self.data.labels),
                      weights={}, metrics=metrics or {}, reason=reason)
