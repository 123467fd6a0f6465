"""Complexity levels: named width rates (HeteroFL's a..e) and which of them an agent can afford."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from models import SubmodelSpec

LEVEL_NAMES = "abcdefghijklmnopqrstuvwxyz"


@dataclass(frozen=True)
class Level:
    """One complexity level: its name ("a" is the largest), width rate and sub-model spec."""

    name: str
    rate: float
    spec: SubmodelSpec


def make_levels(rates: Sequence[float]) -> list[Level]:
    """Levels named a, b, c, ... for rates listed from largest to smallest."""
    if len(rates) > len(LEVEL_NAMES):
        raise ValueError(f"at most {len(LEVEL_NAMES)} levels are supported")
    return [Level(LEVEL_NAMES[i], rate, SubmodelSpec.uniform(rate)) for i, rate in enumerate(rates)]


def affordable(levels: Sequence[Level], budget: int | None, cost: Callable[[SubmodelSpec], int]) -> list[Level]:
    """The levels whose training cost fits ``budget`` (all of them when the budget is unknown)."""
    if budget is None:
        return list(levels)
    return [level for level in levels if cost(level.spec) <= budget]


def pick_fixed(candidates: Sequence[Level]) -> Level:
    """HeteroFL 'fix': the largest affordable level."""
    return candidates[0]


def pick_dynamic(candidates: Sequence[Level], proportions: dict[str, float], rng: random.Random) -> Level:
    """HeteroFL 'dynamic': a level sampled by its proportion among the affordable ones."""
    weights = [proportions.get(level.name, 0.0) for level in candidates]
    if sum(weights) <= 0:
        weights = [1.0] * len(candidates)
    return rng.choices(list(candidates), weights=weights, k=1)[0]
