"""The decision child: what this device trains for a task, decided BEFORE training, in a forkserver child.

It checks the task against the model family (spec, weights, plan, the agent's limits), asks the estimator for
the peak training memory of each option the task allows (``edge_agent.adaptation``), corrects it with the
device's calibration factor and takes the first that fits the memory available (with fewer torch threads than the
agent's when that lets an earlier one fit: some kernels keep scratch per thread); a FeDepth task that fits nowhere
whole is decomposed into blocks trained one after another (:meth:`Decider.depthwise`, the search in
:mod:`edge_agent.depthwise_cut`). It writes a
:class:`~edge_agent.workdir.Decision` and, when the device trains something other than what it was sent, the
task to train (weights cut out of the received ones, plan chosen). The agent process, which imports no torch,
reads that and starts the training child (``edge_agent.forkserver``).

The estimator's first use in a process imports what meta tensors need (about 160 MB of RSS, see
docs/edge-runtime.md); the forkserver has paid that, so a decision child adds about 25 MB for a moment and the agent
process does not grow at all.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from edge_agent.adaptation import Choice, Option, choose, cut_nested, options
from edge_agent.calibration import corrected as calibrated
from edge_agent.depthwise_cut import Cut, DepthwisePlan, DepthwiseSearch, shortfall, why_no_cut
from edge_agent.memory import size_text
from edge_agent.workdir import TASK_FILE, Decision, DecisionRequest, TaskRejected, model_key, write_message
from models import MemoryEstimate, ModelFamily, SubmodelSpec, check_shapes, estimate_plan_memory, get_family
from models.depthwise import micro_batch_ladder
from protocol import (
    MEMORY_DECLINE_REASON,
    ModelRef,
    ProtocolError,
    Task,
    TrainingPlan,
    UpdateStatus,
    decode,
)


def estimate_key(model: ModelRef, option: Option, threads: int = 1) -> str:
    """How an estimate is remembered: the model, the spec, the plan without its seed (which plays no part) and
    the torch threads."""
    return json.dumps([model_key(model), option.spec.to_dict(), replace(option.plan, seed=0).to_dict(), threads],
                      sort_keys=True)


def _parts(estimate: MemoryEstimate) -> dict[str, Any]:
    """An estimate's parts as plain data (what :class:`MemoryEstimate` is built from)."""
    return {key: value for key, value in estimate.as_dict().items() if key != "total"}


