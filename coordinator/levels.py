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
