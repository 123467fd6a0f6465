"""Tests for models.vgg (VGG-11/13/16 with batch norm). The generic family tests run on a small VGG through the
``case`` fixture (tests/models/conftest.py); these cover what is VGG's own."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from models import SubmodelSpec, get_family
from models.layers import Scaler
from models.memory import _estimate_training_memory
from models.vgg import VGG16_CONFIG, Vgg11Family, Vgg13Family, Vgg16Family, VggFamily

SMALL = {"config": (4, "M", 8, 8, "M", 8, "M"), "head": (12, 6)}


def small(dropout: float = 0.5, in_channels: int = 1, **options: object) -> VggFamily:
    family = get_family("vgg11", 3, in_channels, **{**SMALL, "dropout": dropout, **options})
    assert isinstance(family, VggFamily)
    return family


# ------------------------------------------------------------------------------------------------ structure
def test_registry_names_and_defaults() -> None:
    for name, cls, convs in (("vgg11", Vgg11Family, 8), ("vgg13", Vgg13Family, 10), ("vgg16", Vgg16Family, 13)):
        family = get_family(name, 10, 3)
        assert type(family) is cls and family.name == name
        assert family.num_blocks == convs
        assert family.options["head"] == (4096, 4096) and family.options["dropout"] == 0.5
        assert family.options["exit_convs"] == 0
    assert get_family("vgg16", 10, 3).options["config"] == VGG16_CONFIG


def test_vgg16_parameter_count() -> None:
    """The CIFAR VGG-16-BN: convolutions with bias, BN affine, head 512-4096-4096-10."""
    family = get_family("vgg16", 10, 3)
    assert family.param_count() == 33_646_666
    with torch.device("meta"):
        model = family.build(track_bn_stats=False)
    assert sum(p.numel() for p in model.parameters()) == 33_646_666


@pytest.mark.parametrize(("name", "body"), [("vgg11", 9_225_984), ("vgg13", 9_410_880), ("vgg16", 14_723_136)])
def test_body_parameters_match_torchvision_features(name: str, body: int) -> None:
    """torchvision's ``vgg*_bn(...).features`` (3 input channels) has these parameters; the head differs."""
    family = get_family(name, 10, 3)
    assert sum(params for decl, params, _ in family.layer_costs() if decl.block is not None) == body
    head = 512 * 4096 + 4096 + 4096 * 4096 + 4096 + 4096 * 10 + 10
    assert family.param_count() == body + head


def test_prunable_layers_in_depth_order() -> None:
    family = get_family("vgg16", 10, 3)
    expected = tuple(f"conv{i}" for i in range(1, 14)) + ("fc1", "fc2")
    assert family.prunable_layers() == expected
    assert family.layer_names() == expected  # no exit convolutions by default
    assert family.exit_points == tuple(range(12))
    assert get_family("vgg11", 10, 3, head=()).prunable_layers() == tuple(f"conv{i}" for i in range(1, 9))


def test_state_dict_keys_and_layout() -> None:
    family = small()
    bn = ["weight", "bias", "running_mean", "running_var", "num_batches_tracked"]
    convs = [k for i in range(1, 5) for k in [f"conv{i}.weight", f"conv{i}.bias", *(f"bn{i}.{b}" for b in bn)]]
    head = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", "classifier.weight", "classifier.bias"]
    model = family.build()
    assert list(model.state_dict()) == convs + head
    conv = ["Conv2d", "Scaler", "BatchNorm2d", "ReLU"]
    assert [[type(m).__name__ for m in block.children()] for block in model.blocks] == [
        [*conv, "MaxPool2d"], conv, [*conv, "MaxPool2d"], [*conv, "MaxPool2d"]]
    assert model.head is not None
    fc = ["Linear", "Scaler", "ReLU", "Dropout"]
    assert [type(m).__name__ for m in model.head.children()] == ["AdaptiveAvgPool2d", "Flatten", *fc, *fc, "Linear"]
    pools = [m for m in model.modules() if isinstance(m, nn.MaxPool2d)]
    assert len(pools) == 3 and all(p.ceil_mode and p.kernel_size == 2 for p in pools)
    assert all(m.momentum is None for m in model.modules() if isinstance(m, nn.BatchNorm2d))
    assert all(m.p == 0.5 for m in model.modules() if isinstance(m, nn.Dropout))
    assert family.shapes()["fc1.weight"] == (12, 8) and family.shapes()["classifier.weight"] == (3, 6)


def test_head_without_hidden_layers_and_without_dropout() -> None:
    family = get_family("vgg11", 10, 3, head=(), dropout=0.0)
    assert family.shapes()["classifier.weight"] == (10, 512)
    assert family.param_count() == 9_225_984 + 512 * 10 + 10
    model = small(dropout=0.0).build()
    assert not any(isinstance(m, nn.Dropout) for m in model.modules())


