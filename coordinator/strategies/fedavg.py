"""FedAvg baselines: every selected agent trains the same model whatever its memory: the full one (All-Large, the
memory-ignoring upper reference) or a uniform width every device can afford (``fedavg.width``, e.g. 1/6:
"FedAvg (x 1/6)")."""

from __future__ import annotations

import random
from typing import Any

from coordinator.levels import Level
from coordinator.registry import AgentRecord
from coordinator.strategies.base import EvalTarget
from coordinator.strategies.leveled import LevelStrategy
from models import SubmodelSpec


class FedAvg(LevelStrategy):
    """One model, trained by everyone; it is the global model."""

    name = "fedavg"
    adapts = False

    def make_levels(self) -> list[Level]:
        width = self.config.fedavg.width
        return [Level("a", SubmodelSpec.uniform(width), {"rate": width})]

    def choose_level(self, agent: AgentRecord, rng: random.Random, round_number: int) -> Level | None:
        return self.levels[0]

    def plan_for_budget(self, budget: int) -> dict[str, Any]:
        """The one model, whatever the budget (FedAvg ignores memory), and whether it would fit."""
        level = self.levels[0]
        cost = self.cost(level)
        answer = {"trains": level.name, "spec": level.spec.describe(), "train_bytes": cost, "fits": cost <= budget}
        return answer if cost <= budget else {**answer, "needs_bytes": cost, "to_fit": self.setting_to_shrink()}

    def setting_to_shrink(self) -> str:
        return f"a smaller fedavg.width (now {self.config.fedavg.width:g})"

    def eval_targets(self) -> dict[str, EvalTarget]:
        full = self.levels[0]
        return {full.name: EvalTarget("global", full.spec), "global": EvalTarget("global", full.spec, store_bn=True)}
