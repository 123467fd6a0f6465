"""Tests for the shared machinery of models.family.ModelFamily, run against every family."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import pytest
import torch
from torch import nn

from models import FamilyNet, ModelFamily, SubmodelSpec, get_family
from models.memory import _estimate_training_memory

#: HeteroFL levels a..e (the same as the ``spec`` fixture's).
RATES = (1.0, 0.5, 0.25, 0.125, 0.0625)

Case = tuple[ModelFamily, tuple[int, int]]
Feature = Callable[[ModelFamily], SubmodelSpec]
GlobalState = Callable[..., dict[str, torch.Tensor]]

BN_BUFFERS = ("running_mean", "running_var", "num_batches_tracked")


def _shapes(state: dict[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    return {key: tuple(value.shape) for key, value in state.items()}


def _depth(family: ModelFamily, spec: SubmodelSpec) -> int:
    return family.num_blocks if spec.depth is None else spec.depth


# ------------------------------------------------------------------------------------------------ structure
def test_blocks_and_exit_points(case: Case) -> None:
    family, _ = case
    blocks = [d.block for d in family.layers() if d.block is not None]
    assert sorted(set(blocks)) == list(range(family.num_blocks))
    assert blocks == sorted(blocks)  # declared in depth order
    assert family.exit_points == tuple(range(family.num_blocks - 1))
    model = family.build(track_bn_stats=False)
    assert isinstance(model, FamilyNet)
    assert len(model.blocks) == family.num_blocks and model.head is not None
    assert model.exit_blocks == () and model.num_outputs == 1


def test_blocks_compose_to_the_model(case: Case) -> None:
    family, size = case
    torch.manual_seed(0)
    model = family.build(SubmodelSpec.uniform(0.5), track_bn_stats=False).train()
    x = torch.randn(4, family.in_channels, *size)
    out = x
    for block in model.blocks:
        out = block(out)
    assert model.head is not None
    torch.testing.assert_close(model.head(out), model(x))
    covered = [id(p) for m in (*model.blocks, model.head) for p in m.parameters()]
    assert len(covered) == len(set(covered))  # no parameter in two blocks
    assert set(covered) == {id(p) for p in model.parameters()}


def test_layers_of_a_block_are_the_block_modules(case: Case) -> None:
    """The declaration's block numbering is the built model's: block b's parameters are exactly the declared
    layers with ``block == b``, and the final head's are those with neither block nor exit."""
    family, _ = case
    model = family.build(SubmodelSpec(exits=family.exit_points), track_bn_stats=False)
    names = {id(p): name for name, p in model.named_parameters()}
    for b, block in enumerate(model.blocks):
        declared = {f"{d.name}.{kind}" for d in family.layers() if d.block == b for kind in ("weight", "bias")}
        assert {names[id(p)] for p in block.parameters()} <= declared
        assert {n.rsplit(".", 1)[0] for n in (names[id(p)] for p in block.parameters())} == {
            d.name for d in family.layers() if d.block == b
        }
    assert model.head is not None
    assert {names[id(p)].rsplit(".", 1)[0] for p in model.head.parameters()} == {
        d.name for d in family.layers() if d.block is None and d.exit is None
    }
    for b in family.exit_points:
        assert {names[id(p)].rsplit(".", 1)[0] for p in model.exit_head(b).parameters()} == {
            d.name for d in family.layers() if d.exit == b
        }


def test_layer_names_are_the_prunable_layers_then_the_exit_groups(case: Case) -> None:
    family, _ = case
    prunable = family.prunable_layers()
    names = family.layer_names()
    assert names[: len(prunable)] == prunable
    assert not any(name.startswith("exits.") for name in prunable)
    convs = family.options["exit_convs"]
    expected_exits = tuple(f"exits.{b}.conv{i}" for b in family.exit_points for i in range(1, convs + 1))
    assert names[len(prunable):] == expected_exits


def test_global_shapes_are_the_full_model_with_every_exit(case: Case, global_state_of: GlobalState) -> None:
    family, _ = case
    assert family.global_shapes() == _shapes(global_state_of(family))
    assert family.global_shapes() == family.shapes(SubmodelSpec(exits=family.exit_points))


