"""edge_agent.depthwise_cut: FeDepth's cut of a task into stages that fit, searched over estimates given by a
stand-in for the agent's estimator (each block's cost known), and what a cut tells in words."""

from __future__ import annotations

from dataclasses import dataclass

from edge_agent.adaptation import Option
from edge_agent.depthwise_cut import Cut, DepthwisePlan, DepthwiseSearch, shortfall, why_no_cut
from models import MemoryEstimate, SubmodelSpec
from models.depthwise import Decomposition
from protocol import ModelRef, TrainingPlan

MODEL = ModelRef("cnn", 10, 1, {})
#: Bytes each block costs to train at whole batches; the head alone costs HEAD.
BLOCK_COSTS = (300, 100, 100, 50)
HEAD = 20


def _estimate(total: int) -> MemoryEstimate:
    return MemoryEstimate(parameters=0, gradients=0, optimizer_state=0, activations=total, workspace=0, overhead=0)


@dataclass
class CostedBlocks:
    """Estimates of a stage: the sum of its blocks' costs (halved for each halving of the batch in micro-batches),
    the head's where it trains alone, and a buffered stage costing ``buffer_extra`` more."""

    batch_size: int
    buffer_extra: int = 0

    def raw_estimate(self, model: ModelRef, spec: SubmodelSpec, plan: TrainingPlan,
                     threads: int | None = None) -> MemoryEstimate:
        assert spec.segments is not None and len(spec.segments) == 1
        start, stop = spec.segments[0]
        stage = plan.schedule[0]
        cost = sum(BLOCK_COSTS[start:stop]) if stop > start else HEAD
        if stage.micro_batch:
            cost = cost * stage.micro_batch // self.batch_size
        return _estimate(cost + (self.buffer_extra if stage.cache else 0))

    def raw_estimates(self, model: ModelRef, candidates: list[Option],
                      threads: int | None = None) -> dict[Option, MemoryEstimate]:
        return {option: self.raw_estimate(model, option.spec, option.plan, threads) for option in candidates}

    def corrected(self, estimate: MemoryEstimate) -> int:
        return estimate.total


def _search(estimates: CostedBlocks, plan: TrainingPlan, *, ladder: list[int] | None = None,
            head_alone: bool = False) -> DepthwiseSearch:
    return DepthwiseSearch(estimates, MODEL, SubmodelSpec.full(), plan, "skip", len(BLOCK_COSTS), ladder or [],
                           head_alone)


def test_every_stage_of_the_cut_fits_the_memory_available_and_the_blocks_are_covered_in_order() -> None:
    plan = TrainingPlan(batch_size=32)
    for available in (300, 350, 450, 1000):
        found = _search(CostedBlocks(32), plan).plan_for(available)
        assert found.option is not None
        segments = found.cut.decomposition.segments
        assert [b for start, stop in segments for b in range(start, stop)] == list(range(len(BLOCK_COSTS)))
        assert all(sum(BLOCK_COSTS[start:stop]) <= available for start, stop in segments)
        assert found.option.spec.segments == segments
        assert found.estimate.total == max(sum(BLOCK_COSTS[start:stop]) for start, stop in segments)
    assert len(_search(CostedBlocks(32), plan).plan_for(1000).cut.decomposition.segments) == 1  # all fits at once


def test_a_block_too_big_alone_trains_in_micro_batches_from_the_ladder() -> None:
    found = _search(CostedBlocks(32), TrainingPlan(batch_size=32), ladder=[16, 8]).plan_for(200)
    assert found.option is not None
    decomposition = found.cut.decomposition
    assert decomposition.segments[0] == (0, 1) and decomposition.micro_batch(0) == 16  # 300 at 32, 150 at 16
    assert all(stage.micro_batch == decomposition.micro_batch(i)
               for i, stage in enumerate(found.option.plan.schedule))