class Decider:
    """Decides for one task on this device, from a :class:`~edge_agent.workdir.DecisionRequest`."""

    def __init__(self, request: DecisionRequest) -> None:
        self.request = request
        self._estimates: dict[str, MemoryEstimate] = {key: MemoryEstimate(**parts)
                                                      for key, parts in request.known.items()}
        #: The raw estimates this decision made (the agent remembers them for the next).
        self.made: dict[str, dict[str, Any]] = {}
        self._families: dict[str, ModelFamily] = {}

    def family_for(self, ref: ModelRef) -> ModelFamily:
        key = model_key(ref)
        if key not in self._families:
            self._families[key] = get_family(ref.family, ref.num_classes, ref.in_channels, **ref.options)
        return self._families[key]

    def corrected(self, estimate: MemoryEstimate) -> int:
        """The raw estimate corrected by the device's calibration factor."""
        return calibrated(estimate.total, estimate.overhead, self.request.factor)

    def raw_estimates(self, model: ModelRef, candidates: list[Option],
                      threads: int | None = None) -> dict[Option, MemoryEstimate]:
        """The estimator's predictions of peak training memory for each (spec, plan) on this device (with their
        parts) with ``threads`` torch threads (default: the agent's), for the options not estimated before;
        remembered (the seed plays no part)."""
        family = self.family_for(model)
        threads = self.request.threads if threads is None else threads
        found = {}
        for option in candidates:
            key = estimate_key(model, option, threads)
            if key not in self._estimates:
                estimate = estimate_plan_memory(family, option.spec, option.plan,
                                                input_size=self.request.data.image_size, device=self.request.device,
                                                allocator=self.request.allocator, samples=self.request.data.samples,
                                                threads=threads)
                self._estimates[key] = estimate
                self.made[key] = _parts(estimate)
            found[option] = self._estimates[key]
        return found

    def raw_estimate(self, model: ModelRef, spec: SubmodelSpec, plan: TrainingPlan,
                     threads: int | None = None) -> MemoryEstimate:
        """The estimator's prediction for one spec and plan (see :meth:`raw_estimates`)."""
        option = Option(spec, plan)
        return self.raw_estimates(model, [option], threads)[option]

    def fewer_threads(self, model: ModelRef, preferred: list[Option],
                      available: int) -> tuple[Option, int, MemoryEstimate, int] | None:
        """The first of ``preferred`` (options that do not fit with the agent's threads) that fits ``available``
        with fewer, and the most threads it fits with, its raw estimate there and that calibrated; None when none
        fits even with one thread. Some oneDNN kernels keep scratch per thread
        (:func:`models.conv_workspace.gemm_weight_gradient`): a device trains the model it was sent, slower, before
        a smaller one."""
        if self.request.device != "cpu":
            return None
        for option in preferred:
            if (self.raw_estimates(model, [option], 1)[option].total
                    == self.raw_estimates(model, [option])[option].total):
                continue  # no kernel of it keeps scratch per thread: fewer threads need no less
            best = 0  # the estimate grows with the threads: the first that does not fit ends the search
            for threads in range(1, self.request.threads):
                if self.corrected(self.raw_estimates(model, [option], threads)[option]) > available:
                    break
                best = threads
            if best:
                estimate = self.raw_estimates(model, [option], best)[option]
                return option, best, estimate, self.corrected(estimate)
        return None

    # ------------------------------------------------------------------ decide
    def decide(self, task: Task) -> tuple[Decision, Task | None]:
        """The decision, and the task to train when it differs from ``task`` (adapted spec or plan)."""
        try:
            return self._decide(task)
        except TaskRejected as exc:
            return Decision(exc.status, exc.reason, estimates=self.made), None

    def _decide(self, task: Task) -> tuple[Decision, Task | None]:
        family = self.family_for(task.model)
        plan = task.training_plan()
        try:
            sent = family.validate_spec(SubmodelSpec.from_dict(task.spec))
            candidates = options(family, sent, plan, task.adaptation)
        except ValueError as exc:
            raise TaskRejected(UpdateStatus.FAILED, f"invalid task: {exc}") from exc
        self._check_weights(family, sent, task)
        self._check_limits(task, family, sent, plan)
        raw = self.raw_estimates(task.model, candidates)
        available = self.request.available
        choice, threads = self._choice(task.model, candidates, raw, available)
        cut: Cut | None = None
        depthwise = task.adaptation is not None and task.adaptation.kind == "depthwise"
        if choice.option is None and depthwise:
            choice, cut, threads = self._depthwise_choice(task, family, sent, plan, raw, choice, threads)
        if choice.option is None:
            tried = ", ".join(f"{name} {size_text(needed)}" for name, needed in choice.tried)
            head_alone = task.adaptation is not None and task.adaptation.head_alone
            raise TaskRejected(UpdateStatus.DECLINED, f"{MEMORY_DECLINE_REASON} the {size_text(available)} available "
                                                      f"(estimated: {tried}{why_no_cut(cut, head_alone)})")
        spec = choice.option.spec
        whole = replace(sent, exits=()) if depthwise else sent  # the auxiliary classifiers serve stages only
        reason, metrics = _reason(sent, whole, plan, choice.option, cut, available)
        if threads:
            reason = (f"{reason}, with {threads} of {self.request.threads} torch threads" if reason else
                      f"trained with {threads} of {self.request.threads} torch threads to fit {size_text(available)}")
            metrics["torch_threads"] = float(threads)
        estimate = raw[choice.option]
        status = UpdateStatus.OK if spec in (sent, whole) else UpdateStatus.ADAPTED
        decision = Decision(status, reason, spec.to_dict(),
                            raw_total=estimate.total, raw_overhead=estimate.overhead, estimate=choice.estimate,
                            metrics=metrics, estimates=self.made, threads=threads)
        return decision, _adapted_task(task, family, sent, plan, choice.option)

    def _choice(self, model: ModelRef, candidates: list[Option], raw: dict[Option, MemoryEstimate],
                available: int) -> tuple[Choice, int]:
        """The first candidate that fits ``available`` bytes (``raw`` has their estimates), and the torch threads
        it trains with (0: the agent's own). Where a larger candidate fits with fewer threads, that one (its
        estimate put in ``raw``)."""
        choice = choose(candidates, lambda option: self.corrected(raw[option]), available)
        if self.request.threads <= 1 or not candidates or choice.option == candidates[0]:
            return choice, 0
        preferred = candidates if choice.option is None else candidates[:candidates.index(choice.option)]
        fewer = self.fewer_threads(model, preferred, available)
        if fewer is None:
            return choice, 0
        option, threads, raw[option], needed = fewer
        return Choice(option, needed, (*choice.tried, (f"{option.describe()} with {threads} threads", needed))), threads

    def _depthwise_choice(self, task: Task, family: ModelFamily, sent: SubmodelSpec, plan: TrainingPlan,
                          raw: dict[Option, MemoryEstimate], choice: Choice,
                          threads: int) -> tuple[Choice, Cut | None, int]:
        """Where no candidate fits: FeDepth's decomposition of ``sent`` into stages that do (one torch thread where
        that trains more of the model on a CPU); the choice, the cut, the threads."""
        assert task.adaptation is not None
        adaptation, available = task.adaptation, self.request.available
        single = replace(plan, copies=1)
        found = self.depthwise(task.model, family, sent, single, adaptation.route, available,
                               adaptation.min_micro_batch, head_alone=adaptation.head_alone)
        if self.request.threads > 1 and self.request.device == "cpu" and shortfall(found) > (0, 0, 0):
            alone = self.depthwise(task.model, family, sent, single, adaptation.route, available,
                                   adaptation.min_micro_batch, head_alone=adaptation.head_alone, threads=1)
            if shortfall(alone) < shortfall(found):  # one thread trains more of the model: train it so
                found, threads = alone, 1
        if found.option is None:
            return choice, found.cut, threads
        raw[found.option] = found.estimate
        needed = self.corrected(found.estimate)
        return Choice(found.option, needed, (*choice.tried, (found.option.describe(), needed))), found.cut, threads

    def depthwise(self, model: ModelRef, family: ModelFamily, sent: SubmodelSpec, plan: TrainingPlan, route: str,
                  available: int, min_micro_batch: int = 0, *, head_alone: bool = False,
                  threads: int | None = None) -> DepthwisePlan:
        """FeDepth's memory-adaptive decomposition of ``sent`` for ``available`` bytes.

        The (calibrated) estimate of training each candidate segment (its blocks, its classifier reached through
        ``route``, the frozen blocks before it) at the plan's batch size decides; the segments starting at a block
        are estimated together, when the cut first needs one of them, and remembered. A block that fits alone at
        no batch size trains in micro-batches, the largest of the plan's batch halved again and again down to
        ``min_micro_batch`` at which it fits (none when that is 0), with gradients accumulated up to the batch;
        only a block that fits at none of them is skipped; where none fits, the head alone on every frozen block
        when ``head_alone`` (the task allows it) and that fits at the full budget. The cut's spec carries the
        auxiliary classifier of every segment (route ``"exit"``), whose weights all its stages hold: when they push
        a stage over, the cut is made again for that much less. A stage after the first buffers its frozen blocks'
        outputs when it runs more than one epoch and the buffer fits too. The search is
        :class:`edge_agent.depthwise_cut.DepthwiseSearch`'s.
        ``threads``: the torch threads it estimates for (default: the agent's).
        """
        search = DepthwiseSearch(self, model, sent, plan, route, sent.depth or family.num_blocks,
                                  micro_batch_ladder(plan.batch_size, min_micro_batch), head_alone, threads)
        return search.plan_for(available)

    def _check_limits(self, task: Task, family: ModelFamily, sent: SubmodelSpec, plan: TrainingPlan) -> None:
        """Decline a task beyond the agent's ``limits`` (epochs, steps, deadline horizon, model size)."""
        limits = self.request.limits
        stages = len(plan.schedule) or (family.num_blocks if task.adaptation is not None
                                        and task.adaptation.kind == "depthwise" else 1)
        epochs = sum(stage.epochs for stage in plan.schedule) or plan.epochs * stages
        steps = epochs * math.ceil(self.request.data.samples / plan.batch_size)
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
        raise TaskRejected(UpdateStatus.DECLINED, f"task refused: {why}")

    @staticmethod
    def _check_weights(family: ModelFamily, spec: SubmodelSpec, task: Task) -> None:
        """Fail a task whose weights are not the spec's tensors, of the shapes its index map says."""
        index_map = family.index_map(spec)
        expected = set(family.state_keys(spec))
        if set(task.weights) != expected:
            missing = sorted(expected - set(task.weights))[:3]
            extra = sorted(set(task.weights) - expected)[:3]
            raise TaskRejected(UpdateStatus.FAILED,
                               f"task weights do not fit the spec (missing {missing}, unexpected {extra})")
        try:
            check_shapes(task.weights, index_map, says="the spec needs")
        except ValueError as exc:
            raise TaskRejected(UpdateStatus.FAILED, str(exc)) from exc


