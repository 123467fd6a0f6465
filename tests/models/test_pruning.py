"""APoZ-guided pruning (FlexFL): APoZ on a hand-built layer, the adjustment weights of Eq. 3 and Algorithm 1 on a
hand-built score table."""

from __future__ import annotations

import itertools
import math
from typing import Any

import pytest
import torch

from models import SubmodelSpec, get_family
from models.pruning import (
    adjustment_weights,
    apoz_scores,
    group_sizes,
    keep_ratios,
    model_size,
    prune_to_ratio,
    pruned_spec,
)


def hand_built_layer() -> tuple[Any, Any, torch.Tensor]:
    """A CNN whose conv1 has two channels (channel 0 a constant 5, channel 1 a copy of the input pixel), and
    images half all -1, half all +1."""
    family = get_family("cnn", 3, 1, hidden=(2, 3))
    model = family.build(track_bn_stats=False)
    with torch.no_grad():
        model.conv1.weight.zero_()
        model.conv1.bias.copy_(torch.tensor([5.0, 0.0]))
        model.conv1.weight[1, 0, 1, 1] = 1.0
    x = torch.cat([-torch.ones(4, 1, 6, 6), torch.ones(4, 1, 6, 6)])
    return family, model, x


def test_apoz_of_a_hand_built_layer() -> None:
    # conv1 has two channels: channel 0 is constant (its batch norm makes it 0, so every activation is zero),
    # channel 1 copies the input pixel. Half the images are all -1, half all +1: after batch norm channel 1 is
    # negative (zero after ReLU) on the first half and positive on the second. Per sample, the zero fraction over
    # C x H x W is (1 + 1) / 2 = 1 for a -1 image and (1 + 0) / 2 = 0.5 for a +1 image: APoZ 0.75.
    family, model, x = hand_built_layer()
    scores = apoz_scores(family, model, x, batch_size=8)
    assert set(scores) == {"conv1", "conv2"}
    assert scores["conv1"] == pytest.approx(0.75)
    # conv2 reads the same way: its own hook gives a fraction in [0, 1] measured over its own outputs.
    outputs = {}
    model.relu2.register_forward_hook(lambda _m, _i, out: outputs.setdefault("relu2", out))
    with torch.no_grad():
        model(x)
    expected = float((outputs["relu2"] == 0).flatten(1).float().mean(1).mean())
    assert scores["conv2"] == pytest.approx(expected)


def test_apoz_before_bn_reads_each_channel_before_its_batch_norm() -> None:
    # The hand-built layer above, scored at the batch norm's input: channel 0 is a constant 5 (no value a ReLU
    # would zero), channel 1 the input pixel (all <= 0 on a -1 image, none on a +1 image). Per sample, the mean over
    # the two channels is (0 + 1) / 2 = 0.5 for a -1 image and 0 for a +1 image: 0.25 (after the ReLU: 0.75).
    family, model, x = hand_built_layer()
    assert apoz_scores(family, model, x, batch_size=8)["conv1"] == pytest.approx(0.75)
    before = apoz_scores(family, model, x, batch_size=8, at="before_bn")
    assert before["conv1"] == pytest.approx(0.25)
    inputs = {}
    model.bn2.register_forward_pre_hook(lambda _m, args: inputs.setdefault("bn2", args[0]))
    with torch.no_grad():
        model(x)
    assert before["conv2"] == pytest.approx(float((inputs["bn2"] <= 0).float().mean()))
    with pytest.raises(ValueError, match="after_relu"):
        apoz_scores(family, model, x, at="inside")  # type: ignore[arg-type]


def test_apoz_averages_the_relus_reading_one_group() -> None:
    # PreResNet's residual stream is read by several ReLUs (each block's first one and the head's): its score is
    # their mean, and every prunable group gets one.
    family = get_family("preresnet20", 10, 1, hidden=(4, 8), blocks=(2, 1))
    torch.manual_seed(0)
    model = family.build(track_bn_stats=False)
    x = torch.randn(16, 1, 8, 8)
    scores = apoz_scores(family, model, x)
    assert set(scores) == set(family.prunable_layers())
    fractions = {}

    def record(name):
        def hook(_module, _inputs, out):
            fractions[name] = float((out == 0).flatten(1).float().mean(1).mean())
        return hook

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ReLU):
            module.register_forward_hook(record(name))
    with torch.no_grad():
        model(x)
    # Stage 1's stream (layer1) is read by the first ReLU of each block it feeds (stage 2's first block too); the
    # last stream by the head's ReLU; a block's inner width by its second ReLU.
    stream1 = ("layer1.0.relu1", "layer1.1.relu1", "layer2.0.relu1")
    assert scores["layer1"] == pytest.approx(sum(fractions[n] for n in stream1) / 3)
    assert scores["layer2"] == pytest.approx(fractions["relu"])
    assert scores["layer1.1.conv1"] == pytest.approx(fractions["layer1.1.relu2"])


