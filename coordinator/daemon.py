"""The coordinator daemon: select agents, dispatch sub-models, collect, aggregate, evaluate, checkpoint.

Network messages arrive on the MQTT link's dispatcher thread and only touch the registry and the current
round's collector; the round loop runs on the caller's thread.

Misconfigurations end loudly: a publish the broker refuses (its ACL: another federation, or a login that is not
the coordinator's) stops the run with :class:`BrokerRefused`; a fleet with no agent of this federation is told
which federations the broker does show; an agent whose data does not fit the model is never planned for.
"""

from __future__ import annotations

import hashlib
import random
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from common import heap
from common.blas_threads import guard_blas_threads
from common.data import Dataset, load_dataset, subsample
from common.logs import get_logger
from common.mqtt_link import BrokerRefused, MqttLink, Will
from coordinator.checkpoint import load_checkpoint, save_checkpoint
from coordinator.config import CoordinatorConfig
from coordinator.data_fit import data_misfit
from coordinator.evaluation import Evaluator
from coordinator.federations import federations_seen
from coordinator.journal import JournaledRound, RoundJournal
from coordinator.metrics import MetricsWriter, RoundResult, TaskRecord, round_timing
from coordinator.planning import model_family, strategy_for
from coordinator.registry import AgentRecord, FleetRegistry
from coordinator.round import Answer, Examined, Receipt, Round
from coordinator.screening import Change, change_of_result
from coordinator.serving import ServiceLog, answer_text, unserved_text
from coordinator.strategies import TaskOutcome, TaskPlan, TaskResult
from coordinator.strategies.base import Skip
from models import ModelFamily, SubmodelSpec
from protocol import (
    HEAD_ALONE_REVISION,
    PROTOCOL_VERSION,
    Ack,
    Adaptation,
    AgentStatus,
    CoordinatorStatus,
    ModelRef,
    ProtocolError,
    Reassembler,
    Task,
    Topics,
    TrainingPlan,
    Update,
    decode,
    encode,
    encode_parts,
    iter_chunks,
    parse_agent_topic,
)

AGGREGATED = ("ok", "adapted")


def _spec_or_none(spec: dict[str, object] | None) -> SubmodelSpec | None:
    """The spec an agent named, or None when it named none or a malformed one."""
    try:
        return SubmodelSpec.from_dict(spec) if spec is not None else None
    except ValueError:
        return None


_message_thread = threading.local()


def single_threaded_torch() -> None:
    """Run this thread's torch operations on one core (once per thread; other threads keep their setting).

    The thread that takes messages folds each update in and measures its change: passes over memory that one core
    does at memory speed, while torch's intra-op threads, contending with the round's own thread and the broker,
    made them up to 20 times slower here (an add of 1M floats: 0.3-0.6 ms on one thread, 7-10 ms on two)."""
    if not getattr(_message_thread, "single", False):
        torch.set_num_threads(1)
        _message_thread.single = True


def _float_tensor(array: np.ndarray) -> torch.Tensor:
    """A float32 tensor of ``array``: a view when it is float32 already, even a read-only one (a decoded update
    holds views on the message as it arrived; aggregation and screening only read it)."""
    values = np.ascontiguousarray(array, dtype=np.float32)
    if values.flags.writeable:
        return torch.from_numpy(values)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(values)


def _describe(spec: dict[str, object]) -> str:
    """A readable form of a spec dict from an agent, or a note that it is malformed."""
    parsed = _spec_or_none(spec)
    return parsed.describe() if parsed is not None else "(malformed spec)"


class NoAgentsError(RuntimeError):
    """No agent came online in time (before the first round: fewer than ``min_agents``)."""


@dataclass(frozen=True)
class Progress:
    """What the coordinator is doing, for a live display: ``phase`` "fleet" (waiting for ``expected`` agents
    before the first round, ``done`` online) or "round" (round ``round``, ``done`` of its ``expected`` updates
    in). ``on_progress`` gets these on the round's thread and on the one handling messages: it must not block."""

    phase: str
    round: int
    done: int
    expected: int


#: A status from a process that another one of its agent id replaced, within this many seconds, means two
#: processes use the id (a restart says 'offline' first, or its Last Will does, unless the broker was down).
TWO_INSTANCES_WINDOW_S = 120.0

#: Index maps the coordinator keeps, one per trained spec (levels, exits, FeDepth's segments, AdaptiveFL's models).
INDEX_MAPS_KEPT = 256

#: Transfers the coordinator reassembles at once at most (their bytes are bounded by max_buffered_bytes).
MAX_TRANSFERS = 100_000

#: Bytes of task chunks the coordinator leaves in flight to the broker at most while it dispatches (then it waits for
#: the broker's PUBACKs): a round's tasks, 3.9 GB for 1000 agents of a 1M-parameter model, would otherwise be queued
#: in paho all at once. ``DISPATCH_WAIT_S``: how long it waits for room before sending anyway (a broker away).
DISPATCH_WINDOW_BYTES = 64 * 2**20
DISPATCH_WAIT_S = 30.0

#: Seconds a round resumed from the journal waits at least for the updates its agents are still resending.
RESUME_GRACE_S = 60.0

#: Seconds without a new agent status after which the registry counts as settled before the first round: the
#: broker delivers the retained statuses of the whole fleet in one burst after the subscription.
REGISTRY_SETTLE_S = 1.0

