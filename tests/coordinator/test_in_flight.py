"""InFlight: the round in progress, what a buffered round carries, and what an update gets between rounds."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from coordinator.in_flight import InFlight
from coordinator.round import DispatchedTask, Phase, Verdict


class FakeRound:
    """What InFlight asks of a round: open it, interrupt it, its phase."""

    def __init__(self, number: int) -> None:
        self.number, self.phase, self.interrupted = number, Phase.PLANNED, False

    def open(self) -> None:
        self.phase = Phase.COLLECTING

    def interrupt(self) -> None:
        self.interrupted = True


def carried(task_id: str, agent: str, round_number: int) -> DispatchedTask:
    return DispatchedTask(task_id, round_number, SimpleNamespace(agent_id=agent), 0.0)  # type: ignore[arg-type]


def states(value: float) -> dict[str, Any]:
    return {"global": {"w": torch.full((2,), value)}}


def test_an_update_between_rounds_is_deferred_only_for_a_task_the_next_round_carries() -> None:
    in_flight = InFlight(states(0.0))
    in_flight.carry([carried("r1-a-1", "a", 1)], {1: states(1.0)})
    assert in_flight.between_rounds("r1-a-1", "a", 1).verdict is Verdict.DEFERRED
    for task, agent, round_number in (("r1-a-1", "b", 1), ("r1-a-1", "a", 2), ("r2-a-1", "a", 1)):
        receipt = in_flight.between_rounds(task, agent, round_number)
        assert receipt.verdict is Verdict.UNKNOWN and "no round is in progress" in (receipt.refusal or "")


def test_the_states_a_task_was_cut_from_are_kept_while_it_trains_and_then_let_go() -> None:
    in_flight = InFlight(states(0.0))
    assert in_flight.plan(1) == {1: in_flight.states}  # a round is cut from the current states
    first = in_flight.states
    in_flight.carry([carried("r1-a-1", "a", 1)])  # its task trains on into round 2
    in_flight.states = states(2.0)  # round 1 closed
    bases = in_flight.plan(2)
    assert set(bases) == {1, 2} and bases[1] is first and bases[2] is in_flight.states
    assert in_flight.states_of(1) is first and in_flight.states_of(3) is in_flight.states
    in_flight.carry([])  # answered: round 1's states go
    assert in_flight.bases == {} and in_flight.states_of(1) is in_flight.states
    assert in_flight.left_behind([("b", "r2-b-1")]) == [("b", "r2-b-1", "held")]


def test_a_halt_interrupts_the_round_in_progress_and_any_installed_after_it_once() -> None:
    in_flight = InFlight(states(0.0))
    first = FakeRound(1)
    in_flight.install(first)  # type: ignore[arg-type]
    assert in_flight.current() is first and first.phase is Phase.COLLECTING
    assert in_flight.halt("refused") and first.interrupted and in_flight.halted == "refused"
    assert not in_flight.halt("again") and in_flight.halted == "refused"  # the first reason stays
    later = FakeRound(2)
    in_flight.install(later)  # type: ignore[arg-type]
    assert later.interrupted
    in_flight.finished()
    assert in_flight.current() is None


def test_an_agent_back_online_while_no_round_collects_gets_the_carried_task_again_once() -> None:
    in_flight = InFlight(states(0.0))
    collecting = FakeRound(1)
    collecting.open()
    in_flight.back_online("a", collecting)  # type: ignore[arg-type]  # (its unanswered tasks were resent)
    in_flight.back_online("b", None)
    in_flight.back_online("c", FakeRound(1))  # type: ignore[arg-type]  # planned, not yet collecting
    assert in_flight.take_back_online() == {"b", "c"}
    assert in_flight.take_back_online() == set()
