"""How a secure round's slices travel, and what binds a round's secrets to it: a coverage's indices as runs, and
where a slice's values are hidden among enough devices (``keep``) as packed bits, both small whatever the model's
size.

A dimension's indices are written as runs ``[start0, stop0, start1, stop1, ...]`` (each ``start..stop-1``): a width
slice is one run, a rolled window two, a classifier's seen rows a few.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from common.secagg.masking import Coverage

__all__ = ["context_of", "coverage_from_runs", "coverage_to_runs", "from_runs", "keep_from_bits", "keep_to_bits",
           "to_runs"]


def context_of(federation: str, round_number: int) -> bytes:
    """What binds a round's keys and sealed shares to it: both sides compute it from the federation and round."""
    return f"fedfit/{federation}/round/{round_number}".encode()


def to_runs(indices: np.ndarray) -> list[int]:
    """``indices`` (in the order given) as runs of consecutive values."""
    array = np.asarray(indices, dtype=np.int64).ravel()
    if array.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(array) != 1) + 1
    starts = np.concatenate(([0], breaks))
    stops = np.concatenate((breaks, [array.size]))
    runs: list[int] = []
    for start, stop in zip(starts, stops, strict=True):
        runs += [int(array[start]), int(array[stop - 1]) + 1]
    return runs


def from_runs(runs: Sequence[int], where: str = "runs") -> np.ndarray:
    """The indices ``runs`` name (ValueError for an odd count, a negative start or an empty or reversed run)."""
    if len(runs) % 2:
        raise ValueError(f"{where}: an odd number of run bounds ({len(runs)})")
    parts = []
    for start, stop in zip(runs[::2], runs[1::2], strict=True):
        if start < 0 or stop <= start:
            raise ValueError(f"{where}: the run {start}..{stop} is empty or negative")
        parts.append(np.arange(start, stop, dtype=np.int64))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def coverage_to_runs(coverage: Coverage) -> dict[str, list[list[int]]]:
    """A coverage as runs per tensor and dimension."""
    return {name: [to_runs(index) for index in indices] for name, indices in coverage.items()}


def coverage_from_runs(runs: Mapping[str, Sequence[Sequence[int]]]) -> dict[str, tuple[np.ndarray, ...]]:
    """A coverage read back from runs (ValueError naming the tensor for malformed runs)."""
    return {name: tuple(from_runs(dim, f"tensor {name!r}") for dim in dims) for name, dims in runs.items()}


def keep_to_bits(keep: Mapping[str, np.ndarray]) -> dict[str, bytes]:
    """Per tensor, its boolean array over the slice as packed bits (C order)."""
    return {name: np.packbits(np.asarray(mask, dtype=bool).ravel()).tobytes() for name, mask in keep.items()}


def keep_from_bits(bits: Mapping[str, bytes], coverage: Coverage) -> dict[str, np.ndarray]:
    """The boolean arrays over each tensor of ``coverage`` that ``bits`` packed; ValueError when a tensor is missing,
    foreign, or its bits are not as many as its slice's coordinates."""
    if set(bits) != set(coverage):
        raise ValueError(f"the holder bits name tensors {sorted(bits)[:3]}, the slice holds {sorted(coverage)[:3]}")
    keep = {}
    for name, packed in bits.items():
        shape = tuple(len(index) for index in coverage[name])
        size = math.prod(shape)
        if len(packed) != (size + 7) // 8:
            raise ValueError(f"tensor {name!r}: {len(packed)} bytes of holder bits for {size} coordinates")
        keep[name] = np.unpackbits(np.frombuffer(packed, dtype=np.uint8), count=size).astype(bool).reshape(shape)
    return keep
