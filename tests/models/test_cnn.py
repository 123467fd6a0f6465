"""Tests for models.cnn.ConvFamily (HeteroFL's conv model)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from models import SubmodelSpec, get_family
from models.cnn import ConvFamily
from models.layers import Scaler
from models.memory import _estimate_training_memory


def tiny() -> ConvFamily:
    family = get_family("cnn", num_classes=3, in_channels=1, hidden=(2, 4))
    assert isinstance(family, ConvFamily)
    return family


def test_state_dict_keys() -> None:
    keys = list(tiny().build().state_dict())
    bn = ["weight", "bias", "running_mean", "running_var", "num_batches_tracked"]
    assert keys == (
        ["conv1.weight", "conv1.bias"]
        + [f"bn1.{k}" for k in bn]
        + ["conv2.weight", "conv2.bias"]
        + [f"bn2.{k}" for k in bn]
        + ["classifier.weight", "classifier.bias"]
    )
    assert tiny().trainable_keys() == (
        "conv1.weight",
        "conv1.bias",
        "bn1.weight",
        "bn1.bias",
        "conv2.weight",
        "conv2.bias",
        "bn2.weight",
        "bn2.bias",
        "classifier.weight",
        "classifier.bias",
    )
    assert tiny().layer_names() == ("conv1", "conv2")
    assert tiny().prunable_layers() == ("conv1", "conv2")
    assert tiny().num_blocks == 2 and tiny().exit_points == (0,)


def test_exit_heads_are_pool_and_linear_by_default() -> None:
    family = get_family("cnn", num_classes=3, in_channels=1, hidden=(2, 4, 6))
    assert family.options["exit_convs"] == 0
    spec = SubmodelSpec(exits=(0, 1))
    keys = family.state_keys(spec)
    assert keys[-4:] == ("exits.0.classifier.weight", "exits.0.classifier.bias", "exits.1.classifier.weight",
                         "exits.1.classifier.bias")
    assert family.shapes(spec)["exits.0.classifier.weight"] == (3, 2)
    assert family.shapes(spec)["exits.1.classifier.weight"] == (3, 4)
    model = family.build(spec)
    kinds = [type(m).__name__ for m in model.exit_head(1).children()]
    assert kinds == ["AdaptiveAvgPool2d", "Flatten", "Linear"]
    # Exit heads are each their own cost: (3 x 2 + 3) + (3 x 4 + 3) parameters; over 4x4 inputs exit 0 reads a
    # 2x2 map and exit 1 a 1x1 map, and a linear layer costs one multiply-accumulate per weight.
    assert family.param_count(spec) - family.param_count() == 9 + 15
    assert family.flops(spec, (4, 4)) - family.flops(None, (4, 4)) == 3 * 2 + 3 * 4
    with_convs = get_family("cnn", num_classes=3, in_channels=1, hidden=(2, 4, 6), exit_convs=1)
    assert with_convs.layer_names() == ("conv1", "conv2", "conv3", "exits.0.conv1", "exits.1.conv1")
    assert with_convs.shapes(SubmodelSpec(exits=(1,)))["exits.1.conv1.weight"] == (4, 4, 3, 3)


def test_cut_model_ends_with_its_exit() -> None:
    family = get_family("cnn", num_classes=3, in_channels=1, hidden=(2, 4, 6))
    spec = SubmodelSpec(depth=2, exits=(1,))
    model = family.build(spec, track_bn_stats=False)
    assert tuple(model.state_dict()) == (
        "conv1.weight", "conv1.bias", "bn1.weight", "bn1.bias", "conv2.weight", "conv2.bias", "bn2.weight",
        "bn2.bias", "exits.1.classifier.weight", "exits.1.classifier.bias",
    )
    kinds = [type(m).__name__ for m in model.blocks[1]]
    assert kinds == ["Conv2d", "Scaler", "BatchNorm2d", "ReLU", "MaxPool2d"]
    assert model(torch.randn(2, 1, 8, 8)).shape == (2, 3)


def test_layout_and_block_structure() -> None:
    model = get_family("cnn", 10, 1).build(SubmodelSpec.uniform(0.5))
    kinds = [type(m).__name__ for m in model.children()]
    block = ["Conv2d", "Scaler", "BatchNorm2d", "ReLU"]
    assert kinds == (block + ["MaxPool2d"]) * 3 + block + ["AdaptiveAvgPool2d", "Flatten", "Linear"]
    assert all(m.momentum is None for m in model.modules() if isinstance(m, nn.BatchNorm2d))


def test_flops_hand_computed() -> None:
    family = tiny()
    # conv1: 2 maps x 4x4 positions x (1 in x 3x3); pool -> 2x2; conv2: 4 x 2x2 x (2 x 3x3); fc: 3 x 4.
    assert family.flops(input_size=(4, 4)) == 2 * 16 * 9 + 4 * 4 * 18 + 3 * 4 == 588
    # rate 1/2: conv1 1 map, conv2 2 maps over 1 input map, fc 3 x 2.
    assert family.flops(SubmodelSpec.uniform(0.5), (4, 4)) == 1 * 16 * 9 + 2 * 4 * 9 + 3 * 2 == 222


def test_training_memory_hand_computed() -> None:
    family = tiny()
    params = (2 * 9 + 2) + 4 + (4 * 2 * 9 + 4) + 8 + (4 * 3 + 3)
    assert family.param_count() == params == 123
    estimate = _estimate_training_memory(family, batch_size=2, input_size=(4, 4))
    assert estimate.parameters == estimate.gradients == estimate.optimizer_state == 4 * params
    assert _estimate_training_memory(family, batch_size=2, input_size=(4, 4), optimizer_slots=0).optimizer_state == 0
    assert estimate.total == sum(estimate.as_dict()[part] for part in (  # type: ignore[misc]
        "parameters", "gradients", "optimizer_state", "activations", "workspace", "overhead"))
    # Training block 1 alone: every weight is loaded, only block 1 and the head have gradients and momentum.
    second = _estimate_training_memory(family, batch_size=2, input_size=(4, 4), segment=(1, 2))
    trained = (4 * 2 * 9 + 4) + 8 + (4 * 3 + 3)
    assert second.parameters == 4 * params
    assert second.gradients == second.optimizer_state == 4 * trained


def test_heterofl_paper_parameter_counts() -> None:
    """HeteroFL Table (MNIST, Conv): a 1.6 M, b 391 K, c 99 K, d 25 K."""
    family = get_family("cnn", 10, 1)
    counts = [family.param_count(SubmodelSpec.uniform(r)) for r in (1, 0.5, 0.25, 0.125)]
    assert counts == [1_556_874, 391_370, 98_922, 25_274]
    assert family.flops() == 39_974_912


def test_per_layer_widths() -> None:
    family = get_family("cnn", 10, 1)
    spec = SubmodelSpec(width=0.25, layer_widths=(("conv2", 0.5), ("conv4", 1.0)))
    shapes = {k: tuple(v.shape) for k, v in family.build(spec, track_bn_stats=False).state_dict().items()}
    assert shapes["conv1.weight"] == (16, 1, 3, 3)
    assert shapes["conv2.weight"] == (64, 16, 3, 3)
    assert shapes["bn2.weight"] == (64,)
    assert shapes["conv3.weight"] == (64, 64, 3, 3)
    assert shapes["conv4.weight"] == (512, 64, 3, 3)
    assert shapes["classifier.weight"] == (10, 512)
    model = family.build(spec)
    scalers = [m.rate for m in model.modules() if isinstance(m, Scaler)]
    assert scalers == [0.25, 0.5, 0.25, 1.0]
    imap = family.index_map(spec)
    assert [len(i) for i in imap["conv3.weight"]] == [64, 64, 3, 3]
    family.build(spec).load_state_dict(family.extract(family.build().state_dict(), spec))


@pytest.mark.parametrize("rate", [1.0, 0.5, 0.25, 0.125, 0.0625])
def test_digits_sized_input(rate: float) -> None:
    """8x8 inputs (sklearn digits) go through all four blocks down to 1x1."""
    family = get_family("cnn", 10, 1)
    spec = SubmodelSpec.uniform(rate)
    model = family.build(spec, track_bn_stats=False)
    out = model(torch.randn(5, 1, 8, 8))
    assert out.shape == (5, 10)
    out.sum().backward()
    assert family.flops(spec, (8, 8)) < family.flops(spec, (28, 28))


def test_too_small_input_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="input_size"):
        get_family("cnn", 10, 1).flops(input_size=(2, 2))


def test_options_validation() -> None:
    with pytest.raises(ValueError, match="hidden"):
        get_family("cnn", 10, 1, hidden=())
    with pytest.raises(ValueError, match="hidden"):
        get_family("cnn", 10, 1, hidden=(8, 0))
    family = get_family("cnn", 10, 1, hidden=[8, 16])
    assert family.options == {"hidden": (8, 16), "exit_convs": 0}
    assert get_family("cnn", 10, 1, exit_convs=2).options["exit_convs"] == 2
    for bad in (-1, True, 1.5, "2"):
        with pytest.raises(ValueError, match="exit_convs"):
            get_family("cnn", 10, 1, exit_convs=bad)
