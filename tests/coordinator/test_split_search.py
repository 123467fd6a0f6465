"""ScaleFL's split search (Eq. 1): hand-built cost tables, ties, tolerance boundaries, constraints, an exhaustive
grid search as the reference on random monotone costs, and the levels of real (tiny) families."""

from __future__ import annotations

import math
import random

import pytest

from coordinator.split_search import NoSplitError, Split, search_levels, search_split, split_spec
from models import SubmodelSpec, get_family

# ------------------------------------------------------------------------------------------ hand-built table
# Four blocks and a grid step of 0.25: s_d = 0.25, 0.5, 0.75, 1 keeps 1, 2, 3, 4 blocks (one s_d per depth).
# cost(blocks, s_w), increasing in both (rows: blocks; columns: s_w = 0.25, 0.5, 0.75, 1):
TABLE = {
    1: {0.25: 1, 0.5: 2, 0.75: 3, 1.0: 4},
    2: {0.25: 2, 0.5: 6, 0.75: 7, 1.0: 12},
    3: {0.25: 3, 0.5: 7, 0.75: 10, 1.0: 13},
    4: {0.25: 4, 0.5: 12, 0.75: 16, 1.0: 20},
}
FULL = 16.0  # cost(M) as given to the search; targets below are chosen so that goals are exact binary numbers


def table_cost(table=TABLE, calls: list | None = None):
    def cost(blocks: int, s_w: float) -> float:
        if calls is not None:
            calls.append((blocks, s_w))
        return float(table[blocks][s_w])

    return cost


def with_entry(blocks: int, s_w: float, value: float) -> dict:
    table = {b: dict(row) for b, row in TABLE.items()}
    table[blocks][s_w] = value
    return table


def test_table_is_monotone():
    for b in range(1, 5):
        row = [TABLE[b][w] for w in (0.25, 0.5, 0.75, 1.0)]
        assert row == sorted(row)
        if b > 1:
            assert all(TABLE[b][w] >= TABLE[b - 1][w] for w in TABLE[b])


def test_balanced_split_beats_an_exact_cost_off_the_diagonal():
    # Goal 0.75 * 16 = 12 within 20% = [9.6, 14.4]: (2, 1.0) and (4, 0.5) cost exactly 12 but are 0.5 apart;
    # (3, 0.75) costs 10 (17% off) with s_d = s_w.
    split = search_split(table_cost(), 4, FULL, 0.75, 0.2, step=0.25)
    assert split == Split(s_d=0.75, s_w=0.75, blocks=3, cost=10.0, ratio=10 / 16)


def test_ties_on_balance_go_to_the_deeper_split_when_errors_are_equal():
    # Goal 0.5 * 16 = 8 within 30% = [5.6, 10.4]: on the diagonal (2, 0.5) costs 6 and (3, 0.75) costs 10, both
    # 25% off: the deeper one wins.
    split = search_split(table_cost(), 4, FULL, 0.5, 0.3, step=0.25)
    assert split == Split(0.75, 0.75, 3, 10.0, 10 / 16)


def test_ties_on_balance_go_to_the_smaller_error_before_the_depth():
    # With (2, 0.5) = 7 (12.5% off) the shallower diagonal split is nearer the goal than (3, 0.75) (25% off).
    split = search_split(table_cost(with_entry(2, 0.5, 7)), 4, FULL, 0.5, 0.3, step=0.25)
    assert split == Split(0.5, 0.5, 2, 7.0, 7 / 16)


def test_tolerance_boundaries_are_inclusive():
    # Goal 8: 6 and 10 lie exactly 25% off. At 25% both diagonal splits are in (the deeper wins); just below
    # 25% neither is, and the best are 0.25 apart: (2 blocks, s_w 0.75) and (3 blocks, s_w 0.5), both cost 7
    # (12.5% off): the deeper one.
    assert search_split(table_cost(), 4, FULL, 0.5, 0.25, step=0.25) == Split(0.75, 0.75, 3, 10.0, 10 / 16)
    assert search_split(table_cost(), 4, FULL, 0.5, 0.24, step=0.25) == Split(0.75, 0.5, 3, 7.0, 7 / 16)
    # Tolerance 0: only an exact hit; goal 7 -> (2, 0.75) or (3, 0.5), equally balanced, deeper wins.
    assert search_split(table_cost(), 4, FULL, 7 / 16, 0.0, step=0.25) == Split(0.75, 0.5, 3, 7.0, 7 / 16)
    assert search_split(table_cost(), 4, FULL, 0.25, 0.0, step=0.25) == Split(1.0, 0.25, 4, 4.0, 0.25)


