"""Look model families up by name."""

from __future__ import annotations

from typing import Any

from models.cnn import ConvFamily
from models.family import ModelFamily
from models.preresnet import PreResNet18Family, PreResNet20Family
from models.resnet import ResNet20Family, ResNet56Family, ResNet110Family, ResNetFamily
from models.vgg import Vgg11Family, Vgg13Family, Vgg16Family

__all__ = ["FAMILY_NAMES", "get_family"]

_FAMILIES: dict[str, type[ModelFamily]] = {
    family.name: family
    for family in (ConvFamily, PreResNet18Family, PreResNet20Family, ResNetFamily, ResNet20Family, ResNet56Family, ResNet110Family,
                   Vgg11Family, Vgg13Family, Vgg16Family)
}

#: Names accepted by :func:`get_family`.
FAMILY_NAMES: tuple[str, ...] = tuple(_FAMILIES)


def get_family(name: str, num_classes: int, in_channels: int, **options: Any) -> ModelFamily:
    """Create the model family ``name`` for ``num_classes`` classes and ``in_channels`` input channels.

    Raises
    ------
    ValueError
        For an unknown family name or option (the message lists the valid ones) or an invalid value.
    """
    family = _FAMILIES.get(name) if isinstance(name, str) else None
    if family is None:
        raise ValueError(f"unknown model family {name!r}; valid families: {', '.join(FAMILY_NAMES)}.")
    return family(num_classes, in_channels, **options)
