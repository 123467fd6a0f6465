"""One round of the federation as a state machine: planned -> collecting -> aggregating -> closed.

- **planned**: its tasks are chosen and journaled (a fresh round) or read back from the journal (a round resumed
  after a crash). Nothing is taken yet.
- **collecting** (:meth:`Round.open`): updates are taken as they come (:meth:`Round.receive`, on the thread that
  handles messages). Each is examined once (validated against its task by the round's :class:`Intake`), stored
  (journaled) before its ack, measured (its change, for screening) and folded into the round's aggregate at once; the round keeps only
  what the report needs of it, never its weights, so its memory is one aggregate whatever the number of updates.
  Screening's first rule (the plan's reach) needs nothing but the update, so an update beyond it is not folded.
- **aggregating** (:meth:`Round.close`): no update is taken any more. Screening's second rule needs the round's
  medians, so it runs now over the kept changes; when it rejects an update (rare: an attack, not a habit), the
  aggregate is built again from the journal with the updates that stay in, one at a time. (Subtracting the outlier
  would not do: a huge update swamps the others' float32 sums, and taking it out leaves zeros or infinities.)
- **closed** (:meth:`Round.finish`): the new states are out; the daemon evaluates and checkpoints them.

A fresh round and a resumed one differ only in how they are planned: the updates a resumed one had stored are
received through the same path (without storing them again), and its tasks without an update are sent again.

A buffered round (``buffer_size``; :mod:`coordinator.staleness`) also holds the tasks of earlier rounds still
training (carried), whose updates are folded rebased by their staleness; it stops collecting once its buffer of
trained updates is full, and decides when it closes which of its unanswered tasks the next round carries (an update
for one of them that comes meanwhile is deferred: not answered, sent again to the next round).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from enum import Enum
from typing import Protocol

from coordinator.aggregation import RoundAggregate
from coordinator.config import ScreeningConfig
from coordinator.metrics import TaskRecord, TaskStatus
from coordinator.screening import Change, beyond_reach, outliers
from coordinator.staleness import buffer_size
from coordinator.tasks import Skip, State, TaskPlan, TaskResult
from models import SubmodelSpec
from protocol import BytesLike, TextEnum, Update, UpdateStatus

__all__ = ["DEVICE_METRICS", "Answer", "DispatchedTask", "Examined", "Intake", "Phase", "Receipt", "Round", "Verdict"]

#: The update metric each device phase is read from (the agent's TaskRunner and daemon write them).
DEVICE_METRICS = {"queued": "seconds_queued", "decision": "seconds_decision", "training": "seconds",
                  "slowdown": "seconds_slowdown"}


#: The change of a masked update (a secure round's): unknown to the coordinator.
UNMEASURED = Change(math.nan, 0, 0.0, None)


class Phase(Enum):
    """Where a round is (see the module docstring)."""

    PLANNED = "planned"
    COLLECTING = "collecting"
    AGGREGATING = "aggregating"
    CLOSED = "closed"


@dataclass(frozen=True)
class DispatchedTask:
    """What the coordinator sent: the strategy's task plan, with its id, round and when its answer is due."""

    task_id: str
    round: int
    task: TaskPlan
    deadline: float


@dataclass
class Examined:
    """The daemon's reading of an update against its task: its record for the report and, for an update to
    aggregate, the result ready to fold, or why it is refused (then it is never stored)."""

    record: TaskRecord
    result: TaskResult | None = None
    refusal: str | None = None


@dataclass
class Answer:
    """What a round keeps of an answered task: the update without its weights, its size in bytes and the sha256 of
    the message as it arrived, its record, why it was refused at its ack (never stored) and, for an update folded
    in, its trained spec, the keys it trained, its change and screening's verdict (``rejection``, None while it
    stays aggregated)."""

    update: Update
    size: int
    digest: str
    record: TaskRecord
    refusal: str | None = None
    spec: SubmodelSpec | None = None
    keys: frozenset[str] = frozenset()
    change: Change | None = None
    rejection: str | None = None
    arrived: float = 0.0  # time.monotonic() when the round took it

    @property
    def screened(self) -> bool:
        """Whether the update was valid and screening judged it (it hears a verdict)."""
        return self.change is not None

    @property
    def aggregated(self) -> bool:
        """Whether the update is in the round's aggregate."""
        return self.change is not None and self.rejection is None