def test_above_keeps_at_least_the_lower_levels_blocks():
    table = with_entry(2, 0.5, 7)
    assert search_split(table_cost(table), 4, FULL, 0.5, 0.3, step=0.25).blocks == 2
    lower = Split(0.75, 0.75, 3, 10.0, 10 / 16)
    split = search_split(table_cost(table), 4, FULL, 0.5, 0.3, step=0.25, above=lower)
    assert split == Split(0.75, 0.75, 3, 10.0, 10 / 16)
    deepest = Split(1.0, 0.25, 4, 4.0, 0.25)
    with pytest.raises(NoSplitError):  # at 4 blocks: 4, 12, 16, 20, none within [5.6, 10.4]
        search_split(table_cost(table), 4, FULL, 0.5, 0.3, step=0.25, above=deepest)


def test_allowed_blocks_restrict_the_depths():
    assert search_split(table_cost(), 4, FULL, 0.5, 0.3, step=0.25, allowed_blocks=[2, 4]) == Split(
        0.5, 0.5, 2, 6.0, 6 / 16)
    with pytest.raises(NoSplitError, match="25%"):
        search_split(table_cost(), 4, FULL, 0.5, 0.25, step=0.25, allowed_blocks=[1, 4])
    with pytest.raises(NoSplitError, match="no depth"):
        search_split(table_cost(), 4, FULL, 0.5, 0.3, step=0.25, allowed_blocks=[])


def test_no_split_error_is_a_value_error_naming_the_target():
    with pytest.raises(ValueError, match=r"0\.25 grid.*within 1% of 0\.9"):
        search_split(table_cost(), 4, FULL, 0.9, 0.01, step=0.25)  # goal 14.4: nothing in [14.256, 14.544]
    assert issubclass(NoSplitError, ValueError)


def test_grid_step_must_divide_one():
    with pytest.raises(ValueError, match="grid step must divide 1"):
        search_split(table_cost(), 4, FULL, 0.5, 0.3, step=0.3)


def test_step_of_a_tenth_with_several_depth_ratios_per_depth():
    # cost = blocks * (10 s_w), N = 4, full 40, goal 20 within 10% = [18, 22]. s_d 0.3-0.4 keep 1 block,
    # 0.5-0.7 keep 2, 0.8-0.9 keep 3, 1 keeps 4. Feasible: 2 blocks at s_w 0.9, 1 (best s_d 0.7: 0.2 apart);
    # 3 blocks at s_w 0.6, 0.7 (best s_d 0.8, s_w 0.7: 0.1 apart); 4 blocks at s_w 0.5 (0.5 apart).
    def cost(blocks: int, s_w: float) -> float:
        return float(blocks * round(s_w * 10))

    assert search_split(cost, 4, 40.0, 0.5, 0.1, step=0.1) == Split(0.8, 0.7, 3, 21.0, 21 / 40)


def test_search_evaluates_only_part_of_a_large_grid():
    calls: list = []

    def cost(blocks: int, s_w: float) -> float:
        calls.append((blocks, s_w))
        return blocks * s_w * s_w

    split = search_split(cost, 50, 50.0, 0.3, 0.05, step=0.01)
    assert abs(split.ratio / 0.3 - 1) <= 0.05
    assert len(set(calls)) < 50 * 100 // 4


# ------------------------------------------------------------------------------------------ property test
def exhaustive(cost, num_blocks, full, target, tolerance, step, above=None, allowed=None):
    """Eq. 1 by brute force over the whole grid: the feasible split minimising (|s_d - s_w|, cost error, -depth)."""
    count = round(1 / step)
    grid = [round(i * step, 10) for i in range(1, count + 1)]
    goal = target * full
    low, high = goal * (1 - tolerance) * (1 - 1e-9), goal * (1 + tolerance) * (1 + 1e-9)
    best = None
    for s_d in grid:
        blocks = math.floor(s_d * num_blocks + 1e-9)
        if blocks < 1 or (above is not None and blocks < above.blocks) or (
                allowed is not None and blocks not in allowed):
            continue
        for s_w in grid:
            value = cost(blocks, s_w)
            if not low <= value <= high:
                continue
            key = (round(abs(s_d - s_w), 9), abs(value / goal - 1), -blocks)
            if best is None or key < best[0]:
                best = (key, Split(s_d, s_w, blocks, value, value / full))
    return best


