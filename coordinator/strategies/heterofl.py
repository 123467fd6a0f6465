"""HeteroFL (Diao et al., ICLR 2021): nested width-sliced sub-models of one global model."""

from __future__ import annotations

from coordinator.levels import Level, width_levels
from coordinator.strategies.leveled import LevelStrategy


class HeteroFL(LevelStrategy):
    """Each agent trains the prefix slice of its level ('fix' or 'dynamic'), hidden channels rounded up; all share
    one global model. An agent short of memory falls to the next smaller level that fits."""

    name = "heterofl"
    masked_ce_by_default = True  # the paper's non-IID setting; a no-op on a device that holds every class

    def make_levels(self) -> list[Level]:
        return width_levels(self.config.levels)
