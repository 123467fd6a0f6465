"""What every strategy (the server half of a method) provides to the coordinator."""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from coordinator.levels import Level, affordable, pick_dynamic, pick_fixed
from coordinator.registry import AgentRecord
from models import SubmodelSpec


@dataclass(frozen=True)
class Assignment:
    """One agent's part of a round: the level it trains, the spec, and the model group it belongs to."""

    agent_id: str
    level: str
    spec: SubmodelSpec
    group: str


@dataclass(frozen=True)
class EvalTarget:
    """A model to evaluate each round: the sub-model ``spec`` of the state kept for ``group``."""

    group: str
    spec: SubmodelSpec


@dataclass(frozen=True)
class Skip:
    """An agent selected but given nothing, with the reason."""

    agent_id: str
    reason: str


class Strategy(ABC):
    """Plans sub-models for selected agents and says which model states exist and what to evaluate."""

    name: str = ""

    def __init__(
        self,
        levels: Sequence[Level],
        cost: Callable[[SubmodelSpec], int],
        assignment: str = "fix",
        proportions: Sequence[float] | None = None,
    ) -> None:
        self.levels = list(levels)
        self.cost = cost
        self.assignment = assignment
        weights = list(proportions) if proportions is not None else [1.0] * len(self.levels)
        self.proportions = {level.name: w for level, w in zip(self.levels, weights)}

    @abstractmethod
    def groups(self) -> list[str]:
        """Names of the model states this strategy keeps (one global model, or one per level)."""

    @abstractmethod
    def group_of(self, level: Level) -> str:
        """The model state a level's clients train and are aggregated into."""

    def eval_targets(self) -> dict[str, EvalTarget]:
        """Name -> model to evaluate; "global" is the reported global model, level names the sub-models."""
        targets = {level.name: EvalTarget(self.group_of(level), level.spec) for level in self.levels}
        targets["global"] = EvalTarget(self.group_of(self.levels[0]), SubmodelSpec.full())
        return targets

    def adaptation_hint(self) -> dict[str, Any] | None:
        """How an agent may shrink what it was sent when it cannot afford it (None: it must decline)."""
        return None

    def choose_level(self, agent: AgentRecord, rng: random.Random) -> Level | None:
        """The level this agent trains this round, or None when none fits its memory.

        'fix': the largest level whose estimated training memory fits the agent's reported budget.
        'dynamic': a level sampled by proportion from all levels, as in HeteroFL's dynamic setting (devices'
        capabilities change every round); an agent that cannot afford it adapts or declines.
        """
        if self.assignment == "dynamic":
            return pick_dynamic(self.levels, self.proportions, rng)
        candidates = affordable(self.levels, agent.budget(), self.cost)
        return pick_fixed(candidates) if candidates else None

    def plan(self, agents: Sequence[AgentRecord], rng: random.Random) -> tuple[list[Assignment], list[Skip]]:
        """Assign a level to every selected agent that can afford one."""
        assignments: list[Assignment] = []
        skipped: list[Skip] = []
        for agent in agents:
            level = self.choose_level(agent, rng)
            if level is None:
                smallest = self.cost(self.levels[-1].spec)
                skipped.append(Skip(agent.agent_id, f"no level fits its memory ({agent.budget()} bytes < "
                                                    f"{smallest} bytes for level {self.levels[-1].name})"))
                continue
            assignments.append(Assignment(agent.agent_id, level.name, level.spec, self.group_of(level)))
        return assignments, skipped
