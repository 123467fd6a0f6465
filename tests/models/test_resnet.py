"""Tests for models.resnet: the CIFAR ResNets of He et al. (ResNet-20, -56, -110; ScaleFL's Table 1 model)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from models import SubmodelSpec, get_family
from models.layers import Scaler
from models.resnet import BasicBlock, ResNet20Family, ResNet56Family, ResNet110Family, ResNetFamily


def _counts(n: int, hidden: tuple[int, ...] = (16, 32, 64), in_channels: int = 3, classes: int = 10,
            size: int = 32) -> tuple[int, int]:
    """(parameters, multiply-accumulates) of a CIFAR ResNet with ``n`` blocks per stage, counted by hand: 3x3
    convolutions without bias, BN weight and bias, a 1x1 convolution + BN shortcut where a block changes the
    shape (stride 2 entering every stage after the first), a linear classifier."""
    params = hidden[0] * in_channels * 9 + 2 * hidden[0]
    macs = size * size * hidden[0] * in_channels * 9
    prev = hidden[0]
    for s, ch in enumerate(hidden):
        if s > 0:
            size //= 2
        positions = size * size
        for b in range(n):
            cin = prev if b == 0 else ch
            params += ch * cin * 9 + 2 * ch + ch * ch * 9 + 2 * ch
            macs += positions * (ch * cin * 9 + ch * ch * 9)
            if b == 0 and (s > 0 or cin != ch):
                params += ch * cin + 2 * ch
                macs += positions * ch * cin
        prev = ch
    params += classes * prev + classes
    macs += classes * prev
    return params, macs


def test_resnet110_matches_scalefl_table_1() -> None:
    """ScaleFL Table 1: ResNet-110 on CIFAR-10 has 1.73 M parameters and 253.1 M FLOPs (multiply-accumulates)."""
    family = get_family("resnet110", 10, 3)
    assert isinstance(family, ResNet110Family)
    assert family.num_blocks == 54
    assert family.param_count() == 1_730_714 == _counts(18)[0]
    assert family.flops(input_size=(32, 32)) == 253_149_824 == _counts(18)[1]


@pytest.mark.parametrize(("name", "n"), [("resnet20", 3), ("resnet56", 9)])  # resnet110: above
def test_counts_follow_the_hand_formula(name: str, n: int) -> None:
    family = get_family(name, 10, 3)
    assert family.num_blocks == 3 * n
    params, macs = _counts(n)
    assert family.param_count() == params
    assert family.flops(input_size=(32, 32)) == macs


def test_resnet20_is_counted_on_the_built_model() -> None:
    family = get_family("resnet20", 10, 3)
    model = family.build(track_bn_stats=False)
    assert family.param_count() == sum(p.numel() for p in model.parameters()) == 272_474
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)


def test_tiny_counts_by_hand() -> None:
    """Two stages of channels 2 and 4, one input channel, three classes, 4x4 inputs."""
    family = get_family("resnet20", 3, 1, hidden=(2, 4))
    # Stem conv 2x1x9 + BN 2x2; stage 1: three blocks of two 2x2x9 convs and two BNs (80 each); stage 2 block 0:
    # conv 4x2x9, conv 4x4x9, shortcut 4x2, three BNs of 4 (248); blocks 1, 2: two 4x4x9 convs, two BNs (304
    # each); classifier 3x4 + 3.
    assert family.param_count() == 18 + 4 + 3 * 80 + 248 + 2 * 304 + 15 == 1133
    # Stem 2 maps x 16 positions x 9; stage 1 six convs of 2 x 16 x 18; stage 2 (2x2) block 0: 4 x 4 x 18,
    # 4 x 4 x 36 and the shortcut 4 x 4 x 2; four more convs of 4 x 4 x 36; classifier 3 x 4.
    assert family.flops(input_size=(4, 4)) == 288 + 6 * 576 + (288 + 576 + 32) + 4 * 576 + 12 == 6956
    assert (family.param_count(), family.flops(input_size=(4, 4))) == _counts(3, (2, 4), 1, 3, 4)
    # Exit heads: three 3x3 convolutions (with BN) at the block's width, then the classifier.
    after_1 = SubmodelSpec(exits=(1,))  # stage 1, 2 channels at 4x4
    assert family.param_count(after_1) - family.param_count() == 3 * (2 * 2 * 9 + 4) + (3 * 2 + 3) == 129
    assert family.flops(after_1, (4, 4)) - family.flops(None, (4, 4)) == 3 * (2 * 16 * 18) + 3 * 2 == 1734
    after_3 = SubmodelSpec(exits=(3,))  # stage 2 block 0, 4 channels at 2x2
    assert family.param_count(after_3) - family.param_count() == 3 * (4 * 4 * 9 + 8) + (3 * 4 + 3) == 471
    assert family.flops(after_3, (4, 4)) - family.flops(None, (4, 4)) == 3 * (4 * 4 * 36) + 3 * 4 == 1740


def test_structure_and_state_keys() -> None:
    family = get_family("resnet20", 10, 3, hidden=(4, 8, 8))
    assert family.num_blocks == 9 and family.exit_points == tuple(range(8))
    keys = family.state_keys()
    bn = ("weight", "bias")
    assert keys[:3] == ("conv1.weight", "bn1.weight", "bn1.bias")
    assert keys[3:9] == ("layer1.0.conv1.weight", *(f"layer1.0.bn1.{k}" for k in bn), "layer1.0.conv2.weight",
                         *(f"layer1.0.bn2.{k}" for k in bn))
    assert keys[-2:] == ("classifier.weight", "classifier.bias")
    assert not any(k.startswith("layer4") or k.endswith(".conv1.bias") for k in keys)
    blocks = [d.block for d in family.layers() if d.block is not None]
    assert blocks == sorted(blocks) and sorted(set(blocks)) == list(range(9))
    assert [d.name for d in family.layers() if d.block == 0] == [
        "conv1", "bn1", "layer1.0.conv1", "layer1.0.bn1", "layer1.0.conv2", "layer1.0.bn2"]
    assert [d.name for d in family.layers() if d.block == 3] == [
        "layer2.0.conv1", "layer2.0.bn1", "layer2.0.conv2", "layer2.0.bn2", "layer2.0.shortcut",
        "layer2.0.shortcut_bn"]
    assert family.prunable_layers() == ("layer1", "layer2", "layer3", *(
        f"layer{s}.{b}.conv1" for s in (1, 2, 3) for b in range(3)))
    assert family.layer_names()[12:] == tuple(f"exits.{b}.conv{i}" for b in range(8) for i in (1, 2, 3))
    tracked = family.build().state_dict()
    assert tracked["layer1.0.bn1.num_batches_tracked"].shape == ()


def test_shortcut_placement() -> None:
    """A projection (1x1 conv + BN) exactly where a block changes the shape: entering stages 2 and 3 (stride 2),
    even when the channel count stays; identity everywhere else."""
    for hidden in ((4, 8, 8), (8, 8, 8), (16, 32, 64)):
        family = get_family("resnet20", 10, 3, hidden=hidden)
        shortcuts = sorted(k for k in family.state_keys() if "shortcut" in k)
        assert shortcuts == [f"layer{s}.0.{part}" for s in (2, 3) for part in (
            "shortcut.weight", "shortcut_bn.bias", "shortcut_bn.weight")]
        model = family.build(track_bn_stats=False)
        with_shortcut = [name for name, m in model.named_modules() if isinstance(m, BasicBlock) and m.shortcut]
        assert with_shortcut == ["layer2.0", "layer3.0"]
    shapes = get_family("resnet20", 10, 3).shapes(track_bn_stats=False)
    assert shapes["layer2.0.shortcut.weight"] == (32, 16, 1, 1)
    assert shapes["layer3.0.shortcut.weight"] == (64, 32, 1, 1)
    assert shapes["layer3.0.conv1.weight"] == (64, 32, 3, 3)


def test_basic_block_wiring() -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 4, 6, 6)
    identity = BasicBlock(4, 4, 4, stride=1, rate_mid=1.0, rate_out=1.0, track_bn_stats=False,
                          with_shortcut=False)
    nn.init.zeros_(identity.conv2.weight)  # the residual branch gives 0 after its batch-statistics BN
    torch.testing.assert_close(identity(x), torch.relu(x))  # ReLU after the sum
    proj = BasicBlock(4, 4, 8, stride=2, rate_mid=1.0, rate_out=1.0, track_bn_stats=False, with_shortcut=True)
    nn.init.zeros_(proj.conv2.weight)
    assert proj.shortcut is not None and proj.shortcut_bn is not None
    out = proj(x)
    assert out.shape == (2, 8, 3, 3)
    torch.testing.assert_close(out, torch.relu(proj.shortcut_bn(proj.shortcut(x))))
    # Without zeroing: conv -> Scaler -> BN -> ReLU -> conv -> Scaler -> BN, plus the projection, then ReLU.
    torch.manual_seed(1)
    block = BasicBlock(4, 3, 8, stride=2, rate_mid=0.5, rate_out=0.25, track_bn_stats=False, with_shortcut=True)
    assert block.shortcut_bn is not None and block.shortcut is not None
    h = torch.relu(block.bn1(block.conv1(x) / 0.5))
    main = block.bn2(block.conv2(h) / 0.25)
    torch.testing.assert_close(block(x), torch.relu(main + block.shortcut_bn(block.shortcut(x) / 0.25)))


def test_widths_and_scalers_follow_groups() -> None:
    family = get_family("resnet20", 10, 3)
    spec = SubmodelSpec(width=0.5, layer_widths={"layer2": 0.25, "layer3.1.conv1": 1.0})
    shapes = family.shapes(spec, track_bn_stats=False)
    assert shapes["conv1.weight"] == (8, 3, 3, 3)
    assert shapes["layer2.0.conv1.weight"] == (16, 8, 3, 3)  # inner width 1/2 of 32, reads stage 1's 8
    assert shapes["layer2.0.conv2.weight"] == (8, 16, 3, 3)  # writes stage 2's stream at 1/4
    assert shapes["layer2.0.shortcut.weight"] == (8, 8, 1, 1)
    assert shapes["layer2.2.conv2.weight"] == (8, 16, 3, 3)
    assert shapes["layer3.0.conv1.weight"] == (32, 8, 3, 3)
    assert shapes["layer3.0.shortcut.weight"] == (32, 8, 1, 1)
    assert shapes["layer3.1.conv1.weight"] == (64, 32, 3, 3)
    assert shapes["classifier.weight"] == (10, 32)
    model = family.build(spec, track_bn_stats=False)
    modules = dict(model.named_modules())
    assert isinstance(modules["scaler1"], Scaler) and modules["scaler1"].rate == 0.5
    assert modules["layer2.0.scaler1"].rate == 0.5
    assert modules["layer2.0.scaler2"].rate == 0.25
    assert modules["layer2.0.shortcut_scaler"].rate == 0.25
    assert modules["layer3.1.scaler1"].rate == 1.0
    model.load_state_dict(family.extract(family.build().state_dict(), spec, family.state_keys(spec)))
    assert model(torch.randn(2, 3, 8, 8)).shape == (2, 10)


def test_scalefl_floor_widths() -> None:
    """ScaleFL keeps floor(s_w * channels): at s_w = 0.7, ResNet-110's 16, 32, 64 become 11, 22, 44."""
    family = get_family("resnet110", 10, 3)
    kept = family.kept_channels(SubmodelSpec(width=0.7, rounding="floor"))
    assert (kept["layer1"], kept["layer2"], kept["layer3"], kept["layer3.17.conv1"]) == (11, 22, 44, 44)
    ceil = family.kept_channels(SubmodelSpec(width=0.7))
    assert (ceil["layer1"], ceil["layer2"], ceil["layer3"]) == (12, 23, 45)
    floor_params = family.param_count(SubmodelSpec(width=0.7, rounding="floor"))
    assert floor_params == _counts(18, (11, 22, 44))[0]
    assert floor_params < family.param_count(SubmodelSpec(width=0.7)) < family.param_count()