class Verdict(TextEnum):
    """How a round took an update: new, the same message again, another update for a task that has one, after the
    round stopped collecting, or for no task of the round; ``deferred``: after a buffered round stopped collecting,
    for a task the next round carries (not answered: the agent sends it again, and the next round takes it)."""

    ACCEPTED = "accepted"
    DUPLICATE = "duplicate"
    CONFLICT = "conflict"
    LATE = "late"
    UNKNOWN = "unknown"
    DEFERRED = "deferred"


@dataclass(frozen=True)
class Receipt:
    """How a round took an update (``verdict``) and why it will never be aggregated (``refusal``; None: it is
    stored)."""

    verdict: Verdict
    refusal: str | None = None


class Intake(Protocol):
    """What a round asks of the coordinator about its updates (`coordinator.intake.UpdateIntake`): the one way
    the round talks to it."""

    def examine(self, update: Update, task: TaskPlan) -> Examined:
        """Read an update against its task: its record and the result to fold, or why it is refused."""

    def store(self, update: Update, payload: BytesLike) -> None:
        """Keep the update as it arrived (the journal) before its ack; an OSError means it is not kept."""

    def measure(self, result: TaskResult, sent_round: int) -> Change:
        """How far the update moved the weights its task sent in round ``sent_round``, and how far its plan could
        (screening)."""

    def rebase(self, result: TaskResult, sent_round: int, round_number: int) -> TaskResult:
        """The update of a task sent in ``sent_round`` as round ``round_number`` folds it (itself when they are
        the same: `coordinator.staleness.rebased`)."""

    def reload(self, task_id: str, task: TaskPlan) -> TaskResult:
        """A stored update read back and examined again, for the aggregate to be built anew."""


