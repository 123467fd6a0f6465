"""Training speeds of simulated devices (``--speeds``): tiers of a fleet that train f times slower than this machine.

A Raspberry Pi 4 trains about ten times slower than a Jetson; a simulated fleet trains every task at this machine's
speed unless told otherwise. ``--speeds 1,3,10`` gives the fleet's devices slowdown factors: a device of factor f
trains its task here, then its agent holds the update back (f - 1) times the seconds its task took (decision and
training, as measured) before it sends it (``AgentConfig.slowdown``, ``edge_agent.holdback``): f times its compute, in wall time, without holding one
of the simulator's shared training slots meanwhile.

How factors map to devices follows the budget tiers, so that slow devices are a tier of the fleet, not a random
draw: the devices are taken in the order of their budget tier (the scenario's order, weakest first in every named
scenario: ``tiers`` weak, medium, strong; ``fair`` 1/6 ... 1), by index within a tier. With as many factors as the
scenario has tiers, tier i's devices all train at factor i (``--budgets fair --speeds 10,5,2,1``: the 1/6-width
quarter ten times slower than the full-width one); otherwise the devices, in that order, are split into one equal
contiguous share per factor (counted as the tiers are, largest remainders first). A device's tier is the one
``fedfit.sim.budgets.assign_tiers`` gives it, whichever algorithm runs (FedAvg's devices, which get no budget,
included), so every method of a comparison runs on the same slow and fast devices.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from fedfit.sim.budgets import Tier, assign_tiers, scenario_tiers


def parse_speeds(text: str) -> tuple[float, ...]:
    """The factors of ``--speeds F,G,...``, each a number of at least 1; ValueError (one sentence) otherwise."""
    parts = [part.strip() for part in text.split(",")]
    if not text.strip() or not all(parts):
        raise ValueError(f"--speeds takes slowdown factors separated by commas, each at least 1 (e.g. 1,3,10), got "
                         f"{text!r}")
    factors = []
    for part in parts:
        try:
            factor = float(part)
        except ValueError:
            factor = math.nan
        if not math.isfinite(factor) or factor < 1:
            raise ValueError(f"--speeds: every factor is a number of at least 1 (1: this machine's speed, 10: ten "
                             f"times slower), got {part!r}")
        factors.append(factor)
    return tuple(factors)


def speeds_text(factors: Sequence[float]) -> str:
    """``1,3,10``: factors as ``--speeds`` takes them."""
    return ",".join(f"{factor:g}" for factor in factors)


def _shares(count: int, parts: int) -> list[int]:
    """``count`` split into ``parts`` equal whole shares, the remainder to the first ones (largest remainders, as
    :func:`fedfit.sim.budgets.assign_tiers` counts)."""
    return [count // parts + (1 if i < count % parts else 0) for i in range(parts)]


def device_speeds(factors: Sequence[float], count: int, scenario: str, seed: int) -> list[float]:
    """Each of ``count`` devices' slowdown factor (see the module docstring): by budget tier of ``scenario`` (as
    assigned with ``seed``) when there are as many ``factors`` as tiers, else equal contiguous shares of the devices
    in tier order. ValueError for no factors or an unknown scenario."""
    if not factors:
        raise ValueError("--speeds names no factor")
    tiers: list[Tier] = scenario_tiers(scenario)
    place = {id(tier): position for position, tier in enumerate(tiers)}  # (widths:1,1 has two equal tiers)
    ranks = [place[id(tier)] for tier in assign_tiers(count, tiers, seed)]
    if len(factors) == len(tiers):
        return [factors[rank] for rank in ranks]
    order = sorted(range(count), key=lambda index: (ranks[index], index))
    speeds = [1.0] * count
    position = 0
    for factor, share in zip(factors, _shares(count, len(factors))):
        for index in order[position:position + share]:
            speeds[index] = factor
        position += share
    return speeds


def speeds_line(speeds: Sequence[float], scenario: str, seed: int) -> str:
    """What ``fedfit sim`` says at its start: how many devices of which budget tiers train at each factor."""
    tiers_in_order = [tier.name for tier in scenario_tiers(scenario)]
    names = [tier.name for tier in assign_tiers(len(speeds), scenario_tiers(scenario), seed)]
    groups = []
    for factor in sorted(set(speeds)):
        present = {name for name, speed in zip(names, speeds) if speed == factor}
        tiers = [name for name in dict.fromkeys(tiers_in_order) if name in present]
        count = sum(1 for speed in speeds if speed == factor)
        groups.append(f"x{factor:g}: {count} device{'s' * (count > 1)} ({', '.join(tiers)})")
    return ("training speeds (a device of factor f takes f times this machine's time for a task): "
            + ", ".join(groups))
