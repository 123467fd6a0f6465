"""Tests for models.registry and the package's public surface."""

from __future__ import annotations

from types import ModuleType

import pytest

import models
from models import FAMILY_NAMES, ModelFamily, get_family
from models.cnn import ConvFamily
from models.preresnet import PreResNet18Family, PreResNet20Family
from models.resnet import ResNet20Family, ResNet56Family, ResNet110Family, ResNetFamily


def test_family_names() -> None:
    assert FAMILY_NAMES == ("cnn", "preresnet18", "preresnet20", "resnet", "resnet20", "resnet56", "resnet110", "vgg11",
                            "vgg13", "vgg16")


@pytest.mark.parametrize(
    ("name", "cls"),
    [
        ("cnn", ConvFamily),
        ("preresnet18", PreResNet18Family),
        ("preresnet20", PreResNet20Family),
        ("resnet", ResNetFamily),
        ("resnet20", ResNet20Family),
        ("resnet56", ResNet56Family),
        ("resnet110", ResNet110Family),
    ],
)
def test_get_family(name: str, cls: type[ModelFamily]) -> None:
    extra = {"depth": 14} if name == "resnet" else {}  # 2 stages of 3 blocks
    family = get_family(name, num_classes=7, in_channels=2, hidden=(4, 8), **extra)
    assert isinstance(family, cls) and family.name == name
    assert family.num_classes == 7 and family.in_channels == 2
    assert family.options["hidden"] == (4, 8)
    assert name in repr(family) or cls.__name__ in repr(family)


def test_unknown_family_lists_valid_ones() -> None:
    with pytest.raises(ValueError, match="unknown model family 'vgg19'.*cnn, preresnet18, preresnet20, resnet, resnet20, resnet56, "
                                         "resnet110"):
        get_family("vgg19", 10, 3)


def test_unknown_option_lists_valid_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown option 'depth'.*valid options: exit_convs, hidden\.$"):
        get_family("cnn", 10, 1, depth=3)
    with pytest.raises(ValueError, match=r"valid options: blocks, exit_convs, hidden\.$"):
        get_family("preresnet18", 10, 3, widht=2)
    with pytest.raises(ValueError, match=r"unknown option 'blocks'.*valid options: exit_convs, hidden\.$"):
        get_family("resnet110", 10, 3, blocks=(18, 18, 18))


@pytest.mark.parametrize(("num_classes", "in_channels"), [(0, 1), (10, 0), (True, 1), (10, 1.5)])
def test_bad_sizes(num_classes: object, in_channels: object) -> None:
    with pytest.raises(ValueError, match="positive integer"):
        get_family("cnn", num_classes, in_channels)  # type: ignore[arg-type]


def test_dunder_all_is_exactly_the_public_names_the_package_holds() -> None:
    # ``from models import *`` gives what __all__ lists: a listed name the package lacks (a rename left behind) or
    # a private one fails here, and so does a public name the package imports for its users but does not list.
    assert len(set(models.__all__)) == len(models.__all__), "a name is listed twice"
    public = {name for name, value in vars(models).items()
              if not name.startswith("_") and not isinstance(value, ModuleType)}
    assert set(models.__all__) == public


def test_scaled_channels_rounds_as_each_rounding_says() -> None:
    assert models.scaled_channels(64, 1 / 16) == 4
    assert models.scaled_channels(10, 0.55) == 6  # ceil by default (HeteroFL)
    assert {rounding: models.scaled_channels(10, 0.55, rounding) for rounding in models.ROUNDINGS} == {
        "ceil": 6, "floor": 5}
    with pytest.raises(ValueError, match="rounding must be one of ceil, floor"):
        models.scaled_channels(10, 0.55, "nearest")
