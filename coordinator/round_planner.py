"""From the agents online to a round in progress: plan it with the strategy, journal it before any task goes out,
open it; or open the round a journal holds, after a restart. Before the first round, the strategy sized to the
fleet (:meth:`RoundPlanner.fit_to_fleet`).

A round's tasks are planned for the agents not training a task the round carries (a buffered round's devices),
with a random generator of the round's own (a run resumed after round k selects as one never stopped would). The
journal has the round before it opens (`coordinator.journal`), so a coordinator stopped at any point after sends the
same tasks again.
"""

from __future__ import annotations

import hashlib
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

from common.logs import Logger
from coordinator.config import CoordinatorConfig
from coordinator.dispatch import Dispatcher
from coordinator.fleet import FleetWatch
from coordinator.in_flight import InFlight
from coordinator.privacy.guard import PrivacyGuard
from coordinator.registry import AgentRecord
from coordinator.round import DispatchedTask, Intake, Round
from coordinator.run_files import RunFiles
from coordinator.secure.room import SecureRounds
from coordinator.serving import ServiceLog
from coordinator.strategies.base import Strategy
from coordinator.tasks import Skip, TaskPlan

__all__ = ["RoundPlanner"]


class RoundPlanner:
    """Plans, journals and opens rounds (see the module docstring)."""

    def __init__(self, config: CoordinatorConfig, strategy: Strategy, fleet: FleetWatch, in_flight: InFlight,
                 files: RunFiles, intake: Intake, privacy: PrivacyGuard, secure: SecureRounds, log: Logger) -> None:
        self._config = config
        self._privacy = privacy
        self._secure = secure
        self._strategy = strategy
        self._fleet = fleet
        self._in_flight = in_flight
        self._files = files
        self._journal = files.journal
        self._intake = intake
        self._log = log

    def next_round(self, round_number: int, *, stopped: Callable[[], bool],
                   on_count: Callable[[int], None]) -> Round | None:
        """Round ``round_number``, open: the one resumed from the journal (its agents heard first), else one planned
        now for the agents online once the fleet is in (`FleetWatch.online_for_round`, ``on_count(online)`` as
        they come), the strategy sized to them before the first round. None when ``stopped()`` meanwhile."""
        current = self._in_flight.current()
        if current is not None and current.number == round_number:
            self._fleet.settle_for(len({dispatched.task.agent_id for dispatched in current.tasks.values()}))
            return current
        waiting = time.perf_counter()
        online, misfits = self._fleet.online_for_round(stopped=stopped, on_count=on_count)
        if stopped():
            return None
        planning = time.perf_counter()
        if self._strategy.awaits_fleet and self._files.completed_rounds == 0:
            self.fit_to_fleet([budget for agent in online if (budget := agent.budget()) is not None])
        planned = self.plan(round_number, online, misfits)
        planned.timing["waiting_for_agents"] = planning - waiting
        planned.timing["planning"] = time.perf_counter() - planning
        return planned

    def plan(self, round_number: int, online: Sequence[AgentRecord], misfits: Sequence[Skip]) -> Round:
        """Plan round ``round_number`` for the ``online`` agents (``misfits``: those whose data does not fit, each
        recorded as skipped), journal it and open it."""
        carried = self._in_flight.carried
        training = {dispatched.task.agent_id for dispatched in carried}
        free = [agent for agent in online if agent.agent_id not in training]
        self._fleet.tell_service(free)
        rng = random.Random(f"{self._config.seed}:{round_number}")
        plan = self._strategy.configure_round(round_number, free, rng)
        skipped = [*plan.skipped, *misfits]
        deadline = time.time() + self._config.round_timeout_s
        tasks = self._secure.plan(self._privacy.plan({Dispatcher.task_id(round_number, task.agent_id): task
                                                      for task in plan.tasks}))
        bases = self._in_flight.plan(round_number)
        self._journal.begin(round_number, deadline, tasks, skipped, carried, bases)  # before any task goes out
        planned = self.new_round(round_number, tasks, skipped, deadline, carried)
        self._in_flight.install(planned)
        return planned

    def fit_to_fleet(self, budgets: Sequence[int]) -> None:
        """Size what the strategy hands out from the fleet's ``budgets`` (its ``auto`` settings) and make the
        initial states of the models it chose, checkpointed as round 0 before any task goes out (a coordinator
        stopped in round 1 resumes them). Nothing where the strategy sizes nothing; RuntimeError after round 1 began."""
        if not self._strategy.awaits_fleet:
            return
        if self._files.completed_rounds or self._in_flight.current() is not None:
            raise RuntimeError("the strategy can only be sized to the fleet before the first round")
        told = self._strategy.fit_to_fleet(budgets)
        if told is not None:
            self._in_flight.states = self._strategy.initial_states(self._config.seed)
            self._fleet.service_log = ServiceLog(self._strategy)
            self._files.checkpoint(self._in_flight.states)
            self._log.info("sized_to_fleet", detail=told)

    def new_round(self, round_number: int, tasks: dict[str, TaskPlan], skipped: list[Skip], deadline: float,
                  carried: Sequence[DispatchedTask] = (), *, resumed: bool = False) -> Round:
        """A round of these tasks (and, buffered, the ``carried`` tasks of earlier rounds still training), cut from
        the current states. A buffered run's last round waits for every task it holds (``buffered.drain_last``): the
        run ends with what its devices trained aggregated, not carried into a round that never comes."""
        config = self._config
        last = round_number >= config.rounds and config.buffered.drain_last
        size = config.buffered.size if config.round_mode == "buffered" and not last else None
        aggregate = self._privacy.aggregate(round_number, len(tasks) + len(carried),
                                            self._strategy.begin_aggregate(self._in_flight.states))
        if not resumed:  # (a secure round resumed cannot be unmasked: `coordinator.secure.room`)
            aggregate = self._secure.aggregate(round_number, tasks, deadline, aggregate)
        screening = self._privacy.screening(config.screening)
        if self._secure.enabled:  # no change to measure in a masked update
            screening = replace(screening, peers=False, record=False)
        return Round(round_number, tasks, skipped, deadline, aggregate, screening, self._intake, carried=carried,
                     buffer_size=size,
                     max_staleness=config.buffered.max_staleness)

    def resume(self, completed_rounds: int, grace_s: float) -> None:
        """Open the round the journal holds, if it is the next one, with the updates it had stored (taken again as
        if they arrived now, without storing them again), its deadline at least ``grace_s`` seconds away (at most a
        round's timeout): from the first message on, so that an update its agents resend before the round loop gets
        to it is not refused for good. A buffered round's carried tasks, journaled with its checkpoint, go to the
        next round planned."""
        pending = self._journal.load()
        if pending is not None and pending.round == completed_rounds:  # checkpointed, then stopped before the
            pending = self._journal.load_next()  # journal said what the next round carries (as carry_on recorded it)
        if pending is None or pending.round != completed_rounds + 1:
            return
        if pending.round == 1 and self._strategy.awaits_fleet:
            # Its tasks were planned with models sized to the fleet, which no checkpoint kept (a journal of a
            # coordinator that checkpointed the sizing only with round 1): plan it again.
            self._log.warning("first_round_planned_again", round=pending.round,
                              reason="the strategy is sized to the fleet at its first round")
            return
        if not pending.planned:
            # All of them, those past their deadline too: the next round records one missing when it closes without
            # its update, as a round never stopped would.
            self._in_flight.carry(pending.carried, pending.bases)
            self._log.info("carried_tasks_resumed", round=pending.round, tasks=len(pending.carried))
            return
        deadline = max(pending.deadline, time.time() + min(self._config.round_timeout_s, grace_s))
        self._in_flight.resume(pending.round, pending.bases)
        resumed = self.new_round(pending.round, pending.tasks, pending.skipped, deadline, pending.carried,
                                 resumed=True)
        self._in_flight.install(resumed)
        for update, payload in self._journal.stored(resumed.tasks):
            resumed.receive(update, payload, hashlib.sha256(payload).hexdigest(), stored=True)
        self._log.info("round_resumed", round=pending.round, tasks=len(pending.tasks),
                       stored_updates=len(resumed.answers))