# ------------------------------------------------------------------------------------------------ uniform widths
def test_state_dict_matches_declaration(case: Case, spec: SubmodelSpec) -> None:
    family, _ = case
    imap = family.index_map(spec)
    tracked = family.build(spec, track_bn_stats=True).state_dict()
    assert list(tracked) == list(imap)
    for key, tensor in tracked.items():
        assert tuple(tensor.shape) == tuple(len(i) for i in imap[key]), key
    static = family.build(spec, track_bn_stats=False).state_dict()
    assert tuple(static) == family.trainable_keys(spec) == family.state_keys(spec)
    assert not any(k.endswith(BN_BUFFERS) for k in static)


def test_extract_loads_strictly(case: Case, spec: SubmodelSpec, global_state_of: GlobalState) -> None:
    family, _ = case
    global_state = global_state_of(family)
    full_sub = family.extract(global_state, spec)
    family.build(spec).load_state_dict(full_sub, strict=True)
    trainable = family.extract(global_state, spec, keys=family.trainable_keys(spec))
    assert tuple(trainable) == family.trainable_keys(spec)
    family.build(spec, track_bn_stats=False).load_state_dict(trainable, strict=True)


def test_extract_matches_index_map_and_copies(case: Case, global_state_of: GlobalState) -> None:
    family, _ = case
    spec = SubmodelSpec(width=0.5, exits=family.exit_points[:2])
    global_state = global_state_of(family)
    imap = family.index_map(spec)
    sub = family.extract(global_state, spec)
    assert list(sub) == list(imap)
    for key, idx in imap.items():
        expected = global_state[key][torch.meshgrid(*idx, indexing="ij")] if idx else global_state[key]
        assert torch.equal(sub[key], expected), key
        assert sub[key].is_contiguous()
        assert sub[key].data_ptr() != global_state[key].data_ptr()
    key = family.trainable_keys(spec)[0]
    before = global_state[key].clone()
    sub[key].add_(1.0)
    assert torch.equal(global_state[key], before)


def test_scalars_map_to_empty_tuple(case: Case) -> None:
    family, _ = case
    imap = family.index_map(SubmodelSpec.uniform(0.25))
    scalars = [k for k in imap if k.endswith("num_batches_tracked")]
    assert scalars and all(imap[k] == () for k in scalars)
    assert all(i.dtype == torch.int64 for idx in imap.values() for i in idx)


def test_full_index_map_is_identity(case: Case) -> None:
    family, _ = case
    global_state = family.build().state_dict()
    for key, idx in family.index_map(None).items():
        assert len(idx) == global_state[key].dim()
        for dim, i in enumerate(idx):
            assert torch.equal(i, torch.arange(global_state[key].shape[dim])), key
    assert family.index_map(None).keys() == family.index_map(SubmodelSpec.full()).keys()


def test_smaller_specs_are_nested(case: Case) -> None:
    family, _ = case
    maps = [family.index_map(SubmodelSpec.uniform(r)) for r in RATES]
    for larger, smaller in itertools.pairwise(maps):
        assert larger.keys() == smaller.keys()
        for key in smaller:
            for big, small in zip(larger[key], smaller[key]):
                assert set(small.tolist()) <= set(big.tolist()), key
                assert len(small) <= len(big)
    for big, small in itertools.combinations(RATES, 2):
        assert family.is_nested(SubmodelSpec.uniform(small), SubmodelSpec.uniform(big))
        assert not family.is_nested(SubmodelSpec.uniform(big), SubmodelSpec.uniform(small))


def test_classifier_rows_and_input_channels_never_sliced(case: Case) -> None:
    family, _ = case
    keys = family.classifier_keys(SubmodelSpec())
    assert keys == ("classifier.weight", "classifier.bias")
    assert family.classifier_keys() == keys + tuple(
        f"exits.{b}.classifier.{kind}" for b in family.exit_points for kind in ("weight", "bias")
    )
    cut = SubmodelSpec(width=0.25, depth=2, exits=(0, 1))
    assert family.classifier_keys(cut) == tuple(
        f"exits.{b}.classifier.{kind}" for b in (0, 1) for kind in ("weight", "bias")
    )
    first = family.layers()[0]
    assert first.in_group is None and first.kind == "conv"
    for rate in RATES:
        spec = SubmodelSpec(width=rate, exits=family.exit_points)
        imap = family.index_map(spec)
        for key in family.classifier_keys(spec):
            assert torch.equal(imap[key][0], torch.arange(family.num_classes)), key
        assert torch.equal(imap[f"{first.name}.weight"][1], torch.arange(family.in_channels))


