"""Turns one task into one update: validate, check memory, adapt, train in a child process, report.

The decision happens BEFORE training, from the estimator corrected by this device's calibration; the real
peak is measured in the training child and fed back into the calibration. A child that is killed or crashes
becomes a ``failed`` update with the reason; the agent itself carries on.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from edge_agent import allocator as heap
from edge_agent import child, oom
from edge_agent.adaptation import Choice, Option, choose, cut_nested, options
from edge_agent.calibration import Calibration
from edge_agent.config import TaskLimits
from edge_agent.copies import CopyStore, read_copies, write_copies
from edge_agent.memory import available_memory
from models import MemoryEstimate, ModelFamily, SubmodelSpec, get_family
from models.depthwise import Decomposition, cut_segments
from protocol import ModelRef, ProtocolError, Stage, Task, TrainingPlan, Update, decode, encode

# Seconds a training child gets beyond the task's deadline before it is stopped (its update would be late).
DEADLINE_GRACE_S = 30.0


@dataclass
class LocalData:
    """The agent's private training data, already normalised (N x C x H x W float32, int64 labels)."""

    x: torch.Tensor
    y: torch.Tensor

    def __post_init__(self) -> None:
        if self.x.ndim != 4 or len(self.x) != len(self.y) or len(self.x) == 0:
            raise ValueError(f"local data must be a non-empty N x C x H x W batch with N labels, got "
                             f"{tuple(self.x.shape)} and {tuple(self.y.shape)}")
        if int(self.y.min()) < 0:
            raise ValueError("local labels must be non-negative class indices")
        self.labels = sorted(int(v) for v in torch.unique(self.y))

    @property
    def image_size(self) -> tuple[int, int]:
        return int(self.x.shape[2]), int(self.x.shape[3])

    @property
    def in_channels(self) -> int:
        return int(self.x.shape[1])


@dataclass(frozen=True)
class _Cut:
    """A depth-wise decomposition and, when nothing fits, the calibrated estimate of the cheapest single block.

    ``route`` is how each segment reaches a classifier; ``cached`` the stages (1-based) that buffer their frozen
    blocks' outputs, ``recomputed`` those that run them every batch, and ``buffer_needs`` the least a recomputed
    stage's buffered run would need (None when a stage runs one epoch: buffering saves nothing).
    """

    decomposition: Decomposition
    smallest: int | None = None
    route: str = "skip"
    cached: tuple[int, ...] = ()
    recomputed: tuple[int, ...] = ()
    buffer_needs: int | None = None

    def describe(self) -> str:
        """E.g. ``"blocks 0 | 1-3 | 4-8 via the skip path; frozen blocks recomputed every batch in stages 2, 3
        (one epoch a stage)"``."""
        text = f"blocks {self.decomposition.describe()} via " + (
            "auxiliary classifiers" if self.route == "exit" else "the skip path")
        if self.cached:
            text += f"; frozen blocks' outputs buffered in stage{_numbers(self.cached)}"
        if self.recomputed:
            why = ("one epoch a stage" if self.buffer_needs is None
                   else f"buffering needs {_size(self.buffer_needs)}")
            text += f"; frozen blocks recomputed every batch in stage{_numbers(self.recomputed)} ({why})"
        return text


def _numbers(numbers: tuple[int, ...]) -> str:
    """``" 2"`` or ``"s 2, 3"``: the tail of "stage" for a list of stage numbers."""
    return f" {numbers[0]}" if len(numbers) == 1 else "s " + ", ".join(map(str, numbers))


