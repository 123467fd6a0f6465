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

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from models import ModelFamily, SubmodelSpec

__all__ = ["LevelSplit", "NoSplitError", "Split", "search_levels", "search_split", "split_spec"]

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
    exhaustive: bool = False,
) -> Split:
    """The most balanced split whose cost is within ``tolerance`` of ``target * full_cost`` (Eq. 1).

    Parameters
    ----------
    cost:
        ``cost(blocks, s_w)``: cost of the model cut after ``blocks`` blocks at width ``s_w``. Unless
        ``exhaustive``, it is expected not to decrease as the width grows at a fixed depth (parameters, FLOPs and
        training memory do not, by construction: every tensor of the same graph grows with its channels);
        nothing is assumed across depths (the training memory of a cut model with its exit need not grow with
        the depth: an exit after a high-resolution block can cost more than a deeper one). Every depth is
        visited, the depths nearest the one where the balanced diagonal ``s_w = s_d`` meets the target first,
        and at each the feasible widths are found by bisection within the window that could still beat the best
        split so far; a depth where the widths bisection looked at show the cost falling is scanned whole. The
        result is the one an exhaustive grid search finds (for a cost that falls between the widths bisection
        looked at, ``exhaustive`` guarantees it).
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
    exhaustive:
        Evaluate every width of the window at every depth: for a cost that may decrease as the width grows.

    Ties on ``|s_d - s_w|`` go to the cost nearest the target, then to the deeper split. Raises
    :class:`NoSplitError` when nothing on the grid meets the tolerance.
    """
    grid = _grid(step)
    depths = _open_depths(grid, num_blocks, above, allowed_blocks)
    if not depths:
        raise NoSplitError("no depth on the grid is open to this level")
    search = _GridSearch(cost, grid, step, target * full_cost, tolerance, full_cost, depths, exhaustive)
    # Nearest first the depth where the diagonal crosses the target (for costs that grow with the depth too),
    # so that the best split found early narrows the window of the others; every depth is visited.
    order = sorted(depths)
    crossing = _bisect(len(order), lambda i: search.at(order[i], depths[order[i]][len(depths[order[i]]) // 2])
                       >= search.goal)
    for i in sorted(range(len(order)), key=lambda i: abs(i - crossing + 0.5)):
        search.visit(order[i])
    if search.best is None:
        raise NoSplitError(f"no split on the {step:g} grid has a cost within {tolerance:.0%} of {target:g} of the "
                           f"global model's")
    return search.best[1]


def _open_depths(grid: Sequence[float], num_blocks: int, above: Split | None,
                 allowed_blocks: Sequence[int] | None) -> dict[int, list[int]]:
    """The block counts a split may keep, each with the grid indices of the ``s_d`` that keep it."""
    depths: dict[int, list[int]] = {}
    for index, s_d in enumerate(grid):
        blocks = _blocks_of(s_d, num_blocks)
        if 1 <= blocks <= num_blocks and (above is None or blocks >= above.blocks) and (
                allowed_blocks is None or blocks in allowed_blocks):
            depths.setdefault(blocks, []).append(index)
    return depths


class _GridSearch:
    """One :func:`search_split`: the costs looked at so far (each evaluated once) and the best split found."""

    def __init__(self, cost: Callable[[int, float], float], grid: list[float], step: float, goal: float,
                 tolerance: float, full_cost: float, depths: dict[int, list[int]], exhaustive: bool) -> None:
        self.cost, self.grid, self.step, self.goal = cost, grid, step, goal
        self.low, self.high = goal * (1.0 - tolerance) * (1 - _SNAP), goal * (1.0 + tolerance) * (1 + _SNAP)
        self.full_cost, self.depths, self.exhaustive = full_cost, depths, exhaustive
        self.values: dict[tuple[int, int], float] = {}
        self.best: tuple[tuple[float, float, int], Split] | None = None

    def at(self, blocks: int, index: int) -> float:
        """The cost of the split keeping ``blocks`` blocks at width ``grid[index]``."""
        if (blocks, index) not in self.values:
            self.values[(blocks, index)] = self.cost(blocks, self.grid[index])
        return self.values[(blocks, index)]

    def visit(self, blocks: int) -> None:
        """Update ``best`` with this depth's most balanced feasible width, looking only at the widths that could
        still beat it."""
        feasible, scanned = self._feasible(blocks)
        for s_d in self.depths[blocks] if feasible else ():
            nearest = min(feasible, key=lambda i: (abs(i - s_d), -i)) if scanned else min(
                max(s_d, feasible[0]), feasible[-1])
            candidates = [nearest]
            if scanned:  # equally balanced widths on both sides: the one nearer the goal wins below
                candidates += [i for i in feasible if abs(i - s_d) == abs(nearest - s_d) and i != nearest]
            for index in candidates:
                value = self.at(blocks, index)
                key = (round(abs(self.grid[s_d] - self.grid[index]), 9), abs(value / self.goal - 1.0), -blocks)
                if self.best is None or key < self.best[0]:
                    self.best = (key, Split(self.grid[s_d], self.grid[index], blocks, value, value / self.full_cost))

    def _feasible(self, blocks: int) -> tuple[list[int], bool]:
        """The grid indices of the widths within the tolerance at this depth, in the window that could still beat
        the best split, and whether the window was scanned whole (else bisected: a run of feasible widths)."""
        first, last = self.depths[blocks][0], self.depths[blocks][-1]
        reach = len(self.grid) if self.best is None else round(self.best[0][0] / self.step)
        lo, hi = max(0, first - reach), min(len(self.grid) - 1, last + reach)
        scan = self.exhaustive or self.at(blocks, lo) > self.at(blocks, hi)
        if not scan:
            if self.at(blocks, lo) > self.high or self.at(blocks, hi) < self.low:
                return [], False
            start = lo + _bisect(hi - lo + 1, lambda i: self.at(blocks, lo + i) >= self.low)
            stop = lo + _bisect(hi - lo + 1, lambda i: self.at(blocks, lo + i) > self.high) - 1
            # The widths bisection looked at must rise with the width; a fall means the cost is not monotone here
            # (another CPU's blocking, say): this depth is scanned whole, its cached values reused.
            if _rising([value for (b, _), value in sorted(self.values.items()) if b == blocks]):
                return list(range(start, stop + 1)), False
        return [i for i in range(lo, hi + 1) if self.low <= self.at(blocks, i) <= self.high], True


def _rising(values: Sequence[float]) -> bool:
    """Whether ``values`` never decrease."""
    return all(a <= b for a, b in itertools.pairwise(values))


def _bisect(count: int, reached: Callable[[int], bool]) -> int:
    """The first index in ``0..count`` where the monotone ``reached`` holds (``count`` when it never does)."""
    lo, hi = 0, count
    while lo < hi:
        mid = (lo + hi) // 2
        if reached(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


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


def split_spec(family: ModelFamily, blocks: int, s_w: float, exits: Sequence[int]) -> SubmodelSpec:
    """The floor-rounded sub-model cut after ``blocks`` blocks at width ``s_w`` with ``exits``."""
    return SubmodelSpec(width=s_w, rounding="floor", depth=blocks if blocks < family.num_blocks else None,
                        exits=tuple(exits))


class _SpecCost:
    """``cost(blocks, s_w, exits)`` of any per-spec cost (training memory), remembered per spec."""

    def __init__(self, family: ModelFamily, cost: Callable[[SubmodelSpec], float]) -> None:
        self.family, self.cost = family, cost
        self._seen: dict[SubmodelSpec, float] = {}

    def __call__(self, blocks: int, s_w: float, exits: Sequence[int]) -> float:
        spec = split_spec(self.family, blocks, s_w, exits)
        if spec not in self._seen:
            self._seen[spec] = float(self.cost(spec))
        return self._seen[spec]


class _CostModel:
    """Fast ``cost(blocks, s_w, exits)`` of parameters or FLOPs: per-layer costs per width, summed over the kept
    blocks (prefix sums), the exits and, at full depth, the final head."""

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
                  cost: str | Callable[[SubmodelSpec], float] = "params", input_size: tuple[int, int] = (28, 28),
                  step: float = 0.01, max_rounds: int = 10, exhaustive: bool = False,
                  start_exits: Sequence[int] = ()) -> list[LevelSplit]:
    """ScaleFL's levels for ``family``: one split per target ratio (smallest first, the last 1: the full model).

    ``cost`` is ``"params"``, ``"flops"`` (per sample at ``input_size``) or any function of a spec that does not
    fall as its width grows (e.g. the estimated training memory of the level that spec would be; nothing is
    assumed across depths); ``exhaustive`` for one that may (see :func:`search_split`).

    ``cost(M)`` is the global model as the top level trains it, early exits included, so every level's ratio is
    of the same model; since the exits depend on the splits, the search repeats until the exits settle
    (at most ``max_rounds`` times), starting from the global model with ``start_exits`` (default: none). A level
    below the top that is cut keeps an exit after its last block, and every level keeps the exits of the levels
    below it.
    """
    if not ratios or abs(ratios[-1] - 1.0) > 1e-9:
        raise ValueError(f"the last target ratio must be 1 (the full model), got {list(ratios)}")
    costs: Callable[[int, float, Sequence[int]], float]
    if callable(cost):
        costs = _SpecCost(family, cost)
    elif cost in ("params", "flops"):
        costs = _CostModel(family, cost, input_size)
    else:
        raise ValueError(f"the split cost must be 'params', 'flops' or a function of a spec, got {cost!r}")
    n = family.num_blocks
    allowed = [b + 1 for b in family.exit_points] + [n]
    exits = tuple(start_exits)
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
                                 allowed_blocks=allowed, exhaustive=exhaustive)
            found = list(_with_exit(lower, split.blocks, n))
            spec = split_spec(family, split.blocks, split.s_w, found)
            levels.append(LevelSplit(target, tolerance, split, spec))
            previous = split
        top = Split(1.0, 1.0, n, full, 1.0)
        levels.append(LevelSplit(1.0, tolerances[-1], top, split_spec(family, n, 1.0, found)))
        if tuple(found) == exits:
            return levels
        exits = tuple(found)
    # The exits did not settle: keep the last levels only if they meet their targets against the global model
    # they make (with their own exits).
    return _unsettled(family, levels, costs(n, 1.0, exits), exits, max_rounds)


def _unsettled(family: ModelFamily, levels: list[LevelSplit], full: float, exits: tuple[int, ...],
               max_rounds: int) -> list[LevelSplit]:
    """The last search's ``levels`` against the global model with ``exits`` (cost ``full``), when they all meet
    their targets there; NoSplitError otherwise."""
    settled = []
    for level in levels[:-1]:
        split = level.split
        ratio = split.cost / full
        if abs(ratio / level.target - 1.0) > level.tolerance + _SNAP:
            raise NoSplitError(f"the global model's exits do not settle within {max_rounds} searches (the level "
                               f"of ratio {level.target:g} ends at {ratio:.3g})")
        settled.append(LevelSplit(level.target, level.tolerance, Split(split.s_d, split.s_w, split.blocks,
                                                                        split.cost, ratio), level.spec))
    n = family.num_blocks
    top = Split(1.0, 1.0, n, full, 1.0)
    return [*settled, LevelSplit(1.0, levels[-1].tolerance, top, split_spec(family, n, 1.0, exits))]
