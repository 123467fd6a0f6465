"""AdaptiveFL's fine-grained width pruning: a sub-model ``(r_w, I)`` keeps its first ``I`` layers whole and
``r_w`` of every later layer's channels.

"Layers" are the family's prunable channel groups in depth order (:meth:`ModelFamily.prunable_layers`): for VGG
the convolutions ``conv1..convN`` then the head's hidden layers ``fc1, fc2``, so ``(0.66, 8)`` of VGG-16 keeps
conv1..conv8 whole and ``int(0.66 C)`` channels of conv9..conv13, fc1 and fc2 (the reference code's rule, which
reproduces the paper's Table 1). Channels are rounded down (``int(C * r_w)``); the classifier's class rows are
never pruned. A model with a smaller ``r_w`` and a smaller (or equal) ``I`` is nested in a larger one; two models
where one keeps more layers whole and the other keeps later layers wider are not.
"""

from __future__ import annotations

from collections.abc import Sequence

from models.family import ModelFamily
from models.spec import SubmodelSpec

__all__ = ["PAPER_DEPTH_SHARES", "default_full_layers", "fine_grained_spec"]

#: VGG-16's I in {8, 6, 4} (the paper's Table 1) as shares of its 15 prunable layers (13 convolutions, 2 hidden
#: linear layers): other families get the same shares of theirs.
PAPER_DEPTH_SHARES = (8 / 15, 6 / 15, 4 / 15)


def fine_grained_spec(family: ModelFamily, width: float, full_layers: int) -> SubmodelSpec:
    """The sub-model keeping the first ``full_layers`` prunable layers whole and ``width`` of the others (floor);
    ValueError for a width outside (0, 1] or a count outside [0, number of layers]."""
    layers = family.prunable_layers()
    if not 0 < width <= 1:
        raise ValueError(f"a fine-grained width r_w must be in (0, 1], got {width}")
    if not 0 <= full_layers <= len(layers):
        raise ValueError(f"{family.name!r} has {len(layers)} prunable layers; I must be in [0, {len(layers)}], got "
                         f"{full_layers}")
    if width == 1.0:
        return SubmodelSpec.full()
    pruned = tuple((layer, round(width, 6)) for layer in layers[full_layers:])
    return family.validate_spec(SubmodelSpec(layer_widths=pruned, rounding="floor"))


def default_full_layers(family: ModelFamily, count: int = 3, minimum: int = 1,
                        shares: Sequence[float] = PAPER_DEPTH_SHARES) -> list[int]:
    """``count`` values of I for ``family``, largest first: the paper's shares of its prunable layers (VGG-16:
    8, 6, 4), or, where those collide or fall below ``minimum`` on a shallow family, the ``count`` largest values
    in ``[minimum, layers - 1]`` (a 4-layer CNN: 3, 2, 1). Fewer when the family has too few layers."""
    layers = len(family.prunable_layers())
    proposed = [round(layers * share) for share in shares[:count]]
    if len(proposed) == count and len(set(proposed)) == count and min(proposed) >= minimum and max(proposed) < layers:
        return sorted(proposed, reverse=True)
    return list(range(layers - 1, minimum - 1, -1))[:count]
