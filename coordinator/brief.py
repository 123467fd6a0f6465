"""What a method tells whoever runs it, outside the round loop: the model the fleet's budgets are measured against,
what it hands each tier of a fleet and the start-of-run statement that says so, and the settings a run's report
states. The simulator asks here (`Coordinator.brief`) instead of reading the coordinator's strategy, family,
config or dataset.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from coordinator.config import CoordinatorConfig
from coordinator.serving import TierService, largest_needs, serve_tiers, service_lines
from coordinator.strategies.base import Strategy, base_plan
from models import ModelFamily, SubmodelSpec
from protocol import TrainingPlan

__all__ = ["MethodBrief", "PlainTraining"]


@dataclass(frozen=True)
class PlainTraining:
    """The full model as budgets are measured against it: its ``family``, the recipe's ``plan`` (its optimizer and
    batch size) and the dataset's ``input_size``."""

    family: ModelFamily
    plan: TrainingPlan
    input_size: tuple[int, int]


class MethodBrief:
    """The method of one coordinator, as told to whoever runs it (see the module docstring)."""

    def __init__(self, config: CoordinatorConfig, strategy: Strategy, family: ModelFamily,
                 input_size: tuple[int, int]) -> None:
        self._config = config
        self._strategy = strategy
        self._family = family
        self._input_size = input_size

    def plain_training(self) -> PlainTraining:
        """The full model trained by the recipe, what a fleet's budgets are measured against."""
        return PlainTraining(self._family, base_plan(self._config.recipe), self._input_size)

    def largest_task_bytes(self) -> int:
        """The device need of the largest task the method hands out (what an unbounded budget is handed; the full
        model trained plainly where the method names none)."""
        needs = largest_needs(self._strategy)
        if needs is not None:
            return needs
        plain = self.plain_training()
        return self._strategy.training_cost(SubmodelSpec.full(), plain.plan)

    def serve(self, tiers: Sequence[tuple[str, int, int]]) -> list[TierService]:
        """Per ``(tier name, budget bytes, devices)``: what the method hands a device of it, by the device's rule."""
        return serve_tiers(self._strategy, tiers)

    def statement(self, services: Sequence[TierService]) -> list[str]:
        """The start-of-run statement for a fleet served so (:meth:`serve`); for a fleet without budgets, the one
        model every device trains."""
        method = self._config.algorithm
        if not services:
            return [f"{method} ignores memory budgets: every device trains {self._strategy.describe()[0]['spec']}"]
        return service_lines(method, services, self._strategy.largest_whole_model(), largest_needs(self._strategy))

    def report_settings(self) -> dict[str, Any]:
        """What a run's report states of the method: its levels (largest first) and whether it masks the loss."""
        return {"levels": [entry["name"] for entry in self._strategy.describe()],
                "masked_ce": self._strategy.masked_ce}
