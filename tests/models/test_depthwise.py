"""Tests for models.depthwise: SegmentModel, the depth-wise (FeDepth) training view, and output_shape."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from models import FamilyNet, ModelFamily, SegmentModel, SubmodelSpec, get_family
from models.depthwise import (
    Decomposition,
    cut_by_block_costs,
    cut_segments,
    frozen_outputs,
    micro_batch_ladder,
    output_shape,
)

Case = tuple[ModelFamily, tuple[int, int]]


def _build(family: ModelFamily, spec: SubmodelSpec, seed: int = 0) -> FamilyNet:
    torch.manual_seed(seed)
    return family.build(spec, track_bn_stats=False).train()


def _ids(*modules: nn.Module) -> set[int]:
    return {id(p) for m in modules for p in m.parameters()}


def _last_block_output(model: FamilyNet, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        for block in model.blocks:
            x = block(x)
    return x


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_only_the_segment_and_the_head_require_grad(case: Case, where: str) -> None:
    family, size = case
    n = family.num_blocks
    start, stop = {"first": (0, 1), "middle": (1, 3), "last": (n - 2, n)}[where]
    model = _build(family, SubmodelSpec(width=0.5, exits=(0, 1)))
    x = torch.randn(4, family.in_channels, *size)
    net = SegmentModel(model, start, stop, tuple(x.shape))
    trained = _ids(*model.blocks[start:stop], model.output_head())
    assert {id(p) for p in model.parameters() if p.requires_grad} == trained
    assert len(trained) < len(list(model.parameters()))
    logits = net(x)
    assert logits.shape == (4, family.num_classes)
    F.cross_entropy(logits, torch.tensor([0, 1, 2, 3])).backward()
    for name, p in model.named_parameters():
        assert (p.grad is not None) == (id(p) in trained), name
    assert any(float(p.grad.abs().sum()) > 0 for p in model.parameters() if p.grad is not None)
    net.release()
    assert all(p.requires_grad for p in model.parameters())


def test_frozen_blocks_run_without_autograd(case: Case) -> None:
    family, size = case
    model = _build(family, SubmodelSpec.uniform(0.5))
    x = torch.randn(2, family.in_channels, *size)
    net = SegmentModel(model, 2, 3, tuple(x.shape))
    seen: list[torch.Tensor] = []
    model.blocks[2].register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
    net(x)
    assert len(seen) == 1
    assert not seen[0].requires_grad and seen[0].grad_fn is None  # nothing before the segment is saved


def test_skip_route_subsamples_and_pads_to_the_heads_input(case: Case) -> None:
    family, size = case
    model = _build(family, SubmodelSpec.uniform(0.5))
    x = torch.randn(3, family.in_channels, *size)
    full = _last_block_output(model, x)
    head_shape = tuple(full.shape[1:])
    assert output_shape(model, tuple(x.shape)) == head_shape
    received: list[torch.Tensor] = []
    assert model.head is not None
    model.head.register_forward_pre_hook(lambda _m, args: received.append(args[0]))
    net = SegmentModel(model, 0, 1, tuple(x.shape))
    assert (net.head_channels, net.head_h, net.head_w) == head_shape
    net(x)
    got = received[-1]
    assert tuple(got.shape) == (3, *head_shape)
    with torch.no_grad():
        h = model.blocks[0](x)
    assert h.shape[1] < head_shape[0] and h.shape[2] > head_shape[1]  # both adjustments happen here
    step = math.ceil(h.shape[2] / head_shape[1])
    expected = F.pad(h[:, :, ::step, ::step], (0, 0, 0, 0, 0, head_shape[0] - h.shape[1]))
    torch.testing.assert_close(got, expected)
    assert torch.all(got[:, h.shape[1]:] == 0)  # zero-padded channels


def test_skip_route_truncates_extra_channels() -> None:
    family = get_family("cnn", 3, 1, hidden=(8, 4))
    model = _build(family, SubmodelSpec())
    x = torch.randn(2, 1, 8, 8)
    received: list[torch.Tensor] = []
    assert model.head is not None
    model.head.register_forward_pre_hook(lambda _m, args: received.append(args[0]))
    SegmentModel(model, 0, 1, tuple(x.shape))(x)
    with torch.no_grad():
        h = model.blocks[0](x)  # 8 channels at 4x4; the head reads 4 channels at 4x4
    torch.testing.assert_close(received[-1], h[:, :4])


def test_skip_route_of_a_cut_model_feeds_its_output_exit(case: Case) -> None:
    family, size = case
    model = _build(family, SubmodelSpec(width=0.5, depth=3, exits=(0, 2)))
    x = torch.randn(2, family.in_channels, *size)
    net = SegmentModel(model, 0, 1, tuple(x.shape))
    assert _ids(*model.blocks[0:1], model.exit_head(2)) == {id(p) for p in model.parameters() if p.requires_grad}
    received: list[torch.Tensor] = []
    model.exit_head(2).register_forward_pre_hook(lambda _m, args: received.append(args[0]))
    assert net(x).shape == (2, family.num_classes)
    assert tuple(received[-1].shape[1:]) == tuple(_last_block_output(model, x).shape[1:])


def test_exit_route_uses_the_exit_after_the_segment(case: Case) -> None:
    family, size = case
    model = _build(family, SubmodelSpec(width=0.5, exits=(1,)))
    x = torch.randn(4, family.in_channels, *size)
    net = SegmentModel(model, 0, 2, tuple(x.shape), route="exit")
    assert not net.skip
    assert {id(p) for p in model.parameters() if p.requires_grad} == _ids(*model.blocks[:2], model.exit_head(1))
    out = net.forward_exits(x)
    assert len(out) == 1
    with torch.no_grad():
        expected = model.exit_head(1)(model.blocks[1](model.blocks[0](x)))
    torch.testing.assert_close(out[0], expected)
    with pytest.raises(ValueError, match=r"route 'exit' needs an exit after block 2; the spec has exits at \[1\]"):
        SegmentModel(_build(family, SubmodelSpec(exits=(1,))), 1, 3, tuple(x.shape), route="exit")
    with pytest.raises(ValueError, match="route 'exit' needs an exit after block 0"):
        SegmentModel(_build(family, SubmodelSpec()), 0, 1, tuple(x.shape), route="exit")


def test_exit_route_of_the_last_segment_is_the_final_head(case: Case) -> None:
    family, size = case
    n = family.num_blocks
    model = _build(family, SubmodelSpec())  # no exits needed: the last segment ends at the final head
    x = torch.randn(2, family.in_channels, *size)
    net = SegmentModel(model, n - 1, n, tuple(x.shape), route="exit")
    assert model.head is not None
    assert {id(p) for p in model.parameters() if p.requires_grad} == _ids(model.blocks[n - 1], model.head)
    torch.testing.assert_close(net(x), model(x))


@pytest.mark.parametrize("route", ["skip", "exit"])
def test_last_segment_reproduces_the_model(case: Case, route: str) -> None:
    """When the segment ends at the last block nothing is subsampled or padded: the output is the model's."""
    family, size = case
    n = family.num_blocks
    model = _build(family, SubmodelSpec(width=0.5, exits=(0,)))
    x = torch.randn(4, family.in_channels, *size)
    for start in (0, n // 2, n - 1):
        net = SegmentModel(model, start, n, tuple(x.shape), route=route)
        assert not net.skip
        torch.testing.assert_close(net(x), model(x))
        net.release()


@pytest.mark.parametrize(("start", "stop"), [(-1, 1), (0, 0), (2, 1), (0, 99)])
def test_rejects_bad_segments(case: Case, start: int, stop: int) -> None:
    family, size = case
    model = _build(family, SubmodelSpec())
    with pytest.raises(ValueError, match="a segment must be a block range"):
        SegmentModel(model, start, stop, (2, family.in_channels, *size))
    assert all(p.requires_grad for p in model.parameters())  # nothing frozen by a refused view


def test_rejects_unknown_route(case: Case) -> None:
    family, size = case
    with pytest.raises(ValueError, match="route must be 'skip' or 'exit'"):
        SegmentModel(_build(family, SubmodelSpec()), 0, 1, (2, family.in_channels, *size), route="aux")


def test_output_shape_is_a_meta_probe(case: Case) -> None:
    family, size = case
    model = _build(family, SubmodelSpec(width=0.25, depth=2, exits=(1,)))
    x = torch.randn(2, family.in_channels, *size)
    assert output_shape(model, (64, family.in_channels, *size)) == tuple(_last_block_output(model, x).shape[1:])
    assert all(p.device.type == "cpu" for p in model.parameters())


# ---- FeDepth's memory-adaptive decomposition -----------------------------------------------------------------

def test_cut_reproduces_the_papers_gb_example() -> None:
    """FeDepth, Figure 3: layers of {3, 2, 1, 0.5, 0.5, 0.5} GB; a 3 GB client trains 3 blocks, a 5 GB one 2."""
    costs = [3, 2, 1, 0.5, 0.5, 0.5]
    three = cut_by_block_costs(costs, 3.0)
    assert three.segments == ((0, 1), (1, 3), (3, 6)) and three.skipped == ()
    five = cut_by_block_costs(costs, 5.0)
    assert five.segments == ((0, 2), (2, 6)) and five.skipped == ()
    assert cut_by_block_costs(costs, 100.0).segments == ((0, 6),)


# PreResNet-20's block costs in MB, FeDepth's Table 1 (B1-3 20.02, B4 14.05, B5-6 10.07, B7 7.21, B8-9 5.28).
TABLE_1 = [20.02, 20.02, 20.02, 14.05, 10.07, 10.07, 7.21, 5.28, 5.28]


def test_cut_reproduces_the_papers_preresnet20_order() -> None:
    """The paper trains B1 -> B2 -> B3 -> B4 -> B5,6 -> B7,8,9 at the 1/6-width budget. With the table's own
    costs that order is the fewest segments for every budget from B5 + B6 = 20.14 MB up to B4 + B5 = 24.12 MB
    (exclusive); the table's 1/6-width figure, 19.34 MB, is below B1-B3's 20.02 MB, which then do not fit."""
    for budget in (20.14, 22.0, 24.1):
        cut = cut_by_block_costs(TABLE_1, budget)
        assert cut.segments == ((0, 1), (1, 2), (2, 3), (3, 4), (4, 6), (6, 9)), budget
        assert cut.describe() == "0 | 1 | 2 | 3 | 4-5 | 6-8"
    assert cut_by_block_costs(TABLE_1, 24.13).segments[3:] == ((3, 5), (5, 8), (8, 9))


def test_cut_skips_the_input_side_blocks_that_never_fit() -> None:
    """Partial training: at 19.34 MB B1-B3 are skipped and the rest is cut as before."""
    cut = cut_by_block_costs(TABLE_1, 19.34)
    assert cut.skipped == (0, 1, 2)
    assert cut.segments == ((3, 4), (4, 5), (5, 7), (7, 9))
    assert cut.describe() == "3 | 4 | 5-6 | 7-8 (skipped 0, 1, 2)"
    nothing = cut_by_block_costs(TABLE_1, 1.0)
    assert nothing.segments == () and nothing.skipped == tuple(range(9)) and nothing.describe().startswith("nothing")


def test_cut_takes_any_monotone_segment_cost() -> None:
    """Segment costs need not be additive (real training memory is not): the greedy extends while it fits."""
    calls = []

    def cost(start: int, stop: int) -> float:
        calls.append((start, stop))
        return 10.0 + 3.0 * (stop - start)  # a fixed part (the head) plus 3 per block

    cut = cut_segments(cost, 7, 20.0)
    assert cut.segments == ((0, 3), (3, 6), (6, 7))
    assert (0, 4) in calls and (0, 5) not in calls  # stops extending once a segment no longer fits
    with pytest.raises(ValueError, match="non-negative"):
        cut_by_block_costs([1.0, -1.0], 5.0)


# ---------------------------------------------------------------------------------------------- buffering
def test_frozen_outputs_are_the_frozen_blocks_outputs_without_autograd(case: Case) -> None:
    family, size = case
    model = _build(family, SubmodelSpec.uniform(0.5))
    x = torch.randn(6, family.in_channels, *size)
    with torch.no_grad():
        expected = x
        for block in model.blocks[:2]:
            expected = block(expected)
    buffered = frozen_outputs(model, 2, x, batch_size=6)  # one batch: the same batch statistics
    assert buffered.shape == expected.shape and not buffered.requires_grad
    torch.testing.assert_close(buffered, expected)


def test_frozen_outputs_run_in_batches_and_fold_a_last_single_sample_into_the_batch_before(case: Case) -> None:
    family, size = case
    model = _build(family, SubmodelSpec.uniform(0.5))
    x = torch.randn(7, family.in_channels, *size)
    sizes: list[int] = []
    model.blocks[0].register_forward_pre_hook(lambda _m, args: sizes.append(len(args[0])))
    buffered = frozen_outputs(model, 1, x, batch_size=3)
    assert sizes == [3, 4] and len(buffered) == 7  # 3 + 3 + 1: the single sample joins the second batch
    with torch.no_grad():
        torch.testing.assert_close(buffered[3:], model.blocks[0](x[3:]))


def test_segment_on_buffered_inputs_matches_the_recomputed_segment(case: Case) -> None:
    family, size = case
    model = _build(family, SubmodelSpec.uniform(0.5))
    x = torch.randn(4, family.in_channels, *size)
    recomputed = SegmentModel(model, 2, 3, tuple(x.shape))(x)
    buffered = SegmentModel(model, 2, 3, tuple(x.shape), frozen_input=True)(frozen_outputs(model, 2, x, 4))
    torch.testing.assert_close(buffered, recomputed)


# ---------------------------------------------------------------------------------------------- micro-batches
BLOCKS = [6.0, 2.0, 1.0, 5.0, 1.0]  # at a batch of 32; a micro-batch of m costs m / 32 of that


def micro_cost(start: int, stop: int, micro: int) -> float:
    return sum(BLOCKS[start:stop]) * micro / 32


def whole_cost(start: int, stop: int) -> float:
    return sum(BLOCKS[start:stop])


def test_blocks_that_fit_nowhere_whole_train_in_the_largest_micro_batches_that_fit() -> None:
    cut = cut_segments(whole_cost, 5, 4.0, micro_cost=micro_cost, micro_batches=(16, 8, 4))
    # Block 0 (6) and block 3 (5) fit only at 16; the blocks after them fit whole, so they start a segment.
    assert cut == Decomposition(((0, 1), (1, 3), (3, 4), (4, 5)), (), (16, 0, 16, 0))
    assert cut.describe() == "0 (micro-batches of 16) | 1-2 | 3 (micro-batches of 16) | 4"
    assert cut.micro_batch(1) == 0 and cut.micro_batch(2) == 16


def test_a_micro_batched_segment_takes_the_next_blocks_that_need_micro_batches_too() -> None:
    # Budget 2.4: block 0 fits alone at 8 (1.5), block 1 (2.5) needs micro-batches too and fits beside it at 8
    # (8.5 * 8 / 32 = 2.125); block 2 fits whole and starts its own segment.
    blocks = [6.0, 2.5, 1.0]

    def cost(start: int, stop: int, micro: int = 32) -> float:
        return sum(blocks[start:stop]) * micro / 32

    cut = cut_segments(cost, 3, 2.4, micro_cost=cost, micro_batches=(16, 8, 4))
    assert cut == Decomposition(((0, 2), (2, 3)), (), (8, 0))


def test_the_largest_micro_batch_comes_before_the_fewest_segments() -> None:
    # Budget 1.5: block 0 fits at 8 but not beside block 1 at 8, which fits alone at 16: two segments, each at
    # the largest micro-batch it fits in, rather than one at 4.
    cut = cut_segments(whole_cost, 5, 1.5, micro_cost=micro_cost, micro_batches=(16, 8, 4))
    assert cut == Decomposition(((0, 1), (1, 2), (2, 3), (3, 4), (4, 5)), (), (8, 16, 0, 8, 0))


def test_a_block_that_fits_in_no_micro_batch_is_skipped() -> None:
    cut = cut_segments(whole_cost, 5, 0.6, micro_cost=micro_cost, micro_batches=(16, 8, 4))
    assert cut.skipped == (0, 3) and cut.segments == ((1, 2), (2, 3), (4, 5)) and cut.micro_batches == (8, 16, 16)
    assert cut.describe() == "1 (micro-batches of 8) | 2 (micro-batches of 16) | 4 (micro-batches of 16) (skipped 0, 3)"


def test_without_micro_batches_nothing_changes() -> None:
    assert cut_segments(whole_cost, 5, 4.0) == Decomposition(((1, 3), (4, 5)), (0, 3))


@pytest.mark.parametrize(("batch", "floor", "ladder"), [(32, 8, [16, 8]), (32, 2, [16, 8, 4, 2]), (32, 0, []),
                                                        (32, 17, []), (10, 2, [5, 2]), (8, 4, [4])])
def test_the_micro_batch_ladder_halves_the_batch_down_to_the_floor(batch: int, floor: int, ladder: list[int]) -> None:
    assert micro_batch_ladder(batch, floor) == ladder


# ---- the head alone: partial training where no block fits -----------------------------------------------------

def test_the_head_alone_trains_only_the_head_on_every_blocks_frozen_output(case: Case) -> None:
    family, size = case
    n = family.num_blocks
    model = _build(family, SubmodelSpec())
    x = torch.randn(4, family.in_channels, *size)
    net = SegmentModel(model, n, n, tuple(x.shape))
    assert not net.skip and net.classifier is model.output_head()
    assert {id(p) for p in model.parameters() if p.requires_grad} == _ids(model.output_head())
    logits = net(x)
    torch.testing.assert_close(logits, model(x))  # the real features: no skip path
    F.cross_entropy(logits, torch.tensor([0, 1, 2, 3])).backward()
    head = _ids(model.output_head())
    for name, p in model.named_parameters():
        assert (p.grad is not None) == (id(p) in head), name
    net.release()
    buffered = frozen_outputs(model, n, x, batch_size=4)  # what a buffered head-only stage trains from
    torch.testing.assert_close(SegmentModel(model, n, n, tuple(x.shape), frozen_input=True)(buffered), model(x))


def test_the_head_alone_is_one_empty_segment_after_every_kept_block(case: Case) -> None:
    family, _ = case
    n = family.num_blocks
    spec = family.validate_spec(SubmodelSpec(segments=((n, n),)))
    assert spec.head_only and not SubmodelSpec(segments=((0, n),)).head_only and not SubmodelSpec().head_only
    assert family.trained_blocks(spec) == ()
    assert set(family.trainable_keys(spec)) == set(family.head_keys())  # what the update carries: the head
    assert family.is_nested(spec, SubmodelSpec())
    with pytest.raises(ValueError, match="after every kept block"):
        family.validate_spec(SubmodelSpec(segments=((1, 1),)))
    with pytest.raises(ValueError, match="the only one"):
        SubmodelSpec(segments=((0, 1), (n, n)))


def test_the_head_alone_is_cut_exactly_where_no_block_fits() -> None:
    head = 0.1  # cost(5, 5): the head on the frozen output of every block, below any block in micro-batches

    def cost(start: int, stop: int) -> float:
        return whole_cost(start, stop) if stop > start else head

    def micro(start: int, stop: int, size: int) -> float:
        return cost(start, stop) * size / 32

    ladder = (16, 8, 4)
    least_block = min(micro(b, b + 1, 4) for b in range(5))
    assert head < least_block  # the head alone is cheaper than any block at the smallest micro-batch
    just_below = cut_segments(cost, 5, least_block - 1e-9, micro_cost=micro, micro_batches=ladder, head_only=True)
    assert just_below == Decomposition(((5, 5),), (0, 1, 2, 3, 4)) and just_below.head_only
    assert just_below.describe() == "head alone (skipped 0, 1, 2, 3, 4)"
    at = cut_segments(cost, 5, least_block, micro_cost=micro, micro_batches=ladder, head_only=True)
    assert at.segments and not at.head_only and (5, 5) not in at.segments  # a block fits: no head-only stage
    assert at == cut_segments(cost, 5, least_block, micro_cost=micro, micro_batches=ladder)  # as without it
    in_micro = cut_segments(cost, 5, head / 2, micro_cost=micro, micro_batches=ladder, head_only=True)
    assert in_micro == Decomposition(((5, 5),), (0, 1, 2, 3, 4), (16,))  # the largest micro-batch that fits
    assert in_micro.describe() == "head alone (micro-batches of 16) (skipped 0, 1, 2, 3, 4)"
    nothing = cut_segments(cost, 5, micro(5, 5, 4) - 1e-9, micro_cost=micro, micro_batches=ladder, head_only=True)
    assert nothing.segments == () and not nothing.head_only
    assert cut_segments(cost, 5, least_block - 1e-9, micro_cost=micro, micro_batches=ladder).segments == ()