def random_table(rng: random.Random, num_blocks: int, count: int, strict: bool):
    """cost[b][k] non-decreasing in the depth b and the width index k (strictly with random floats, or with
    plateaus of small integers)."""
    table = [[0.0] * (count + 1) for _ in range(num_blocks + 1)]
    for b in range(1, num_blocks + 1):
        for k in range(1, count + 1):
            step = rng.uniform(0.01, 1.0) if strict else rng.choice([0, 0, 1, 2])
            table[b][k] = max(table[b - 1][k], table[b][k - 1]) + step
    return table


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "plateaus"])
def test_search_equals_exhaustive_grid_search_on_random_monotone_costs(strict):
    rng = random.Random(1234 + strict)
    found = infeasible = 0
    for _ in range(400):
        num_blocks = rng.randint(1, 12)
        step = rng.choice([0.5, 0.25, 0.2, 0.125, 0.1, 0.05])
        count = round(1 / step)
        table = random_table(rng, num_blocks, count, strict)

        def cost(blocks: int, s_w: float, table=table, step=step) -> float:
            return table[blocks][round(s_w / step)]

        full = table[num_blocks][count] * rng.uniform(0.9, 1.1) or 1.0
        target = rng.uniform(0.02, 1.0)
        tolerance = rng.choice([0.0, 0.01, 0.05, 0.1, 0.2, 0.4])
        above = None
        if rng.random() < 0.3:
            b = rng.randint(1, num_blocks)
            above = Split(b / num_blocks, 1.0, b, 0.0, 0.0)
        allowed = sorted(rng.sample(range(1, num_blocks + 1), rng.randint(1, num_blocks))) if rng.random() < 0.3 \
            else None
        reference = exhaustive(cost, num_blocks, full, target, tolerance, step, above, allowed)
        context = (num_blocks, step, target, tolerance, above, allowed)
        if reference is None:
            infeasible += 1
            with pytest.raises(NoSplitError):
                search_split(cost, num_blocks, full, target, tolerance, step=step, above=above,
                             allowed_blocks=allowed)
            continue
        found += 1
        split = search_split(cost, num_blocks, full, target, tolerance, step=step, above=above,
                             allowed_blocks=allowed)
        key = (round(abs(split.s_d - split.s_w), 9), abs(split.cost / (target * full) - 1), -split.blocks)
        assert key == reference[0], context
        assert split.cost == cost(split.blocks, split.s_w) and split.ratio == pytest.approx(split.cost / full)
        assert split.blocks == math.floor(split.s_d * num_blocks + 1e-9)
        if strict:  # no ties: the very same split
            assert split == reference[1], context
    assert found > 100 and infeasible > 10  # both branches are exercised


def random_width_monotone_table(rng: random.Random, num_blocks: int, count: int):
    """cost[b][k] non-decreasing in the width index k at every depth b, anything across depths (a cut model's
    training memory with its exit: an exit after a high-resolution block can cost more than a deeper one)."""
    table = [[0.0] * (count + 1) for _ in range(num_blocks + 1)]
    for b in range(1, num_blocks + 1):
        scale = rng.uniform(0.2, 3.0)
        for k in range(1, count + 1):
            table[b][k] = table[b][k - 1] + scale * rng.choice([0.0, rng.uniform(0.01, 1.0)])
    return table


def random_case(rng: random.Random, make_table):
    num_blocks = rng.randint(1, 12)
    step = rng.choice([0.5, 0.25, 0.2, 0.125, 0.1, 0.05])
    count = round(1 / step)
    table = make_table(rng, num_blocks, count)

    def cost(blocks: int, s_w: float) -> float:
        return table[blocks][round(s_w / step)]

    full = max(max(row) for row in table) * rng.uniform(0.9, 1.1) or 1.0
    above = None
    if rng.random() < 0.3:
        b = rng.randint(1, num_blocks)
        above = Split(b / num_blocks, 1.0, b, 0.0, 0.0)
    allowed = sorted(rng.sample(range(1, num_blocks + 1), rng.randint(1, num_blocks))) if rng.random() < 0.3 \
        else None
    return cost, num_blocks, full, rng.uniform(0.02, 1.0), rng.choice([0.0, 0.01, 0.05, 0.1, 0.2, 0.4]), step, \
        above, allowed


def agrees_with_exhaustive(case, exhaustive_search: bool) -> bool:
    """Whether the search finds what brute force finds (the same key, or NoSplitError for both); False if not."""
    cost, num_blocks, full, target, tolerance, step, above, allowed = case
    reference = exhaustive(cost, num_blocks, full, target, tolerance, step, above, allowed)
    try:
        split = search_split(cost, num_blocks, full, target, tolerance, step=step, above=above,
                             allowed_blocks=allowed, exhaustive=exhaustive_search)
    except NoSplitError:
        return reference is None
    key = (round(abs(split.s_d - split.s_w), 9), abs(split.cost / (target * full) - 1), -split.blocks)
    return reference is not None and key == reference[0] and split.cost == cost(split.blocks, split.s_w)


