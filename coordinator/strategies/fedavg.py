"""FedAvg / All-Large baseline: every selected agent trains the full model, whatever its memory."""

from __future__ import annotations

import random

from coordinator.levels import Level
from coordinator.registry import AgentRecord
from coordinator.strategies.base import EvalTarget
from coordinator.strategies.leveled import LevelStrategy
from models import SubmodelSpec


class FedAvg(LevelStrategy):
    """The memory-ignoring upper reference; only the full model exists."""

    name = "fedavg"
    adapts = False

    def make_levels(self) -> list[Level]:
        return [Level("a", SubmodelSpec.full(), {"rate": 1.0})]

    def choose_level(self, agent: AgentRecord, rng: random.Random, round_number: int) -> Level | None:
        return self.levels[0]

    def eval_targets(self) -> dict[str, EvalTarget]:
        full = self.levels[0]
        return {full.name: EvalTarget("global", full.spec), "global": EvalTarget("global", full.spec, store_bn=True)}
