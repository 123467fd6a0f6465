"""What a coordinator has out at a time: the round in progress, the model states tasks were cut from, the tasks the
next round carries (buffered rounds), the agents back online between rounds, and why the run was halted.

One object, handed to every room that asks (the intake and the dispatcher: which states a task was cut from; the
upload desk: the round in progress and whether a task is carried), instead of a callable each. Read on the MQTT
link's message thread and the status timer while the round loop changes it: one lock guards the round in progress,
the halt and the agents back between rounds; the states, the bases and the carried tasks change only on the round
loop, between rounds (a reader sees the old or the new value, each whole).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from coordinator.round import DispatchedTask, Phase, Receipt, Round, Verdict
from coordinator.tasks import State

__all__ = ["InFlight"]


class InFlight:
    """The round in progress and the buffered rounds' ledger (see the module docstring)."""

    def __init__(self, states: dict[str, State]) -> None:
        #: The global model's states as the last closed round left them (the round being planned cuts from them).
        self.states = states
        self._bases: dict[int, dict[str, State]] = {}  # round -> the states its tasks were cut from, while they train
        self._carried: list[DispatchedTask] = []
        self._carried_ids: frozenset[str] = frozenset()
        self._back: set[str] = set()  # agents back online while no round collected
        self._round: Round | None = None
        self._halted: str | None = None
        self._lock = threading.Lock()

    # ------------------------------------------------------------ the round in progress
    def current(self) -> Round | None:
        """The round in progress (collecting or aggregating), None between rounds."""
        with self._lock:
            return self._round

    def install(self, planned: Round) -> None:
        """Open a planned round and make it the one in progress: from now on its updates are stored and acked. A run
        already halted interrupts it at once."""
        planned.open()
        with self._lock:
            self._round = planned
            if self._halted is not None:
                planned.interrupt()

    def finished(self) -> None:
        """The round in progress is done (checkpointed, its verdicts sent)."""
        with self._lock:
            self._round = None

    def halt(self, reason: str) -> bool:
        """Stop the run for ``reason`` (one sentence): the round in progress, and any installed later, is
        interrupted. False when the run was already halted (the first reason stays)."""
        with self._lock:
            if self._halted is not None:
                return False
            self._halted = reason
            current = self._round
        if current is not None:
            current.interrupt()
        return True

    @property
    def halted(self) -> str | None:
        """Why the run cannot go on, None while it can."""
        return self._halted

    # ------------------------------------------------------------ buffered rounds
    @property
    def carried(self) -> list[DispatchedTask]:
        """The tasks of earlier rounds the next round carries (still training)."""
        return self._carried

    @property
    def carried_ids(self) -> frozenset[str]:
        """The carried tasks' ids."""
        return self._carried_ids

    @property
    def bases(self) -> dict[int, dict[str, State]]:
        """Round -> the states its tasks were cut from, for the rounds whose tasks still train."""
        return self._bases

    def states_of(self, round_number: int) -> dict[str, State]:
        """The states the tasks of ``round_number`` were cut from: a round's own, kept while tasks of it train; the
        current states for the round being planned or in progress."""
        return self._bases.get(round_number, self.states)

    def carries(self, task_id: str, agent_id: str, round_number: int) -> bool:
        """Whether the next round carries ``task_id``, of that agent and round (asked between two rounds)."""
        return any(dispatched.task_id == task_id and dispatched.task.agent_id == agent_id
                   and dispatched.round == round_number for dispatched in self._carried)

    def between_rounds(self, task_id: str, agent_id: str, round_number: int) -> Receipt:
        """What an update for ``task_id`` (or a request to upload one) gets while no round is in progress: deferred
        when the next round carries that task (held until a round collects), else refused as unknown."""
        if self.carries(task_id, agent_id, round_number):
            return Receipt(Verdict.DEFERRED)
        return Receipt(Verdict.UNKNOWN, f"unknown task {task_id!r} of round {round_number}: no round is in progress")

    def carry(self, carried: Sequence[DispatchedTask], bases: dict[int, dict[str, State]] | None = None) -> None:
        """Keep what the next round carries and only the states those tasks were cut from (``bases``; default:
        those kept for their rounds)."""
        if bases is None:
            bases = {dispatched.round: self._bases[dispatched.round] for dispatched in carried}
        self._bases = bases
        self._carried = list(carried)
        self._carried_ids = frozenset(dispatched.task_id for dispatched in carried)

    def plan(self, round_number: int) -> dict[int, dict[str, State]]:
        """The bases of a round being planned: its own (the current states) and its carried tasks' rounds'."""
        self._bases = {number: self._bases.get(number, self.states)
                       for number in {round_number, *(dispatched.round for dispatched in self._carried)}}
        return self._bases

    def resume(self, round_number: int, bases: dict[int, dict[str, State]]) -> None:
        """The bases of a round resumed from the journal: its carried tasks' as journaled, its own the current."""
        self._bases = {**bases, round_number: self.states}

    def left_behind(self, held: Sequence[tuple[str, str]]) -> list[tuple[str, str, str]]:
        """(agent, task, where) of what no round settled: the tasks ``carried`` into the next round, and the updates
        ``held`` for it (``held``: (agent, task) the upload desk holds) that are not for one of them."""
        carried = [(dispatched.task.agent_id, dispatched.task_id, "carried") for dispatched in self._carried]
        return carried + [(agent, task, "held") for agent, task in held if task not in self._carried_ids]

    def back_online(self, agent_id: str, current: Round | None) -> None:
        """An agent came back online while ``current`` was the round in progress (read once, as its unanswered
        tasks were sent again): if that round does not collect, the task the next round carries for it goes to it
        again then (:meth:`take_back_online`)."""
        if current is None or current.phase is not Phase.COLLECTING:
            with self._lock:
                self._back.add(agent_id)

    def take_back_online(self) -> set[str]:
        """The agents back online while no round collected, since last asked."""
        with self._lock:
            back, self._back = self._back, set()
        return back
