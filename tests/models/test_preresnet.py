"""Tests for models.preresnet.PreResNet18Family (HeteroFL's PreResNet18)."""

from __future__ import annotations

import pytest
import torch

from models import SubmodelSpec, get_family
from models.layers import Scaler
from models.preresnet import PreActBlock, PreResNet18Family


def tiny(**options: object) -> PreResNet18Family:
    family = get_family("preresnet18", num_classes=10, in_channels=3, hidden=(8, 16, 16, 32), **options)
    assert isinstance(family, PreResNet18Family)
    return family


def test_structure_and_shortcuts() -> None:
    family = tiny()
    keys = family.trainable_keys()
    shortcuts = sorted(k for k in keys if "shortcut" in k)
    # Stage 1 keeps its width at stride 1 (identity); later first blocks stride 2 (even 16 -> 16).
    assert shortcuts == ["layer2.0.shortcut.weight", "layer3.0.shortcut.weight", "layer4.0.shortcut.weight"]
    assert keys[0] == "conv1.weight" and keys[-2:] == ("classifier.weight", "classifier.bias")
    assert "conv1.bias" not in keys
    blocks = [d.block for d in family.layers() if d.block is not None]
    assert sorted(set(blocks)) == list(range(8))  # the stem belongs to block 0
    assert family.num_blocks == 8 and family.exit_points == tuple(range(7))
    stem = next(d for d in family.layers() if d.name == "conv1")
    assert stem.block == 0
    assert [d.name for d in family.layers() if d.block == 0] == [
        "conv1", "layer1.0.bn1", "layer1.0.conv1", "layer1.0.bn2", "layer1.0.conv2"]
    assert [d.name for d in family.layers() if d.block is None and d.exit is None] == ["bn", "classifier"]
    assert family.prunable_layers()[:4] == ("layer1", "layer2", "layer3", "layer4")
    assert len(family.prunable_layers()) == 4 + 8
    # Three convolutions per exit head (ScaleFL's reference) at every exit point, each its own group.
    assert family.options["exit_convs"] == 3
    assert len(family.layer_names()) == 4 + 8 + 7 * 3
    assert family.layer_names()[12:15] == ("exits.0.conv1", "exits.0.conv2", "exits.0.conv3")


def test_default_is_resnet18_sized() -> None:
    family = get_family("preresnet18", 10, 3)
    model = family.build(track_bn_stats=False)
    assert family.param_count() == sum(p.numel() for p in model.parameters()) == 11_172_170
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)


def test_preresnet20_is_fedepths_model() -> None:
    """FeDepth's PreResNet-20: 3 stages x 3 pre-activation blocks of 16, 32, 64 channels; 9 body blocks."""
    family = get_family("preresnet20", 10, 3)
    assert family.num_blocks == 9 and family.options["hidden"] == (16, 32, 64)
    assert family.options["blocks"] == (3, 3, 3)
    # stem 432; stage 1: 3 x (2 BN of 16 + 2 convs 16x16x3x3); stages 2 and 3 add a 1x1 shortcut in the first
    # block; final BN and classifier.
    stage1 = 3 * (2 * 32 + 2 * 2304)
    stage2 = (32 + 16 * 32 * 9 + 64 + 32 * 32 * 9 + 16 * 32) + 2 * (2 * 64 + 2 * 9216)
    stage3 = (64 + 32 * 64 * 9 + 128 + 64 * 64 * 9 + 32 * 64) + 2 * (2 * 128 + 2 * 36864)
    assert family.param_count() == 432 + stage1 + stage2 + stage3 + 128 + 650 == 272_282
    model = family.build(track_bn_stats=False)
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    assert [k for k in family.state_keys() if k.endswith("shortcut.weight")] == ["layer2.0.shortcut.weight",
                                                                             "layer3.0.shortcut.weight"]
    assert get_family("preresnet20", 10, 1, blocks=(1, 1, 1)).num_blocks == 3


def test_reference_code_blocks_reproduce_paper_table() -> None:
    """HeteroFL's code builds "resnet18" with (1, 1, 1, 2) blocks: the paper's 9.6 M / 2.4 M / 604 K / 152 K / 38 K."""
    family = get_family("preresnet18", 10, 3, blocks=(1, 1, 1, 2))
    counts = [family.param_count(SubmodelSpec.uniform(r)) for r in (1, 0.5, 0.25, 0.125, 0.0625)]
    assert counts == [9_622_090, 2_408_746, 603_802, 151_762, 38_350]


def test_residual_shortcut_indices() -> None:
    family = tiny()
    spec = SubmodelSpec(width=0.5, layer_widths=(("layer1", 0.25), ("layer2.0.conv1", 1.0)))
    imap = family.index_map(spec)
    kept = family.kept_channels(spec)
    assert kept["layer1"] == 2 and kept["layer2"] == 8 and kept["layer2.0.conv1"] == 16
    # The shortcut reads the block input (stage 1 stream) and writes the block output (stage 2 stream).
    sc = imap["layer2.0.shortcut.weight"]
    assert torch.equal(sc[1], imap["layer1.1.conv2.weight"][0])
    assert torch.equal(sc[0], imap["layer2.0.conv2.weight"][0])
    assert torch.equal(imap["layer2.0.bn1.weight"][0], sc[1])
    # The inner width is its own group.
    assert [len(i) for i in imap["layer2.0.conv1.weight"]] == [16, 2, 3, 3]
    assert [len(i) for i in imap["layer2.0.conv2.weight"]] == [8, 16, 3, 3]
    # The stem writes to the stage 1 stream.
    assert [len(i) for i in imap["conv1.weight"]] == [2, 3, 3, 3]
    model = family.build(spec, track_bn_stats=False)
    model.load_state_dict(family.extract(family.build().state_dict(), spec, family.trainable_keys(spec)))
    assert model(torch.randn(2, 3, 16, 16)).shape == (2, 10)


