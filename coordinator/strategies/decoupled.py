"""Decoupled baseline: one separate model per level, trained only by that level's agents."""

from __future__ import annotations

from coordinator.levels import Level, width_levels
from coordinator.strategies.leveled import LevelStrategy


class Decoupled(LevelStrategy):
    """HeteroFL's level planning, but no aggregation across levels (and no falling to another level's model);
    the global model is level a's."""

    name = "decoupled"
    adapts = False

    def make_levels(self) -> list[Level]:
        return width_levels(self.config.levels)

    def groups(self) -> list[str]:
        return [level.name for level in self.levels]

    def group_of(self, level: Level) -> str:
        return level.name
