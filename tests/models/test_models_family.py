"""Tests for the shared machinery of models.family.ModelFamily, run against every family."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from models import ModelFamily, SubmodelSpec
from models.family import BYTES_PER_ELEMENT

#: HeteroFL levels a..e (the same as the ``spec`` fixture's).
RATES = (1.0, 0.5, 0.25, 0.125, 0.0625)

Case = tuple[ModelFamily, tuple[int, int]]


def _global_state(family: ModelFamily) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    state = family.build().state_dict()
    # Give the BN buffers distinctive values so slicing them is checked too.
    for key, value in state.items():
        if key.endswith(("running_mean", "running_var")):
            value.copy_(torch.rand_like(value) + 0.5)
    return state


def test_state_dict_matches_declaration(case: Case, spec: SubmodelSpec) -> None:
    family, _ = case
    imap = family.index_map(spec)
    tracked = family.build(spec, track_bn_stats=True).state_dict()
    assert list(tracked) == list(imap)
    for key, tensor in tracked.items():
        assert tuple(tensor.shape) == tuple(len(i) for i in imap[key]), key
    static = family.build(spec, track_bn_stats=False).state_dict()
    assert tuple(static) == family.trainable_keys(spec)
    assert not any(k.endswith(("running_mean", "running_var", "num_batches_tracked")) for k in static)


def test_extract_loads_strictly(case: Case, spec: SubmodelSpec) -> None:
    family, _ = case
    global_state = _global_state(family)
    full_sub = family.extract(global_state, spec)
    family.build(spec).load_state_dict(full_sub, strict=True)
    trainable = family.extract(global_state, spec, keys=family.trainable_keys(spec))
    assert tuple(trainable) == family.trainable_keys(spec)
    family.build(spec, track_bn_stats=False).load_state_dict(trainable, strict=True)


def test_extract_matches_index_map_and_copies(case: Case) -> None:
    family, _ = case
    spec = SubmodelSpec.uniform(0.5)
    global_state = _global_state(family)
    imap = family.index_map(spec)
    sub = family.extract(global_state, spec)
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


def test_classifier_rows_and_input_channels_never_sliced(case: Case) -> None:
    family, _ = case
    keys = family.classifier_keys()
    assert keys == ("classifier.weight", "classifier.bias")
    first = family.layers()[0]
    assert first.in_group is None and first.kind == "conv"
    for rate in RATES:
        imap = family.index_map(SubmodelSpec.uniform(rate))
        for key in keys:
            assert torch.equal(imap[key][0], torch.arange(family.num_classes))
        assert torch.equal(imap[f"{first.name}.weight"][1], torch.arange(family.in_channels))


def test_layers_feed_from_the_previous_kept_outputs(case: Case) -> None:
    family, _ = case
    spec = SubmodelSpec.uniform(0.25)
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


@pytest.mark.parametrize("name", ["cnn", "preresnet18"])
def test_param_count_shrinks_roughly_with_rate_squared(name: str) -> None:
    from models import get_family

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


def test_training_memory_is_linear_in_batch(case: Case) -> None:
    family, size = case
    spec = SubmodelSpec.uniform(0.5)

    def activations(batch: int) -> int:
        return family.training_memory_estimate(spec, batch_size=batch, input_size=size).activations

    a1, a2, a4, a64 = activations(1), activations(2), activations(4), activations(64)
    per_sample = a2 - a1
    assert per_sample > 0
    assert a4 - a2 == 2 * per_sample and a64 - a1 == 63 * per_sample  # what autograd saves is per sample
    params = family.param_count(spec)

    def state(slots: int) -> int:
        return family.training_memory_estimate(spec, batch_size=8, input_size=size, optimizer_slots=slots
                                               ).optimizer_state

    assert state(2) - state(1) == params * BYTES_PER_ELEMENT == state(1)
    assert family.training_memory_bytes(spec, batch_size=8, input_size=size, optimizer_slots=0) < \
        family.training_memory_bytes(spec, batch_size=8, input_size=size)


def test_training_memory_shrinks_with_rate(case: Case) -> None:
    family, size = case
    mems = [
        family.training_memory_bytes(SubmodelSpec.uniform(r), batch_size=10, input_size=size) for r in RATES
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
        family.training_memory_bytes(None, **kwargs)  # type: ignore[arg-type]


def test_unknown_layer_name_is_rejected(case: Case) -> None:
    family, _ = case
    spec = SubmodelSpec(layer_widths=(("no_such_layer", 0.5),))
    for call in (family.build, family.index_map, family.trainable_keys, family.param_count, family.flops):
        with pytest.raises(ValueError, match="no_such_layer"):
            call(spec)


@pytest.mark.parametrize(
    ("spec", "feature"),
    [
        (SubmodelSpec(depth=2), "depth"),
        (SubmodelSpec(exits=(1,)), "exits"),
        (SubmodelSpec(trainable_blocks=(0,)), "trainable_blocks"),
    ],
)
def test_unsupported_features_are_rejected(case: Case, spec: SubmodelSpec, feature: str) -> None:
    family, _ = case
    message = f"{feature} is not supported by family '{family.name}' yet"
    for call in (family.build, family.index_map, family.trainable_keys, family.param_count):
        with pytest.raises(ValueError, match=message):
            call(spec)
    with pytest.raises(ValueError, match=message):
        family.training_memory_bytes(spec, batch_size=2)


def test_extract_errors(case: Case) -> None:
    family, _ = case
    state = family.build().state_dict()
    with pytest.raises(ValueError, match="no_such_key"):
        family.extract(state, keys=["no_such_key"])
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


def test_build_returns_train_mode_module(case: Case) -> None:
    family, _ = case
    assert family.build(SubmodelSpec.uniform(0.5)).training
    with pytest.raises(ValueError, match="SubmodelSpec"):
        family.build({"width": 0.5})  # type: ignore[arg-type]