class TaskRejected(Exception):
    """The task cannot be served; ``status`` is "declined" (not affordable, too late) or "failed"."""

    def __init__(self, status: str, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


BudgetFn = Callable[[int], "int | None"]


def _size(count: int) -> str:
    """Bytes in the unit that reads best (KiB, MiB, GiB)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if count >= scale:
            return f"{count / scale:.1f} {unit}"
    return f"{count / 2**10:.1f} KiB"


def _killed(outcome: child.ChildOutcome) -> str:
    """Why a child killed by a signal failed, the OOM killer told from anyone else."""
    if outcome.killed_by != "SIGKILL" or outcome.timed_out:
        return f"training process was killed by {outcome.killed_by}"
    if outcome.out_of_memory:
        return "training process was killed by the kernel's OOM killer (SIGKILL, out of memory)"
    if outcome.out_of_memory is None:
        return "training process was killed by SIGKILL (no OOM-kill counter to tell whether for memory)"
    return "training process was killed by SIGKILL, not for memory (the kernel counted no OOM kill)"


def _constant(budget: int | None) -> BudgetFn:
    """A budget that does not change from round to round."""
    return lambda _round: budget


class TaskRunner:
    """Serves tasks for one agent: keeps model families warm, its data on disk for the training children."""

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
        allocator: str = "compact",
        limits: TaskLimits | None = None,
    ) -> None:
        self.agent_id = agent_id
        self.limits = limits or TaskLimits()
        self.data = data
        self.budget_for: BudgetFn = budget if callable(budget) else _constant(budget)
        self.device = device
        self.torch_threads = torch_threads
        # What the children really run (glibc-only "compact" falls back), so the estimates match it.
        self.allocator = heap.resolve(allocator)
        self._own_state_dir = state_dir is None
        self.state_dir = Path(state_dir) if state_dir is not None else Path(tempfile.mkdtemp(
            prefix=f"fedfit-{agent_id}-"))
        self.state_dir.mkdir(parents=True, exist_ok=True)
        # One calibration per way of running: a factor learnt under one allocator is wrong for the other.
        runtime = "cuda" if device == "cuda" else f"cpu-{self.allocator}"
        self.calibration = calibration if calibration is not None else Calibration(
            self.state_dir / f"calibration-{runtime}.json",
            resolution=0 if device == "cuda" else child.CPU_PEAK_RESOLUTION_BYTES)
        self.data_path = self.state_dir / "local-data.npz"
        np.savez(self.data_path, x=data.x.numpy(), y=data.y.numpy())
        self._families: dict[tuple[str, int, int, str], ModelFamily] = {}
        self._estimates: dict[tuple[object, ...], MemoryEstimate] = {}
        self.copies = CopyStore(self.state_dir / "copies")
        self.child_pid: int | None = None
        #: Reads the OOM-kill counter that tells the OOM killer's SIGKILL from any other (:mod:`edge_agent.oom`).
        self.oom_kills: Callable[[], oom.OomCount | None] = oom.oom_kills

    def close(self) -> None:
        """Remove what the runner wrote when it chose the directory itself."""
        if self._own_state_dir:
            shutil.rmtree(self.state_dir, ignore_errors=True)

    # ------------------------------------------------------------------ public
    def run(self, task: Task) -> Update:
        """Run ``task``; any failure becomes an update with status declined/failed and the reason."""
        try:
            return self._serve(task)
        except TaskRejected as exc:
            return self._answer(task, exc.status, reason=exc.reason)
        except Exception as exc:  # noqa: BLE001 - the agent outlives any task
            return self._answer(task, "failed", reason=f"{type(exc).__name__}: {exc}")

    def family_for(self, ref: ModelRef) -> ModelFamily:
        key = (ref.family, ref.num_classes, ref.in_channels, repr(sorted(ref.options.items())))
        if key not in self._families:
            self._families[key] = get_family(ref.family, ref.num_classes, ref.in_channels, **ref.options)
        return self._families[key]

    def raw_estimates(self, model: ModelRef, candidates: list[Option]) -> dict[Option, MemoryEstimate]:
        """The estimator's predictions of peak training memory for each (spec, plan) on this device (with their
        parts).

        Made in a child of the training forkserver (``child.estimate_in_child``: the agent process does not pay the
        estimator's imports) for the options not estimated before, and remembered (the seed plays no part).
        """
        model_key = (model.family, model.num_classes, model.in_channels, repr(sorted(model.options.items())))

        def key(option: Option) -> tuple[object, ...]:
            return (*model_key, option.spec, replace(option.plan, seed=0))

        missing = list({key(option): option for option in candidates if key(option) not in self._estimates}.values())
        if missing:
            made = child.estimate_in_child(model, [(o.spec, o.plan) for o in missing], input_size=self.data.image_size,
                                           device=self.device, allocator=self.allocator, samples=len(self.data.x))
            self._estimates.update(zip(map(key, missing), made))
        return {option: self._estimates[key(option)] for option in candidates}

    def raw_estimate(self, model: ModelRef, spec: SubmodelSpec, plan: TrainingPlan) -> MemoryEstimate:
        """The estimator's prediction for one spec and plan (see :meth:`raw_estimates`)."""
        option = Option(spec, plan)
        return self.raw_estimates(model, [option])[option]

    def available(self, round_number: int) -> int:
        """Memory training may use now (budget for this round, cgroup, psutil; CUDA free memory on GPUs)."""
        free = available_memory(self.budget_for(round_number))
        if self.device == "cuda" and torch.cuda.is_available():
            free = min(free, int(torch.cuda.mem_get_info()[0]))
        return free

    # --------------------------------------------------------------- internals
    def _serve(self, task: Task) -> Update:
        if time.time() > task.deadline:
            raise TaskRejected("declined", "the task's deadline passed before training could start")
        family = self.family_for(task.model)
        plan = task.training_plan()
        self._check_compatible(task, plan)
        try:
            sent = family.validate_spec(SubmodelSpec.from_dict(task.spec))
            candidates = options(family, sent, plan, task.adaptation)
        except ValueError as exc:
            raise TaskRejected("failed", f"invalid task: {exc}") from exc
        self._check_weights(family, sent, task)
        self._check_limits(task, family, sent, plan)
        raw = self.raw_estimates(task.model, candidates)

        def corrected(option: Option) -> int:
            return self.calibration.corrected(raw[option].total, raw[option].overhead)

        available = self.available(task.round)
        choice = choose(candidates, corrected, available)
        cut: _Cut | None = None
        depthwise = task.adaptation is not None and task.adaptation.kind == "depthwise"
        whole = replace(sent, exits=()) if depthwise else sent  # the auxiliary classifiers serve stages only
        if choice.option is None and task.adaptation is not None and depthwise:
            cut, option, segment_estimate = self._depthwise(task.model, family, sent, replace(plan, copies=1),
                                                            task.adaptation.route, available)
            if option is not None:
                raw[option] = segment_estimate
                choice = Choice(option, corrected(option), (*choice.tried, (option.describe(), corrected(option))))
        if choice.option is None:
            tried = ", ".join(f"{name} {_size(needed)}" for name, needed in choice.tried)
            raise TaskRejected("declined", f"nothing fits the {_size(available)} available (estimated: {tried}"
                                           + (f"; no block fits alone, the smallest needs {_size(cut.smallest)}"
                                              if cut is not None and cut.smallest is not None else "")
                                           + ("; no cut fits with its auxiliary classifiers"
                                              if cut is not None and cut.smallest is None else "") + ")")
        spec, chosen_plan = choice.option.spec, choice.option.plan
        estimate = raw[choice.option]
        memory = {"estimated_bytes": float(choice.estimate), "raw_estimate_bytes": float(estimate.total),
                  "budget_bytes": float(available), "calibration": self.calibration.factor}
        if spec == sent and chosen_plan != plan:
            task = replace(task, recipe=None, plan=chosen_plan, adaptation=None)
        elif spec != sent:
            try:
                task = replace(task, spec=spec.to_dict(), recipe=None, plan=choice.option.plan, adaptation=None,
                               weights=cut_nested(task.weights, family.index_map(spec), family.state_keys(spec)))
            except ValueError as exc:
                raise TaskRejected("failed", f"cannot adapt: {exc}") from exc
        outcome = self._train_in_child(task, spec, chosen_plan)
        if outcome.update is None:
            if outcome.out_of_memory:  # only the OOM killer's kills say the estimate was too low
                self.calibration.observe_failure(estimate.total, available, estimate.overhead)
            why = _killed(outcome) if outcome.killed_by else f"training process failed (exit code {outcome.exitcode})"
            detail = (outcome.error or "").strip().splitlines()[:1]
            return self._answer(task, "failed", spec_trained=spec.to_dict(), metrics=memory,
                                reason=f"{why}: {detail[0]}" if detail else why)
        try:
            update = decode(outcome.update, expected=Update)
        except ProtocolError as exc:
            return self._answer(task, "failed", metrics=memory, reason=f"training child answered garbage: {exc}")
        assert isinstance(update, Update)
        peak = int(update.metrics.get("peak_bytes", 0))
        self.calibration.observe(estimate.total, peak, estimate.overhead)
        update.status = "ok" if spec in (sent, whole) else "adapted"
        update.metrics.update(memory)
        if cut is not None and spec.segments is not None:
            update.reason = f"trained depth-wise, {cut.describe()}, to fit {_size(available)}"
            update.metrics["cached_stages"] = float(len(cut.cached))
        elif spec not in (sent, whole):
            update.reason = f"adapted {sent.describe()} -> {spec.describe()} to fit {_size(available)}"
        elif plan.copies > 1 and chosen_plan.copies > 1:
            update.reason = (f"trained {chosen_plan.copies} of up to {plan.copies} copies with mutual distillation, "
                             f"uploaded the first, to fit {_size(available)}")
        elif plan.copies > 1:
            update.reason = (f"trained 1 of up to {plan.copies} copies (no mutual distillation: a second copy does "
                             f"not fit {_size(available)})")
        return update

    def _depthwise(self, model: ModelRef, family: ModelFamily, sent: SubmodelSpec, plan: TrainingPlan, route: str,
                   available: int) -> tuple[_Cut, Option | None, MemoryEstimate]:
        """FeDepth's memory-adaptive decomposition of ``sent`` for ``available`` bytes.

        The (calibrated) estimate of training each candidate segment (its blocks, its classifier reached through
        ``route``, the frozen blocks before it) at the plan's batch size decides; the segments starting at a block
        are estimated together, when the cut first needs one of them, and remembered. The cut's spec carries the
        auxiliary classifier of every segment (route ``"exit"``), whose weights all its stages hold: when they
        push a stage over, the cut is made again for that much less. A stage after the first buffers its frozen
        blocks' outputs when it runs more than one epoch and the buffer fits too. Returns the cut, the option to
        train (None when nothing fits) and its raw estimate (its costliest stage).
        """
        blocks = sent.depth or family.num_blocks
        starts: set[int] = set()

        def spec_for(segments: tuple[tuple[int, int], ...]) -> SubmodelSpec:
            ends = tuple(stop - 1 for _, stop in segments if stop < blocks) if route == "exit" else ()
            return replace(sent, segments=segments, exits=ends)

        def staged(count: int, cache: bool = False) -> TrainingPlan:
            return replace(plan, schedule=(Stage(plan.epochs, route, cache),) * count)

        def raw_cost(start: int, stop: int) -> MemoryEstimate:
            if start not in starts:  # every segment from this block in one estimating child
                starts.add(start)
                self.raw_estimates(model, [Option(spec_for(((start, end),)), staged(1))
                                           for end in range(start + 1, blocks + 1)])
            return self.raw_estimate(model, spec_for(((start, stop),)), staged(1))

        def corrected(estimate: MemoryEstimate) -> int:
            return self.calibration.corrected(estimate.total, estimate.overhead)

        budget = available
        for _ in range(8):  # each pass lowers the budget by what the auxiliary classifiers added
            decomposition = cut_segments(lambda a, b: corrected(raw_cost(a, b)), blocks, budget)
            if not decomposition.segments:  # every block was tried alone: their estimates are known
                if budget < available:  # a block fits alone, but not with the other segments' classifiers
                    return _Cut(decomposition, None, route), None, raw_cost(0, 1)
                smallest = min(corrected(raw_cost(b, b + 1)) for b in range(blocks))
                return _Cut(decomposition, smallest, route), None, raw_cost(0, 1)
            spec = spec_for(decomposition.segments)
            each = [Option(replace(spec, segments=(segment,)), staged(1)) for segment in decomposition.segments]
            buffered = [Option(replace(spec, segments=(segment,)), staged(1, cache=True))
                        for segment in decomposition.segments if segment[0] > 0 and plan.epochs > 1]
            made = self.raw_estimates(model, each + buffered)
            worst = max(corrected(made[option]) for option in each)
            if worst <= available:
                break
            budget -= worst - available
        else:
            return _Cut(Decomposition((), ()), None, route), None, raw_cost(0, 1)
        chosen: list[MemoryEstimate] = []
        cached: list[int] = []
        recomputed: list[int] = []
        needs: list[int] = []
        for number, (option, segment) in enumerate(zip(each, decomposition.segments), start=1):
            estimate = made[option]
            if segment[0] > 0 and plan.epochs > 1:
                with_buffer = made[replace(option, plan=staged(1, cache=True))]
                if corrected(with_buffer) <= available:
                    estimate = with_buffer
                    cached.append(number)
                else:
                    recomputed.append(number)
                    needs.append(corrected(with_buffer))
            elif segment[0] > 0:
                recomputed.append(number)
            chosen.append(estimate)
        schedule = tuple(Stage(plan.epochs, route, number in cached)
                         for number in range(1, len(decomposition.segments) + 1))
        cut = _Cut(decomposition, None, route, tuple(cached), tuple(recomputed), min(needs) if needs else None)
        return cut, Option(spec, replace(plan, schedule=schedule)), max(chosen, key=lambda e: e.total)

    def _check_limits(self, task: Task, family: ModelFamily, sent: SubmodelSpec, plan: TrainingPlan) -> None:
        """Decline a task beyond the agent's ``limits`` (epochs, steps, deadline horizon, model size)."""
        limits = self.limits
        stages = len(plan.schedule) or (family.num_blocks if task.adaptation is not None
                                        and task.adaptation.kind == "depthwise" else 1)
        epochs = sum(stage.epochs for stage in plan.schedule) or plan.epochs * stages
        steps = epochs * math.ceil(len(self.data.x) / plan.batch_size)
        ahead = task.deadline - time.time()
        parameters = family.param_count(sent)
        if epochs > limits.max_epochs:
            why = f"it trains {epochs} epochs, more than limits.max_epochs {limits.max_epochs}"
        elif steps > limits.max_steps:
            why = f"it takes {steps} steps on the local data, more than limits.max_steps {limits.max_steps}"
        elif ahead > limits.max_deadline_s:
            why = (f"its deadline lies {ahead / 3600:.1f} h ahead, more than limits.max_deadline_s "
                   f"{limits.max_deadline_s:.0f} s")
        elif parameters > limits.max_parameters:
            why = f"its model has {parameters} parameters, more than limits.max_parameters {limits.max_parameters}"
        else:
            return
        raise TaskRejected("declined", f"task refused: {why}")

    def _check_compatible(self, task: Task, plan: TrainingPlan) -> None:
        if task.model.in_channels != self.data.in_channels:
            raise TaskRejected("failed", f"model expects {task.model.in_channels} input channels, local data has "
                                         f"{self.data.in_channels}")
        if self.data.labels[-1] >= task.model.num_classes:
            raise TaskRejected("failed", f"local label {self.data.labels[-1]} is outside the model's "
                                         f"{task.model.num_classes} classes")
        if plan.batch_size < 2:
            raise TaskRejected("failed", "batch_size must be at least 2: static BN normalises with batch statistics")

    @staticmethod
    def _check_weights(family: ModelFamily, spec: SubmodelSpec, task: Task) -> None:
        shapes = {key: tuple(len(idx) for idx in index) for key, index in family.index_map(spec).items()}
        expected = set(family.state_keys(spec))
        if set(task.weights) != expected:
            missing = sorted(expected - set(task.weights))[:3]
            extra = sorted(set(task.weights) - expected)[:3]
            raise TaskRejected("failed", f"task weights do not fit the spec (missing {missing}, unexpected {extra})")
        for key, array in task.weights.items():
            if tuple(array.shape) != shapes[key]:
                raise TaskRejected("failed", f"tensor {key!r} has shape {tuple(array.shape)}, the spec needs "
                                             f"{shapes[key]}")

    def _train_in_child(self, task: Task, spec: SubmodelSpec, plan: TrainingPlan) -> child.ChildOutcome:
        # Named by a digest: a task id is wire data and must never become a path ("..", say).
        workdir = self.state_dir / "tasks" / hashlib.sha256(task.task_id.encode()).hexdigest()[:24]
        shutil.rmtree(workdir, ignore_errors=True)
        workdir.mkdir(parents=True)
        try:
            (workdir / child.TASK_FILE).write_bytes(encode(task))
            (workdir / child.PLAN_FILE).write_text(json.dumps({
                "spec": spec.to_dict(), "device": self.device, "labels": self.data.labels,
                "data_path": str(self.data_path), "torch_threads": self.torch_threads,
                "allocator": self.allocator}))
            if plan.copies > 1:  # the device's own auxiliary copies (m-FeDepth), kept between rounds
                write_copies(workdir / child.COPIES_FILE, self.copies.load(
                    task.model, self.family_for(task.model), spec, plan.copies - 1, plan.seed))
            timeout = max(30.0, task.deadline - time.time() + DEADLINE_GRACE_S)
            before = self.oom_kills()
            outcome = child.run_in_child(workdir, timeout, on_start=self._started)
            if outcome.killed_by == "SIGKILL" and not outcome.timed_out:
                outcome = replace(outcome, out_of_memory=oom.struck(before, self.oom_kills()))
            trained = workdir / child.TRAINED_COPIES_FILE
            if plan.copies > 1 and outcome.update is not None and trained.exists():
                self.copies.save(task.model, spec, read_copies(trained, plan.copies - 1,
                                                               self.family_for(task.model).state_keys(spec)))
            return outcome
        finally:
            self.child_pid = None
            shutil.rmtree(workdir, ignore_errors=True)

    def _started(self, pid: int) -> None:
        self.child_pid = pid

    def _answer(self, task: Task, status: str, *, spec_trained: dict | None = None,
                metrics: dict[str, float] | None = None, reason: str | None = None) -> Update:
        return Update(task_id=task.task_id, round=task.round, agent_id=self.agent_id, status=status,
                      spec_trained=spec_trained, num_samples=len(self.data.y), labels=list(self.data.labels),
                      weights={}, metrics=metrics or {}, reason=reason)