def test_layers_feed_from_the_previous_kept_outputs(case: Case) -> None:
    family, _ = case
    spec = SubmodelSpec(width=0.25, exits=family.exit_points)
    imap = family.index_map(spec)
    kept = family.kept_channels(spec)
    for decl in family.layers():
        weight = imap[f"{decl.name}.weight"]
        if decl.out_group is not None:
            assert len(weight[0]) == kept[decl.out_group]
        if decl.kind != "bn" and decl.in_group is not None:
            assert len(weight[1]) == kept[decl.in_group]


def test_forward_backward_of_each_submodel(case: Case, spec: SubmodelSpec) -> None:
    family, size = case
    torch.manual_seed(1)
    model = family.build(spec, track_bn_stats=False).train()
    x = torch.randn(4, family.in_channels, *size)
    y = torch.tensor([0, 1, 2, 3])
    logits = model(x)
    assert logits.shape == (4, family.num_classes)
    nn.functional.cross_entropy(logits, y).backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert any(float(g.abs().sum()) > 0 for g in grads if g is not None)


def test_full_slice_reproduces_global_outputs(case: Case) -> None:
    family, size = case
    torch.manual_seed(2)
    global_model = family.build().eval()
    copy = family.build().eval()
    copy.load_state_dict(family.extract(global_model.state_dict(), SubmodelSpec.full()))
    x = torch.randn(2, family.in_channels, *size)
    assert torch.equal(global_model(x), copy(x))


def test_param_count_matches_built_models(case: Case, spec: SubmodelSpec) -> None:
    family, _ = case
    expected = sum(p.numel() for p in family.build(spec, track_bn_stats=False).parameters())
    assert family.param_count(spec) == expected
    assert family.param_count(spec) == sum(p.numel() for p in family.build(spec).parameters())


@pytest.mark.parametrize("name", ["cnn", "preresnet18", "resnet20", "vgg16"])
def test_param_count_shrinks_roughly_with_rate_squared(name: str) -> None:
    family = get_family(name, 10, 3)  # default sizes: no model is built here
    full = family.param_count()
    assert family.param_count(SubmodelSpec.full()) == full
    for rate in RATES[1:]:
        ratio = family.param_count(SubmodelSpec.uniform(rate)) / full
        assert 0.9 * rate**2 <= ratio <= 1.5 * rate**2, (rate, ratio)


def test_flops_decrease_with_rate(case: Case) -> None:
    family, size = case
    flops = [family.flops(SubmodelSpec.uniform(r), size) for r in RATES]
    assert all(a > b > 0 for a, b in itertools.pairwise(flops))
    assert family.flops(None, size) == flops[0]
    # Roughly quadratic in the width rate for the body.
    assert flops[1] / flops[0] < 0.35


def test_training_memory_shrinks_with_rate(case: Case) -> None:
    family, size = case
    mems = [
        _estimate_training_memory(family, SubmodelSpec.uniform(r), batch_size=10, input_size=size).total
        for r in RATES
    ]
    assert all(a > b for a, b in itertools.pairwise(mems))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"batch_size": 0},
        {"batch_size": 2.5},
        {"batch_size": 4, "optimizer_slots": -1},
        {"batch_size": 4, "input_size": (28,)},
        {"batch_size": 4, "input_size": (0, 28)},
    ],
)
def test_training_memory_rejects_bad_arguments(case: Case, kwargs: dict[str, object]) -> None:
    family, _ = case
    with pytest.raises(ValueError):
        _estimate_training_memory(family, None, **kwargs)  # type: ignore[arg-type]


