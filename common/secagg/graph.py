"""SecAgg+'s communication graph (Bell et al. 2020): each device exchanges masks and shares with ``k`` neighbours
instead of every other device, on a random Harary graph (the devices on a ring in random order, each joined to the
``k/2`` nearest on either side), and ``threshold`` of a device's neighbours give back what it shared."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

__all__ = ["neighbour_count", "neighbours", "threshold_of"]


def neighbour_count(devices: int, least: int = 16) -> int:
    """How many neighbours each of ``devices`` has: every other device up to ``least + 1`` devices, else an even
    ``k`` of about ``3 log2(n)`` (at least ``least``), within ``devices - 1``."""
    if devices <= least + 1:
        return devices - 1
    k = max(least, 3 * math.ceil(math.log2(devices)))
    return min(devices - 1, k + (k % 2))


def threshold_of(neighbour_total: int) -> int:
    """The shares that give a secret back: a majority of a device's neighbours (and at least one)."""
    return max(1, neighbour_total // 2 + 1)


def neighbours(devices: Sequence[str], k: int, rng: random.Random) -> dict[str, list[str]]:
    """Each device's ``k`` neighbours (symmetric), every device when ``k`` is one less than their number."""
    names = list(devices)
    if k >= len(names) - 1:
        return {name: [other for other in names if other != name] for name in names}
    rng.shuffle(names)
    half = k // 2
    ring: dict[str, set[str]] = {name: set() for name in names}
    for index, name in enumerate(names):
        for step in range(1, half + 1):
            other = names[(index + step) % len(names)]
            ring[name].add(other)
            ring[other].add(name)
    return {name: sorted(ring[name]) for name in devices}
