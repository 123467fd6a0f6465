"""The ``secure_aggregation`` section."""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["SecureAggregationConfig"]


@dataclass
class SecureAggregationConfig:
    """The ``secure_aggregation`` section (docs/privacy.md): ``enabled`` makes every round secure; ``phase_s`` is how
    long each exchange after training waits for the devices (the roster's shares, the masked uploads once relayed,
    the shares given back): the adverts close ``2 * phase_s`` before the round's deadline at the latest."""

    enabled: bool = False
    phase_s: float = 30.0

    def validate(self, round_timeout_s: float, round_mode: str, privacy_mode: str, weighting: str,
                 min_agents: int) -> None:
        """Raises ValueError with one clear sentence."""
        if not self.enabled:
            return
        if min_agents < 3:
            raise ValueError(f"secure_aggregation needs min_agents of at least 3 (got {min_agents}): with fewer, one "
                             f"device could read another's update from their sum")
        if not (math.isfinite(self.phase_s) and self.phase_s > 0):
            raise ValueError(f"secure_aggregation.phase_s must be positive seconds, got {self.phase_s}")
        if round_timeout_s <= 3 * self.phase_s:
            raise ValueError(f"secure_aggregation needs round_timeout_s above 3 x secure_aggregation.phase_s "
                             f"({3 * self.phase_s:g} s): training, the shares and the masked uploads share the "
                             f"round's time")
        if round_mode != "sync":
            raise ValueError("secure_aggregation needs round_mode: sync: a buffered round folds updates of earlier "
                             "rounds, whose masks were agreed among other devices")
        if privacy_mode != "off":
            raise ValueError("secure_aggregation cannot be combined with privacy.mode yet: the coordinator would add "
                             "its noise to sums it never sees in the clear (distributed noise is not built)")
        if weighting != "uniform":
            raise ValueError("secure_aggregation needs weighting: uniform: the coordinator only learns each "
                             "coordinate's sum and count, so every update weighs 1")
