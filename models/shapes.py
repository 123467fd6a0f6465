"""The one shape check against index maps: the tensors of a spec have the shapes its index map says.

An index map (:meth:`models.family.ModelFamily.index_map`) gives each tensor of a sub-model one index tensor per
dimension into the global tensor, so the tensor's shape is the lengths of those index tensors. The coordinator
checks an update's tensors and what it aggregates against it, the agent a task's weights.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence, Sized
from typing import Any

__all__ = ["check_shape", "check_shapes", "index_shape"]


def index_shape(indices: Sequence[Sized]) -> tuple[int, ...]:
    """The shape of a tensor whose positions in its global tensor are ``indices`` (one per dimension)."""
    return tuple(len(idx) for idx in indices)


def check_shape(key: str, shape: Iterable[int], indices: Sequence[Sized], says: str = "its index map says") -> None:
    """Raise ``ValueError`` ("tensor 'key' has shape (..), <says> (..)") unless ``shape`` is the one ``indices``
    give; ``says`` names where the expected shape comes from, as the caller's message puts it."""
    expected = index_shape(indices)
    if tuple(shape) != expected:
        raise ValueError(f"tensor {key!r} has shape {tuple(shape)}, {says} {expected}")


def check_shapes(tensors: Mapping[str, Any], index_map: Mapping[str, Sequence[Sized]],
                 says: str = "its index map says") -> None:
    """:func:`check_shape` for every tensor (array) of ``tensors``, in order, against its entry of ``index_map``
    (each key must have one)."""
    for key, tensor in tensors.items():
        check_shape(key, tensor.shape, index_map[key], says)
