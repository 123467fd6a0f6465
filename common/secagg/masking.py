"""Masks for sub-models: a device's slice of the global model masked so that the coordinator's sum over every
device holding a coordinate is that coordinate's plain sum, while no single slice says anything of its values.

A device's slice is its *coverage*: per tensor, the global indices it holds in each dimension (the slice is their
cartesian product, as the coordinator's masked aggregation cuts it). It adds to its fixed-point values
(`common.secagg.encoding`):

- its **self mask**, from its own seed, on every coordinate it holds (removed by the coordinator with the seed
  its surviving neighbours give back);
- one **pair mask** per neighbour, from the seed they agreed, on the coordinates *both* hold: the lower device id adds
  it, the higher subtracts it, so it cancels in the sum wherever it was added. Two slices that share no coordinate
  of a tensor exchange no mask there; a neighbour that drops out after the masks were agreed leaves its pair masks
  in its neighbours' slices, which the coordinator removes with that neighbour's key, given back by the others.

Masks are drawn over the global tensor (`common.secagg.prg`), so both devices of a pair draw the same value for the
same global coordinate whatever slices they hold.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from common.secagg.encoding import decode, encode
from common.secagg.prg import tensor_mask

__all__ = ["MIN_HOLDERS", "Coverage", "PairMask", "SecureSum", "check_coverage", "intersect", "mask_slice"]

#: Per tensor, the global indices a slice holds in each dimension.
Coverage = Mapping[str, Sequence[np.ndarray]]

#: The fewest devices whose values a coordinate's unmasked sum may hold: with one it is that device's value, with two
#: each holder reads the other's from it.
MIN_HOLDERS = 3


def check_coverage(coverage: Coverage, shapes: Mapping[str, Sequence[int]]) -> None:
    """ValueError unless every tensor of ``coverage`` is one of ``shapes`` and its indices, per dimension, are distinct
    and within the global tensor."""
    for name, indices in coverage.items():
        if name not in shapes:
            raise ValueError(f"a slice holds tensor {name!r}, which the global model lacks")
        if len(indices) != len(shapes[name]):
            raise ValueError(f"tensor {name!r}: {len(indices)} dimension(s) of indices for a tensor of "
                             f"{len(shapes[name])}")
        for index, size in zip(indices, shapes[name], strict=True):
            array = np.asarray(index)
            if array.size == 0 or array.min() < 0 or array.max() >= size or len(np.unique(array)) != array.size:
                raise ValueError(f"tensor {name!r}: a slice's indices must be distinct and within 0..{size - 1}")


@dataclass(frozen=True)
class PairMask:
    """A mask agreed with one neighbour: its ``seed``, ``sign`` (+1 for the lower device id, -1 for the higher) and
    the neighbour's coverage."""

    seed: bytes
    sign: int
    peer: Coverage


def _grid(indices: Sequence[np.ndarray]) -> tuple[np.ndarray, ...]:
    """Broadcastable index arrays selecting the cartesian product of per-dimension ``indices``."""
    return np.ix_(*[np.asarray(index, dtype=np.int64) for index in indices])


def intersect(first: Sequence[np.ndarray], second: Sequence[np.ndarray]) -> tuple[np.ndarray, ...] | None:
    """The global indices per dimension two slices of one tensor both hold (None when they share no coordinate)."""
    common = tuple(np.intersect1d(np.asarray(a), np.asarray(b)) for a, b in zip(first, second, strict=True))
    return None if any(index.size == 0 for index in common) else common


def _local(indices: Sequence[np.ndarray], sub: Sequence[np.ndarray], shape: Sequence[int]) -> tuple[np.ndarray, ...]:
    """Where the global indices ``sub`` sit inside a slice of global ``indices`` (per dimension)."""
    positions = []
    for index, part, size in zip(indices, sub, shape, strict=True):
        where = np.full(size, -1, dtype=np.int64)
        where[np.asarray(index)] = np.arange(len(index))
        positions.append(where[np.asarray(part)])
    return tuple(positions)


def _mask(seed: bytes, name: str, shape: Sequence[int], indices: Sequence[np.ndarray]) -> np.ndarray:
    """The mask of tensor ``name`` under ``seed`` at the global coordinates ``indices`` select."""
    return tensor_mask(seed, name, math.prod(shape)).reshape(tuple(shape))[_grid(indices)]


