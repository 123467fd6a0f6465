"""AdaptiveFL's (r_w, I) sub-models: which layers stay whole, the reference's rounding, nesting and the default
values of I per family."""

from __future__ import annotations

import pytest

from models import SubmodelSpec, get_family
from models.fine_grained import default_full_layers, fine_grained_spec


def test_the_first_layers_stay_whole_and_the_rest_keep_int_c_times_r() -> None:
    family = get_family("vgg16", 10, 3)
    kept = family.kept_channels(fine_grained_spec(family, 0.66, 8))
    full = family.kept_channels(SubmodelSpec.full())
    layers = family.prunable_layers()
    assert layers[:8] == tuple(f"conv{i}" for i in range(1, 9)) and layers[-2:] == ("fc1", "fc2")
    for index, layer in enumerate(layers):
        assert kept[layer] == (full[layer] if index < 8 else int(full[layer] * 0.66)), layer
    assert fine_grained_spec(family, 1.0, 3) == SubmodelSpec.full()


def test_smaller_width_and_fewer_whole_layers_nest_and_the_crossed_pairs_do_not() -> None:
    family = get_family("cnn", 10, 1)
    m3, s3, s1 = (fine_grained_spec(family, 0.66, 1), fine_grained_spec(family, 0.4, 1),
                  fine_grained_spec(family, 0.4, 3))
    assert family.is_nested(s3, m3) and family.is_nested(s3, s1)
    assert not family.is_nested(s1, m3)  # S1 keeps conv2, conv3 whole; M3 thins them


def test_default_values_of_i() -> None:
    assert default_full_layers(get_family("vgg16", 10, 3)) == [8, 6, 4]  # the paper's
    assert default_full_layers(get_family("cnn", 10, 1)) == [3, 2, 1]
    assert default_full_layers(get_family("cnn", 10, 1), minimum=2) == [3, 2]
    for name in ("vgg11", "vgg13", "resnet20", "preresnet18"):
        values = default_full_layers(get_family(name, 10, 3))
        layers = len(get_family(name, 10, 3).prunable_layers())
        assert len(values) == 3 and values == sorted(set(values), reverse=True) and 1 <= values[-1]
        assert values[0] < layers


def test_bad_values_are_refused() -> None:
    family = get_family("cnn", 10, 1)
    with pytest.raises(ValueError, match="r_w must be in"):
        fine_grained_spec(family, 0.0, 1)
    with pytest.raises(ValueError, match="I must be in"):
        fine_grained_spec(family, 0.5, 5)