def test_nothing_fits_names_the_least_a_block_needs_at_the_smallest_micro_batch() -> None:
    found = _search(CostedBlocks(32), TrainingPlan(batch_size=32), ladder=[16, 8]).plan_for(10)
    assert found.option is None and shortfall(found) == (1, 0, 0)
    assert found.cut.smallest == min(BLOCK_COSTS) * 8 // 32 and found.cut.smallest_micro == 8
    assert "the smallest needs" in why_no_cut(found.cut, head_alone=False)


def test_the_head_alone_trains_where_no_block_fits_and_it_is_offered() -> None:
    found = _search(CostedBlocks(32), TrainingPlan(batch_size=32), head_alone=True).plan_for(30)
    assert found.option is not None and found.cut.decomposition.head_only
    assert shortfall(found) == (0, 1, len(BLOCK_COSTS))  # the body frozen, every block skipped
    assert "the head alone" in found.cut.describe()


def test_a_later_stage_buffers_its_frozen_inputs_only_where_that_fits_and_it_runs_more_than_one_epoch() -> None:
    several = TrainingPlan(batch_size=32, epochs=3)
    roomy = _search(CostedBlocks(32, buffer_extra=10), several).plan_for(310)
    assert roomy.option is not None and roomy.cut.cached  # 100-block stages plus a 10-byte buffer fit 310
    assert all(stage.cache == (number in roomy.cut.cached)
               for number, stage in enumerate(roomy.option.plan.schedule, start=1))
    tight = _search(CostedBlocks(32, buffer_extra=10_000), several).plan_for(310)
    assert tight.option is not None and not tight.cut.cached and tight.cut.recomputed
    assert tight.cut.buffer_needs is not None and tight.cut.buffer_needs > 310
    once = _search(CostedBlocks(32, buffer_extra=10), TrainingPlan(batch_size=32, epochs=1)).plan_for(310)
    assert once.option is not None and not once.cut.cached and once.cut.buffer_needs is None  # nothing to save
    assert "one epoch a stage" in once.cut.describe()


def test_shortfall_orders_plans_by_what_they_leave_out() -> None:
    whole = DepthwisePlan(Cut(Decomposition(((0, 2), (2, 4)), ())), Option(SubmodelSpec.full(), TrainingPlan()),
                          _estimate(1))
    skipping = DepthwisePlan(Cut(Decomposition(((1, 4),), (0,))), Option(SubmodelSpec.full(), TrainingPlan()),
                             _estimate(1))
    head = DepthwisePlan(Cut(Decomposition(((4, 4),), (0, 1, 2, 3))), Option(SubmodelSpec.full(), TrainingPlan()),
                        _estimate(1))
    nothing = DepthwisePlan(Cut(Decomposition((), ())), None, _estimate(1))
    assert sorted([nothing, head, skipping, whole], key=shortfall) == [whole, skipping, head, nothing]


def test_why_no_cut_says_nothing_without_a_cut_and_what_the_cheapest_needs_with_one() -> None:
    assert why_no_cut(None, head_alone=False) == ""
    assert why_no_cut(Cut(Decomposition((), ())), head_alone=False) == "; no cut fits with its auxiliary classifiers"
    text = why_no_cut(Cut(Decomposition((), ()), smallest=4 << 20, smallest_micro=8), head_alone=True)
    assert "nor the head alone" in text and "in micro-batches of 8" in text


def test_describe_names_the_blocks_route_and_buffering_of_each_stage() -> None:
    cut = Cut(Decomposition(((0, 1), (1, 4)), ()), route="exit", cached=(2,))
    assert cut.describe() == "blocks 0 | 1-3 via auxiliary classifiers; frozen blocks' outputs buffered in stage 2"
    recomputed = Cut(Decomposition(((0, 1), (1, 3), (3, 4)), ()), recomputed=(2, 3))
    assert recomputed.describe().endswith("recomputed every batch in stages 2, 3 (one epoch a stage)")