def test_scalefl_level_with_depth_cut_and_exits() -> None:
    """A ScaleFL-style level: floor width, the first blocks, exits along the way, the last one its output."""
    family = get_family("resnet20", 10, 3, hidden=(4, 8, 8))
    spec = SubmodelSpec(width=0.5, rounding="floor", depth=6, exits=(2, 5))
    model = family.build(spec, track_bn_stats=False)
    assert len(model.blocks) == 6 and model.head is None
    assert not any(k.startswith(("layer3", "classifier")) for k in model.state_dict())
    assert family.shapes(spec, track_bn_stats=False)["exits.5.conv1.weight"] == (4, 4, 3, 3)
    outputs = model.forward_exits(torch.randn(3, 3, 8, 8))
    assert [o.shape for o in outputs] == [(3, 10), (3, 10)]
    assert family.is_nested(spec, SubmodelSpec(exits=(2, 5)))
    assert not family.is_nested(SubmodelSpec(exits=(2, 5)), spec)


@pytest.mark.parametrize(("cls", "n"), [(ResNet20Family, 3), (ResNet56Family, 9), (ResNet110Family, 18)])
def test_families_differ_only_in_blocks_per_stage(cls: type[ResNetFamily], n: int) -> None:
    assert issubclass(cls, ResNetFamily)
    family = cls(10, 3, hidden=(4,))
    assert family.blocks_per_stage == n and family.num_blocks == n
    assert family.options == {"hidden": (4,), "exit_convs": 3}


