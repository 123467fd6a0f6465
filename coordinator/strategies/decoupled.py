"""Decoupled baseline: one separate model per level, trained only by that level's agents."""

from __future__ import annotations

from coordinator.levels import Level
from coordinator.strategies.base import Strategy


class Decoupled(Strategy):
    """Same level planning as HeteroFL, but no aggregation across levels; the global model is level a's."""

    name = "decoupled"

    def groups(self) -> list[str]:
        return [level.name for level in self.levels]

    def group_of(self, level: Level) -> str:
        return level.name
