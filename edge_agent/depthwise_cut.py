"""FeDepth's memory-adaptive decomposition of one task (:meth:`edge_agent.decision.Decider.depthwise`): the
cut of a sub-model's blocks into stages that each fit the memory an agent has, each stage's micro-batch, and
whether a stage buffers its frozen blocks' outputs; what was cut and what it left out, in words for the report."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

from edge_agent.adaptation import Option
from edge_agent.memory import size_text
from models import MemoryEstimate, SubmodelSpec
from models.depthwise import Decomposition, cut_segments
from protocol import ModelRef, Stage, TrainingPlan


class Estimates(Protocol):
    """What the search asks of the agent's estimates (:class:`edge_agent.decision.Decider`)."""

    def raw_estimates(self, model: ModelRef, candidates: list[Option],
                      threads: int | None = None) -> dict[Option, MemoryEstimate]: ...

    def raw_estimate(self, model: ModelRef, spec: SubmodelSpec, plan: TrainingPlan,
                     threads: int | None = None) -> MemoryEstimate: ...

    def corrected(self, estimate: MemoryEstimate) -> int: ...


def _numbers(numbers: tuple[int, ...]) -> str:
    """``" 2"`` or ``"s 2, 3"``: the tail of "stage" for a list of stage numbers."""
    return f" {numbers[0]}" if len(numbers) == 1 else "s " + ", ".join(map(str, numbers))


@dataclass(frozen=True)
class Cut:
    """A depth-wise decomposition and, when nothing fits, the calibrated estimate of the cheapest single block.

    ``route`` is how each segment reaches a classifier; ``cached`` the stages (1-based) that buffer their frozen
    blocks' outputs, ``recomputed`` those that run them every batch, and ``buffer_needs`` the least a recomputed
    stage's buffered run would need (None when a stage runs one epoch: buffering saves nothing).
    ``smallest_micro`` is the micro-batch ``smallest`` was estimated at (0: the whole batch).
    """

    decomposition: Decomposition
    smallest: int | None = None
    route: str = "skip"
    cached: tuple[int, ...] = ()
    recomputed: tuple[int, ...] = ()
    buffer_needs: int | None = None
    smallest_micro: int = 0

    def describe(self) -> str:
        """E.g. ``"blocks 0 | 1-3 | 4-8 via the skip path; frozen blocks recomputed every batch in stages 2, 3
        (one epoch a stage)"``."""
        if self.decomposition.head_only:  # partial training of what fits: no block does
            micro = self.decomposition.micro_batch(0)
            text = (f"the head alone on the frozen output of blocks 0-{self.decomposition.segments[0][0] - 1}"
                    + (f" (micro-batches of {micro})" if micro else "") + " (no block fits alone)")
        else:
            text = f"blocks {self.decomposition.describe()} via " + (
                "auxiliary classifiers" if self.route == "exit" else "the skip path")
        if self.cached:
            text += f"; frozen blocks' outputs buffered in stage{_numbers(self.cached)}"
        if self.recomputed:
            why = ("one epoch a stage" if self.buffer_needs is None
                   else f"buffering needs {size_text(self.buffer_needs)}")
            text += f"; frozen blocks recomputed every batch in stage{_numbers(self.recomputed)} ({why})"
        return text


@dataclass(frozen=True)
class DepthwisePlan:
    """What FeDepth's decomposition settled on (:meth:`edge_agent.decision.Decider.depthwise`): the cut, the option to train (None when
    nothing fits) and its raw estimate (its costliest stage; without an option, that of block 0 alone)."""

    cut: Cut
    option: Option | None
    estimate: MemoryEstimate


def shortfall(found: DepthwisePlan) -> tuple[int, int, int]:
    """What a depth-wise plan leaves out, to compare two (less is better): nothing trained at all, the body left
    frozen (the head alone), blocks skipped."""
    if found.option is None:
        return (1, 0, 0)
    decomposition = found.cut.decomposition
    return (0, int(decomposition.head_only), len(decomposition.skipped))


def why_no_cut(cut: Cut | None, head_alone: bool) -> str:
    """What a memory decline adds when a depth-wise cut was tried and none fits (empty when none was tried)."""
    if cut is None:
        return ""
    if cut.smallest is None:
        return "; no cut fits with its auxiliary classifiers"
    return ("; no block fits alone" + (", nor the head alone on the frozen blocks" if head_alone else "")
            + f", the smallest needs {size_text(cut.smallest)}"
            + (f" in micro-batches of {cut.smallest_micro}" if cut.smallest_micro else ""))


#: How often a cut is made again for a budget lowered by what its auxiliary classifiers added (route ``"exit"``).
_CUT_PASSES = 8


@dataclass(frozen=True)
class _StageCost:
    """One stage of a cut: its segment, micro-batch (0: whole batches) and option to train recomputing its frozen
    blocks every batch, with the raw estimates of that and, where buffering could pay (a stage after the first
    running more than one epoch), of buffering their outputs instead."""

    segment: tuple[int, int]
    micro: int
    recomputing: MemoryEstimate
    buffering: MemoryEstimate | None