def test_options_validation() -> None:
    for hidden in ((), (8, 0), "16", (8, 2.5), None):
        with pytest.raises(ValueError, match="hidden"):
            get_family("resnet20", 10, 3, hidden=hidden)
    for exit_convs in (-1, True, 0.5):
        with pytest.raises(ValueError, match="exit_convs"):
            get_family("resnet20", 10, 3, exit_convs=exit_convs)
    with pytest.raises(ValueError, match="unknown option 'blocks'.*valid options: exit_convs, hidden"):
        get_family("resnet56", 10, 3, blocks=(9, 9, 9))
    family = get_family("resnet20", 10, 3, hidden=[8, 16], exit_convs=0)
    assert family.options == {"hidden": (8, 16), "exit_convs": 0}
    assert family.num_blocks == 6
    assert family.layer_names() == family.prunable_layers()  # exits without convolutions have no groups
    assert family.state_keys(SubmodelSpec(exits=(2,)))[-2:] == ("exits.2.classifier.weight",
                                                               "exits.2.classifier.bias")


@pytest.mark.parametrize(("depth", "blocks"), [(8, 3), (20, 9), (32, 15), (56, 27), (110, 54)])
def test_generic_family_by_depth(depth: int, blocks: int) -> None:
    family = get_family("resnet", 10, 3, depth=depth)
    assert family.num_blocks == blocks and family.options["depth"] == depth
    named = {20: "resnet20", 56: "resnet56", 110: "resnet110"}.get(depth)
    if named is not None:
        assert family.param_count() == get_family(named, 10, 3).param_count()
    assert get_family("resnet", 10, 3).num_blocks == 9  # default ResNet-20
    assert get_family("resnet", 10, 3, depth=14, hidden=(8, 16)).num_blocks == 6  # 2 * 2 * 3 + 2
    assert get_family("resnet110", 10, 3, hidden=(8, 16)).num_blocks == 36  # presets fix 18 blocks per stage


def test_generic_depth_is_checked_and_presets_fix_it() -> None:
    for depth in (21, 2, 0, True, "20", 20.0):
        with pytest.raises(ValueError, match="depth must be 2 \\* 3 \\* n \\+ 2"):
            get_family("resnet", 10, 3, depth=depth)
    with pytest.raises(ValueError, match="unknown option 'depth' for model family 'resnet110'"):
        get_family("resnet110", 10, 3, depth=56)
