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
- FeDepth's scenarios, a quarter of the fleet each: ``fair`` {1/6, 1/3, 1/2, 1}, ``lack`` {1/8, 1/6, 1/2, 1}
  (the weakest quarter can train only part of the model), ``surplus`` {1/6, 1/3, 1/2, 2} (the richest can hold
  two copies); ``fractions:A,B,...`` any such list, one equal share of the fleet per fraction.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

#: The named scenarios (``fractions:A,B,...`` is accepted too, see :func:`scenario_tiers`).
BUDGET_SCENARIOS = ("uniform", "tiers", "tiers-fluctuating", "fair", "lack", "surplus")
_FEDEPTH = {"fair": (1 / 6, 1 / 3, 1 / 2, 1.0), "lack": (1 / 8, 1 / 6, 1 / 2, 1.0),
            "surplus": (1 / 6, 1 / 3, 1 / 2, 2.0)}


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
        tier = self.tier
        if self.variance > 0:
            rng = random.Random(f"{self.seed}:{round_number}")
            tier = Tier(tier.name, tier.share, tier.percent - abs(rng.gauss(0.0, math.sqrt(self.variance))))
        return tier_budget(tier, self.full_model_bytes, self.fixed_bytes)


def _fraction_name(value: float) -> str:
    for denominator in (1, 2, 3, 4, 6, 8):
        if abs(value * denominator - round(value * denominator)) < 1e-9:
            numerator = round(value * denominator)
            return f"{numerator}" if denominator == 1 else f"{numerator}/{denominator}"
    return f"{value:g}"


def parse_fractions(text: str) -> tuple[float, ...]:
    """The fractions of ``fractions:A,B,...`` (numbers or ``p/q``), each positive; ValueError otherwise."""
    values: list[float] = []
    for part in text.split(","):
        try:
            numerator, _, denominator = part.strip().partition("/")
            value = float(numerator) / float(denominator) if denominator else float(numerator)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"--budgets fractions must be positive numbers or p/q, e.g. fractions:1/6,1/3,1/2,1; "
                             f"got {part.strip()!r}")
        values.append(value)
    return tuple(values)


def scenario_tiers(scenario: str) -> list[Tier]:
    """The tiers of a scenario (each with its share of the fleet and percentage); ValueError for an unknown one."""
    if scenario == "uniform":
        return [UNIFORM_TIER]
    if scenario in ("tiers", "tiers-fluctuating"):
        return list(DEFAULT_TIERS)
    if scenario in _FEDEPTH or scenario.startswith("fractions:"):
        fractions = _FEDEPTH.get(scenario) or parse_fractions(scenario.partition(":")[2])
        return [Tier(f"r={_fraction_name(f)}", 1 / len(fractions), 100.0 * f) for f in fractions]
    raise ValueError(f"--budgets must be one of {', '.join(BUDGET_SCENARIOS)} or fractions:A,B,..., got {scenario!r}")


def tier_budget(tier: Tier, full_model_bytes: int, fixed_bytes: int = 0) -> int:
    """The memory of a device of ``tier`` when the full model's model-dependent training memory is
    ``full_model_bytes``: the fixed overhead plus the tier's percentage of it."""
    return fixed_bytes + max(1, int(full_model_bytes * tier.percent / 100.0))


def device_budgets(scenario: str, count: int, full_model_bytes: int, seed: int,
                   variance: float = 10.0, fixed_bytes: int = 0) -> list[DeviceBudget]:
    """Budget schedules for ``count`` devices under ``scenario``; ValueError for an unknown one.

    ``full_model_bytes`` is the model-dependent training memory of the full model (the 100% point),
    ``fixed_bytes`` the runtime overhead every device has on top.
    """
    tiers_of_scenario = scenario_tiers(scenario)
    if variance < 0:
        raise ValueError(f"the budget variance must be non-negative, got {variance}")
    tiers = assign_tiers(count, tiers_of_scenario, seed)
    fluctuation = variance if scenario == "tiers-fluctuating" else 0.0
    return [DeviceBudget(tier, full_model_bytes, fluctuation, seed * 100_003 + index, fixed_bytes)
            for index, tier in enumerate(tiers)]
