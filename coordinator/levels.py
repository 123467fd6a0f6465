"""Complexity levels: named sub-models (HeteroFL's a..e, ScaleFL's 1..L) and which of them an agent can afford."""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from models import SubmodelSpec

LEVEL_NAMES = "abcdefghijklmnopqrstuvwxyz"


@dataclass(frozen=True)
class Level:
    """One complexity level: its name, its sub-model spec, and what else describes it (e.g. ScaleFL's
    ``s_d``/``s_w``), shown by ``fedfit plan``."""

    name: str
    spec: SubmodelSpec
    info: Mapping[str, Any] = field(default_factory=dict)


def width_levels(rates: Sequence[float], rounding: str = "ceil") -> list[Level]:
    """HeteroFL's levels named a, b, c, ... for width rates listed from largest to smallest."""
    if len(rates) > len(LEVEL_NAMES):
        raise ValueError(f"at most {len(LEVEL_NAMES)} levels are supported")
    return [Level(LEVEL_NAMES[i], SubmodelSpec.uniform(rate, rounding), {"rate": rate})
            for i, rate in enumerate(rates)]


def affordable(levels: Sequence[Level], budget: int | None, cost: Callable[[Level], int]) -> list[Level]:
    """The levels whose training cost fits ``budget`` (all of them when the budget is unknown)."""
    if budget is None:
        return list(levels)
    return [level for level in levels if cost(level) <= budget]


def pick_dynamic(candidates: Sequence[Level], proportions: Mapping[str, float], rng: random.Random) -> Level:
    """HeteroFL 'dynamic': a level sampled by its proportion among ``candidates``."""
    weights = [proportions.get(level.name, 0.0) for level in candidates]
    if sum(weights) <= 0:
        weights = [1.0] * len(candidates)
    return rng.choices(list(candidates), weights=weights, k=1)[0]


def affordable_share(budget: int, overhead: int, full_variable: float, factor: float) -> float:
    """The share of the full model's model-dependent training memory (``full_variable``) a device with ``budget``
    bytes can train by its own rule (``overhead + variable * factor <= budget``: :mod:`common.device_need`);
    0 when the budget does not even hold the runtime's fixed overhead."""
    if full_variable <= 0:
        return 1.0
    return max(0.0, (budget - overhead) / factor / full_variable)


def fleet_shares(shares: Sequence[float], *, most: int, merge: float = 0.15) -> list[float]:
    """The levels a fleet asks for, as shares of the full model (smallest first, ending with 1): one per cluster
    of the devices' affordable ``shares`` below 1 (a share within ``merge`` (relative) above a cluster's smallest
    joins it, and the cluster gets that smallest: every device of it can train its level), at most ``most``
    below the full model (the smallest cluster always kept, the others spread over the rest)."""
    clusters: list[float] = []
    for share in sorted(s for s in shares if 0 < s < 1 - 1e-3):  # within 0.1% of 1: the full model (the
        # device's rule truncates to whole bytes)
        if not clusters or share > clusters[-1] * (1 + merge):
            clusters.append(share)
    if len(clusters) > most > 0:
        step = (len(clusters) - 1) / (most - 1) if most > 1 else 0.0
        clusters = [clusters[round(i * step)] for i in range(most)] if most > 1 else clusters[:1]
    return [*clusters, 1.0]
