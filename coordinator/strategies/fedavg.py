"""FedAvg / All-Large baseline: every selected agent trains the full model, whatever its memory."""

from __future__ import annotations

import random

from coordinator.levels import Level
from coordinator.registry import AgentRecord
from coordinator.strategies.base import EvalTarget, Strategy


class FedAvg(Strategy):
    """The memory-ignoring upper reference; only the full model exists."""

    name = "fedavg"

    def groups(self) -> list[str]:
        return ["global"]

    def group_of(self, level: Level) -> str:
        return "global"

    def choose_level(self, agent: AgentRecord, rng: random.Random) -> Level | None:
        return self.levels[0]

    def eval_targets(self) -> dict[str, EvalTarget]:
        full = self.levels[0]
        return {full.name: EvalTarget("global", full.spec), "global": EvalTarget("global", full.spec)}
