"""AdaptiveFL's client selection (Algorithm 1): the table updates on a scripted sequence of returns, the rewards
and probabilities on hand-built tables, the round's draws and the tables' state."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest

from coordinator.client_selection import PoolEntry, SelectionTables

#: R for p = 2, smallest first.
POOL = [PoolEntry("S2", "S"), PoolEntry("S1", "S"), PoolEntry("M2", "M"), PoolEntry("M1", "M"), PoolEntry("L1", "L")]


def tables() -> SelectionTables:
    return SelectionTables(POOL, per_type=2)


def scores(t: SelectionTables, client: str) -> list[float]:
    return [t.resource[client][name] for name in t.names]


def test_the_tables_follow_algorithm_1_on_a_scripted_sequence_of_returns() -> None:
    t = tables()
    # Unpruned (lines 15-18): M2 and every larger model gain 1, the largest p - 1 more; T_c[M] counts send and back.
    t.record("c", "M2", "M2")
    assert scores(t, "c") == [1, 1, 2, 2, 3]
    assert t.curiosity["c"] == {"S": 1, "M": 3, "L": 1}
    # Pruned to S1 (lines 20-25): S1 gains p, then S1, M2, M1, L1 lose 0, 1, 2, 3, floored at 0.
    t.record("c", "L1", "S1")
    assert scores(t, "c") == [1, 3, 1, 0, 0]
    assert t.curiosity["c"] == {"S": 2, "M": 3, "L": 2}
    # Declined (nothing fit, the smallest tried S2): S2 upwards lose 1, 2, 3, ...
    t.record("c", "M1", None, declined_from="S2")
    assert scores(t, "c") == [0, 1, 0, 0, 0]
    assert t.curiosity["c"] == {"S": 2, "M": 4, "L": 2}
    # Missed its deadline: a selection, nothing learnt of its memory.
    t.record("c", "S1", None)
    assert scores(t, "c") == [0, 1, 0, 0, 0]
    assert t.curiosity["c"] == {"S": 3, "M": 4, "L": 2}
    # Another client's tables are untouched (and start at 1).
    assert t.resource_reward("d", "L") == pytest.approx(1 / (2 * 5))  # its share 1/5, divided by p
    assert scores(t, "d") == [1] * 5
    with pytest.raises(ValueError, match="not a pool model"):
        t.record("c", "X9", None)


def test_rewards_and_probabilities_on_hand_built_tables() -> None:
    t = tables()
    t.record("a", "M2", "M2")  # a: scores [1, 1, 2, 2, 3] (total 9), T_c = S 1, M 3, L 1
    t.curiosity["a"]["M"] = 4
    # R_s: per model of the type, the share of scores on it or larger, averaged over the type's models.
    assert t.resource_reward("a", "S") == pytest.approx((9 + 8) / (2 * 9))
    assert t.resource_reward("a", "M") == pytest.approx((7 + 5) / (2 * 9))
    assert t.resource_reward("a", "L") == pytest.approx(3 / (2 * 9))  # one model of type L, divided by p too
    assert t.resource_reward("b", "M") == pytest.approx((3 + 2) / (2 * 5))
    assert t.curiosity_reward("a", "M") == pytest.approx(1 / math.sqrt(4))
    # R = min(0.5, R_s) * R_c: for M, a has min(0.5, 2/3) * 1/2 = 0.25, b has min(0.5, 0.5) * 1 = 0.5.
    assert t.probabilities("M1", ["a", "b"]) == pytest.approx({"a": 1 / 3, "b": 2 / 3})
    # For L: a 1/6 * 1, b 1/10 * 1.
    assert t.probabilities("L1", ["a", "b"]) == pytest.approx({"a": (1 / 6) / (1 / 6 + 1 / 10),
                                                              "b": (1 / 10) / (1 / 6 + 1 / 10)})
    # The ablations: curiosity alone, resource alone (uncapped), uniform.
    assert t.probabilities("M1", ["a", "b"], "curiosity") == pytest.approx({"a": 1 / 3, "b": 2 / 3})
    assert t.probabilities("M1", ["a", "b"], "resource") == pytest.approx({"a": (2 / 3) / (2 / 3 + 1 / 2),
                                                                          "b": (1 / 2) / (2 / 3 + 1 / 2)})
    assert t.probabilities("M1", ["a", "b"], "random") == {"a": 0.5, "b": 0.5}


def test_a_round_gives_each_client_at_most_one_model_and_never_one_whose_reward_is_zero() -> None:
    t = tables()
    for name in t.names:  # z's every score has fallen to 0: its resource reward is 0 for every type
        t.resource.setdefault("z", {})[name] = 0.0
    t.curiosity["z"] = {"S": 1.0, "M": 1.0, "L": 1.0}
    rng = random.Random(0)
    for _ in range(50):
        pairs = t.assign(3, ["a", "b", "z"], rng)
        clients = [client for _, client in pairs]
        assert len(clients) == len(set(clients)) == 2 and "z" not in clients
        assert all(model in t.names for model, _ in pairs)
    assert t.assign(5, ["a"], rng)[0][1] == "a" and len(t.assign(5, ["a"], rng)) == 1
    # Greedy: always the largest model; random: any client, z included.
    assert {model for model, _ in t.assign(3, ["a", "b", "z"], rng, "greedy")} == {"L1"}
    drawn = Counter(client for _ in range(100) for _, client in t.assign(1, ["a", "b", "z"], rng, "random"))
    assert drawn["z"] > 0
    with pytest.raises(ValueError, match="selection mode"):
        t.assign(1, ["a"], rng, "smart")


def test_draws_follow_the_rewards() -> None:
    t = tables()
    for _ in range(3):  # a keeps pruning L1 to S2: its L score falls to 0 while b's stays
        t.record("a", "L1", "S2")
    rng = random.Random(1)
    given_l = Counter(client for _ in range(400) for model, client in t.assign(1, ["a", "b"], rng) if model == "L1")
    assert given_l["a"] == 0 and given_l["b"] > 0


def test_the_tables_round_trip_and_refuse_another_pool() -> None:
    t = tables()
    t.record("a", "M2", "S1")
    restored = tables()
    restored.load_state_dict(t.state_dict())
    assert restored.resource == t.resource and restored.curiosity == t.curiosity
    other = SelectionTables(POOL[1:], per_type=2)
    with pytest.raises(ValueError, match="other model types or pool models"):
        other.load_state_dict(t.state_dict())
    with pytest.raises(ValueError, match="no curiosity and resource table"):
        restored.load_state_dict({"curiosity": {}})


def test_a_model_no_remaining_client_can_take_is_drawn_again_among_those_some_can() -> None:
    t = tables()
    t.resource["a"] = {"S2": 1.0, "S1": 0.0, "M2": 0.0, "M1": 0.0, "L1": 0.0}  # a: only the S type pays
    t.curiosity["a"] = {"S": 1.0, "M": 1.0, "L": 1.0}
    assert t.probabilities("L1", ["a"]) == {"a": 0.0} and t.probabilities("S1", ["a"])["a"] == 1.0
    rng = random.Random(0)
    for _ in range(30):
        [(model, client)] = t.assign(1, ["a"], rng)
        assert client == "a" and t.type_of[model] == "S"


# ---------------------------------------------------------------------- the L type's divisor
def test_the_large_divisor_divides_the_l_share_by_p_or_by_one() -> None:
    paper, reference = tables(), SelectionTables(POOL, per_type=2, large_divisor="reference")
    for t in (paper, reference):
        t.record("a", "M2", "M2")  # a: scores [1, 1, 2, 2, 3], total 9
    assert paper.resource_reward("a", "L") == pytest.approx(3 / (2 * 9))
    assert reference.resource_reward("a", "L") == pytest.approx(3 / 9)
    for model_type in ("S", "M"):  # p models each: both divide by p
        assert paper.resource_reward("a", model_type) == pytest.approx(reference.resource_reward("a", model_type))
    # x has 3/4 of its scores on L1, y 1/2: under reference both meet the cap 0.5 and tie; under paper R_s(L) is
    # 3/8 and 1/4, below the cap, and weighs the draw.
    for t in (paper, reference):
        t.resource["x"] = {"S2": 1.0, "S1": 0.0, "M2": 0.0, "M1": 0.0, "L1": 3.0}
        t.resource["y"] = {"S2": 1.0, "S1": 0.0, "M2": 0.0, "M1": 0.0, "L1": 1.0}
        for client in ("x", "y"):
            t.curiosity[client] = {"S": 1.0, "M": 1.0, "L": 1.0}
    assert reference.probabilities("L1", ["x", "y"]) == pytest.approx({"x": 0.5, "y": 0.5})
    assert paper.probabilities("L1", ["x", "y"]) == pytest.approx({"x": (3 / 8) / (3 / 8 + 1 / 4),
                                                                  "y": (1 / 4) / (3 / 8 + 1 / 4)})
    with pytest.raises(ValueError, match="large_divisor"):
        SelectionTables(POOL, per_type=2, large_divisor="half")


# ---------------------------------------------------------------------- re-admission
def decline(t: SelectionTables, client: str) -> None:
    """Nothing fit down to the pool's smallest model: every score from it upwards falls to 0."""
    t.record(client, "M1", None, declined_from="S2")