def test_extract_errors(case: Case) -> None:
    family, _ = case
    state = family.build().state_dict()
    with pytest.raises(ValueError, match="no_such_key"):
        family.extract(state, keys=["no_such_key"])
    with pytest.raises(ValueError, match=r"global state has no tensor .exits\.0\."):
        family.extract(state, SubmodelSpec(exits=(0,)))  # the global state lacks the exit heads
    missing = dict(state)
    del missing["classifier.weight"]
    with pytest.raises(ValueError, match="classifier.weight"):
        family.extract(missing)
    wrong = dict(state)
    wrong["classifier.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match="shape"):
        family.extract(wrong)


def test_kept_channels_follow_rates(case: Case) -> None:
    family, _ = case
    names = family.layer_names()
    kept = family.kept_channels(SubmodelSpec.uniform(0.5))
    full = family.kept_channels(None)
    assert tuple(kept) == names
    assert all(kept[n] == -(-full[n] // 2) for n in names)
    floor = family.kept_channels(SubmodelSpec(width=0.7, rounding="floor"))
    ceil = family.kept_channels(SubmodelSpec(width=0.7))
    assert all(floor[n] == max(1, math.floor(0.7 * full[n] + 1e-9)) for n in names)
    assert all(ceil[n] == math.ceil(0.7 * full[n] - 1e-9) for n in names)
    assert any(floor[n] < ceil[n] for n in names)


def test_build_returns_train_mode_module(case: Case) -> None:
    family, _ = case
    assert family.build(SubmodelSpec.uniform(0.5)).training
    with pytest.raises(ValueError, match="SubmodelSpec"):
        family.build({"width": 0.5})  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------------ every feature
def test_declaration_round_trip(case: Case, feature: Feature) -> None:
    """index_map, shapes, state_keys and the built module agree key for key and shape for shape."""
    family, _ = case
    spec = feature(family)
    imap = family.index_map(spec)
    for track in (True, False):
        built = _shapes(family.build(spec, track_bn_stats=track).state_dict())
        assert list(built) == list(family.shapes(spec, track_bn_stats=track))
        assert built == family.shapes(spec, track_bn_stats=track)
        if track:
            assert list(imap) == list(built)
            assert {k: tuple(len(i) for i in idx) for k, idx in imap.items()} == built
        else:
            assert family.state_keys(spec) == tuple(built)
            assert not any(k.endswith(BN_BUFFERS) for k in built)
    assert family.shapes(spec) == family.shapes(spec, track_bn_stats=True)
    # Exit heads exist exactly where the spec puts them; the final head only when no block is cut.
    keys = family.state_keys(spec)
    assert {k.split(".")[1] for k in keys if k.startswith("exits.")} == {str(b) for b in spec.exits}
    assert ("classifier.weight" in keys) == (spec.depth is None)


def test_extract_from_the_global_state_loads_strictly(case: Case, feature: Feature,
                                                      global_state_of: GlobalState) -> None:
    family, _ = case
    spec = feature(family)
    global_state = global_state_of(family)
    imap = family.index_map(spec)
    sub = family.extract(global_state, spec)
    model = family.build(spec, track_bn_stats=True)
    model.load_state_dict(sub, strict=True)
    for key, value in model.state_dict().items():
        idx = imap[key]
        expected = global_state[key][torch.meshgrid(*idx, indexing="ij")] if idx else global_state[key]
        assert torch.equal(value, expected), key
    static = family.build(spec, track_bn_stats=False)
    static.load_state_dict(family.extract(global_state, spec, keys=family.state_keys(spec)), strict=True)
    # The trainable keys alone fill exactly the trainable part of the model.
    result = static.load_state_dict(family.extract(global_state, spec, keys=family.trainable_keys(spec)),
                                    strict=False)
    assert result.unexpected_keys == []
    assert set(result.missing_keys) == set(family.state_keys(spec)) - set(family.trainable_keys(spec))


def test_trainable_keys(case: Case, feature: Feature) -> None:
    """All state keys without segments; with segments the trained blocks' layers and the head producing the
    model's output, in state order (computed here from the built module). An early exit after a trained block
    that is not the model's output is never trained by a depth-wise stage through the skip route (only through
    the exit route, when the exit ends a segment); whether it is listed is left open here."""
    family, _ = case
    spec = feature(family)
    state_keys = family.state_keys(spec)
    trainable = family.trainable_keys(spec)
    assert set(trainable) <= set(state_keys)
    assert list(trainable) == [k for k in state_keys if k in trainable]  # state order kept
    depth = _depth(family, spec)
    trained = family.trained_blocks(spec)
    if spec.segments is None:
        assert trained == tuple(range(depth))
        assert trainable == state_keys
        return
    assert trained == tuple(sorted(b for start, stop in spec.segments for b in range(start, stop)))
    model = family.build(spec, track_bn_stats=False)

    def names(*modules: nn.Module) -> set[str]:
        ids = {id(p) for m in modules for p in m.parameters()}
        return {name for name, p in model.named_parameters() if id(p) in ids}

    required = names(*(model.blocks[b] for b in trained), model.output_head())
    optional = names(*(model.exit_head(b) for b in model.exit_blocks if b in trained)) - required
    assert required <= set(trainable) <= required | optional
    if not optional:
        assert set(trainable) == required
    frozen = names(*(model.blocks[b] for b in range(depth) if b not in trained))
    frozen |= names(*(model.exit_head(b) for b in model.exit_blocks if b not in trained and b != depth - 1))
    assert frozen  # every segment spec here leaves a block frozen
    assert set(state_keys) - set(trainable) >= frozen
    assert not frozen & set(trainable)


def test_param_count_of_every_feature(case: Case, feature: Feature) -> None:
    family, _ = case
    spec = feature(family)
    expected = sum(p.numel() for p in family.build(spec, track_bn_stats=False).parameters())
    assert family.param_count(spec) == expected
    costs = family.layer_costs(spec)
    assert sum(params for _, params, _ in costs) == expected
    assert all(macs == 0 for _, _, macs in costs)  # no input size: no multiply-accumulates


def _hooked_macs(model: nn.Module, x: torch.Tensor) -> int:
    """Multiply-accumulates of one sample, counted on a real ``forward_exits`` pass: conv out.numel() x in_ch x
    kh x kw, linear out.numel() x in_features."""
    total = 0

    def hook(module: nn.Module, _inputs: object, output: torch.Tensor) -> None:
        nonlocal total
        per_sample = output[0].numel()
        if isinstance(module, nn.Conv2d):
            assert module.groups == 1
            total += per_sample * module.in_channels * module.kernel_size[0] * module.kernel_size[1]
        else:
            assert isinstance(module, nn.Linear)
            total += per_sample * module.in_features

    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    try:
        with torch.no_grad():
            model.forward_exits(x)  # type: ignore[operator]
    finally:
        for handle in handles:
            handle.remove()
    return total


def test_flops_match_a_hooked_forward_pass(case: Case, feature: Feature) -> None:
    family, size = case
    spec = feature(family)
    model = family.build(spec, track_bn_stats=False).train()
    expected = _hooked_macs(model, torch.randn(2, family.in_channels, *size))
    assert family.flops(spec, size) == expected > 0
    costs = family.layer_costs(spec, size)
    assert sum(macs for _, _, macs in costs) == expected
    assert [d.name for d, _, _ in costs] == [d.name for d in family.layers() if f"{d.name}.weight" in
                                            family.state_keys(spec)]
    assert all(macs == 0 for d, _, macs in costs if d.kind == "bn")


def test_flops_count_the_exit_heads(case: Case) -> None:
    family, size = case
    with_exit = SubmodelSpec(exits=(0,))
    model = family.build(with_exit, track_bn_stats=False)
    head_macs = _hooked_macs(model, torch.randn(2, family.in_channels, *size)) - _hooked_macs(
        family.build(track_bn_stats=False), torch.randn(2, family.in_channels, *size))
    assert head_macs > 0
    assert family.flops(with_exit, size) - family.flops(None, size) == head_macs


def test_forward_exits_gives_every_output(case: Case, feature: Feature) -> None:
    family, size = case
    spec = feature(family)
    torch.manual_seed(3)
    model = family.build(spec, track_bn_stats=False).train()
    cut = spec.depth is not None
    assert len(model.blocks) == _depth(family, spec)
    assert model.exit_blocks == spec.exits
    assert (model.head is None) == cut
    assert model.num_outputs == len(spec.exits) + (not cut) == family.num_outputs(spec)
    x = torch.randn(3, family.in_channels, *size)
    outputs = model.forward_exits(x)
    assert len(outputs) == model.num_outputs
    assert all(out.shape == (3, family.num_classes) for out in outputs)
    torch.testing.assert_close(model(x), outputs[-1])
    # The exits after the blocks, in depth order: each exit output is its head applied to its block's output.
    h = x
    expected: list[torch.Tensor] = []
    for b, block in enumerate(model.blocks):
        h = block(h)
        if b in spec.exits:
            expected.append(model.exit_head(b)(h))
    if model.head is not None:
        expected.append(model.head(h))
    for got, want in zip(outputs, expected):
        torch.testing.assert_close(got, want)
    # Every output trains: cross-entropy of all of them reaches every parameter.
    sum(nn.functional.cross_entropy(out, torch.tensor([0, 1, 2])) for out in outputs).backward()
    assert all(p.grad is not None for p in model.parameters())


def test_output_head_of_a_cut_model_is_its_last_exit(case: Case) -> None:
    family, _ = case
    model = family.build(SubmodelSpec(depth=2, exits=(0, 1)))
    assert model.head is None
    assert model.output_head() is model.exit_head(1)
    with pytest.raises(KeyError, match="no exit after block 2"):
        model.exit_head(2)
    full = family.build()
    assert full.output_head() is full.head


# ------------------------------------------------------------------------------------------------ nesting
def test_every_spec_is_nested_in_itself_and_in_the_full_model_with_its_exits(case: Case, feature: Feature) -> None:
    family, _ = case
    spec = feature(family)
    assert family.is_nested(spec, spec)
    assert family.is_nested(spec, SubmodelSpec(exits=spec.exits))
    assert family.is_nested(spec, SubmodelSpec(exits=family.exit_points))
    if spec != SubmodelSpec():
        assert not family.is_nested(SubmodelSpec(exits=family.exit_points), spec)


def test_is_nested(case: Case) -> None:
    family, _ = case
    n = family.num_blocks
    first = family.prunable_layers()[0]
    nested = [
        (None, None),
        (SubmodelSpec.uniform(0.5), None),
        (SubmodelSpec(width=0.7, rounding="floor"), SubmodelSpec(width=0.7)),  # floor keeps fewer channels
        (SubmodelSpec.uniform(0.5), SubmodelSpec(width=0.5, layer_widths={first: 1.0})),
        (SubmodelSpec(width=0.5, layer_widths={first: 0.25}), SubmodelSpec.uniform(0.5)),
        (SubmodelSpec(exits=(0,)), SubmodelSpec(exits=(0, 1))),  # fewer exits
        (SubmodelSpec(), SubmodelSpec(exits=(1,))),
        (SubmodelSpec(depth=2, exits=(1,)), SubmodelSpec(exits=(1,))),  # shallower
        (SubmodelSpec(depth=2, exits=(1,)), SubmodelSpec(depth=3, exits=(1, 2))),
        (SubmodelSpec(width=0.5, depth=2, exits=(1,)), SubmodelSpec(depth=2, exits=(0, 1))),
        (SubmodelSpec(segments=((0, 1),)), SubmodelSpec()),  # trains less
        (SubmodelSpec(segments=((0, 1),)), SubmodelSpec(segments=((0, 2), (3, n)))),
        (SubmodelSpec(segments=((2, 3), (0, 1))), SubmodelSpec(segments=((0, 3),))),
    ]
    for inner, outer in nested:
        assert family.is_nested(inner, outer), (inner, outer)
    not_nested = [
        (None, SubmodelSpec.uniform(0.5)),  # wider
        (SubmodelSpec(width=0.7), SubmodelSpec(width=0.7, rounding="floor")),
        (SubmodelSpec(width=0.5, layer_widths={first: 1.0}), SubmodelSpec.uniform(0.5)),
        (SubmodelSpec(exits=(0, 1)), SubmodelSpec(exits=(0,))),  # an extra exit
        (SubmodelSpec(exits=(1,)), SubmodelSpec()),
        (SubmodelSpec(exits=(1,)), SubmodelSpec(depth=2, exits=(1,))),  # deeper
        (SubmodelSpec(depth=3, exits=(2,)), SubmodelSpec(depth=2, exits=(1,))),
        (SubmodelSpec(depth=2, exits=(1,)), SubmodelSpec()),  # its output exit is not in the outer spec
        (SubmodelSpec(), SubmodelSpec(segments=((0, 1),))),  # trains blocks the outer one freezes
        (SubmodelSpec(segments=((2, 3),)), SubmodelSpec(segments=((0, 2),))),  # different segments
        (SubmodelSpec(segments=((0, 2),)), SubmodelSpec(segments=((0, 1), (2, 3)))),
    ]
    for inner, outer in not_nested:
        assert not family.is_nested(inner, outer), (inner, outer)


# ------------------------------------------------------------------------------------------------ spec checks
def test_trained_blocks(case: Case) -> None:
    family, _ = case
    n = family.num_blocks
    assert family.trained_blocks() == tuple(range(n))
    assert family.trained_blocks(SubmodelSpec(depth=2, exits=(1,))) == (0, 1)
    assert family.trained_blocks(SubmodelSpec(segments=((2, 3), (0, 1)))) == (0, 2)
    assert family.trained_blocks(SubmodelSpec(depth=3, exits=(2,), segments=((1, 3),))) == (1, 2)


def test_validate_spec(case: Case) -> None:
    family, _ = case
    n = family.num_blocks
    assert family.validate_spec(None) == SubmodelSpec.full()
    spec = SubmodelSpec(width=0.5, depth=n - 1, exits=(n - 2,), segments=((0, n - 1),))
    assert family.validate_spec(spec) is spec
    with pytest.raises(ValueError, match=f"depth {n + 1} exceeds the {n} blocks"):
        family.validate_spec(SubmodelSpec(depth=n + 1))
    with pytest.raises(ValueError, match=f"no exit point after block {n - 1}"):
        family.validate_spec(SubmodelSpec(exits=(n - 1,)))
    with pytest.raises(ValueError, match=f"no exit point after block {n + 3}"):
        family.validate_spec(SubmodelSpec(exits=(0, n + 3)))
    with pytest.raises(ValueError, match="cut after block 1 needs an exit there"):
        family.validate_spec(SubmodelSpec(depth=2))
    with pytest.raises(ValueError, match="cut after block 2 needs an exit there"):
        family.validate_spec(SubmodelSpec(depth=3, exits=(0, 1)))
    with pytest.raises(ValueError, match="no_such_layer"):
        family.validate_spec(SubmodelSpec(layer_widths={"no_such_layer": 0.5}))
    with pytest.raises(ValueError, match="SubmodelSpec"):
        family.validate_spec({"width": 0.5})  # type: ignore[arg-type]


def test_segments_beyond_the_blocks_are_rejected(case: Case) -> None:
    """validate_spec promises to reject "a segment beyond the kept blocks"; without a depth the kept blocks are
    the family's."""
    family, _ = case
    n = family.num_blocks
    for segments in (((0, n + 1),), ((0, 1), (n, n + 2))):
        with pytest.raises(ValueError, match="segment"):
            family.validate_spec(SubmodelSpec(segments=segments))


def test_unknown_layer_name_is_rejected(case: Case) -> None:
    family, _ = case
    spec = SubmodelSpec(layer_widths=(("no_such_layer", 0.5),))
    calls = (family.build, family.index_map, family.trainable_keys, family.state_keys, family.param_count,
             family.flops, family.shapes, family.kept_channels, family.trained_blocks, family.layer_costs)
    for call in calls:
        with pytest.raises(ValueError, match="no_such_layer"):
            call(spec)
    with pytest.raises(ValueError, match="no_such_layer"):
        family.is_nested(spec, None)


@pytest.mark.parametrize(
    "make",
    [
        lambda n: SubmodelSpec(depth=n + 1),
        lambda n: SubmodelSpec(exits=(n - 1,)),
        lambda n: SubmodelSpec(depth=2, exits=(0,)),
    ],
    ids=["too-deep", "exit-after-last-block", "cut-without-exit"],
)
def test_invalid_specs_are_rejected_everywhere(case: Case, make: Callable[[int], SubmodelSpec]) -> None:
    family, _ = case
    spec = make(family.num_blocks)
    for call in (family.build, family.index_map, family.state_keys, family.trainable_keys, family.param_count,
                 family.shapes):
        with pytest.raises(ValueError):
            call(spec)
    with pytest.raises(ValueError):
        _estimate_training_memory(family, spec, batch_size=2)