def mask_slice(values: Mapping[str, np.ndarray], own: Coverage, shapes: Mapping[str, Sequence[int]],
               self_seed: bytes, pairs: Sequence[PairMask]) -> dict[str, np.ndarray]:
    """A device's slice ``values`` (each tensor the shape its coverage selects) in fixed point, masked (uint64):
    its self mask everywhere, each pair mask where the pair's coverages meet."""
    if set(values) != set(own):
        raise ValueError(f"the slice's tensors {sorted(values)} are not its coverage's {sorted(own)}")
    check_coverage(own, shapes)
    masked: dict[str, np.ndarray] = {}
    for name, value in values.items():
        indices, shape = own[name], shapes[name]
        if tuple(len(index) for index in indices) != np.shape(value):
            raise ValueError(f"tensor {name!r} has shape {np.shape(value)}, its coverage selects "
                             f"{tuple(len(index) for index in indices)}")
        result = encode(value) + _mask(self_seed, name, shape, indices)
        for pair in pairs:
            if name not in pair.peer:
                continue
            common = intersect(indices, pair.peer[name])
            if common is None:
                continue
            local = np.ix_(*_local(indices, common, shape))
            if pair.sign > 0:
                result[local] += _mask(pair.seed, name, shape, common)
            else:
                result[local] -= _mask(pair.seed, name, shape, common)
        masked[name] = result
    return masked


class SecureSum:
    """The coordinator's sums modulo 2^64 of masked slices over the global tensors of ``shapes``, and how many
    slices hold each coordinate; the masks taken away, :meth:`result` is each coordinate's plain sum."""

    def __init__(self, shapes: Mapping[str, Sequence[int]]) -> None:
        self.shapes = {name: tuple(shape) for name, shape in shapes.items()}
        self.sums = {name: np.zeros(shape, dtype=np.uint64) for name, shape in self.shapes.items()}
        self.counts = {name: np.zeros(shape, dtype=np.int64) for name, shape in self.shapes.items()}

    def add(self, masked: Mapping[str, np.ndarray], coverage: Coverage) -> None:
        """Fold one device's masked slice in; ValueError (folding nothing) when its tensors or their shapes are not
        its coverage's."""
        if set(masked) != set(coverage):
            raise ValueError(f"a masked slice holds tensors {sorted(masked)}, its coverage {sorted(coverage)}")
        for name, value in masked.items():
            if np.shape(value) != tuple(len(index) for index in coverage[name]):
                raise ValueError(f"tensor {name!r} of a masked slice has shape {np.shape(value)}, its coverage "
                                 f"selects {tuple(len(index) for index in coverage[name])}")
        for name, value in masked.items():
            where = _grid(coverage[name])
            self.sums[name][where] += np.asarray(value, dtype=np.uint64)
            self.counts[name][where] += 1

    def subtract(self, masked: Mapping[str, np.ndarray], coverage: Coverage) -> None:
        """Take a masked slice folded in back out (a sender left out of the sum)."""
        for name, value in masked.items():
            where = _grid(coverage[name])
            self.sums[name][where] -= np.asarray(value, dtype=np.uint64)
            self.counts[name][where] -= 1

    def remove_self_mask(self, seed: bytes, coverage: Coverage) -> None:
        """Take away the self mask of a device whose slice was folded in (its seed given back by its neighbours)."""
        for name, indices in coverage.items():
            self.sums[name][_grid(indices)] -= _mask(seed, name, self.shapes[name], indices)

    def remove_pair_mask(self, seed: bytes, sign: int, survivor: Coverage, dropped: Coverage) -> None:
        """Take away the pair mask a surviving device (of coverage ``survivor``, ``sign`` its own) added for a
        neighbour that dropped out (``dropped``); ``seed`` recomputed from the dropped device's key."""
        for name, indices in survivor.items():
            if name not in dropped:
                continue
            common = intersect(indices, dropped[name])
            if common is None:
                continue
            mask = _mask(seed, name, self.shapes[name], common)
            if sign > 0:
                self.sums[name][_grid(common)] -= mask
            else:
                self.sums[name][_grid(common)] += mask

    def result(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """Per tensor, the plain sums (float64; where no slice holds a coordinate, 0) and the count of slices."""
        return {name: (decode(self.sums[name]), self.counts[name].copy()) for name in self.sums}