class DepthwiseSearch:
    """The search behind :meth:`edge_agent.decision.Decider.depthwise` for one task: the estimates of candidate segments of ``sent``
    (each a one-stage spec and plan, its classifier reached through ``route``), the cut they allow, and the stages
    of that cut."""

    def __init__(self, decider: Estimates, model: ModelRef, sent: SubmodelSpec, plan: TrainingPlan, route: str,
                 blocks: int, ladder: list[int], head_alone: bool, threads: int | None = None) -> None:
        self.decider = decider
        self.threads = threads
        self.model = model
        self.sent = sent
        self.base = plan
        self.route = route
        self.blocks = blocks
        self.ladder = ladder
        self.head_alone = head_alone
        self._starts: set[int] = set()  # blocks whose segments have all been estimated

    def spec(self, segments: tuple[tuple[int, int], ...]) -> SubmodelSpec:
        """``sent`` trained in ``segments``, with the auxiliary classifier closing each (route ``"exit"``)."""
        ends = tuple(stop - 1 for _, stop in segments if stop < self.blocks) if self.route == "exit" else ()
        return replace(self.sent, segments=segments, exits=ends)

    def staged(self, count: int, cache: bool = False, micro: int = 0) -> TrainingPlan:
        """The plan with ``count`` like stages."""
        return replace(self.base, schedule=(Stage(self.base.epochs, self.route, cache, micro),) * count)

    def raw(self, start: int, stop: int, micro: int = 0) -> MemoryEstimate:
        """The raw estimate of training blocks ``start..stop-1`` as one stage (at whole batches, every segment from
        ``start`` is estimated at once, the first time)."""
        if not micro and start not in self._starts:
            self._starts.add(start)
            self.decider.raw_estimates(self.model, [Option(self.spec(((start, end),)), self.staged(1))
                                                    for end in range(start + 1, self.blocks + 1)], self.threads)
        return self.decider.raw_estimate(self.model, self.spec(((start, stop),)), self.staged(1, micro=micro),
                                         self.threads)

    def cost(self, start: int, stop: int, micro: int = 0) -> int:
        """:meth:`raw`, calibrated: what ``models.depthwise.cut_segments`` weighs."""
        return self.decider.corrected(self.raw(start, stop, micro))

    def plan_for(self, available: int) -> DepthwisePlan:
        """The cut for ``available`` bytes: made for a budget lowered, pass after pass, by what the auxiliary
        classifiers add to its costliest stage, until every stage fits."""
        budget = available
        for _ in range(_CUT_PASSES):
            decomposition = cut_segments(self.cost, self.blocks, budget, micro_cost=self.cost,
                                         micro_batches=self.ladder, head_only=self.head_alone and budget == available)
            if not decomposition.segments:  # every block and the head alone were tried: their estimates are known
                return self._nothing_fits(decomposition, lowered=budget < available)
            stages = self._stages(decomposition)
            worst = max(self.decider.corrected(stage.recomputing) for stage in stages)
            if worst <= available:
                return self._trained(decomposition, stages, available)
            budget -= worst - available
        return DepthwisePlan(Cut(Decomposition((), ()), None, self.route), None, self.raw(0, 1))

    def _nothing_fits(self, decomposition: Decomposition, lowered: bool) -> DepthwisePlan:
        """No cut: with a ``lowered`` budget a block fits alone, but not with the other segments' classifiers;
        otherwise the cut names the least any block (or the head alone) needs, at the smallest micro-batch."""
        if lowered:
            return DepthwisePlan(Cut(decomposition, None, self.route), None, self.raw(0, 1))
        least = self.ladder[-1] if self.ladder else 0
        smallest = min(self.cost(b, min(b + 1, self.blocks), least)
                       for b in range(self.blocks + 1 if self.head_alone else self.blocks))
        return DepthwisePlan(Cut(decomposition, smallest, self.route, smallest_micro=least), None, self.raw(0, 1))

    def _stages(self, decomposition: Decomposition) -> list[_StageCost]:
        """The stages of ``decomposition``, estimated together."""
        spec = self.spec(decomposition.segments)
        micros = [decomposition.micro_batch(i) for i in range(len(decomposition.segments))]
        each = [Option(replace(spec, segments=(segment,)), self.staged(1, micro=micro))
                for segment, micro in zip(decomposition.segments, micros)]
        buffered = [replace(option, plan=self.staged(1, cache=True, micro=micro))
                    if segment[0] > 0 and self.base.epochs > 1 else None
                    for option, segment, micro in zip(each, decomposition.segments, micros)]
        made = self.decider.raw_estimates(self.model, each + [option for option in buffered if option is not None],
                                          self.threads)
        return [_StageCost(segment, micro, made[option], made[buffer] if buffer is not None else None)
                for option, buffer, segment, micro in zip(each, buffered, decomposition.segments, micros)]

    def _trained(self, decomposition: Decomposition, stages: list[_StageCost], available: int) -> DepthwisePlan:
        """The option to train the cut, each stage after the first buffering its frozen blocks' outputs where that
        fits (and pays: more than one epoch)."""
        chosen: list[MemoryEstimate] = []
        cached: list[int] = []
        recomputed: list[int] = []
        needs: list[int] = []
        for number, stage in enumerate(stages, start=1):
            estimate = stage.recomputing
            if stage.buffering is not None:
                if self.decider.corrected(stage.buffering) <= available:
                    estimate = stage.buffering
                    cached.append(number)
                else:
                    recomputed.append(number)
                    needs.append(self.decider.corrected(stage.buffering))
            elif stage.segment[0] > 0:
                recomputed.append(number)
            chosen.append(estimate)
        schedule = tuple(Stage(self.base.epochs, self.route, number in cached, stage.micro)
                         for number, stage in enumerate(stages, start=1))
        cut = Cut(decomposition, None, self.route, tuple(cached), tuple(recomputed), min(needs) if needs else None)
        option = Option(self.spec(decomposition.segments), replace(self.base, schedule=schedule))
        return DepthwisePlan(cut, option, max(chosen, key=lambda e: e.total))
