"""Server halves of the methods, one per module, and the registry of algorithm names."""

from __future__ import annotations

from coordinator.strategies.adaptivefl import AdaptiveFL
from coordinator.strategies.base import (
    EvalTarget,
    RoundPlan,
    Skip,
    Strategy,
    StrategyContext,
    TaskOutcome,
    TaskPlan,
    TaskResult,
)
from coordinator.strategies.decoupled import Decoupled
from coordinator.strategies.depthfl import DepthFL
from coordinator.strategies.fedavg import FedAvg
from coordinator.strategies.fedepth import FeDepth
from coordinator.strategies.fedrolex import FedRolex
from coordinator.strategies.fjord import FjORD
from coordinator.strategies.flexfl import FlexFL
from coordinator.strategies.heterofl import HeteroFL
from coordinator.strategies.scalefl import ScaleFL

STRATEGIES: dict[str, type[Strategy]] = {
    cls.name: cls for cls in (HeteroFL, FedAvg, Decoupled, ScaleFL, FeDepth, FlexFL, AdaptiveFL, FedRolex,
                                        DepthFL, FjORD)
}
#: The algorithm names a coordinator config, ``fedfit sim`` and ``fedfit plan`` accept.
ALGORITHM_NAMES: tuple[str, ...] = tuple(STRATEGIES)


def check_algorithm(name: str) -> None:
    """Raise ValueError (one sentence naming the valid ones) unless ``name`` is a known algorithm."""
    if name not in STRATEGIES:
        raise ValueError(f"unknown algorithm {name!r}; 'algorithm' must be one of {', '.join(ALGORITHM_NAMES)}")


def make_strategy(name: str, context: StrategyContext) -> Strategy:
    """Set up the strategy called ``name``; ValueError listing the known ones otherwise."""
    check_algorithm(name)
    return STRATEGIES[name](context)


__all__ = [
    "ALGORITHM_NAMES",
    "STRATEGIES",
    "EvalTarget",
    "RoundPlan",
    "Skip",
    "Strategy",
    "StrategyContext",
    "TaskOutcome",
    "TaskPlan",
    "TaskResult",
    "check_algorithm",
    "make_strategy",
]