@pytest.mark.parametrize("k", [1, 2, 5])
def test_a_client_whose_scores_all_fell_to_0_is_out_k_rounds_then_back(k: int) -> None:
    t = SelectionTables(POOL, per_type=2, readmit_after=k)
    t.readmit(1)
    decline(t, "c")  # in round 1, a fresh client (scores all 1) declines once
    assert t.is_out("c") and scores(t, "c") == [0] * 5
    curiosity = dict(t.curiosity["c"])
    for round_number in range(2, 2 + k):  # rounds 2 .. k + 1: out, reward 0 for every model, never drawn
        assert t.readmit(round_number) == []
        assert all(t.probabilities(model, ["c", "d"])["c"] == 0 for model in t.names)
        assert [client for _, client in t.assign(2, ["c", "d"], random.Random(round_number))] == ["d"]
    # Round k + 2: back, rated as a new client (the initial 1s), its curiosity counts kept.
    assert t.readmit(2 + k) == ["c"] and not t.is_out("c")
    assert scores(t, "c") == [1] * 5 and t.curiosity["c"] == curiosity
    assert all(t.probabilities(model, ["c", "d"])["c"] > 0 for model in t.names)
    # Every client with a positive reward is drawn when the round has room for all: c is, whatever the draws.
    assert {client for _, client in t.assign(2, ["c", "d"], random.Random(0))} == {"c", "d"}
    assert t.readmit(2 + k) == []  # idempotent within a round
    # Out again after another decline, and back k rounds later again: never out more than k rounds.
    decline(t, "c")
    assert all(t.readmit(n) == [] for n in range(3 + k, 3 + 2 * k))
    assert t.readmit(3 + 2 * k) == ["c"]


