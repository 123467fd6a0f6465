"""Tests for models.registry and the package's public surface."""

from __future__ import annotations

import pytest

import models
from models import FAMILY_NAMES, ModelFamily, get_family
from models.cnn import ConvFamily
from models.preresnet import PreResNet18Family


def test_family_names() -> None:
    assert FAMILY_NAMES == ("cnn", "preresnet18")


@pytest.mark.parametrize(("name", "cls"), [("cnn", ConvFamily), ("preresnet18", PreResNet18Family)])
def test_get_family(name: str, cls: type[ModelFamily]) -> None:
    family = get_family(name, num_classes=7, in_channels=2, hidden=(4, 8))
    assert isinstance(family, cls) and family.name == name
    assert family.num_classes == 7 and family.in_channels == 2
    assert family.options["hidden"] == (4, 8)
    assert name in repr(family) or cls.__name__ in repr(family)


def test_unknown_family_lists_valid_ones() -> None:
    with pytest.raises(ValueError, match="unknown model family 'vgg16'.*cnn, preresnet18"):
        get_family("vgg16", 10, 3)


def test_unknown_option_lists_valid_ones() -> None:
    with pytest.raises(ValueError, match="unknown option 'depth'.*valid options: hidden"):
        get_family("cnn", 10, 1, depth=3)
    with pytest.raises(ValueError, match="valid options: blocks, hidden"):
        get_family("preresnet18", 10, 3, widht=2)


@pytest.mark.parametrize(("num_classes", "in_channels"), [(0, 1), (10, 0), (True, 1), (10, 1.5)])
def test_bad_sizes(num_classes: object, in_channels: object) -> None:
    with pytest.raises(ValueError, match="positive integer"):
        get_family("cnn", num_classes, in_channels)  # type: ignore[arg-type]


def test_public_exports() -> None:
    assert set(models.__all__) == {
        "FAMILY_NAMES",
        "BlockTrainingModel",
        "MemoryEstimate",
        "block_training_model",
        "estimate_training_memory",
        "ModelFamily",
        "Scaler",
        "SubmodelSpec",
        "get_family",
        "scaled_channels",
    }
    for name in models.__all__:
        assert getattr(models, name) is not None
    assert models.scaled_channels(64, 1 / 16) == 4