def test_search_equals_exhaustive_search_when_the_cost_grows_with_the_width_only():
    rng = random.Random(77)
    cases = [random_case(rng, random_width_monotone_table) for _ in range(3000)]
    disagreements = [case[1:] for case in cases if not agrees_with_exhaustive(case, exhaustive_search=False)]
    assert disagreements == []


def test_exhaustive_search_of_a_cost_that_falls_as_the_width_grows():
    def arbitrary(rng: random.Random, num_blocks: int, count: int):
        return [[rng.uniform(0.0, 10.0) for _ in range(count + 1)] for _ in range(num_blocks + 1)]

    rng = random.Random(78)
    cases = [random_case(rng, arbitrary) for _ in range(300)]
    assert all(agrees_with_exhaustive(case, exhaustive_search=True) for case in cases)
    # Without exhaustive, a fall between the widths bisection looked at goes unseen: it misses some of these.
    assert not all(agrees_with_exhaustive(case, exhaustive_search=False) for case in cases)


def test_a_fall_the_bisection_sees_makes_it_scan_the_depth():
    # Costs that fall as the width grows at some depths (every step, so bisection sees it): scanned, found.
    def falling_here_and_there(rng: random.Random, num_blocks: int, count: int):
        table = random_width_monotone_table(rng, num_blocks, count)
        for b in rng.sample(range(1, num_blocks + 1), rng.randint(1, num_blocks)):
            table[b] = [table[b][0]] + sorted(table[b][1:], reverse=True)
            table[b] = [value + 1e-6 * (count - k) for k, value in enumerate(table[b])]  # strictly
        return table

    rng = random.Random(79)
    cases = [random_case(rng, falling_here_and_there) for _ in range(1000)]
    assert all(agrees_with_exhaustive(case, exhaustive_search=False) for case in cases)


def test_a_deeper_cut_that_costs_less_does_not_hide_the_balanced_split():
    # Depth 3 costs more than depth 4 at every width (its exit sits after a high-resolution block): the goal
    # 12 within 5% is met only at depth 3, on the diagonal (s_w 0.75); depth 4 never reaches it.
    table = {1: {0.25: 1, 0.5: 2, 0.75: 3, 1.0: 4}, 2: {0.25: 2, 0.5: 4, 0.75: 6, 1.0: 8},
             3: {0.25: 5, 0.5: 9, 0.75: 12, 1.0: 15}, 4: {0.25: 3, 0.5: 6, 0.75: 9, 1.0: 11}}
    assert search_split(table_cost(table), 4, FULL, 0.75, 0.05, step=0.25) == Split(0.75, 0.75, 3, 12.0, 12 / 16)


# ------------------------------------------------------------------------------------------ real families
FAMILIES = {
    "cnn": ("cnn", {"hidden": (4, 8, 16, 32)}),
    "resnet20": ("resnet20", {"hidden": (4, 8, 16)}),
}


def measure(family, spec: SubmodelSpec, cost: str) -> int:
    return family.param_count(spec) if cost == "params" else family.flops(spec, (8, 8))


def check_levels(family, levels, cost: str, ratios, tolerances) -> None:
    """The levels' invariants: targets met within tolerance against the returned global model (its exits
    included), floor-rounded specs that keep the lower levels' exits, and the full model with every exit on top."""
    assert [level.target for level in levels] == ratios
    assert [level.tolerance for level in levels] == tolerances
    n = family.num_blocks
    top = levels[-1]
    assert top.spec == SubmodelSpec(width=1.0, rounding="floor", exits=top.spec.exits)
    assert top.split == Split(1.0, 1.0, n, measure(family, top.spec, cost), 1.0)
    all_exits: set[int] = set()
    previous = None
    for level in levels:
        spec, split = level.spec, level.split
        family.validate_spec(spec)
        assert spec.rounding == "floor" and spec.width == split.s_w
        assert spec.depth == (split.blocks if split.blocks < n else None)
        # The cost ratio is that of the built sub-model against the top level's, exits included.
        assert split.cost == measure(family, spec, cost)
        assert split.ratio == pytest.approx(measure(family, spec, cost) / measure(family, top.spec, cost))
        assert abs(split.ratio / level.target - 1) <= level.tolerance + 1e-9
        if split.blocks < n:
            assert spec.exits[-1] == split.blocks - 1
        if previous is not None:
            assert set(previous.spec.exits) <= set(spec.exits)  # the lower levels' exits are kept
            assert split.blocks >= previous.split.blocks
        all_exits |= set(spec.exits)
        previous = level
    assert set(top.spec.exits) == all_exits and all_exits  # the full model with every level's exit


