"""Update intake: an agent's update from its chunks to the result a round folds in.

`UpdateIntake` puts the chunks of one transfer back together, decodes the update once (:class:`Arrival`), hands it
to the round in progress and acks it (an ack says stored for aggregation, or why it never will be); as the round's
:class:`~coordinator.round.Intake` it examines it against its task (the spec trained must sit inside the one sent,
its tensors be exactly that spec's and of its shapes), stores it in the journal before its ack, measures how far it
moved the weights its task sent (screening), and reads a stored one back when screening takes an update out.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from common.logs import Logger
from common.mqtt_link import MqttLink
from coordinator.in_flight import InFlight
from coordinator.journal import RoundJournal
from coordinator.metrics import TaskRecord, TaskStatus
from coordinator.round import Examined, Receipt, Round, Verdict
from coordinator.screening import Change, change_of_result
from coordinator.secure.room import SecureRounds
from coordinator.staleness import rebased
from coordinator.strategies.base import Strategy
from coordinator.tasks import TaskPlan, TaskResult
from models import ModelFamily, SubmodelSpec, check_shapes
from protocol import Ack, BytesLike, ProtocolError, Reassembler, Topics, Update, decode, encode

#: Index maps kept, one per trained spec (levels, exits, FeDepth's segments, AdaptiveFL's models).
INDEX_MAPS_KEPT = 256

#: Transfers reassembled at once at most (their bytes are bounded by ``MAX_BUFFERED_BYTES``).
MAX_TRANSFERS = 100_000

#: Bytes of incomplete transfers kept at most: bounded by bytes, not by count, since a large fleet uploads at once.
MAX_BUFFERED_BYTES = 2 * 2**30


_message_thread = threading.local()


@dataclass(frozen=True)
class Arrival:
    """A whole update as it arrived: decoded, the message's bytes (a read-only view) and their sha256."""

    update: Update
    payload: BytesLike
    digest: str


def single_threaded_torch() -> None:
    """Run this thread's torch operations on one core (once per thread; other threads keep their setting).

    The thread that takes messages folds each update in and measures its change: passes over memory that one core
    does at memory speed, while torch's intra-op threads, contending with the round's own thread and the broker,
    made them up to 20 times slower here (an add of 1M floats: 0.3-0.6 ms on one thread, 7-10 ms on two)."""
    if not getattr(_message_thread, "single", False):
        torch.set_num_threads(1)
        _message_thread.single = True


def spec_or_none(spec: dict[str, object] | None) -> SubmodelSpec | None:
    """The spec an agent named, or None when it named none or a malformed one."""
    try:
        return SubmodelSpec.from_dict(spec) if spec is not None else None
    except ValueError:
        return None


def _describe(spec: dict[str, object]) -> str:
    """A readable form of a spec dict from an agent, or a note that it is malformed."""
    parsed = spec_or_none(spec)
    return parsed.describe() if parsed is not None else "(malformed spec)"


def _float_tensor(array: np.ndarray) -> torch.Tensor:
    """A float32 tensor of ``array``: a view when it is float32 already, even a read-only one (a decoded update
    holds views on the message as it arrived; aggregation and screening only read it)."""
    values = np.ascontiguousarray(array, dtype=np.float32).reshape(np.shape(array))  # (keeps a 0-d shape)
    if values.flags.writeable:
        return torch.from_numpy(values)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(values)


