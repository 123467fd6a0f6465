"""Memory budgets of simulated devices, in the papers' terms, with one anchor for every method.

The anchor is the full model trained with plain cross-entropy at the recipe's batch size, without exits, under the
agents' allocator (:class:`BudgetAnchor`): the same for every strategy, so that "the same fleet" means the same
devices whatever method runs on it. A strategy whose largest task costs more (ScaleFL's exits and distillation)
must fit inside these budgets.

Two kinds of tier:

- **Width tiers** (``widths:A,B,...``; FeDepth's scenarios ``fair`` {1/6, 1/3, 1/2, 1}, ``lack`` {1/8, 1/6,
  1/2, 1} and ``surplus`` {1/6, 1/3, 1/2, 2} are aliases, a quarter of the fleet each): a device of tier r < 1
  can train the r-width model of the family (uniform width r, plain cross-entropy, the recipe's batch size) and
  no more, as FeDepth defines its tiers. Its budget is the estimate of that training with the agent's initial
  calibration margin and the runtime's fixed overhead included, exactly what the agent's own check asks for, so
  the device admits that model (with plain cross-entropy or HeteroFL's masked one, whichever the estimate finds
  dearer: they differ by a few KB of logits at most). r = 1 admits the full model the same way; r > 1 holds r
  times the full model's training memory (its model-dependent part, with the margin): room for m-FeDepth's
  copies.
- **Share tiers** (``uniform``, ``tiers``, ``tiers-fluctuating``, ``fractions:A,B,...``): the fixed overhead plus a
  share of the full model's model-dependent training memory as estimated (no margin): ``uniform`` 110% for all;
  ``tiers`` weak / medium / strong, 40 / 30 / 30% of the fleet, with 35 / 60 / 110% (FlexFL's setting);
  ``tiers-fluctuating`` the same, and every round each device has r = r_M - |u|, u ~ N(0, sigma^2) percentage
  points (FlexFL: sigma^2 in {5, 8, 10}; the coordinator learns the new figure from the device's next status, so
  the device adapts at task time); methods are sized and planned for the budget such a device has in all but its
  rarest rounds (:func:`dependable_bytes`; ``--size-for typical``: in its median round); ``fractions:A,B,...``
  one equal share of the fleet per fraction.

Every budget is rounded up to a whole number of :data:`BUDGET_GRANULE` (64 KiB): a measured CPU peak moves by about
0.3 MB between identical runs, so a budget finer than that means nothing, while the next width up, megabytes away,
still does not fit.

Real memory has parts that do not shrink with width (the input batch, the classifier's rows, page-sized blocks),
so the r-width model needs more than r times the full model's memory: a width tier is not the fraction r.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from common.device_need import INITIAL_FACTOR, corrected
from protocol import LossTerm, TrainingPlan

if TYPE_CHECKING:  # the models (and torch) load only where an anchor is estimated: `fedfit agent` parses no budget
    from models import ModelFamily, SubmodelSpec

#: sigma^2 of ``tiers-fluctuating`` unless ``--budget-variance`` says otherwise (FlexFL's largest).
DEFAULT_VARIANCE = 10.0
#: A fluctuating device's methods are sized (``auto``) and planned for the budget it has in all but its rarest
#: rounds: its shortfall |u| exceeds this many sigmas in 4.6% of rounds. Sized for its budget before fluctuation,
#: a model that just fits it fits in no round, since the shortfall is never negative.
DEPENDABLE_SIGMAS = 2.0
#: ``--size-for typical``: sized for the budget of a device's median round instead (|u| exceeds this many sigmas
#: in half the rounds); in a round below it the device takes its task down its own ladder, or declines it.
TYPICAL_SIGMAS = 0.6745
#: What a fluctuating fleet's methods are sized for (``--size-for``): the shortfall, in sigmas, of the budget used.
SIZE_FOR = {"dip": DEPENDABLE_SIGMAS, "typical": TYPICAL_SIGMAS}
#: Budgets are whole multiples of this (see the module docstring).
BUDGET_GRANULE = 64 * 1024
#: The named scenarios (``widths:A,B,...`` and ``fractions:A,B,...`` are accepted too, see :func:`scenario_tiers`).
BUDGET_SCENARIOS = ("uniform", "tiers", "tiers-fluctuating", "fair", "lack", "surplus")
#: FeDepth's scenarios (Memory budgets paragraph): the width each quarter of the fleet can train.
FEDEPTH_SCENARIOS = {"fair": (1 / 6, 1 / 3, 1 / 2, 1.0), "lack": (1 / 8, 1 / 6, 1 / 2, 1.0),
                     "surplus": (1 / 6, 1 / 3, 1 / 2, 2.0)}


@dataclass(frozen=True)
class Tier:
    """A class of devices and its share of the fleet: either ``width`` (it can train the r-width model; r > 1:
    r times the full model's memory) or ``percent`` (a share of the full model's training memory)."""

    name: str
    share: float
    percent: float | None = None
    width: float | None = None


DEFAULT_TIERS = (Tier("weak", 0.4, percent=35.0), Tier("medium", 0.3, percent=60.0),
                 Tier("strong", 0.3, percent=110.0))
UNIFORM_TIER = Tier("uniform", 1.0, percent=110.0)


@dataclass(frozen=True)
class BudgetAnchor:
    """What budgets are measured against (bytes): the runtime's fixed ``overhead``, the model-dependent part of
    the full model's estimated training memory with plain cross-entropy (``full_bytes``, the share tiers' 100%),
    the agents' initial calibration ``margin``, and ``width_bytes(r)``, the model-dependent part for training the
    r-width model with plain or masked cross-entropy, whichever needs more (a width tier trains its width with
    either; they differ by a few KB of logits)."""

    overhead: int
    full_bytes: int
    width_bytes: Callable[[float], int]
    margin: float = INITIAL_FACTOR

    @classmethod
    def estimate(cls, family: ModelFamily, plan: TrainingPlan, *, input_size: tuple[int, int],
                 allocator: str = "pooled", margin: float = INITIAL_FACTOR, device: str = "cpu") -> BudgetAnchor:
        """The anchor of ``family`` trained with ``plan``'s optimizer and batch size (its loss replaced by plain
        cross-entropy, one copy, no stages) on ``input_size`` images under ``allocator`` on ``device`` ("cuda":
        budgets in GPU memory, the CUDA allocator's figures)."""
        from models import SubmodelSpec, estimate_plan_memory

        plain = replace(plan, loss=(LossTerm.ce(),), copies=1, schedule=())
        masked = replace(plain, loss=(LossTerm.ce(masked=True),))

        def variable(spec: SubmodelSpec, loss_plan: TrainingPlan) -> tuple[int, int]:
            estimate = estimate_plan_memory(family, spec, loss_plan, input_size=input_size, allocator=allocator,
                                            device=device)
            return estimate.overhead, estimate.total - estimate.overhead

        def width_bytes(width: float) -> int:  # the r-width model with either loss a plain model trains with
            spec = SubmodelSpec.uniform(width)
            return max(variable(spec, plain)[1], variable(spec, masked)[1])

        overhead, full = variable(SubmodelSpec.full(), plain)
        return cls(overhead, full, width_bytes, margin)

    def tier_bytes(self, tier: Tier, shortfall: float = 0.0) -> int:
        """The budget of a device of ``tier``, in whole :data:`BUDGET_GRANULE`; ``shortfall``: percentage points
        it lacks this round (share tiers only)."""
        if tier.width is not None:
            if tier.width <= 1:
                exact = corrected(self.overhead + self.width_bytes(tier.width), self.overhead, self.margin)
            else:
                exact = self.overhead + int(tier.width * self.width_bytes(1.0) * self.margin)
        else:
            assert tier.percent is not None
            exact = self.overhead + max(1, int(self.full_bytes * (tier.percent - shortfall) / 100.0))
        return -(-exact // BUDGET_GRANULE) * BUDGET_GRANULE


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
    anchor: BudgetAnchor
    variance: float
    seed: int

    def __call__(self, round_number: int) -> int:
        shortfall = 0.0
        if self.variance > 0 and self.tier.percent is not None:
            shortfall = abs(random.Random(f"{self.seed}:{round_number}").gauss(0.0, math.sqrt(self.variance)))
        return self.anchor.tier_bytes(self.tier, shortfall)

    def dependable(self) -> int:
        """The budget this device has in all but its rarest rounds (:func:`dependable_bytes`)."""
        return dependable_bytes(self.anchor, self.tier, self.variance)

    def sized_for(self, size_for: str) -> int:
        """The budget this device's methods are sized and planned for (:func:`dependable_bytes`)."""
        return dependable_bytes(self.anchor, self.tier, self.variance, size_for)


def dependable_bytes(anchor: BudgetAnchor, tier: Tier, variance: float, size_for: str = "dip") -> int:
    """The budget a device of ``tier`` has in all but its rarest rounds when its share fluctuates with
    ``variance`` (its budget less :data:`DEPENDABLE_SIGMAS` sigmas; ``size_for`` ``typical``: in half its rounds,
    :data:`TYPICAL_SIGMAS`); its budget when it does not fluctuate."""
    if size_for not in SIZE_FOR:
        raise ValueError(f"--size-for is {' or '.join(SIZE_FOR)}, got {size_for!r}")
    fluctuates = variance > 0 and tier.percent is not None
    return anchor.tier_bytes(tier, SIZE_FOR[size_for] * math.sqrt(variance) if fluctuates else 0.0)


def scenario_variance(scenario: str, variance: float = DEFAULT_VARIANCE) -> float:
    """The fluctuation of ``scenario``'s budgets: ``variance`` for ``tiers-fluctuating``, else none."""
    return variance if scenario == "tiers-fluctuating" else 0.0


def fraction_name(value: float) -> str:
    """``1/6``, ``0.3`` or ``2``: a fraction as the scenarios write it."""
    for denominator in (1, 2, 3, 4, 6, 8, 16):
        if abs(value * denominator - round(value * denominator)) < 1e-9:
            numerator = round(value * denominator)
            return f"{numerator}" if denominator == 1 else f"{numerator}/{denominator}"
    return f"{value:g}"


def parse_fractions(text: str, option: str = "fractions") -> tuple[float, ...]:
    """The numbers of ``fractions:A,B,...`` or ``widths:A,B,...`` (decimals or ``p/q``), each positive;
    ValueError (one sentence) otherwise."""
    values: list[float] = []
    for part in text.split(","):
        try:
            numerator, _, denominator = part.strip().partition("/")
            value = float(numerator) / float(denominator) if denominator else float(numerator)
        except (ValueError, ZeroDivisionError):
            value = math.nan
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"--budgets {option}: needs positive numbers or p/q with q > 0, e.g. "
                             f"{option}:1/6,1/3,1/2,1; got {part.strip()!r}")
        values.append(value)
    return tuple(values)


def scenario_tiers(scenario: str) -> list[Tier]:
    """The tiers of a scenario (each with its share of the fleet); ValueError (one sentence) for an unknown one."""
    if scenario == "uniform":
        return [UNIFORM_TIER]
    if scenario in ("tiers", "tiers-fluctuating"):
        return list(DEFAULT_TIERS)
    kind, _, listed = scenario.partition(":")
    if scenario in FEDEPTH_SCENARIOS or kind == "widths":
        widths = FEDEPTH_SCENARIOS.get(scenario) or parse_fractions(listed, "widths")
        return [Tier(f"r={fraction_name(w)}", 1 / len(widths), width=w) for w in widths]
    if kind == "fractions":
        fractions = parse_fractions(listed)
        return [Tier(f"{fraction_name(f)} of full", 1 / len(fractions), percent=100.0 * f) for f in fractions]
    raise ValueError(f"--budgets must be one of {', '.join(BUDGET_SCENARIOS)}, widths:A,B,... or fractions:A,B,..., "
                     f"got {scenario!r}")


def smallest_width(scenario: str) -> float | None:
    """The narrowest width every device of a width scenario can train (FedAvg x min r); None for share tiers."""
    widths = [tier.width for tier in scenario_tiers(scenario) if tier.width is not None]
    return min(min(widths), 1.0) if widths else None


def width_for_all(scenario: str, anchor: BudgetAnchor, widths: Sequence[float],
                  variance: float = DEFAULT_VARIANCE) -> float:
    """The widest uniform width every device of ``scenario`` can train, FedAvg's "smallest" baseline: min r for
    width tiers; for share tiers the largest of ``widths`` whose need (as the agent's check asks, plain
    cross-entropy) fits the weakest tier's budget (in all but its rarest rounds where budgets fluctuate with
    ``variance``), else the smallest of ``widths``."""
    smallest = smallest_width(scenario)
    if smallest is not None:
        return smallest
    fluctuation = scenario_variance(scenario, variance)
    weakest = min(dependable_bytes(anchor, tier, fluctuation) for tier in scenario_tiers(scenario))
    fitting = [width for width in widths
               if corrected(anchor.overhead + (anchor.full_bytes if width >= 1 else anchor.width_bytes(width)),
                            anchor.overhead, anchor.margin) <= weakest]
    return max(fitting) if fitting else min(widths)


def device_budgets(scenario: str, count: int, anchor: BudgetAnchor, seed: int,
                   variance: float = DEFAULT_VARIANCE) -> list[DeviceBudget]:
    """Budget schedules for ``count`` devices under ``scenario``; ValueError for an unknown one."""
    tiers_of_scenario = scenario_tiers(scenario)
    if variance < 0:
        raise ValueError(f"the budget variance must be non-negative, got {variance}")
    tiers = assign_tiers(count, tiers_of_scenario, seed)
    fluctuation = scenario_variance(scenario, variance)
    return [DeviceBudget(tier, anchor, fluctuation, seed * 100_003 + index) for index, tier in enumerate(tiers)]
