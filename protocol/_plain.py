"""Message values as msgpack primitives."""

from __future__ import annotations

from dataclasses import fields, is_dataclass

import numpy as np


def plain(value: object) -> object:
    """Dataclasses to maps, tuples to lists, numpy scalars and arrays to Python values."""
    if is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, dict):
        return {key: plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(item) for item in value]
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    return value
