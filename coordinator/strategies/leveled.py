"""Strategies built on a fixed ladder of nested levels (HeteroFL, its baselines, ScaleFL)."""

from __future__ import annotations

import random
from abc import abstractmethod
from collections.abc import Sequence
from typing import Any

from coordinator.levels import Level, affordable, pick_dynamic
from coordinator.registry import AgentRecord
from coordinator.strategies.base import (
    EvalTarget,
    RoundPlan,
    Skip,
    Strategy,
    StrategyContext,
    TaskPlan,
    select_fraction,
)
from models import SubmodelSpec
from protocol import Adaptation, Candidate, TrainingPlan


class LevelStrategy(Strategy):
    """Levels listed largest first; each round ``fraction`` of the online agents is selected and each gets a level
    ('fix': the largest whose estimated training memory fits the budget the agent reports; 'dynamic': sampled
    by the configured proportions from all levels, HeteroFL's setting of capabilities that change every round).
    """

    #: Whether an agent short of memory may fall to a smaller level (a ladder of the levels below its own).
    adapts: bool = True

    def __init__(self, context: StrategyContext, *, lazy: bool = False) -> None:
        super().__init__(context)
        self._levels: list[Level] | None = None
        self.proportions: dict[str, float] = {}
        if not lazy:
            self._make()

    def _make(self) -> list[Level]:
        levels = self.make_levels()
        if not levels:
            raise ValueError(f"strategy {self.name!r} has no levels")
        sent = [level for level in levels if self.sends(level)]
        weights = self.config.level_proportions or [1.0] * len(sent)
        if len(weights) != len(sent):
            raise ValueError(f"level_proportions needs one weight per level of {self.name} ({len(sent)}), "
                             f"got {len(weights)}")
        self.proportions = {level.name: w for level, w in zip(sent, weights)}
        self._levels = levels
        return levels

    @property
    def levels(self) -> list[Level]:
        """The levels, largest first (made at set-up, or on first use by a strategy set up ``lazy``: one whose
        levels come from work a restored state makes unnecessary)."""
        return self._levels if self._levels is not None else self._make()

    @abstractmethod
    def make_levels(self) -> list[Level]:
        """The levels, largest first."""

    def level_plan(self, level: Level, round_number: int) -> TrainingPlan:
        """How a level is trained in a round (default: the configured recipe)."""
        return self.recipe_plan()

    def group_of(self, level: Level) -> str:
        """The model state a level's agents train and are aggregated into."""
        return "global"

    def cost(self, level: Level, round_number: int = 1) -> int:
        """Estimated training memory of a level on an agent."""
        return self.training_cost(level.spec, self.level_plan(level, round_number))

    def sends(self, level: Level) -> bool:
        """Whether the coordinator sends ``level`` itself (default: every level). A level it does not send
        (FlexFL's adaptive variants) is reached only down the ladder of a level it sends."""
        return True

    def sent_for(self, level: Level) -> Level | None:
        """The level sent to an agent whose budget fits ``level`` at most: ``level`` itself when it is sent, else
        the smallest sent level it is nested in (the agent falls to ``level`` down that level's ladder)."""
        if self.sends(level):
            return level
        above = [other for other in self.levels[:self.levels.index(level)]
                 if self.sends(other) and self.family.is_nested(level.spec, other.spec)]
        return above[-1] if above else None

    def choose_level(self, agent: AgentRecord, rng: random.Random, round_number: int) -> Level | None:
        """The level this agent is sent this round, or None when none fits its memory."""
        if self.config.level_assignment == "dynamic":
            return pick_dynamic([level for level in self.levels if self.sends(level)], self.proportions, rng)
        candidates = affordable(self.levels, agent.budget(), lambda level: self.cost(level, round_number))
        sent = [self.sent_for(level) for level in candidates]
        return next((level for level in sent if level is not None), None)

    def ladder(self, level: Level, round_number: int) -> Adaptation | None:
        """The smaller levels nested in ``level`` that an agent short of memory may train instead, largest first
        (None: none)."""
        below = [lower for lower in self.levels[self.levels.index(level) + 1:]
                 if self.family.is_nested(lower.spec, level.spec)]
        if not self.adapts or not below:
            return None
        return Adaptation("ladder", [Candidate(lower.spec.to_dict(), self.level_plan(lower, round_number))
                                     for lower in below])

    def configure_round(self, round_number: int, agents: Sequence[AgentRecord], rng: random.Random) -> RoundPlan:
        plan = RoundPlan()
        for agent in select_fraction(agents, self.config.fraction, rng):
            level = self.choose_level(agent, rng, round_number)
            if level is None:
                smallest = self.levels[-1]
                plan.skipped.append(Skip(agent.agent_id, f"no level fits its memory ({agent.budget()} bytes < "
                                                         f"{self.cost(smallest, round_number)} bytes for level "
                                                         f"{smallest.name})"))
                continue
            plan.tasks.append(TaskPlan(agent.agent_id, level.name, level.spec, self.level_plan(level, round_number),
                                       self.group_of(level), self.ladder(level, round_number)))
        return plan

    def level_of(self, spec: SubmodelSpec) -> str | None:
        return next((level.name for level in self.levels if level.spec == spec.unrolled()), None)

    def eval_targets(self) -> dict[str, EvalTarget]:
        targets = {level.name: EvalTarget(self.group_of(level), level.spec) for level in self.levels}
        targets["global"] = EvalTarget(self.group_of(self.levels[0]), self.global_spec(), store_bn=True)
        return targets

    def plan_for_budget(self, budget: int) -> dict[str, Any]:
        """The level ``fix`` assignment gives a device with ``budget`` bytes, and its training memory."""
        fitting = affordable(self.levels, budget, self.cost)
        if not fitting:
            return self.nothing_fits(min(self.cost(level) for level in self.levels))
        return {"trains": fitting[0].name, "spec": fitting[0].spec.describe(), "train_bytes": self.cost(fitting[0])}

    def largest_whole_model(self) -> str | None:
        return self.levels[0].name

    def setting_to_shrink(self) -> str:
        return f"a smaller last width in levels (now {self.config.levels[-1]:g})"

    def describe(self) -> list[dict[str, Any]]:
        """Per level: name, spec, parameters, FLOPs, estimated training memory at the recipe's batch size (with the
        plan of the last round, e.g. distilling after a warm-up), and the level's own figures."""
        size = self.context.input_size
        return [{"name": level.name, "spec": level.spec.describe(), "params": self.family.param_count(level.spec),
                 "macs": self.family.flops(level.spec, size), "train_bytes": self.cost(level, self.config.rounds),
                 **level.info} for level in self.levels]
