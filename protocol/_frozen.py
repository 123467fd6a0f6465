"""Immutable, hashable forms of decoded msgpack trees, for wire data held inside frozen dataclasses."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

__all__ = ["FrozenMap", "freeze"]


class FrozenMap(Mapping[str, Any]):
    """A read-only mapping that hashes by its items (its values frozen: maps to FrozenMap, lists to tuples).

    It compares equal to a dict with the same items, and ``protocol._plain.plain`` writes it as a map.
    """

    __slots__ = ("_data", "_hash")

    def __init__(self, data: Mapping[str, Any] | None = None) -> None:
        self._data: dict[str, Any] = {key: freeze(value) for key, value in (data or {}).items()}
        self._hash: int | None = None

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __hash__(self) -> int:
        if self._hash is None:
            self._hash = hash(frozenset(self._data.items()))
        return self._hash

    def __eq__(self, other: object) -> bool:  # a dict with the same items (lists as tuples) is equal
        if not isinstance(other, Mapping):
            return NotImplemented
        return self._data == (other._data if isinstance(other, FrozenMap) else FrozenMap(other)._data)

    def __repr__(self) -> str:
        return f"FrozenMap({self._data!r})"

    def __reduce__(self) -> tuple[type[FrozenMap], tuple[dict[str, Any]]]:
        return FrozenMap, (self._data,)


def freeze(value: Any) -> Any:
    """``value`` with every mapping in it a :class:`FrozenMap` and every list or tuple a tuple."""
    if isinstance(value, FrozenMap):
        return value
    if isinstance(value, Mapping):
        return FrozenMap(value)
    if isinstance(value, (list, tuple)):
        return tuple(freeze(item) for item in value)
    return value
