"""Memory budgets of simulated devices, as fractions of the full model's training memory.

A budget is the runtime's fixed overhead (the memory any torch training run takes, whatever the model) plus
the percentage of the model-dependent part (parameters, gradients, optimizer state, activations, workspace)
of training the full model. Without the fixed part, a 35% device could not even start the runtime, which is
not what FlexFL's percentages of the model size describe.

- ``uniform``: every device can just train the full model (110%).
- ``tiers``: weak / medium / strong devices, 40 / 30 / 30% of the fleet, with 35 / 60 / 110% (FlexFL's setting).
- ``tiers-fluctuating``: the same tiers, and every round each device has r = r_M - |u|, u ~ N(0, sigma^2)
  percentage points (FlexFL: sigma^2 in {5, 8, 10}); the coordinator only learns the new figure from the
  device's next status, so the device must adapt at task time.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

BUDGET_SCENARIOS = ("uniform", "tiers", "tiers-fluctuating")


@dataclass(frozen=True)
class Tier:
    """A class of devices: its share of the fleet and its memory as a percentage of the full model's."""

    name: str
    share: float
    percent: float


DEFAULT_TIERS = (Tier("weak", 0.4, 35.0), Tier("medium", 0.3, 60.0), Tier("strong", 0.3, 110.0))
UNIFORM_TIER = Tier("uniform", 1.0, 110.0)


def assign_tiers(count: int, tiers: Sequence[Tier], seed: int) -> list[Tier]:
    """Each device's tier: counts by share (largest remainders), order shuffled by ``seed``."""
    exact = [tier.share * count for tier in tiers]
    counts = [math.floor(value) for value in exact]
    by_remainder = sorted(range(len(tiers)), key=lambda i: exact[i] - counts[i], reverse=True)
    for i in by_remainder[: count - sum(counts)]:
        counts[i] += 1
    assigned = [tier for tier, n in zip(tiers, counts) for _ in range(n)]
    random.Random(seed).shuffle(assigned)
    return assigned


@dataclass(frozen=True)
class DeviceBudget:
    """One simulated device's memory budget per round."""

    tier: Tier
    full_model_bytes: int
    variance: float
    seed: int
    fixed_bytes: int = 0

    def __call__(self, round_number: int) -> int:
        percent = self.tier.percent
        if self.variance > 0:
            rng = random.Random(f"{self.seed}:{round_number}")
            percent -= abs(rng.gauss(0.0, math.sqrt(self.variance)))
        return self.fixed_bytes + max(1, int(self.full_model_bytes * percent / 100.0))


def device_budgets(scenario: str, count: int, full_model_bytes: int, seed: int,
                   variance: float = 10.0, fixed_bytes: int = 0) -> list[DeviceBudget]:
    """Budget schedules for ``count`` devices under ``scenario``; ValueError for an unknown one.

    ``full_model_bytes`` is the model-dependent training memory of the full model (the 100% point),
    ``fixed_bytes`` the runtime overhead every device has on top.
    """
    if scenario not in BUDGET_SCENARIOS:
        raise ValueError(f"--budgets must be one of {', '.join(BUDGET_SCENARIOS)}, got {scenario!r}")
    if variance < 0:
        raise ValueError(f"the budget variance must be non-negative, got {variance}")
    tiers = [UNIFORM_TIER] * count if scenario == "uniform" else assign_tiers(count, DEFAULT_TIERS, seed)
    fluctuation = variance if scenario == "tiers-fluctuating" else 0.0
    return [DeviceBudget(tier, full_model_bytes, fluctuation, seed * 100_003 + index, fixed_bytes)
            for index, tier in enumerate(tiers)]