def test_apoz_needs_two_samples() -> None:
    family = get_family("cnn", 3, 1, hidden=(2,))
    with pytest.raises(ValueError, match="at least 2 samples"):
        apoz_scores(family, family.build(track_bn_stats=False), torch.zeros(1, 1, 4, 4))


def test_adjustment_weights_follow_eq_3() -> None:
    family = get_family("cnn", 10, 1, hidden=(4, 8))
    sizes = group_sizes(family)
    # conv1: 1*4*9 weights + 4 biases + BN 8; conv2: 4*8*9 + 8 + BN 16 (the classifier is no group).
    assert sizes == {"conv1": 36 + 4 + 8, "conv2": 288 + 8 + 16}
    weights = adjustment_weights(family)
    assert weights["conv2"] == 1.0
    assert weights["conv1"] == pytest.approx(math.log(48) / math.log(312))


def test_keep_ratios_clamp_between_the_floor_and_one() -> None:
    ratios = keep_ratios({"a": 0.5, "b": 1.0, "c": 0.0}, {"a": 1.0, "b": 1.0, "c": 0.5}, gamma=1.5)
    assert ratios == {"a": 0.75, "b": 0.01, "c": 1.0}
    with pytest.raises(ValueError, match="different layers"):
        keep_ratios({"a": 0.5}, {"b": 1.0}, gamma=1.0)


HIDDEN = (16, 32, 64, 128)
TABLE = {"conv1": 0.2, "conv2": 0.6, "conv3": 0.4, "conv4": 0.7}


def test_algorithm_1_on_a_hand_built_score_table() -> None:
    family = get_family("cnn", 10, 1, hidden=HIDDEN)
    weights = adjustment_weights(family)
    full = family.param_count()
    pool = {target: prune_to_ratio(family, TABLE, weights, target, step=0.01, tolerance=0.01)
            for target in (0.25, 0.5, 1.0)}
    for target, pruned in pool.items():
        assert abs(family.param_count(pruned.spec) / full - target) <= 0.01
        assert pruned.share == pytest.approx(family.param_count(pruned.spec) / full)
        if target < 1:
            # The spec is exactly Algorithm 1's keep ratios at the gamma it stopped at.
            assert pruned.ratios == keep_ratios(TABLE, weights, pruned.gamma)
            assert pruned.spec == pruned_spec(pruned.ratios, "floor")
            # Upwards from 0 it stops at the first gamma within the tolerance: one step less is not.
            below = pruned_spec(keep_ratios(TABLE, weights, pruned.gamma - 0.01), "floor")
            assert abs(family.param_count(below) / full - target) > 0.01
    assert pool[1.0].spec.is_full
    # Layers with more dead activations (times their weight) keep less: the ratios differ across layers.
    half = pool[0.5].ratios
    assert half["conv4"] < half["conv2"] < half["conv3"] and len(set(half.values())) == 4
    for smaller, larger in itertools.pairwise([pool[0.25], pool[0.5], pool[1.0]]):
        assert family.is_nested(smaller.spec, larger.spec)


def test_algorithm_1_searches_down_and_refuses_what_it_cannot_reach() -> None:
    family = get_family("cnn", 10, 1, hidden=HIDDEN)
    weights = adjustment_weights(family)
    up = prune_to_ratio(family, TABLE, weights, 0.5, tolerance=0.03)
    down = prune_to_ratio(family, TABLE, weights, 0.5, tolerance=0.03, search="down")
    assert up.gamma <= down.gamma and up.share <= down.share
    assert abs(down.share - 0.5) <= 0.03
    with pytest.raises(ValueError, match="no gamma on a grid of step 0.5"):
        prune_to_ratio(family, TABLE, weights, 0.3, step=0.5, tolerance=0.0)


def test_the_features_measure_leaves_the_classifier_out() -> None:
    family = get_family("cnn", 10, 1, hidden=(4, 8))
    classifier = 8 * 10 + 10
    assert model_size(family, SubmodelSpec.full(), "features") == family.param_count() - classifier
    with pytest.raises(ValueError, match="size measure"):
        model_size(family, SubmodelSpec.full(), "flops")  # type: ignore[arg-type]