def test_blocks_are_the_residual_blocks_with_the_stem_in_block_0() -> None:
    family = tiny()
    model = family.build(track_bn_stats=False)
    assert len(model.blocks) == 8
    assert isinstance(model.blocks[0], torch.nn.Sequential)
    assert model.blocks[0][0] is model.conv1
    assert model.blocks[0][1] is model.layer1[0]
    assert model.blocks[1] is model.layer1[1] and model.blocks[2] is model.layer2[0]
    assert model.blocks[7] is model.layer4[1]
    assert isinstance(model.blocks[3], PreActBlock)


def test_cut_model_keeps_the_first_blocks_and_its_exit() -> None:
    family = tiny()
    spec = SubmodelSpec(width=0.5, depth=3, exits=(0, 2))
    model = family.build(spec, track_bn_stats=False)
    keys = list(model.state_dict())
    assert not any(k.startswith(("layer3", "layer4", "bn.", "classifier")) for k in keys)
    assert any(k.startswith("layer2.0.") for k in keys) and not any(k.startswith("layer2.1.") for k in keys)
    shapes = family.shapes(spec, track_bn_stats=False)
    # Exit 2 follows layer2.0 (8 channels at width 1/2): three 3x3 convolutions at that width, then the classifier.
    assert shapes["exits.2.conv1.weight"] == (8, 8, 3, 3)
    assert shapes["exits.2.conv3.weight"] == (8, 8, 3, 3)
    assert shapes["exits.2.bn3.weight"] == (8,)
    assert shapes["exits.2.classifier.weight"] == (10, 8)
    assert shapes["exits.0.conv1.weight"] == (4, 4, 3, 3)
    outputs = model.forward_exits(torch.randn(2, 3, 16, 16))
    assert [o.shape for o in outputs] == [(2, 10), (2, 10)]


def test_exit_head_reads_the_raw_block_output() -> None:
    family = get_family("preresnet18", 4, 3, hidden=(4, 8), blocks=(1, 1), exit_convs=1)
    torch.manual_seed(0)
    model = family.build(SubmodelSpec(exits=(0,)), track_bn_stats=False)
    x = torch.randn(3, 3, 8, 8)
    head = model.exit_head(0)
    expected = head(model.layer1[0](model.conv1(x)))
    torch.testing.assert_close(model.forward_exits(x)[0], expected)
    assert [type(m).__name__ for m in head] == ["Conv2d", "Scaler", "BatchNorm2d", "ReLU", "AdaptiveAvgPool2d",
                                                 "Flatten", "Linear"]


def test_identity_shortcut_and_preactivation_wiring() -> None:
    torch.manual_seed(0)
    block = PreActBlock(
        4, 4, 4, stride=1, rate_in=1.0, rate_mid=1.0, track_bn_stats=False, with_shortcut=False
    )
    torch.nn.init.zeros_(block.conv2.weight)
    x = torch.randn(2, 4, 5, 5)
    assert torch.equal(block(x), x)  # residual path zeroed: the raw input passes through
    proj = PreActBlock(4, 4, 8, stride=2, rate_in=1.0, rate_mid=1.0, track_bn_stats=False, with_shortcut=True)
    torch.nn.init.zeros_(proj.conv2.weight)
    assert proj.shortcut is not None
    expected = proj.shortcut(torch.relu(proj.bn1(x)))  # the shortcut sees the pre-activated input
    assert torch.allclose(proj(x), expected)


def test_scaler_rates_follow_groups() -> None:
    family = tiny()
    spec = SubmodelSpec(width=0.25, layer_widths=(("layer1.0.conv1", 0.5),))
    model = family.build(spec)
    modules = dict(model.named_modules())
    assert isinstance(modules["layer1.0.scaler1"], Scaler) and modules["layer1.0.scaler1"].rate == 0.25
    assert isinstance(modules["layer1.0.scaler2"], Scaler) and modules["layer1.0.scaler2"].rate == 0.5
    assert isinstance(modules["layer1.1.scaler2"], Scaler) and modules["layer1.1.scaler2"].rate == 0.25
    assert isinstance(modules["scaler"], Scaler) and modules["scaler"].rate == 0.25
    x = torch.randn(3, 3, 8, 8)
    model.eval()
    assert model(x).shape == (3, 10)


def test_flops_hand_checked_for_one_stage() -> None:
    family = get_family("preresnet18", 2, 1, hidden=(2,), blocks=(1,))
    # 4x4 input: stem 2x16x(1x9), block conv1 2x16x(2x9), conv2 2x16x(2x9), fc 2x2.
    assert family.flops(input_size=(4, 4)) == 2 * 16 * 9 + 2 * (2 * 16 * 18) + 4 == 1444


def test_options_validation() -> None:
    with pytest.raises(ValueError, match="one block count per stage"):
        tiny(blocks=(2, 2))
    with pytest.raises(ValueError, match="blocks"):
        tiny(blocks=(2, 0, 2, 2))
    assert tiny().options["blocks"] == (2, 2, 2, 2)
    assert get_family("preresnet18", 10, 3, blocks=(1, 1, 1, 2)).num_blocks == 5
