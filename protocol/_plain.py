"""Message values as msgpack primitives."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields, is_dataclass
from enum import Enum

import numpy as np


def plain(value: object) -> object:
    """Dataclasses to maps (without the fields named in their ``OMITTED_AT_DEFAULT`` that hold their default),
    every mapping (e.g. a ``FrozenMap``) to a dict, tuples to lists, numpy scalars and arrays to Python values,
    enum members (e.g. an ``UpdateStatus``) to their values."""
    if is_dataclass(value) and not isinstance(value, type):
        # Fields added after a message's first version stay off the wire at their default (older readers).
        omit = getattr(value, "OMITTED_AT_DEFAULT", ())
        return {f.name: plain(getattr(value, f.name)) for f in fields(value)
                if f.name not in omit or getattr(value, f.name) != f.default}
    if isinstance(value, Mapping):
        return {key: plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(item) for item in value]
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, Enum):
        return value.value
    return value