@pytest.mark.parametrize("strict", [0, None])
def test_the_strict_option_keeps_a_client_out_for_good(strict: int | None) -> None:
    t = SelectionTables(POOL, per_type=2, readmit_after=strict)
    decline(t, "c")
    for round_number in range(1, 200):
        assert t.readmit(round_number) == []
    assert t.is_out("c") and t.out_since == {"c": 1}
    assert all(t.probabilities(model, ["c", "d"])["c"] == 0 for model in t.names)
    with pytest.raises(ValueError, match="readmit_after"):
        SelectionTables(POOL, per_type=2, readmit_after=-1)


def test_a_client_out_of_the_larger_models_only_is_not_out() -> None:
    t = SelectionTables(POOL, per_type=2, readmit_after=1)
    t.record("c", "L1", "S2")
    t.record("c", "L1", "S2")  # S2 gains p twice; S1 .. L1 fall to 0
    assert scores(t, "c")[1:] == [0, 0, 0, 0] and not t.is_out("c")
    for round_number in range(1, 10):
        assert t.readmit(round_number) == []
    assert scores(t, "c")[1:] == [0, 0, 0, 0] and t.out_since == {}


def test_the_readmission_clock_round_trips_and_old_tables_load() -> None:
    t = SelectionTables(POOL, per_type=2, readmit_after=3)
    decline(t, "c")
    t.readmit(4)  # c out since round 4: back in round 7
    state = t.state_dict()
    assert state["out_since"] == {"c": 4}
    restored = SelectionTables(POOL, per_type=2, readmit_after=3)
    restored.load_state_dict(state)
    assert restored.out_since == t.out_since and restored.resource == t.resource
    assert restored.readmit(6) == [] and restored.readmit(7) == ["c"]
    # Tables saved before re-admission existed (no out_since): loaded, and the clock starts at the next round.
    old = SelectionTables(POOL, per_type=2, readmit_after=3)
    old.load_state_dict({"curiosity": state["curiosity"], "resource": state["resource"]})
    assert old.out_since == {} and old.readmit(9) == [] and old.readmit(12) == ["c"]
    with pytest.raises(ValueError, match="out_since"):
        old.load_state_dict({**state, "out_since": {"nobody": 1}})
