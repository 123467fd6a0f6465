"""Server halves of the methods, one per module."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from coordinator.levels import Level
from coordinator.strategies.base import Assignment, EvalTarget, Skip, Strategy
from coordinator.strategies.decoupled import Decoupled
from coordinator.strategies.fedavg import FedAvg
from coordinator.strategies.heterofl import HeteroFL
from models import SubmodelSpec

STRATEGIES: dict[str, type[Strategy]] = {cls.name: cls for cls in (HeteroFL, FedAvg, Decoupled)}


def make_strategy(
    name: str,
    levels: Sequence[Level],
    cost: Callable[[SubmodelSpec], int],
    assignment: str = "fix",
    proportions: Sequence[float] | None = None,
) -> Strategy:
    """The strategy called ``name``; ValueError listing the known ones otherwise."""
    if name not in STRATEGIES:
        raise ValueError(f"unknown algorithm {name!r}; choose one of {', '.join(sorted(STRATEGIES))}")
    return STRATEGIES[name](levels, cost, assignment, proportions)


__all__ = ["STRATEGIES", "Assignment", "EvalTarget", "Skip", "Strategy", "make_strategy"]
