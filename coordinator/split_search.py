"""ScaleFL's two-dimensional split search (Eq. 1): the most balanced depth and width ratios for a target cost.

For a level with target cost ratio ``r`` and tolerance ``eps``, find the depth ratio ``s_d`` and width ratio
``s_w`` that are as equal as possible (``min |s_d - s_w|``) subject to
``|cost(split(M; s_d, s_w)) / (r * cost(M)) - 1| <= eps``, by grid search over both ratios in steps of ``step``.
Depth ``s_d`` keeps ``floor(s_d * N)`` of the ``N`` body blocks (an early exit follows the last kept one); the
width keeps ``floor(s_w * channels)`` of every hidden layer.

:func:`search_split` is the search itself over any cost function (tests give it a hand-built table);
:func:`search_levels` runs it for every level of a model family, lowest level first, so that each level
keeps the exits of the levels below it (its own at least as deep) and its cost counts them. Widths are free, as
in Eq. 1: a lower level is nested in a higher one (and can serve as its fallback) where its width is not larger. A level may keep every block (``s_d = 1``): its last output is then the final head at its width.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from models import ModelFamily, SubmodelSpec

__all__ = ["NoSplitError", "Split", "search_levels", "search_split"]

_SNAP = 1e-9


class NoSplitError(ValueError):
    """No split on the grid meets a level's target within its tolerance."""


@dataclass(frozen=True)
class Split:
    """One level's split: ratios, the blocks kept (its exit follows block ``blocks - 1``), cost and cost ratio."""

    s_d: float
    s_w: float
    blocks: int
    cost: float
    ratio: float


def _grid(step: float) -> list[float]:
    count = round(1.0 / step)
    if count < 1 or abs(count * step - 1.0) > 1e-6:
        raise ValueError(f"the grid step must divide 1 (e.g. 0.01), got {step!r}")
    return [round(i * step, 10) for i in range(1, count + 1)]


def _blocks_of(s_d: float, num_blocks: int) -> int:
    return math.floor(s_d * num_blocks + _SNAP)


def search_split(
    cost: Callable[[int, float], float],
    num_blocks: int,
    full_cost: float,
    target: float,
    tolerance: float,
    *,
    step: float = 0.01,
    above: Split | None = None,
    allowed_blocks: Sequence[int] | None = None,
) -> Split:
    """The most balanced split whose cost is within ``tolerance`` of ``target * full_cost`` (Eq. 1).

    Parameters
    ----------
    cost:
        ``cost(blocks, s_w)``: cost of the model cut after ``blocks`` blocks at width ``s_w``.
    num_blocks:
        ``N``, the body blocks of the full model.
    full_cost, target, tolerance:
        ``cost(M)``, ``r_l`` and ``eps_l``.
    step:
        Grid step of both ratios.
    above:
        The split of the level below: this one must keep at least as many blocks, so that it holds the lower
        level's exits (Eq. 3-4: the level-``j`` model has the exits of every level ``i <= j``).
    allowed_blocks:
        The block counts a split may keep (default all ``1..N``); e.g. those after which an exit may sit.

    Ties on ``|s_d - s_w|`` go to the cost nearest the target, then to the deeper split. Raises
    :class:`NoSplitError` when nothing on the grid meets the tolerance.
    """
    grid = _grid(step)
    goal = target * full_cost
    best: tuple[tuple[float, float, int], Split] | None = None
    for blocks in range(1, num_blocks + 1):
        depths = [s for s in grid if _blocks_of(s, num_blocks) == blocks]
        if not depths or (above is not None and blocks < above.blocks) or (
                allowed_blocks is not None and blocks not in allowed_blocks):
            continue
        for s_w in grid:
            value = cost(blocks, s_w)
            error = abs(value / goal - 1.0)
            if error > tolerance + _SNAP:
                continue
            s_d = min(depths, key=lambda s: (abs(s - s_w), s))
            key = (round(abs(s_d - s_w), 9), error, -blocks)
            if best is None or key < best[0]:
                best = (key, Split(s_d, s_w, blocks, value, value / full_cost))
    if best is None:
        raise NoSplitError(f"no split on the {step:g} grid has a cost within {tolerance:.0%} of {target:g} of the "
                           f"global model's")
    return best[1]


@dataclass(frozen=True)
class LevelSplit:
    """A searched level: its split and its sub-model spec (exits of the levels below included)."""

    target: float
    tolerance: float
    split: Split
    spec: SubmodelSpec