@pytest.mark.parametrize(("name", "cost"), [("cnn", "params"), ("cnn", "flops"), ("resnet20", "params")])
def test_search_levels_on_real_families(name, cost):
    family_name, options = FAMILIES[name]
    family = get_family(family_name, 10, 1, **options)
    ratios, tolerances = [0.25, 0.5, 1.0], [0.1, 0.1, 0.1]
    levels = search_levels(family, ratios, tolerances, cost=cost, input_size=(8, 8), step=0.05)
    check_levels(family, levels, cost, ratios, tolerances)


def test_search_levels_never_returns_levels_off_their_tolerance():
    # Here the global model's exits do not settle: with exit 6 only, the levels' search puts an exit after
    # block 5 too, and with exits 5 and 6 it puts one after block 6 only. The search may refuse (NoSplitError),
    # but levels it returns must meet their targets against the global model it returns.
    family = get_family("resnet20", 10, 1, hidden=(4, 8, 16))
    ratios, tolerances = [0.25, 0.5, 1.0], [0.1, 0.1, 0.1]
    try:
        levels = search_levels(family, ratios, tolerances, cost="flops", input_size=(8, 8), step=0.05)
    except NoSplitError:
        return
    check_levels(family, levels, "flops", ratios, tolerances)


def test_search_levels_with_a_callable_cost_equals_params():
    family = get_family("resnet20", 10, 1, hidden=(4, 8, 16))
    by_name = search_levels(family, [0.25, 0.5, 1.0], [0.1] * 3, cost="params", step=0.05)
    seen: list = []

    def params(spec: SubmodelSpec) -> float:
        seen.append(spec)
        return float(family.param_count(spec))

    by_callable = search_levels(family, [0.25, 0.5, 1.0], [0.1] * 3, cost=params, step=0.05)
    assert [(lv.spec, lv.split.blocks, lv.split.s_w) for lv in by_callable] == [
        (lv.spec, lv.split.blocks, lv.split.s_w) for lv in by_name]
    assert all(split_spec(family, s.depth or family.num_blocks, s.width, s.exits) == s for s in seen)


def test_search_levels_rejects_bad_arguments():
    family = get_family("cnn", 10, 1, hidden=(4, 8, 16, 32))
    with pytest.raises(ValueError, match="last target ratio must be 1"):
        search_levels(family, [0.25, 0.5], [0.1, 0.1])
    with pytest.raises(ValueError, match="'params', 'flops' or a function"):
        search_levels(family, [0.5, 1.0], [0.1, 0.1], cost="bytes")
    with pytest.raises(NoSplitError):
        search_levels(family, [0.001, 1.0], [0.01, 0.1], step=0.05)


def test_split_spec_cuts_and_keeps_the_final_head():
    family = get_family("cnn", 10, 1, hidden=(4, 8, 16, 32))
    assert split_spec(family, 2, 0.5, (1,)) == SubmodelSpec(width=0.5, rounding="floor", depth=2, exits=(1,))
    assert split_spec(family, 4, 0.5, (1,)) == SubmodelSpec(width=0.5, rounding="floor", exits=(1,))


def test_search_levels_starts_from_the_global_model_it_is_given():
    """The levels' ratios are of the global model with its exits: a search started from the plain model reads a
    share of that model against one without its exits' cost, and a small level, whose own exit costs more than that
    share of the plain model, is found by no split. Started from the global model the share was of (ScaleFL's
    `auto` sizing gives it), it is found. (A training-memory-like cost: a part per block kept, whatever the width,
    and a costly exit.)"""
    family = get_family("resnet20", 10, 1, hidden=(4, 8, 16))
    plain = float(family.param_count(SubmodelSpec.full()))

    def cost(spec: SubmodelSpec) -> float:
        blocks = spec.depth if spec.depth is not None else family.num_blocks
        return float(family.param_count(spec)) + 0.2 * plain * blocks + plain * len(spec.exits)

    with pytest.raises(NoSplitError):
        search_levels(family, [0.3, 1.0], [0.1, 0.0], cost=cost, step=0.05)
    level, top = search_levels(family, [0.3, 1.0], [0.1, 0.0], cost=cost, step=0.05, start_exits=(0,))
    assert top.spec.exits == level.spec.exits == (0,)  # settled where it started
    assert abs(cost(level.spec) / cost(top.spec) / 0.3 - 1) <= 0.1 + 1e-9