class UpdateIntake:
    """Updates in, from chunks to results (see the module docstring). ``in_flight`` gives the states the tasks of a
    round were cut from (what an update is measured against; a buffered round's stale updates name earlier rounds)
    and decides what an update gets while no round is in progress; ``num_classes`` is the dataset's;
    ``on_accepted(round)``: the round took an update as new; ``on_receipt(verdict, bytes, answers)``: every whole
    update, how the round took it (a :class:`Verdict` value), its size and the round's answers then (None: no
    round); ``secure``: the secure rounds' room, which reads a secure task's masked update against its slice and is
    told of every update a round takes (`coordinator.secure.room.SecureRounds`)."""

    def __init__(self, family: ModelFamily, strategy: Strategy, journal: RoundJournal, num_classes: int,
                 in_flight: InFlight, link: MqttLink, topics: Topics, log: Logger, *,
                 on_accepted: Callable[[Round], None] | None = None,
                 on_receipt: Callable[[str, int, int | None], None] | None = None,
                 secure: SecureRounds | None = None) -> None:
        self._link = link  # acks go out through it
        self.topics = topics
        self.family = family
        self.strategy = strategy
        self.journal = journal
        self.num_classes = num_classes
        self._in_flight = in_flight
        self._on_accepted = on_accepted
        self._on_receipt = on_receipt
        self._secure = secure
        self.log = log
        self.reassembler = Reassembler(max_buffered_bytes=MAX_BUFFERED_BYTES, max_transfers=MAX_TRANSFERS)
        self._index_maps: dict[SubmodelSpec, dict[str, tuple[torch.Tensor, ...]]] = {}

    def on_chunk(self, agent_id: str, payload: bytes) -> Arrival | None:
        """Feed one chunk of ``agent_id``'s upload; once its transfer is whole, the update decoded (once: the round
        examines this object), else None. ProtocolError for a malformed update or one that names another agent."""
        whole = self.reassembler.feed_transfer(payload, source=agent_id)
        if whole is None:
            return None
        update = decode(whole.payload, expected=Update)  # a read-only view; its sha256 computed as its chunks came
        assert isinstance(update, Update)
        if update.agent_id != agent_id:
            raise ProtocolError(f"update from agent {update.agent_id!r} published on the topic of {agent_id!r}")
        return Arrival(update, whole.payload, whole.sha256)

    def take(self, arrival: Arrival, current: Round | None) -> Receipt | None:
        """Give a whole update to the round in progress ``current`` (read by the caller before it looked for an
        earlier verdict) and answer it with its ack. Returns the receipt; one ``deferred`` (the next round carries
        the task, and none collects now) is not answered: its update is for the caller to keep until a round can
        take it. None when it could not be journaled (not answered: the agent sends it again)."""
        update, agent_id = arrival.update, arrival.update.agent_id
        if current is None:
            receipt = self._in_flight.between_rounds(update.task_id, agent_id, update.round)
        else:
            try:  # stored (journaled) before the ack goes out, and folded into the round's aggregate
                receipt = current.receive(update, arrival.payload, arrival.digest)
            except OSError as exc:
                self.log.error("update_not_journaled", agent=agent_id, task=update.task_id, error=str(exc))
                return None  # no ack: the agent sends it again
            if receipt.verdict is Verdict.ACCEPTED and self._secure is not None and self._secure.enabled:
                self._secure.answered(current.number, set(current.answers))  # (a decline: no advert is coming)
            if receipt.verdict is Verdict.ACCEPTED and self._on_accepted is not None:
                self._on_accepted(current)
        if receipt.verdict is Verdict.DEFERRED:
            return receipt
        # Answered only now: an ack says the update is stored for aggregation, a reason that it never will be. (The
        # round may close and screen it before this ack goes out; its verdict ack settles the device either way.)
        self._link.publish(self.topics.agent_ack(agent_id),
                     encode(Ack(update.task_id, update.round, agent_id, receipt.refusal)))
        self.log.info("update_received", agent=agent_id, task=update.task_id, round=update.round,
                      status=update.status, verdict=receipt.verdict, bytes=len(arrival.payload),
                      refused=receipt.refusal)
        if self._on_receipt is not None:
            self._on_receipt(str(receipt.verdict), len(arrival.payload),
                             len(current.answers) if current is not None else None)
        return receipt

    # ----------------------------------------------------------- the round's Intake
    def examine(self, update: Update, task: TaskPlan) -> Examined:
        """Read an update against its task: its record and, for a trained one, the result to aggregate (or why it
        is refused)."""
        record = TaskRecord(update.agent_id, task.level, TaskStatus.answered(update.status), task.spec.describe(),
                            reason=update.reason, num_samples=update.num_samples, metrics=dict(update.metrics),
                            params_sent=self.family.param_count(task.spec))
        if update.spec_trained is not None:
            record.spec_trained = _describe(update.spec_trained)
        if not update.status.trained:
            return Examined(record)
        try:
            result = self.unpack(update, task)
        except ValueError as exc:
            record.status, record.reason = TaskStatus.REJECTED, str(exc)
            self.log.warning("update_rejected", agent=update.agent_id, task=update.task_id, reason=str(exc))
            return Examined(record, refusal=f"update rejected: {exc}")
        record.spec_trained = result.spec.describe()
        record.level_trained = self.level_of(result.spec)
        record.params_returned = self.family.param_count(result.spec)
        return Examined(record, result)

    def store(self, update: Update, payload: BytesLike) -> None:
        """Journal the update as it arrived, before its ack."""
        self.journal.store(update, payload)

    def measure(self, result: TaskResult, sent_round: int) -> Change:
        """How far an update moved the weights its task sent (in round ``sent_round``), and how far its plan could
        (screening)."""
        sent = self.family.extract(self._in_flight.states_of(sent_round)[result.task.group], result.spec,
                                   keys=result.state.keys(), views=True)
        return change_of_result(result, sent)

    def rebase(self, result: TaskResult, sent_round: int, round_number: int) -> TaskResult:
        """A stale update (its task sent in ``sent_round``) as round ``round_number`` folds it
        (`coordinator.staleness.rebased`); a fresh one as it is."""
        if sent_round == round_number:
            return result
        group, states_of = result.task.group, self._in_flight.states_of
        return rebased(result, states_of(sent_round)[group], states_of(round_number)[group], round_number - sent_round)

    def reload(self, task_id: str, task: TaskPlan) -> TaskResult:
        """A stored update of the round in progress, read back from the journal and unpacked."""
        return self.unpack(self.journal.read_update(task_id), task)

    # ------------------------------------------------------------------ reading
    def unpack(self, update: Update, task: TaskPlan) -> TaskResult:
        """Validate an update against what was sent and return it ready to aggregate (ValueError if not)."""
        if task.secure:
            if self._secure is None:
                raise ValueError("its task was secure and this coordinator runs no secure aggregation")
            return self._secure.unpack(update, task)
        # Where the trained tensors sit is the coordinator's to say (a rolled window: the task's), not the agent's.
        spec = (SubmodelSpec.from_dict(update.spec_trained).rolled(task.spec.roll)
                if update.spec_trained is not None else task.spec)
        self.family.validate_spec(spec)
        if not self.family.is_nested(spec, task.spec):
            raise ValueError(f"agent trained {spec.describe()}, which is not inside the {task.spec.describe()} sent")
        expected = set(self.family.trainable_keys(spec))
        if set(update.weights) != expected:
            missing, extra = sorted(expected - set(update.weights)), sorted(set(update.weights) - expected)
            raise ValueError(f"update tensors do not match {spec.describe()} (missing {missing[:3]}, "
                             f"unexpected {extra[:3]})")
        full_map = self.index_map(spec)
        index_map = {key: full_map[key] for key in expected}
        check_shapes({key: update.weights[key] for key in expected}, index_map, says="expected")
        state = {key: _float_tensor(update.weights[key]) for key in expected}
        labels = [label for label in update.labels if label < self.num_classes]
        return TaskResult(task, spec, state, index_map, update.num_samples, labels)

    def index_map(self, spec: SubmodelSpec) -> dict[str, tuple[torch.Tensor, ...]]:
        """``family.index_map(spec)``, made once per spec (every update of a level has the same one; aggregation
        only reads it)."""
        made = self._index_maps.get(spec)
        if made is None:
            if len(self._index_maps) >= INDEX_MAPS_KEPT:
                self._index_maps.clear()
            made = self._index_maps[spec] = self.family.index_map(spec)
        return made

    def level_of(self, spec: SubmodelSpec) -> str | None:
        """The name of the level (pool model) whose spec ``spec`` is, if any."""
        return self.strategy.level_of(spec)