def _with_exit(exits: tuple[int, ...], blocks: int, num_blocks: int) -> tuple[int, ...]:
    """The exits of a level cut after ``blocks`` blocks: those below it and one after its last block (none at full
    depth, where the final head is the last output)."""
    if blocks == num_blocks or blocks - 1 in exits:
        return exits
    return (*exits, blocks - 1)


class _CostModel:
    """Fast ``cost(blocks, s_w, exits)`` of a family's floor-rounded sub-models: per-layer costs per width, summed
    over the kept blocks (prefix sums), the exits and, at full depth, the final head."""

    def __init__(self, family: ModelFamily, metric: str, input_size: tuple[int, int]) -> None:
        self.family, self.metric, self.input_size = family, metric, input_size
        self._tables: dict[float, tuple[list[float], dict[int, float], float]] = {}

    def _table(self, s_w: float) -> tuple[list[float], dict[int, float], float]:
        table = self._tables.get(s_w)
        if table is None:
            spec = SubmodelSpec(width=s_w, rounding="floor", exits=self.family.exit_points)
            per_block = [0.0] * self.family.num_blocks
            exits: dict[int, float] = {}
            head = 0.0
            for decl, params, macs in self.family.layer_costs(spec, self.input_size if self.metric == "flops"
                                                              else None):
                value = float(params if self.metric == "params" else macs)
                if decl.exit is not None:
                    exits[decl.exit] = exits.get(decl.exit, 0.0) + value
                elif decl.block is not None:
                    per_block[decl.block] += value
                else:
                    head += value
            prefix = [0.0]
            for value in per_block:
                prefix.append(prefix[-1] + value)
            table = (prefix, exits, head)
            self._tables[s_w] = table
        return table

    def __call__(self, blocks: int, s_w: float, exits: Sequence[int]) -> float:
        prefix, exit_costs, head = self._table(s_w)
        total = prefix[blocks] + sum(exit_costs[b] for b in exits)
        return total + head if blocks == self.family.num_blocks else total


def search_levels(family: ModelFamily, ratios: Sequence[float], tolerances: Sequence[float], *,
                  metric: str = "params", input_size: tuple[int, int] = (28, 28), step: float = 0.01,
                  max_rounds: int = 10) -> list[LevelSplit]:
    """ScaleFL's levels for ``family``: one split per target ratio (smallest first, the last 1: the full model).

    ``cost(M)`` is the global model as the top level trains it, early exits included, so every level's ratio is
    of the same model; since the exits depend on the splits, the search repeats until the exits settle
    (at most ``max_rounds`` times). A level below the top that is cut keeps an exit after its last block, and
    every level keeps the exits of the levels below it.
    """
    if metric not in ("params", "flops"):
        raise ValueError(f"the split cost must be 'params' or 'flops', got {metric!r}")
    if not ratios or abs(ratios[-1] - 1.0) > 1e-9:
        raise ValueError(f"the last target ratio must be 1 (the full model), got {list(ratios)}")
    costs = _CostModel(family, metric, input_size)
    n = family.num_blocks
    allowed = [b + 1 for b in family.exit_points] + [n]
    exits: tuple[int, ...] = ()
    levels: list[LevelSplit] = []
    for _ in range(max_rounds):
        full = costs(n, 1.0, exits)
        levels = []
        found: list[int] = []
        previous: Split | None = None
        for target, tolerance in zip(ratios[:-1], tolerances[:-1]):
            lower = tuple(found)

            def level_cost(blocks: int, s_w: float, lower: tuple[int, ...] = lower) -> float:
                return costs(blocks, s_w, _with_exit(lower, blocks, n))

            split = search_split(level_cost, n, full, target, tolerance, step=step, above=previous,
                                 allowed_blocks=allowed)
            found = list(_with_exit(lower, split.blocks, n))
            spec = SubmodelSpec(width=split.s_w, rounding="floor", depth=split.blocks if split.blocks < n else None,
                                exits=tuple(found))
            levels.append(LevelSplit(target, tolerance, split, spec))
            previous = split
        top = Split(1.0, 1.0, n, full, 1.0)
        levels.append(LevelSplit(1.0, tolerances[-1], top, SubmodelSpec(rounding="floor", exits=tuple(found))))
        if tuple(found) == exits:
            return levels
        exits = tuple(found)
    return levels