#: Seconds the first round waits for an agent of this federation before saying which federations the broker
#: shows (and again every ``FEDERATIONS_REPEAT_S`` while none comes).
FEDERATIONS_CHECK_S = 10.0
FEDERATIONS_REPEAT_S = 60.0


class Coordinator:
    """Runs the federation described by a :class:`CoordinatorConfig`."""

    def __init__(
        self,
        config: CoordinatorConfig,
        *,
        dataset: Dataset | None = None,
        on_round: Callable[[RoundResult], None] | None = None,
        on_progress: Callable[[Progress], None] | None = None,
    ) -> None:
        config.validate()
        self.config = config
        self.topics = Topics(config.federation)
        self.log = get_logger("coordinator", federation=config.federation)
        if (blas := guard_blas_threads()) is not None:
            self.log.warning("blas_threads_capped", reason=blas)
        self.dataset = dataset if dataset is not None else load_dataset(config.data.dataset, config.data.root)
        self.family: ModelFamily = model_family(config, self.dataset)
        self.model_ref = ModelRef(config.model.family, self.dataset.num_classes, self.dataset.in_channels,
                                  dict(config.model.options))
        self.strategy = strategy_for(config, self.dataset, self.family)
        self.registry = FleetRegistry()
        self.service_log = ServiceLog(self.strategy)
        #: Why the run cannot go on (the broker refused a publish it needs), one sentence; ends the round loop.
        self.fatal: str | None = None
        self._misfits_told: dict[str, str] = {}  # agents whose data does not fit, with the reason already logged
        #: Per agent id, processes another one of the id replaced while online, with when (see _watch_instances).
        self._replaced_instances: dict[str, dict[str, float]] = {}
        self._fleet_settled = False  # set once the first round of this process has seen the fleet
        self._index_maps: dict[SubmodelSpec, dict[str, tuple[torch.Tensor, ...]]] = {}  # see _index_map
        self._dispatch_unpaced = False  # see _pace_dispatch
        # Transfers bounded by bytes, not by count: a large fleet uploads at once.
        self.reassembler = Reassembler(max_buffered_bytes=2 * 2**30, max_transfers=MAX_TRANSFERS)
        self.on_round = on_round
        self.on_progress = on_progress
        self.rng = random.Random(config.seed)
        self.state_dir = Path(config.state_dir)
        self.checkpoint_path = self.state_dir / "checkpoint.safetensors"
        self.metrics = MetricsWriter(self.state_dir / "metrics.jsonl")
        self.completed_rounds = 0
        if config.resume and self.checkpoint_path.exists():
            self._resume()
        elif self.checkpoint_path.exists():
            raise ValueError(f"state_dir {self.state_dir} holds an earlier run (checkpoint.safetensors): set resume: "
                             f"true to continue it, or give this run another state_dir")
        else:
            self.states = self.strategy.initial_states(config.seed)
        self.journal = RoundJournal(self.state_dir / "round", self.model_ref)
        self._evaluator = self._make_evaluator()
        #: The round in progress (collecting or aggregating), None between rounds; guarded by _round_lock.
        self._round: Round | None = None
        self._round_lock = threading.Lock()
        if config.resume:
            pending = self.journal.load()
            if (pending is not None and pending.round == self.completed_rounds + 1 == 1
                    and self.strategy.awaits_fleet):
                # Its tasks were planned with models sized to the fleet, which no checkpoint kept: plan it again.
                self.log.warning("first_round_planned_again", round=pending.round,
                                 reason="the strategy is sized to the fleet at its first round")
            elif pending is not None and pending.round == self.completed_rounds + 1:
                self._resume_round(pending)  # the round in flight when the last run stopped: finish it
        self.rejected_messages = 0
        self.link = MqttLink(
            client_id=f"fedfit-coordinator-{config.federation}",
            broker=config.broker,
            subscriptions=[self.topics.all_agent_status(), self.topics.all_agent_updates()],
            handler=self._on_message,
            will=Will(self.topics.coordinator_status(), encode(self._status("offline"))),
            on_ready=self._announce,
            on_refused=self._on_refused,
        )

    # ------------------------------------------------------------------ setup
    def _resume(self) -> None:
        states, meta = load_checkpoint(self.checkpoint_path)
        if meta.get("algorithm") != self.config.algorithm or meta.get("family") != self.config.model.family:
            raise ValueError(f"checkpoint {self.checkpoint_path} is for {meta.get('algorithm')}/"
                             f"{meta.get('family')}, not {self.config.algorithm}/{self.config.model.family}; "
                             f"use another state_dir or set resume: false")
        # The strategy's state first: what its set-up computed (e.g. FlexFL's pool) is restored, not redone.
        self.strategy.load_state_dict(meta.get("strategy", {}))
        self.states = self.strategy.initial_states(self.config.seed)
        if set(states) != set(self.states):
            raise ValueError(f"checkpoint {self.checkpoint_path} holds model groups {sorted(states)}, this "
                             f"{self.config.algorithm} run keeps {sorted(self.states)}; use another state_dir")
        for group, state in states.items():
            if set(state) == set(self.states[group]):
                self.states[group] = state
            else:
                raise ValueError(f"checkpoint {self.checkpoint_path} does not match this model (group {group})")
        self.completed_rounds = int(meta.get("round", 0))
        self.log.info("resumed", round=self.completed_rounds, checkpoint=str(self.checkpoint_path))

    def _make_evaluator(self) -> Evaluator:
        test_x, test_y = self.dataset.x_test, self.dataset.y_test
        if self.config.data.eval_samples is not None:
            test_x, test_y = subsample(test_x, test_y, self.config.data.eval_samples, self.config.seed)
        return Evaluator(self.family, self.strategy.context.server_x, torch.tensor(np.asarray(test_x)),
                         torch.tensor(np.asarray(test_y), dtype=torch.long))

    # --------------------------------------------------------------- lifecycle
    def start(self, timeout: float = 30.0) -> None:
        """Connect to the broker; the retained coordinator status goes out once subscribed."""
        self.link.start(timeout)

    def stop(self) -> None:
        """Publish the retained 'offline' status and disconnect."""
        self.link.stop(final=(self.topics.coordinator_status(), encode(self._status("offline")), True))

    def _status(self, state: str) -> CoordinatorStatus:
        """The retained status: its ``round`` is the round in progress, else the last one completed."""
        current = self._round
        return CoordinatorStatus(self.config.federation, state,
                                 current.number if current is not None else self.completed_rounds, time.time())

    def _announce(self) -> None:
        self.link.publish(self.topics.coordinator_status(), encode(self._status("online")), retain=True)

    def _on_refused(self, topic: str, reason: str) -> None:
        """The broker refused a publish (its status, a task or an ack): the federation cannot run."""
        with self._round_lock:
            if self.fatal is not None:
                return
            self.fatal = (f"the MQTT broker at {self.config.broker} refused to let user "
                          f"{self.config.broker.username!r} publish on {topic} ({reason}): federation "
                          f"('{self.config.federation}') must be the one the broker was made for and broker.username "
                          f"its coordinator login (see the coordinator.yaml `fedfit broker init` writes)")
            current = self._round  # (a round installed later sees fatal and interrupts itself)
        self.log.error("coordinator_refused_by_broker", message=self.fatal)
        self.registry.interrupt()
        if current is not None:
            current.interrupt()

    def _raise_if_fatal(self) -> None:
        if self.fatal is not None:
            raise BrokerRefused(self.fatal)

    # ---------------------------------------------------------------- messages
    def _on_message(self, topic: str, payload: bytes) -> None:
        single_threaded_torch()
        try:
            _, agent_id, kind = parse_agent_topic(topic)
            if kind == "status":
                self._on_status(agent_id, payload)
            elif kind == "update":
                self._on_update_chunk(agent_id, payload)
        except ProtocolError as exc:
            self.rejected_messages += 1
            self.log.warning("message_rejected", topic=topic, size=len(payload), reason=str(exc))

    def _on_status(self, agent_id: str, payload: bytes) -> None:
        if not payload:
            return  # a cleared retained status
        status = decode(payload, expected=AgentStatus)
        assert isinstance(status, AgentStatus)
        if status.agent_id != agent_id:
            raise ProtocolError(f"status for agent {status.agent_id!r} published on the topic of {agent_id!r}")
        if status.state == "starting":  # a process asking whether one runs this id: not a status of the agent
            known = self.registry.get(agent_id)
            if known is not None and known.online and known.instance != status.instance:
                self.log.warning("agent_id_second_process", agent=agent_id, running=known.instance,
                                 starting=status.instance,
                                 message=f"a process started as agent '{agent_id}' while one was online (a second "
                                         f"process, or a restart before the broker saw the first one end); give "
                                         f"every device its own agent_id")
            return
        previous = self.registry.on_status(status)
        self._watch_instances(agent_id, previous, status)
        back = status.state in ("online", "busy") and status.capabilities is not None
        if back and previous is not None and not previous.online:
            self._resend_unanswered(agent_id)

    def _watch_instances(self, agent_id: str, previous: AgentRecord | None, status: AgentStatus) -> None:
        """Warn when one agent id answers from two processes: a status from a process another one replaced
        (without an 'offline' between: a restart during a broker outage looks the same at first) within
        :data:`TWO_INSTANCES_WINDOW_S` means both are alive."""
        if status.state not in ("online", "busy") or not status.instance:
            return
        replaced = self._replaced_instances.setdefault(agent_id, {})
        now = time.time()
        if previous is not None and previous.online and previous.instance and previous.instance != status.instance:
            if status.instance in replaced and now - replaced[status.instance] < TWO_INSTANCES_WINDOW_S:
                self.log.warning("agent_id_two_instances", agent=agent_id,
                                 instances=[previous.instance, status.instance],
                                 message=f"agent '{agent_id}' answers from two processes; give every device its own "
                                         f"agent_id")
            replaced[previous.instance] = now
        for instance, when in list(replaced.items()):
            if now - when >= TWO_INSTANCES_WINDOW_S:
                del replaced[instance]

    def _resend_unanswered(self, agent_id: str) -> None:
        """Send again the tasks of the round in progress that ``agent_id`` has not answered: it came back online
        (a restart or a reconnect may have lost them; an agent that has one already ignores the copy)."""
        with self._round_lock:
            current = self._round
        if current is None:
            return
        for dispatched in current.unanswered(agent_id):
            # (Unpaced: this is the message thread, whose waiting would hold up every update and ack meanwhile.)
            self._dispatch(dispatched.round, dispatched.task_id, dispatched.task, dispatched.deadline, paced=False)
            current.mark_sent(dispatched.task_id)
            self.log.info("task_resent", agent=agent_id, task=dispatched.task_id, round=dispatched.round)

    def _on_update_chunk(self, agent_id: str, payload: bytes) -> None:
        whole = self.reassembler.feed_transfer(payload, source=agent_id)
        if whole is None:
            return
        complete = whole.payload  # a read-only view; its sha256 was computed as its chunks came
        update = decode(complete, expected=Update)  # decoded and validated once: the round examines this object
        assert isinstance(update, Update)
        if update.agent_id != agent_id:
            raise ProtocolError(f"update from agent {update.agent_id!r} published on the topic of {agent_id!r}")
        with self._round_lock:
            current = self._round
        if current is None:
            receipt = Receipt("unknown", f"unknown task {update.task_id!r} of round {update.round}: no round is in "
                                         f"progress")
        else:
            try:  # stored (journaled) before the ack goes out, and folded into the round's aggregate
                receipt = current.receive(update, len(complete), whole.sha256, self._examine,
                                          lambda: self.journal.store(update, complete))
            except OSError as exc:
                self.log.error("update_not_journaled", agent=agent_id, task=update.task_id, error=str(exc))
                return  # no ack: the agent sends it again
            if receipt.verdict == "accepted":
                self._progress("round", current.number, len(current.answers), len(current.tasks))
        # Answered only now: an ack says the update is stored for aggregation, a reason that it never will be. (The
        # round may close and screen it before this ack goes out; its verdict ack settles the device either way.)
        self.link.publish(self.topics.agent_ack(agent_id),
                          encode(Ack(update.task_id, update.round, agent_id, receipt.refusal)))
        self.log.info("update_received", agent=agent_id, task=update.task_id, round=update.round,
                      status=update.status, verdict=receipt.verdict, bytes=len(complete), refused=receipt.refusal)

    def _examine(self, update: Update, task: TaskPlan) -> Examined:
        """Read an update against its task: its record and, for a trained one, the result to aggregate (or why it
        is refused)."""
        record = TaskRecord(update.agent_id, task.level, update.status, task.spec.describe(), reason=update.reason,
                            num_samples=update.num_samples, metrics=dict(update.metrics),
                            params_sent=self.family.param_count(task.spec))
        if update.spec_trained is not None:
            record.spec_trained = _describe(update.spec_trained)
        if update.status not in AGGREGATED:
            return Examined(record)
        try:
            result = self._unpack_update(update, task)
        except ValueError as exc:
            record.status, record.reason = "rejected", str(exc)
            self.log.warning("update_rejected", agent=update.agent_id, task=update.task_id, reason=str(exc))
            return Examined(record, refusal=f"update rejected: {exc}")
        record.spec_trained = result.spec.describe()
        record.level_trained = self._level_of(result.spec)
        record.params_returned = self.family.param_count(result.spec)
        return Examined(record, result)

    def _measure(self, result: TaskResult) -> Change:
        """How far an update moved the weights its task sent, and how far its plan could (screening)."""
        return change_of_result(result, self._sent(result))

    def _reload(self, task_id: str) -> TaskResult:
        """A stored update of the round in progress, read back from the journal and unpacked (for screening to
        take it out of the aggregate)."""
        assert self._round is not None
        return self._unpack_update(self.journal.read_update(task_id), self._round.tasks[task_id].task)

    # ------------------------------------------------------------------ rounds
    def run(self, rounds: int | None = None) -> list[RoundResult]:
        """Run ``rounds`` rounds (default: up to the configured total) and return their results."""
        last = self.config.rounds if rounds is None else self.completed_rounds + rounds
        results = []
        while self.completed_rounds < last:
            results.append(self.run_round(self.completed_rounds + 1))
        self._raise_if_fatal()  # e.g. the last round's verdicts refused: the run is not one to trust
        return results

    def run_round(self, round_number: int) -> RoundResult:
        """One round: plan it (the strategy; or take the round resumed from the journal), then drive it through
        collecting, aggregating (the strategy's aggregate), evaluation and the checkpoint."""
        started = time.monotonic()
        with self._round_lock:
            current = self._round
        if current is None or current.number != round_number:
            current = self._plan_round(round_number)
        return self._drive(current, started)

    def _plan_round(self, round_number: int) -> Round:
        """Wait for the fleet, plan the round, journal it (before any task goes out) and open it."""
        waiting = time.perf_counter()
        if not self._fleet_settled:  # the first round sees the whole fleet, or none runs
            online = self._wait_for_first_fleet(round_number)
            if online and len(online) < self.config.min_agents:
                raise NoAgentsError(f"{len(online)} of the {self.config.min_agents} agents of federation "
                                    f"'{self.config.federation}' that min_agents asks for came online within "
                                    f"{self.config.wait_for_agents_s:g} s; start more agents or lower min_agents")
            self._fleet_settled = bool(online)
        else:
            online = self.registry.wait_for(self.config.min_agents, self.config.wait_for_agents_s)
        self._raise_if_fatal()
        if not online:
            raise NoAgentsError(f"no agent of federation '{self.config.federation}' came online within "
                                f"{self.config.wait_for_agents_s:g} s; {self._federations_hint()}")
        if len(online) < self.config.min_agents:
            self.log.warning("fewer_agents_than_expected", online=len(online), expected=self.config.min_agents)
        planning = time.perf_counter()
        online, misfits = self._fitting(online)
        if misfits and len(online) < self.config.min_agents:
            self.log.warning("fewer_fitting_agents_than_expected", fitting=len(online),
                             expected=self.config.min_agents)
        if self.strategy.awaits_fleet and self.completed_rounds == 0:
            self.fit_to_fleet([budget for agent in online if (budget := agent.budget()) is not None])
        self._tell_service(online)
        plan = self.strategy.configure_round(round_number, online, self.rng)
        plan.skipped.extend(misfits)
        deadline = time.time() + self.config.round_timeout_s
        tasks = {self._task_id(round_number, t.agent_id): t for t in plan.tasks}
        self.journal.begin(round_number, deadline, tasks, plan.skipped)  # before any task goes out
        planned = self._new_round(round_number, tasks, plan.skipped, deadline)
        planned.timing["waiting_for_agents"] = planning - waiting
        planned.timing["planning"] = time.perf_counter() - planning
        self._install(planned)
        return planned

    def fit_to_fleet(self, budgets: Sequence[int]) -> None:
        """Size what the strategy hands out from the fleet's ``budgets`` (its ``auto`` settings: ScaleFL's and
        FlexFL's ratios, ...) before the first round, and make the initial states of the models it chose. The
        round driver does it with the budgets of the agents online at round 1; the simulator before it starts,
        with the budgets it gives its devices."""
        if self.completed_rounds or self._round is not None:
            raise RuntimeError("the strategy can only be sized to the fleet before the first round")
        told = self.strategy.fit_to_fleet(budgets)
        if told is not None:
            self.states = self.strategy.initial_states(self.config.seed)
            self.service_log = ServiceLog(self.strategy)
            self.log.info("sized_to_fleet", detail=told)

    def _tell_service(self, online: Sequence[AgentRecord]) -> None:
        """Log what the method hands each device by the budget it reports (once, and again when that changes):
        a device it can serve nothing is named with the least it would need and the setting that would help."""
        for agent_id, service in self.service_log.changes(online):
            if service.served:
                self.log.info("device_served", agent=agent_id, budget=service.budget,
                              trains=answer_text(service.answer))
            else:
                self.log.warning("device_unserved", agent=agent_id, budget=service.budget,
                                 needs=service.answer.get("needs_bytes"), to_fit=service.answer.get("to_fit"),
                                 reason=unserved_text(service))

    def _resume_round(self, journaled: JournaledRound) -> None:
        """Open the round the journal holds, with the updates it had stored (taken again as if they arrived now,
        without storing them again). It takes the updates its agents resend from the first message on: were it
        opened only when run() gets to it, an update arriving before would be refused for good and lost."""
        deadline = max(journaled.deadline, time.time() + min(self.config.round_timeout_s, RESUME_GRACE_S))
        resumed = self._new_round(journaled.round, journaled.tasks, journaled.skipped, deadline)
        self._install(resumed)
        for update, payload in self.journal.stored(journaled.round):
            resumed.receive(update, len(payload), hashlib.sha256(payload).hexdigest(), self._examine, lambda: None)
        self.log.info("round_resumed", round=journaled.round, tasks=len(journaled.tasks),
                      stored_updates=len(resumed.answers))

    def _new_round(self, round_number: int, tasks: dict[str, TaskPlan], skipped: list[Skip],
                   deadline: float) -> Round:
        return Round(round_number, tasks, skipped, deadline, self.strategy.begin_aggregate(self.states),
                     self.config.screening, self._measure)

    def _install(self, planned: Round) -> None:
        """Open a planned round and make it the one in progress: from now on its updates are stored and acked."""
        planned.open()
        with self._round_lock:
            self._round = planned
            if self.fatal is not None:  # refused before this round was there to interrupt
                planned.interrupt()

    def _wait_for_first_fleet(self, round_number: int) -> list[AgentRecord]:
        """Wait for the fleet before the first round; while no agent of this federation is online, say which
        federations the broker shows after :data:`FEDERATIONS_CHECK_S` (and every :data:`FEDERATIONS_REPEAT_S`)."""
        deadline = time.monotonic() + self.config.wait_for_agents_s
        check_at = time.monotonic() + FEDERATIONS_CHECK_S
        while True:
            # Cut into windows only while no agent is online: then the fleet settles as wait_settled says.
            limit = deadline if self.registry.online() else min(deadline, check_at)
            online = self.registry.wait_settled(
                self.config.min_agents, REGISTRY_SETTLE_S, max(0.0, limit - time.monotonic()),
                lambda count: self._progress("fleet", round_number, count, self.config.min_agents))
            now = time.monotonic()
            if self.fatal is not None or now >= deadline or now < limit:  # before its limit: the fleet is in
                return online
            if not online:
                waited = self.config.wait_for_agents_s - (deadline - now)
                self.log.warning("no_agents_of_this_federation",
                                 message=f"no agent of federation '{self.config.federation}' is online after "
                                         f"{waited:.0f} s; {self._federations_hint()}")
                check_at = time.monotonic() + FEDERATIONS_REPEAT_S

    def _federations_hint(self) -> str:
        """What to do when no agent of this federation is online, naming the federations whose agents the broker
        shows (read through a short-lived probe)."""
        try:
            seen = federations_seen(self.config.broker, f"fedfit-coordinator-{self.config.federation}-look")
        except Exception as exc:  # noqa: BLE001 - a hint must never end the run
            return f"start agents or check the broker address (the broker could not be asked for other federations: " \
                   f"{exc})"
        others = {name: agents for name, agents in seen.items() if name != self.config.federation}
        if not others:
            return (f"start agents (with federation: {self.config.federation}) or check the broker address; the "
                    f"broker shows this login no agent of another federation")
        listed = ", ".join(f"'{name}' ({len(agents)} agent{'s' if len(agents) != 1 else ''})"
                           for name, agents in sorted(others.items()))
        return (f"the broker shows agents of federation {listed}: set the same federation in the coordinator's and "
                f"the agents' configurations")

    def _fitting(self, online: list[AgentRecord]) -> tuple[list[AgentRecord], list[Skip]]:
        """The agents whose data fits the model, and a skip (reason logged once per agent) for each other one;
        raises NoAgentsError when no online agent's data fits."""
        expected = (self.dataset.in_channels, *self.dataset.image_size)
        fitting, misfits = [], []
        for record in online:
            reason = data_misfit(record.capabilities, expected, self.dataset.num_classes, self.dataset.name)
            if reason is None:
                self._misfits_told.pop(record.agent_id, None)
                fitting.append(record)
                continue
            misfits.append(Skip(record.agent_id, reason))
            if self._misfits_told.get(record.agent_id) != reason:
                self._misfits_told[record.agent_id] = reason
                self.log.error("agent_data_does_not_fit", agent=record.agent_id, reason=reason)
        if not fitting:
            first = misfits[0]
            raise NoAgentsError(f"the data of none of the {len(online)} online agents of federation "
                                f"'{self.config.federation}' fits the model, so no round can be planned: agent "
                                f"'{first.agent_id}': {first.reason}")
        return fitting, misfits

    def _drive(self, current: Round, started: float) -> RoundResult:
        """Collect (dispatching the tasks without an update yet), aggregate, evaluate, checkpoint, tell every
        device its verdict and report."""
        timing = current.timing
        self._announce()
        stored = len(current.answers)
        phase = time.perf_counter()
        bytes_down = 0
        for task_id, dispatched in current.tasks.items():
            if task_id not in current.answers:
                bytes_down += self._dispatch(current.number, task_id, dispatched.task, dispatched.deadline)
                current.mark_sent(task_id)
        timing["dispatch"] = time.perf_counter() - phase
        self._progress("round", current.number, len(current.answers), len(current.tasks))
        self.log.info("round_dispatched", round=current.number, tasks=len(current.tasks),
                      skipped=len(current.skipped), bytes_down=bytes_down,
                      **({"resumed_with_updates": stored} if stored else {}))
        outage_before = self.link.outage_seconds()
        phase = time.perf_counter()
        # The deadline moves by any broker outage the coordinator sees meanwhile: updates could not arrive then.
        current.wait(lambda: self.link.outage_seconds() - outage_before)
        timing["collecting"] = time.perf_counter() - phase
        self._raise_if_fatal()
        current.close(self._reload)
        self.states = current.finish()
        records, outcomes = self._outcomes(current)
        aggregated = list(current.aggregated())
        self.strategy.observe(current.number, outcomes)
        trained_levels, trained_exits = self._trained(aggregated)
        phase = time.perf_counter()
        accuracies = self._evaluate()
        timing["evaluation"] = time.perf_counter() - phase
        phase = time.perf_counter()
        self.completed_rounds = current.number
        self._checkpoint()
        self.journal.clear()  # the checkpoint holds the round now
        timing["checkpoint"] = time.perf_counter() - phase
        self._send_verdicts(current)  # only now: an update said aggregated is, for good
        global_outputs = accuracies.pop("global")
        result = RoundResult(
            round=current.number,
            global_accuracy=global_outputs[-1],
            level_accuracy={name: outputs[-1] for name, outputs in accuracies.items()},
            exit_accuracy={f"exit{i}": acc for i, acc in enumerate(global_outputs, start=1)}
            if len(global_outputs) > 1 else {},
            participants=len(aggregated),
            selected=len(current.tasks) + len(current.skipped),
            bytes_down=bytes_down,
            bytes_up=current.bytes_up,
            seconds=round(time.monotonic() - started, 3),
            tasks=[records[agent] for agent in sorted(records)],
            trained_levels=trained_levels,
            trained_exits=[f"exit{i}" for i in trained_exits] if len(global_outputs) > 1 else [],
            timing=round_timing(timing, current.device_times()),
        )
        self.metrics.write(result)
        with self._round_lock:
            self._round = None
        heap.give_back_free_memory()  # the round's freed megabytes (updates queued, chunks) back to the system
        self._announce()
        self.log.info("round_done", round=current.number, global_accuracy=result.global_accuracy,
                      participants=result.participants, seconds=result.seconds)
        if self.on_round is not None:
            self.on_round(result)
        return result

    def _progress(self, phase: str, round_number: int, done: int, expected: int) -> None:
        """Tell the live display (``on_progress``); whatever it raises is logged, never the round's business."""
        if self.on_progress is None:
            return
        try:
            self.on_progress(Progress(phase, round_number, done, expected))
        except Exception as exc:  # noqa: BLE001 - a display must not stop a round
            self.log.warning("progress_display_failed", error=f"{type(exc).__name__}: {exc}")

    def _task_id(self, round_number: int, agent_id: str) -> str:
        return f"r{round_number}-{agent_id}-{uuid.uuid4().hex[:8]}"

    def _seeded(self, plan: TrainingPlan, round_number: int, agent_id: str) -> TrainingPlan:
        material = f"{self.config.seed}:{round_number}:{agent_id}".encode()
        return replace(plan, seed=int.from_bytes(hashlib.sha256(material).digest()[:4], "little"))

    def _dispatch(self, round_number: int, task_id: str, planned: TaskPlan, deadline: float, *,
                  paced: bool = True) -> int:
        """Publish one task in chunks; returns the bytes sent. ``paced``: each chunk waits for room in the window
        of bytes in flight (`_pace_dispatch`), as the round's thread does."""
        spec = planned.spec
        weights = self.family.extract(self.states[planned.group], spec, keys=self.family.state_keys(spec), views=True)
        task = Task(task_id, round_number, planned.agent_id, deadline, self.model_ref, spec.to_dict(), None,
                    {key: value.detach().cpu().numpy() for key, value in weights.items()},
                    adaptation=self._readable(planned.adaptation, planned.agent_id),
                    plan=self._seeded(planned.plan, round_number, planned.agent_id))
        version = self._protocol_version(planned.agent_id)
        payload = encode_parts(task, version=version)  # the weights are read as the chunks are made
        topic = self.topics.agent_task(planned.agent_id)
        sent = 0
        for chunk in iter_chunks(payload, task_id, round_number=round_number, version=version):  # round: see
            if paced:                                                                            # TransferRefused
                self._pace_dispatch(task_id)
            self.link.publish(topic, chunk)
            sent += len(chunk)
        return sent

    def _pace_dispatch(self, task_id: str) -> None:
        """Wait until fewer than DISPATCH_WINDOW_BYTES of task chunks are in flight to the broker. After a wait in
        vain (DISPATCH_WAIT_S: the broker is away, paho queues for its return) it sends on without waiting until
        the broker has taken the backlog below the window again, rather than stalling every chunk."""
        if self._dispatch_unpaced:
            self._dispatch_unpaced = self.link.bytes_in_flight >= DISPATCH_WINDOW_BYTES
        elif not self.link.wait_for_room(DISPATCH_WINDOW_BYTES, DISPATCH_WAIT_S):
            self._dispatch_unpaced = True
            self.log.warning("dispatch_not_paced", in_flight=self.link.bytes_in_flight, task=task_id,
                             message=f"no PUBACK from the broker for {DISPATCH_WAIT_S:g} s: sending on without "
                                     f"waiting until it takes them")

    def _protocol_version(self, agent_id: str) -> int:
        """The newest protocol version both this coordinator and the agent read (1 for an agent that predates 2)."""
        return min(PROTOCOL_VERSION, self._revision(agent_id))

    def _revision(self, agent_id: str) -> int:
        """The protocol revision the agent announced (`protocol.PROTOCOL_REVISION`; 1 when it announced none)."""
        record = self.registry.get(agent_id)
        return record.capabilities.protocol_version if record is not None and record.capabilities else 1

    def _readable(self, adaptation: Adaptation | None, agent_id: str) -> Adaptation | None:
        """``adaptation`` without the fields the agent's revision does not read (it would refuse the task): an
        agent older than `HEAD_ALONE_REVISION` is not offered the head alone, and so declines where it would
        train only that."""
        if adaptation is not None and adaptation.head_alone and self._revision(agent_id) < HEAD_ALONE_REVISION:
            return replace(adaptation, head_alone=False)
        return adaptation

    # ------------------------------------------------------------- collection
    def _outcomes(self, current: Round) -> tuple[dict[str, TaskRecord], list[TaskOutcome]]:
        """Every selected agent's record (skipped, missing or answered) and how every task ended, for the
        strategy (answered tasks by task id, then the missing ones)."""
        records = {s.agent_id: TaskRecord(s.agent_id, "-", "skipped", "-", reason=s.reason) for s in current.skipped}
        outcomes: list[TaskOutcome] = []
        for task_id, answer in sorted(current.answers.items()):
            update, record = answer.update, answer.record
            records[update.agent_id] = record
            if answer.rejection is not None:
                self.log.warning("update_rejected", agent=update.agent_id, task=task_id, reason=answer.rejection)
            outcomes.append(TaskOutcome(current.tasks[task_id].task, record.status,
                                        answer.spec if answer.aggregated else None, dict(update.metrics),
                                        update.reason, _spec_or_none(update.spec_trained)))
        for task_id, dispatched in current.tasks.items():
            if task_id not in current.answers:
                task = dispatched.task
                records[task.agent_id] = TaskRecord(task.agent_id, task.level, "missing", task.spec.describe(),
                                                    reason="no update by deadline",
                                                    params_sent=self.family.param_count(task.spec))
                outcomes.append(TaskOutcome(task, "missing", None, {}))
        return records, outcomes

    def _send_verdicts(self, current: Round) -> None:
        """Tell every device whose stored update was screened whether it is aggregated or, with the reason, not."""
        for task_id, answer in sorted(current.answers.items(), key=lambda item: item[1].update.agent_id):
            if not answer.screened:
                continue
            agent, reason = answer.update.agent_id, answer.rejection
            try:  # best effort: the round is stored already, and the device's uplink settled at the first ack
                self.link.publish(self.topics.agent_ack(agent), encode(Ack(
                    task_id, current.number, agent, reason, "rejected" if reason else "aggregated")))
            except Exception as exc:  # noqa: BLE001 - one device's verdict never ends the round
                self.log.warning("verdict_not_sent", agent=agent, round=current.number, error=str(exc))

    def _level_of(self, spec: SubmodelSpec) -> str | None:
        """The name of the level (pool model) whose spec ``spec`` is, if any."""
        return next((name for name, target in self.strategy.eval_targets().items()
                     if name != "global" and target.spec == spec), None)

    def _trained(self, aggregated: Sequence[Answer]) -> tuple[list[str], list[int]]:
        """Which levels some aggregated update trained as such (its spec is the level's), and which outputs of the
        global model (1-based, depth order: its exits, then its final head) some update's tensors reached."""
        targets = self.strategy.eval_targets()
        levels = sorted(name for name, target in targets.items()
                        if name != "global" and any(answer.spec == target.spec for answer in aggregated))
        global_spec = targets["global"].spec
        heads = [set(self.family.head_keys(block)) for block in (*sorted(global_spec.exits), None)]
        exits = [number for number, keys in enumerate(heads, start=1)
                 if any(keys & answer.keys for answer in aggregated)]
        return levels, exits

    def _sent(self, result: TaskResult) -> dict[str, torch.Tensor]:
        """The weights ``result``'s task sent for the keys it trained (the group's state before this round)."""
        return self.family.extract(self.states[result.task.group], result.spec, keys=result.state.keys(), views=True)

    def _index_map(self, spec: SubmodelSpec) -> dict[str, tuple[torch.Tensor, ...]]:
        """``family.index_map(spec)``, made once per spec (every update of a level has the same one; aggregation
        only reads it)."""
        made = self._index_maps.get(spec)
        if made is None:
            if len(self._index_maps) >= INDEX_MAPS_KEPT:
                self._index_maps.clear()
            made = self._index_maps[spec] = self.family.index_map(spec)
        return made

    def _unpack_update(self, update: Update, task: TaskPlan) -> TaskResult:
        """Validate an update against what was sent and return it ready to aggregate (ValueError if not)."""
        spec = SubmodelSpec.from_dict(update.spec_trained) if update.spec_trained is not None else task.spec
        self.family.validate_spec(spec)
        if not self.family.is_nested(spec, task.spec):
            raise ValueError(f"agent trained {spec.describe()}, which is not inside the {task.spec.describe()} sent")
        expected = set(self.family.trainable_keys(spec))
        if set(update.weights) != expected:
            missing, extra = sorted(expected - set(update.weights)), sorted(set(update.weights) - expected)
            raise ValueError(f"update tensors do not match {spec.describe()} (missing {missing[:3]}, "
                             f"unexpected {extra[:3]})")
        full_map = self._index_map(spec)
        index_map = {key: full_map[key] for key in expected}
        state = {}
        for key in expected:
            tensor = _float_tensor(update.weights[key])
            shape = tuple(len(idx) for idx in index_map[key])
            if tuple(tensor.shape) != shape:
                raise ValueError(f"tensor {key!r} has shape {tuple(tensor.shape)}, expected {shape}")
            state[key] = tensor
        labels = [label for label in update.labels if label < self.dataset.num_classes]
        return TaskResult(task, spec, state, index_map, update.num_samples, labels)

    # -------------------------------------------------------------- evaluation
    def _evaluate(self) -> dict[str, list[float]]:
        """Accuracy of every output of each evaluation target (a model shared by several targets is evaluated
        once); the BN statistics of ``store_bn`` targets go into their state."""
        results: dict[str, list[float]] = {}
        done: dict[tuple[str, SubmodelSpec], tuple[list[float], dict[str, torch.Tensor]]] = {}
        for name, target in self.strategy.eval_targets().items():
            key = (target.group, target.spec)
            if key not in done:
                done[key] = self._evaluator.evaluate(self.states[target.group], target.spec)
            accuracies, bn_state = done[key]
            if target.store_bn:
                self._store_bn(self.states[target.group], bn_state)
            results[name] = accuracies
        return results

    @staticmethod
    def _store_bn(state: dict[str, torch.Tensor], bn_state: dict[str, torch.Tensor]) -> None:
        """Write a sub-model's BN statistics into the leading slices of the global tensors they belong to."""
        for key, value in bn_state.items():
            target = state[key]
            if value.shape == target.shape:
                state[key] = value
            else:
                target = target.clone()
                region = target
                for dim, size in enumerate(value.shape):
                    region = region.narrow(dim, 0, size)
                region.copy_(value)
                state[key] = target

    def _checkpoint(self) -> None:
        save_checkpoint(self.checkpoint_path, self.states, {
            "round": self.completed_rounds, "algorithm": self.config.algorithm,
            "family": self.config.model.family, "federation": self.config.federation,
            "strategy": self.strategy.state_dict()})