def test_repeated_pools_are_one_larger_pool() -> None:
    family = get_family("vgg11", 3, 1, config=(4, "M", "M", 6), head=(5,))
    model = family.build(track_bn_stats=False).eval()
    pool = list(model.blocks[0].children())[-1]
    assert isinstance(pool, nn.MaxPool2d) and pool.kernel_size == 4 and pool.stride == 4
    x = torch.randn(2, 4, 13, 13)
    twice = nn.MaxPool2d(2, ceil_mode=True)
    torch.testing.assert_close(pool(x), twice(twice(x)))


# ------------------------------------------------------------------------------------------------ input sizes
@pytest.mark.parametrize("name", ["vgg11", "vgg13"])
@pytest.mark.parametrize(("in_channels", "size"), [(3, 32), (1, 28), (1, 8)])
def test_standard_configs_run_on_every_input_size(name: str, in_channels: int, size: int) -> None:
    """The standard convolutions (at width 1/16 and a small head, to stay fast) reduce 32x32, 28x28 and 8x8 to
    1x1; training runs and reaches every parameter."""
    family = get_family(name, 10, in_channels, head=(64, 64))
    spec = SubmodelSpec.uniform(1 / 16)
    torch.manual_seed(0)
    model = family.build(spec, track_bn_stats=False)
    x = torch.randn(4, in_channels, size, size)
    h = x
    for block in model.blocks:
        h = block(h)
    assert h.shape == (4, 32, 1, 1)
    out = model(x)
    assert out.shape == (4, 10)
    nn.functional.cross_entropy(out, torch.tensor([0, 1, 2, 3])).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_vgg16_flops_hand_computed() -> None:
    """32x32 inputs: 3x3 convolutions at 32, 16, 8, 4 and 2 pixels a side, then the 512-4096-4096-10 head (a
    meta-device forward pass, no real VGG-16 is run). 28x28 and 8x8 inputs fit as well."""
    family = get_family("vgg16", 10, 3)
    side, cin, macs = 32, 3, 0
    for entry in VGG16_CONFIG:
        if entry == "M":
            side = -(-side // 2)
            continue
        assert isinstance(entry, int)
        macs += side * side * cin * entry * 9
        cin = entry
    macs += 512 * 4096 + 4096 * 4096 + 4096 * 10
    assert family.flops(input_size=(32, 32)) == macs == 332_111_872
    gray = get_family("vgg16", 10, 1)
    assert gray.flops(input_size=(8, 8)) < gray.flops(input_size=(28, 28)) < family.flops(input_size=(32, 32))


def test_larger_inputs_are_averaged_to_one_position() -> None:
    family = small(dropout=0.0)
    model = family.build(track_bn_stats=False)
    assert model(torch.randn(2, 1, 40, 24)).shape == (2, 3)
    assert family.flops(input_size=(40, 24)) > family.flops(input_size=(8, 8))


# ------------------------------------------------------------------------------------------------ widths
def test_per_layer_widths() -> None:
    family = get_family("vgg11", 10, 3)
    spec = SubmodelSpec(layer_widths=(("conv3", 0.5), ("fc1", 0.25)))
    shapes = family.shapes(spec, track_bn_stats=False)
    assert shapes["conv2.weight"] == (128, 64, 3, 3)
    assert shapes["conv3.weight"] == (128, 128, 3, 3) and shapes["conv3.bias"] == (128,)
    assert shapes["bn3.weight"] == (128,)
    assert shapes["conv4.weight"] == (256, 128, 3, 3)
    assert shapes["fc1.weight"] == (1024, 512) and shapes["fc1.bias"] == (1024,)
    assert shapes["fc2.weight"] == (4096, 1024)
    assert shapes["classifier.weight"] == (10, 4096)
    # The same spec on a smaller head, built and loaded from an extracted global state.
    family = get_family("vgg11", 10, 3, head=(64, 32))
    model = family.build(spec)
    built = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert built == family.shapes(spec)
    assert built["fc1.weight"] == (16, 512) and built["fc2.weight"] == (32, 16) and built["conv3.bias"] == (128,)
    rates = [m.rate for m in model.modules() if isinstance(m, Scaler)]
    assert rates == [1.0, 1.0, 0.5] + [1.0] * 5 + [0.25, 1.0]
    global_state = family.build().state_dict()
    sub = family.extract(global_state, spec)
    model.load_state_dict(sub, strict=True)
    assert torch.equal(sub["fc1.weight"], global_state["fc1.weight"][:16])
    assert torch.equal(sub["fc2.weight"], global_state["fc2.weight"][:, :16])
    assert torch.equal(sub["conv4.weight"], global_state["conv4.weight"][:, :128])
    static = family.build(spec, track_bn_stats=False)
    static.load_state_dict(family.extract(global_state, spec, keys=family.state_keys(spec)), strict=True)
    assert static(torch.randn(2, 3, 32, 32)).shape == (2, 10)


def test_nesting() -> None:
    family = get_family("vgg16", 10, 3)
    narrow_fc = SubmodelSpec(layer_widths=(("conv3", 0.5), ("fc1", 0.25)))
    assert family.is_nested(narrow_fc, None)
    assert not family.is_nested(None, narrow_fc)
    assert family.is_nested(SubmodelSpec(width=0.25), SubmodelSpec(width=0.5, layer_widths=(("fc2", 1.0),)))
    assert not family.is_nested(SubmodelSpec(width=0.5, layer_widths=(("fc2", 1.0),)), SubmodelSpec(width=0.5))
    assert family.is_nested(SubmodelSpec(depth=5, exits=(4,)), SubmodelSpec(exits=(4,)))
    assert family.kept_channels(SubmodelSpec.uniform(1 / 16))["fc1"] == 256


def test_exits_and_cut_models() -> None:
    family = small()
    spec = SubmodelSpec(width=0.5, depth=3, exits=(0, 2))
    shapes = family.shapes(spec, track_bn_stats=False)
    assert shapes["exits.0.classifier.weight"] == (3, 2) and shapes["exits.2.classifier.weight"] == (3, 4)
    assert "classifier.weight" not in shapes and "fc1.weight" not in shapes
    model = family.build(spec, track_bn_stats=False)
    assert [type(m).__name__ for m in model.exit_head(2).children()] == ["AdaptiveAvgPool2d", "Flatten", "Linear"]
    outputs = model.forward_exits(torch.randn(3, 1, 28, 28))
    assert [o.shape for o in outputs] == [(3, 3), (3, 3)]


# ------------------------------------------------------------------------------------------------ dropout, memory
def test_dropout_is_random_in_training_only() -> None:
    family = small(dropout=0.5)
    torch.manual_seed(0)
    model = family.build(track_bn_stats=True)
    x = torch.randn(6, 1, 8, 8)
    assert not torch.equal(model(x), model(x))
    model.eval()
    assert torch.equal(model(x), model(x))


def test_training_memory_with_dropout() -> None:
    """Dropout keeps its mask and its output for backward: two batch x width float tensors per hidden layer. (The
    total need not grow: here the step peaks in the convolutions' backward pass, after the head's tensors are
    freed.)"""
    with_dropout = _estimate_training_memory(small(dropout=0.5), batch_size=8, input_size=(28, 28))
    without = _estimate_training_memory(small(dropout=0.0), batch_size=8, input_size=(28, 28))
    assert with_dropout.parameters == without.parameters
    assert with_dropout.activations - without.activations == 2 * 8 * (12 + 6) * 4
    assert with_dropout.total >= without.total > 0


# ------------------------------------------------------------------------------------------------ options
@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"config": ()}, "config"),
        ({"config": "64M"}, "config"),
        ({"config": (8, 0, "M")}, "config"),
        ({"config": (8, True)}, "config"),
        ({"config": (8, 2.0)}, "config"),
        ({"config": (8, "m")}, "config"),
        ({"config": ("M", 8)}, "start with a convolution"),
        ({"head": 4096}, "head"),
        ({"head": "4096"}, "head"),
        ({"head": (64, 0)}, "head"),
        ({"head": (True,)}, "head"),
        ({"dropout": 1.0}, "dropout"),
        ({"dropout": -0.1}, "dropout"),
        ({"dropout": True}, "dropout"),
        ({"dropout": "0.5"}, "dropout"),
        ({"dropout": float("nan")}, "dropout"),
        ({"hidden": (8, 16)}, "unknown option 'hidden'.*valid options: config, dropout, exit_convs, head"),
        ({"exit_convs": -1}, "exit_convs"),
    ],
)
def test_bad_options(options: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        get_family("vgg16", 10, 3, **options)


def test_options_are_normalised() -> None:
    family = get_family("vgg13", 10, 3, config=[8, "M", 16], head=[32], dropout=0)
    assert family.options == {"config": (8, "M", 16), "head": (32,), "dropout": 0.0, "exit_convs": 0}
    assert get_family("vgg11", 10, 3, exit_convs=2).layer_names()[-1] == "exits.6.conv2"
    with pytest.raises(ValueError, match="needs a config"):
        VggFamily(10, 3)
    assert VggFamily(10, 3, config=(4, "M")).num_blocks == 1