class Round:
    """One round (see the module docstring). Thread-safe: :meth:`receive` runs on the message thread while the
    round's own thread waits, closes and finishes it. It examines, stores, measures and reads back its updates
    through ``intake``."""

    def __init__(self, number: int, tasks: dict[str, TaskPlan], skipped: list[Skip], deadline: float,
                 aggregate: RoundAggregate, screening: ScreeningConfig, intake: Intake, *,
                 carried: Sequence[DispatchedTask] = (), buffer_size: int | None = None,
                 max_staleness: int = 0) -> None:
        """``carried``: tasks of earlier rounds still training (a buffered round takes their updates, rebased by
        their staleness: :mod:`coordinator.staleness`); ``buffer_size``: the trained updates a buffered round
        aggregates at (0: half of those its tasks may bring, `coordinator.staleness.buffer_size`; None: a
        synchronous round waits for every task); ``max_staleness``: how many rounds old a task may be in the
        next round for this one to carry it there."""
        self.number = number
        self.tasks = {task_id: DispatchedTask(task_id, number, task, deadline) for task_id, task in tasks.items()}
        self.tasks.update({dispatched.task_id: dispatched for dispatched in carried})
        self.buffer_size = buffer_size
        self.max_staleness = max_staleness
        self._carry: frozenset[str] = frozenset()  # a closed buffered round's tasks the next round carries
        self._stopped_at = 0.0  # when it stopped collecting (wall clock): the moment the carry is decided for
        self.skipped = skipped
        self.deadline = deadline
        self.phase = Phase.PLANNED
        self.answers: dict[str, Answer] = {}
        #: Seconds this round spent examining (validation and screening's measure) and folding updates in.
        self.timing: dict[str, float] = {"validation": 0.0, "aggregation": 0.0}
        self._aggregate = aggregate
        self._screening = screening
        self._intake = intake
        self._sent_at: dict[str, float] = {}  # task id -> time.monotonic() when it was (last) sent
        self._taking = 0  # updates being taken (examined, stored, folded) outside the lock
        self._interrupted = False
        self._done = threading.Condition()

    # ------------------------------------------------------------------ collecting
    def open(self) -> None:
        """planned -> collecting: updates are taken from now on."""
        with self._done:
            self._expect(Phase.PLANNED)
            self.phase = Phase.COLLECTING

    def receive(self, update: Update, payload: BytesLike, digest: str, *, stored: bool = False) -> Receipt:
        """Take an update, decoded from ``payload`` (see :class:`Receipt`). A new one is examined, stored (unless
        refused, or ``stored`` already: a round resumed from the journal) and folded in; an OSError from storing
        it leaves the round as it was (the agent sends the update again).

        Called from one thread at a time (the message thread; before the link starts, the resume). The work is
        done outside the round's lock, so that the round's own thread (dispatching, waiting) is never held up by
        it; :meth:`close` waits for an update being taken to be in."""
        with self._done:
            verdict = self._verdict(update, digest)
            if verdict is Verdict.DUPLICATE:
                return Receipt(verdict, self.answers[update.task_id].refusal)
            if verdict is Verdict.DEFERRED:
                return Receipt(verdict)
            if verdict is not Verdict.ACCEPTED:
                return Receipt(verdict, self._refusal(update, verdict))
            self._taking += 1
        try:
            started = time.perf_counter()
            dispatched = self.tasks[update.task_id]
            examined = self._intake.examine(update, dispatched.task)
            examined.record.staleness = self.number - dispatched.round
            self.timing["validation"] += time.perf_counter() - started
            answer = Answer(replace(update, weights={}), len(payload), digest, examined.record, examined.refusal,
                            arrived=time.monotonic())
            if examined.refusal is None:
                if not stored:
                    self._intake.store(update, payload)
                if examined.result is not None:
                    try:
                        self._fold(answer, examined.result, dispatched.round)
                    except ValueError as exc:  # it does not fit its group's model: stored, never aggregated
                        answer.refusal = f"update rejected: {exc}"
                        answer.record.status, answer.record.reason = TaskStatus.REJECTED, str(exc)
                        answer.change = None
        except BaseException:
            with self._done:
                self._taking -= 1
                self._done.notify_all()
            raise
        with self._done:
            self.answers[update.task_id] = answer
            self._taking -= 1
            self._done.notify_all()
        return Receipt(verdict, answer.refusal)

    def _verdict(self, update: Update, digest: str) -> Verdict:
        dispatched = self.tasks.get(update.task_id)
        if dispatched is None or update.round != dispatched.round or dispatched.task.agent_id != update.agent_id:
            return Verdict.UNKNOWN
        if update.task_id in self.answers:
            first = self.answers[update.task_id].digest
            return Verdict.CONFLICT if digest and first and digest != first else Verdict.DUPLICATE
        if self.phase is not Phase.COLLECTING:
            if self.phase not in (Phase.AGGREGATING, Phase.CLOSED):
                return Verdict.UNKNOWN
            return Verdict.DEFERRED if self._carries(update.task_id) else Verdict.LATE
        return Verdict.ACCEPTED

    def _carries(self, task_id: str) -> bool:
        """Whether the next round carries ``task_id`` (lock held; once the round stopped collecting): a buffered
        round's task without an answer, its deadline not passed when the round stopped collecting, that would be at
        most ``max_staleness`` rounds old there. The same answer before :meth:`close` has decided (while it waits
        for an update being taken: another task's answers do not change it) as after."""
        dispatched = self.tasks[task_id]
        return (self.buffer_size is not None and task_id not in self.answers
                and dispatched.deadline > self._stopped_at and self.number + 1 - dispatched.round <= self.max_staleness)

    def receipt_before_upload(self, task_id: str, round_number: int, agent_id: str, digest: str) -> Receipt | None:
        """What the round would answer an update of ``task_id`` (its sha256 ``digest``; empty when unknown) with,
        decided before the agent sends it (an agent asking to upload, `coordinator.upload_grants`): None when the
        round would take it, else the receipt (stored already, deferred to the next round, or why it never will
        be). Without a digest, an update for a task that has one is taken as the same (its ack again)."""
        probe = Update(task_id, round_number, agent_id, UpdateStatus.DECLINED, None, 0, [], {}, {})
        with self._done:
            verdict = self._verdict(probe, digest)
            if verdict is Verdict.ACCEPTED:
                return None
            if verdict in (Verdict.DUPLICATE, Verdict.DEFERRED):
                return Receipt(verdict, self.answers[task_id].refusal if verdict is Verdict.DUPLICATE else None)
            return Receipt(verdict, self._refusal(probe, verdict))

    def _refusal(self, update: Update, verdict: Verdict) -> str:
        if verdict is Verdict.LATE:
            return f"round {update.round} closed before the update arrived"
        if verdict is Verdict.CONFLICT:
            return (f"another update for task {update.task_id!r} arrived first and is the one kept (is this device's "
                    f"login used elsewhere?)")
        return f"unknown task {update.task_id!r} of round {update.round}: round {self.number} is in progress"

    def _fold(self, answer: Answer, result: TaskResult, sent_round: int) -> None:
        """Measure a valid update (against what its task was sent, in round ``sent_round``), and fold it in unless
        it is beyond its plan's reach (screening's first rule); a stale one rebased by its staleness."""
        started = time.perf_counter()
        if result.masked is not None:  # a secure round's masked slice: nothing to measure or screen
            keys = frozenset(name.partition("/")[2] for name in result.masked)  # (named group/key)
            answer.spec, answer.keys, answer.change = result.spec, keys, UNMEASURED
            self._aggregate.add(result)
            self.timing["aggregation"] += time.perf_counter() - started
            return
        change = self._intake.measure(result, sent_round)
        measured = time.perf_counter()
        self.timing["validation"] += measured - started
        answer.spec, answer.keys, answer.change = result.spec, frozenset(result.state), change
        answer.record.screening = change.as_dict() if self._screening.record else {}
        reason = beyond_reach(result, change) if self._screening.enabled else None
        if reason is not None:
            self._reject(answer, reason)
            return
        self._aggregate.add(self._intake.rebase(result, sent_round, self.number))
        self.timing["aggregation"] += time.perf_counter() - measured

    @staticmethod
    def _reject(answer: Answer, reason: str) -> None:
        answer.rejection = reason
        answer.record.status, answer.record.reason = TaskStatus.REJECTED, reason

    def mark_sent(self, task_id: str) -> None:
        """Note that ``task_id``'s task went out (again) now: its update's transfer time counts from here."""
        with self._done:
            self._sent_at[task_id] = time.monotonic()

    def unanswered(self, agent_id: str) -> list[DispatchedTask]:
        """The tasks of ``agent_id`` still waiting for an update (none once the round stopped collecting)."""
        with self._done:
            if self.phase not in (Phase.PLANNED, Phase.COLLECTING):
                return []
            return [task for task_id, task in self.tasks.items()
                    if task.task.agent_id == agent_id and task_id not in self.answers]

    def interrupt(self) -> None:
        """End :meth:`wait` now (the run is ending)."""
        with self._done:
            self._interrupted = True
            self._done.notify_all()

    def wait(self, extension: Callable[[], float] = lambda: 0.0) -> bool:
        """Block until every task has an answer (a buffered round: its buffer of trained updates is full), the round
        is interrupted, or its wall-clock deadline plus ``extension()`` seconds (read as it grows, e.g. a broker
        outage) passes; True when every task answered (a buffered round: its buffer is full)."""
        with self._done:
            while not self._full() and not self._interrupted:
                remaining = self.deadline + extension() - time.time()
                if remaining <= 0:
                    break
                self._done.wait(min(remaining, 1.0))
            return self._full()

    def _full(self) -> bool:
        """Every task answered, or (buffered) the buffer's trained updates in (lock held)."""
        if len(self.answers) >= len(self.tasks) or self.buffer_size is None:
            return len(self.answers) >= len(self.tasks)
        trained = sum(1 for answer in self.answers.values() if answer.update.status.trained)
        return trained >= buffer_size(self.buffer_size, len(self.tasks), len(self.answers) - trained)

    # ------------------------------------------------------------------ aggregating
    def close(self) -> None:
        """collecting -> aggregating: take no more updates (one being received finishes first) and run
        screening's second rule over the kept changes; when it rejects any, build the aggregate again from the
        updates that stay in (read back one at a time through the intake, in task id order)."""
        with self._done:
            self._expect(Phase.COLLECTING)
            self.phase = Phase.AGGREGATING
            self._stopped_at = time.time()
            while self._taking:
                self._done.wait()
            self._carry = frozenset(task_id for task_id in self.tasks if self._carries(task_id))
        started = time.perf_counter()
        if self._screening.enabled and self._screening.peers:
            screened = [(task_id, answer, answer.spec, answer.change) for task_id, answer in sorted(self.answers.items())
                        if answer.spec is not None and answer.change is not None]
            reasons = outliers([(spec, change) for _, _, spec, change in screened],
                               [answer.rejection is None for _, answer, _, _ in screened], self._screening)
            for (_, answer, _, _), reason in zip(screened, reasons):
                if reason is not None:
                    self._reject(answer, reason)
            if any(reason is not None for reason in reasons):
                self._aggregate = self._aggregate.fresh()
                for task_id, answer in sorted(self.answers.items()):
                    if answer.aggregated:
                        dispatched = self.tasks[task_id]
                        self._aggregate.add(self._intake.rebase(self._intake.reload(task_id, dispatched.task),
                                                                dispatched.round, self.number))
        self.timing["aggregation"] += time.perf_counter() - started

    def finish(self) -> dict[str, State]:
        """aggregating -> closed: the new states (the aggregate of the updates that stayed in)."""
        with self._done:
            self._expect(Phase.AGGREGATING)
        started = time.perf_counter()
        states = self._aggregate.result()
        self.timing["aggregation"] += time.perf_counter() - started
        with self._done:
            failure, left_out = self._aggregate.failure, self._aggregate.left_out
            for answer in self.answers.values():  # (a secure round not unmasked, or some of its updates left out)
                reason = failure if failure is not None else left_out.get(answer.update.agent_id)
                if answer.aggregated and reason is not None:
                    self._reject(answer, reason)
            self.phase = Phase.CLOSED
        return states

    # ------------------------------------------------------------------ reading
    def carried_over(self) -> list[DispatchedTask]:
        """A closed buffered round's tasks still training, for the next round (none from a synchronous round): as
        :meth:`close` found them, those without an answer whose deadline had not passed and whose updates would be
        at most ``max_staleness`` rounds old there. An update for one of them that comes meanwhile is deferred."""
        with self._done:
            return [self.tasks[task_id] for task_id in sorted(self._carry)]

    def aggregated(self) -> Iterator[Answer]:
        """The answers whose update is in the aggregate, by task id."""
        return (answer for _, answer in sorted(self.answers.items()) if answer.aggregated)

    def device_times(self) -> list[dict[str, float]]:
        """Per update, where its device's time went (seconds; see ``coordinator.metrics.DEVICE_PHASES``): the
        waiting, decision and training its metrics report, and the transfer: the time from its task's dispatch to
        its arrival that the device did not report as its own (``seconds_queued`` + ``seconds_task``)."""
        with self._done:
            times = []
            for task_id, answer in sorted(self.answers.items()):
                metrics = answer.update.metrics
                entry = {phase: float(metrics[name]) for phase, name in DEVICE_METRICS.items() if name in metrics}
                sent = self._sent_at.get(task_id)
                if sent is not None and "seconds_task" in metrics:
                    own = float(metrics["seconds_task"]) + float(metrics.get("seconds_queued", 0.0))
                    entry["transfer"] = max(0.0, answer.arrived - sent - own)
                times.append(entry)
            return times

    @property
    def bytes_up(self) -> int:
        """Bytes of every update the round took."""
        return sum(answer.size for answer in self.answers.values())

    def _expect(self, phase: Phase) -> None:
        if self.phase is not phase:
            raise RuntimeError(f"round {self.number} is {self.phase.value}, not {phase.value}")

