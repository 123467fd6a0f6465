"""HeteroFL (Diao et al., ICLR 2021): nested width-sliced sub-models of one global model."""

from __future__ import annotations

from typing import Any

from coordinator.levels import Level
from coordinator.strategies.base import Strategy


class HeteroFL(Strategy):
    """Each agent trains the prefix slice of its level ('fix' or 'dynamic'); all share one global model."""

    name = "heterofl"

    def groups(self) -> list[str]:
        return ["global"]

    def group_of(self, level: Level) -> str:
        return "global"

    def adaptation_hint(self) -> dict[str, Any]:
        """Nested levels: an agent short of memory trains the next smaller level that fits."""
        return {"kind": "width-levels", "rates": [level.rate for level in self.levels]}