def _adapted_task(task: Task, family: ModelFamily, sent: SubmodelSpec, plan: TrainingPlan,
                  option: Option) -> Task | None:
    """The task the child trains where the choice differs from what was sent (its spec cut from the weights sent,
    its plan), else None."""
    if option.spec == sent:
        return None if option.plan == plan else replace(task, recipe=None, plan=option.plan, adaptation=None)
    try:
        return replace(task, spec=option.spec.to_dict(), recipe=None, plan=option.plan, adaptation=None,
                       weights=cut_nested(task.weights, family.index_map(option.spec), family.state_keys(option.spec)))
    except ValueError as exc:
        raise TaskRejected(UpdateStatus.FAILED, f"cannot adapt: {exc}") from exc


def _reason(sent: SubmodelSpec, whole: SubmodelSpec, plan: TrainingPlan, option: Option, cut: Cut | None,
            available: int) -> tuple[str | None, dict[str, float]]:
    """What the agent tells of its choice (None when it trains what was sent, as sent) and the metrics that go
    with it."""
    spec, chosen = option.spec, option.plan
    fits = f"to fit {size_text(available)}"
    if cut is not None and spec.segments is not None:
        metrics = {"head_only": float(spec.head_only), "cached_stages": float(len(cut.cached)),
                   "micro_batched_stages": float(sum(1 for m in cut.decomposition.micro_batches if m)),
                   "skipped_blocks": float(len(cut.decomposition.skipped))}
        trained = f"trained {cut.describe()}" if spec.head_only else f"trained depth-wise, {cut.describe()}"
        return f"{trained}, {fits}", metrics
    if spec not in (sent, whole):
        return f"adapted {sent.describe()} -> {spec.describe()} {fits}", {}
    if plan.copies > 1 and chosen.copies > 1:
        return (f"trained {chosen.copies} of up to {plan.copies} copies with mutual distillation, uploaded the "
                f"first, {fits}"), {}
    if plan.copies > 1:
        return (f"trained 1 of up to {plan.copies} copies (no mutual distillation: a second copy does not fit "
                f"{size_text(available)})"), {}
    return None, {}


def decide_in_workdir(workdir: Path) -> Decision:
    """Read the request and the task of ``workdir``, decide, write the decision (and the task to train)."""
    request = DecisionRequest.read(workdir)
    try:
        task = decode((workdir / TASK_FILE).read_bytes(), expected=Task)
    except ProtocolError as exc:
        decision = Decision(UpdateStatus.FAILED, f"invalid task: {exc}")
    else:
        assert isinstance(task, Task)
        try:
            decision, adapted = Decider(request).decide(task)
        except Exception as exc:  # noqa: BLE001 - an unknown family, a broken model option: the task fails
            decision, adapted = Decision(UpdateStatus.FAILED, f"{type(exc).__name__}: {exc}"), None
        if adapted is not None:
            write_message(workdir / TASK_FILE, adapted)
    decision.write(workdir)
    return decision
