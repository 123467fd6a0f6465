"""The coordinator daemon: the loop of rounds, read top to bottom.

Each round: wait for the fleet (`coordinator.fleet`), plan (the strategy), journal and open it
(`coordinator.round`), send its tasks (`coordinator.dispatch`), collect the updates (`coordinator.intake`, on the
MQTT link's message thread), close and aggregate, evaluate, checkpoint, tell every device its verdict and report
(`coordinator.reporting`). Network messages only touch the registry and the round in progress; the round loop
runs on the caller's thread.

Misconfigurations end loudly: a publish the broker refuses (its ACL: another federation, or a login that is not
the coordinator's) stops the run with :class:`BrokerRefused`; a fleet with no agent of this federation is told
which federations the broker does show; an agent whose data does not fit the model is never planned for.
"""

from __future__ import annotations

import hashlib
import random
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from common import heap
from common.blas_threads import guard_blas_threads
from common.data import Dataset, load_dataset
from common.logs import get_logger
from common.mqtt_link import BrokerRefused, MqttLink, Will
from coordinator import deployable, reporting
from coordinator.checkpoint import checkpoint_metadata, save_checkpoint, starting_states
from coordinator.config import CoordinatorConfig
from coordinator.dispatch import Dispatcher
from coordinator.evaluation import Evaluator
from coordinator.exporter import CoordinatorMetrics
from coordinator.fleet import REGISTRY_SETTLE_S, FleetWatch, NoAgentsError
from coordinator.intake import UpdateIntake, single_threaded_torch
from coordinator.journal import RoundJournal
from coordinator.metrics import MetricsWriter, Progress, RoundResult
from coordinator.planning import model_family, model_options, strategy_for
from coordinator.registry import FleetRegistry
from coordinator.round import DispatchedTask, Phase, Round
from coordinator.serving import ServiceLog
from coordinator.strategies import TaskPlan
from coordinator.strategies.base import Skip, State
from coordinator.upload_desk import UploadDesk
from coordinator.upload_grants import UploadGrants
from models import ModelFamily
from protocol import (
    STATUS_REPORT_REVISION,
    CoordinatorStatus,
    ModelRef,
    ProtocolError,
    RoundProgress,
    Topics,
    encode,
    parse_agent_topic,
)

__all__ = ["REGISTRY_SETTLE_S", "Coordinator", "NoAgentsError", "Progress", "single_threaded_torch"]

#: Seconds a round resumed from the journal waits at least for the updates its agents are still resending.
RESUME_GRACE_S = 60.0
#: Seconds a resumed round waits at most for its agents' statuses before its tasks go out again.
RESUME_SETTLE_S = 10.0
#: Seconds between the re-publications of the status (the round's progress) that updates cause, at most.
PROGRESS_INTERVAL_S = 1.0


class Coordinator:
    """Runs the federation described by a :class:`CoordinatorConfig`."""

    def __init__(self, config: CoordinatorConfig, *, dataset: Dataset | None = None,
                 on_round: Callable[[RoundResult], None] | None = None,
                 on_progress: Callable[[Progress], None] | None = None,
                 resume_grace_s: float = RESUME_GRACE_S) -> None:
        config.validate()
        self.config = config
        self.topics = Topics(config.federation)
        self.log = get_logger("coordinator", federation=config.federation)
        if (blas := guard_blas_threads()) is not None:
            self.log.warning("blas_threads_capped", reason=blas)
        self.dataset = dataset if dataset is not None else load_dataset(config.data.dataset, config.data.root)
        self.family: ModelFamily = model_family(config, self.dataset)
        self.model_ref = ModelRef(config.model.family, self.dataset.num_classes, self.dataset.in_channels,
                                  model_options(config))
        self.strategy = strategy_for(config, self.dataset, self.family)
        self.registry = FleetRegistry()
        self.fleet = FleetWatch(config, self.registry, self.dataset, self.strategy, self.log)
        #: Why the run cannot go on (the broker refused a publish it needs), one sentence; ends the round loop.
        self.fatal: str | None = None
        self._fleet_settled = False  # set once the first round of this process has seen the fleet
        self._round_opened_at = 0.0  # wall clock: when the round in progress sent its tasks
        self._reports_announced = False  # whether the last status said this coordinator reads agents' reports
        self._progress_announced = 0.0  # monotonic: when an update last re-published the status
        self._progress_pending = False  # a re-publication is scheduled
        self._progress_lock = threading.Lock()
        self._announce_lock = threading.Lock()
        self._stopped = False
        self._outage_at_open = 0.0  # the link's outage seconds when the round in progress opened
        self.on_round = on_round
        self.on_progress = on_progress
        #: Seconds a round resumed from the journal waits at least (a simulator whose agents restarted with it and
        #: train its tasks again gives it a whole round's deadline).
        self.resume_grace_s = resume_grace_s
        self.state_dir = Path(config.state_dir)
        self.checkpoint_path = self.state_dir / "checkpoint.safetensors"
        self.metrics = MetricsWriter(self.state_dir / "metrics.jsonl")
        self.states, self.completed_rounds = starting_states(self.checkpoint_path, config, self.strategy)
        last_record = checkpoint_metadata(self.checkpoint_path).get("record") if self.completed_rounds else None
        if self.completed_rounds:
            self.log.info("resumed", round=self.completed_rounds, checkpoint=str(self.checkpoint_path))
            if self.metrics.restore(self.completed_rounds, last_record):
                self.log.warning("round_record_restored", round=self.completed_rounds,
                                 reason="stopped after the round's checkpoint, before metrics.jsonl had its record")
        self.journal = RoundJournal(self.state_dir / "round", self.model_ref)
        #: What the run's rounds trained so far: the deployable model is the largest of it (`coordinator.deployable`).
        self.trained_so_far = deployable.TrainedSoFar.of_run(self.metrics.path, self.completed_rounds, self.log)
        #: Buffered rounds: the states each round's tasks were cut from, while tasks of that round still train
        #: (their updates are measured and rebased against them), and the tasks the next round carries.
        self._bases: dict[int, dict[str, State]] = {}
        self._carried: list[DispatchedTask] = []
        self._carried_ids: frozenset[str] = frozenset()
        self._back_between_rounds: set[str] = set()  # agents back online while no round collected (guarded by
        # _round_lock): the tasks the next round carries for them are sent again
        self.intake = UpdateIntake(self.family, self.strategy, self.journal, self.dataset.num_classes,
                                   self._states_of, lambda topic, payload: self.link.publish(topic, payload),
                                   self.topics, self.log, carried=self._carries)
        #: Prometheus metrics (``metrics_port``), None when off; ``metrics_port`` the port served once started.
        self.exporter: CoordinatorMetrics | None = None
        self.metrics_port: int | None = None
        if config.metrics_port is not None:
            self.exporter = CoordinatorMetrics(config.federation, config.algorithm, lambda: self.link.backlog(),
                                               lambda: len(self.registry.online()), lambda: self.uploads.window())
            exporter = self.exporter
            self.intake.on_receipt = lambda verdict, size, current: exporter.update_received(
                verdict, size, len(current.answers) if current is not None else None)
            if last_record is not None:  # what the run resumes after, shown until its next round is done
                exporter.round_done(RoundResult.from_dict(last_record), counted=False)
        self._evaluator = Evaluator.for_test_set(self.family, self.dataset, config.data.eval_samples, config.seed,
                                                 self.strategy.context.server_x)
        #: The round in progress (collecting or aggregating), None between rounds; guarded by _round_lock.
        self._round: Round | None = None
        self._round_lock = threading.Lock()
        self.rejected_messages = 0  # messages refused as malformed
        if config.resume:
            self._resume_pending_round()
        self.link = MqttLink(  # after the resume: its Last Will names the round in progress
            client_id=f"fedfit-coordinator-{config.federation}", broker=config.broker,
            subscriptions=[self.topics.all_agent_status(), self.topics.all_agent_updates()],
            handler=self._on_message,
            will=Will(self.topics.coordinator_status(), encode(self._status("offline", reports=False))),
            on_ready=self._announce, on_refused=self._on_refused)
        #: The agents' update topics: requests to upload and chunks (``uploads``: the window, `grants`).
        self.uploads = UploadDesk(self.intake, config.uploads, lambda topic, payload: self.link.publish(topic, payload),
                                  self.topics, self._current, self._carries,
                                  self._on_answer, self.registry.revision, self.log)
        self.dispatcher = Dispatcher(self.link, self.topics, self.registry, self.family, self.model_ref,
                                     self._states_of, config.seed, self.log, grants_uploads=self.uploads.grants is not None)

    @property
    def grants(self) -> UploadGrants | None:
        """The window of update bytes in transfer (``uploads``), None when uploads are not granted."""
        return self.uploads.grants

    def _resume_pending_round(self) -> None:
        """Open the round the journal holds, if it is the next one, with the updates it had stored (taken again as
        if they arrived now, without storing them again): from the first message on, so that an update its agents
        resend before run() gets to it is not refused for good."""
        pending = self.journal.load()
        if pending is not None and pending.round == self.completed_rounds:  # checkpointed, then stopped before the
            pending = self.journal.load_next()  # journal said what the next round carries (as carry_on recorded it)
        if pending is None or pending.round != self.completed_rounds + 1:
            return
        if pending.round == 1 and self.strategy.awaits_fleet:
            # Its tasks were planned with models sized to the fleet, which no checkpoint kept (a journal of a
            # coordinator that checkpointed the sizing only with round 1): plan it again.
            self.log.warning("first_round_planned_again", round=pending.round,
                             reason="the strategy is sized to the fleet at its first round")
            return
        if not pending.planned:  # a buffered round's carried tasks, recorded with its checkpoint: plan the next.
            # All of them, those past their deadline too: the next round records one missing when it closes without
            # its update, as a round never stopped would.
            self._carry(pending.carried, pending.bases)
            self.log.info("carried_tasks_resumed", round=pending.round, tasks=len(self._carried))
            return
        deadline = max(pending.deadline, time.time() + min(self.config.round_timeout_s, self.resume_grace_s))
        self._bases = {**pending.bases, pending.round: self.states}
        resumed = self._new_round(pending.round, pending.tasks, pending.skipped, deadline, pending.carried)
        self._install(resumed)
        for update, payload in self.journal.stored(resumed.tasks):
            resumed.receive(update, payload, hashlib.sha256(payload).hexdigest(), stored=True)
        self.log.info("round_resumed", round=pending.round, tasks=len(pending.tasks),
                      stored_updates=len(resumed.answers))

    # --------------------------------------------------------------- lifecycle
    def start(self, timeout: float = 30.0) -> None:
        """Connect to the broker; the retained coordinator status goes out once subscribed."""
        self._stopped = False
        if self.exporter is not None and self.metrics_port is None:
            try:
                self.metrics_port = self.exporter.serve(self.config.metrics_host, self.config.metrics_port or 0)
            except OSError as exc:
                raise OSError(exc.errno, f"cannot serve metrics on metrics_host {self.config.metrics_host}, "
                                         f"metrics_port {self.config.metrics_port}: {exc.strerror}") from None
            self.log.info("metrics_served", url=f"http://{self.config.metrics_host}:{self.metrics_port}/metrics")
        self.link.start(timeout)

    def stop(self) -> None:
        """Publish the retained 'offline' status and disconnect; then stop serving the metrics once a scrape has read
        their final state, or after ``metrics_linger_s`` (at once when nothing ever scraped them)."""
        with self._announce_lock:
            self._stopped = True  # no 'online' after the 'offline' (a progress re-publication due within the second)
        # Plain, as the Last Will: an agent of any revision may read it when it starts.
        self.link.stop(final=(self.topics.coordinator_status(), encode(self._status("offline", reports=False)), True))
        if self.exporter is not None:
            if not self.exporter.stop(linger=self.config.metrics_linger_s):
                self.log.warning("metrics_final_state_not_scraped", linger_s=self.config.metrics_linger_s,
                                 message="no scrape read the final metrics before metrics_linger_s passed")
            self.metrics_port = None

    def _status(self, state: str, reports: bool | None = None) -> CoordinatorStatus:
        """The retained status: its ``round`` is the round in progress, else the last one completed. With
        ``reports`` (default: while every agent online reads them, `protocol.STATUS_REPORT_REVISION`) it says this
        coordinator reads agents' reports and carries the round in progress; the Last Will never does (an agent of
        any revision must read it)."""
        current = self._round
        number = current.number if current is not None else self.completed_rounds
        if reports is None:
            reports = self._fleet_reads_reports()
        if not reports:
            return CoordinatorStatus(self.config.federation, state, number, time.time())
        progress = None
        if current is not None and state == "online" and self._round_opened_at:
            # The deadline as the round keeps it: moved out by the broker outages seen since it opened.
            deadline = current.deadline + self.link.outage_seconds() - self._outage_at_open
            progress = RoundProgress(current.number, len(current.tasks), len(current.answers), self._round_opened_at,
                                     deadline)
        return CoordinatorStatus(self.config.federation, state, number, time.time(), STATUS_REPORT_REVISION,
                                 progress)

    def _fleet_reads_reports(self) -> bool:
        """Whether agents are online and every one reads reports (none online: an agent of any revision may come
        first, and must read the status it finds retained)."""
        oldest = self.registry.oldest_revision()
        return oldest is not None and oldest >= STATUS_REPORT_REVISION

    def _announce(self) -> None:
        # One at a time (the round's thread, the message dispatcher, a due re-publication): the last status
        # published is the one the last to publish built, and none follows stop()'s 'offline'.
        with self._announce_lock:
            if self._stopped:
                return
            status = self._status("online")
            self._reports_announced = status.revision >= STATUS_REPORT_REVISION
            self.link.publish(self.topics.coordinator_status(), encode(status), retain=True)

    def _announce_progress(self, current: Round) -> None:
        """Re-publish the status for an update taken: at once at the round's last answer, else at most once a
        second (an answer within the second is published when it is over)."""
        if not self._reports_announced:
            return
        last = len(current.answers) >= len(current.tasks)
        with self._progress_lock:
            if self._progress_pending and not last:
                return  # a publication is due within the second: it will say this answer too
            wait = PROGRESS_INTERVAL_S - (time.monotonic() - self._progress_announced)
            if wait > 0 and not last:
                self._progress_pending = True
                timer = threading.Timer(wait, self._announce_due)
                timer.daemon = True
                timer.start()
                return
            self._progress_announced = time.monotonic()
        self._announce()

    def _announce_due(self) -> None:
        with self._progress_lock:
            self._progress_pending = False
            self._progress_announced = time.monotonic()
        self._announce()

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

    def _current(self) -> Round | None:
        with self._round_lock:
            return self._round

    def _raise_if_fatal(self) -> None:
        if self.fatal is not None:
            raise BrokerRefused(self.fatal)

    def _on_message(self, topic: str, payload: bytes) -> None:
        single_threaded_torch()
        try:
            _, agent_id, kind = parse_agent_topic(topic)
            if kind == "status":
                if self.fleet.on_status(agent_id, payload):
                    current = self._current()
                    self.dispatcher.resend_unanswered(current, agent_id)
                    if current is None or current.phase is not Phase.COLLECTING:
                        with self._round_lock:  # a task the next round carries goes to it again then
                            self._back_between_rounds.add(agent_id)
                if self._fleet_reads_reports() != self._reports_announced:  # an older agent came, or the last went
                    self._announce()
                record = self.registry.get(agent_id)
                if record is not None and not record.online:
                    self.uploads.forget(agent_id)
            elif kind == "update":
                self.uploads.on_message(agent_id, payload)
        except ProtocolError as exc:
            self.rejected_messages += 1
            self.log.warning("message_rejected", topic=topic, size=len(payload), reason=str(exc))

    def _on_answer(self, current: Round) -> None:
        self._progress("round", current.number, len(current.answers), len(current.tasks))
        self._announce_progress(current)

    # ------------------------------------------------------------------ rounds
    def run(self, rounds: int | None = None) -> list[RoundResult]:
        """Run ``rounds`` rounds (default: up to the configured total) and return their results."""
        last = self.config.rounds if rounds is None else self.completed_rounds + rounds
        results = []
        while self.completed_rounds < last:
            results.append(self.run_round(self.completed_rounds + 1))
        self._raise_if_fatal()  # e.g. the last round's verdicts refused: the run is not one to trust
        if left := self.left_behind():
            self.log.warning("run_ended_with_tasks_left", round=self.completed_rounds,
                             left=[f"{agent} {task} ({where})" for agent, task, where in left])
        return results

    def run_round(self, round_number: int) -> RoundResult:
        """One round: plan it (or take the round resumed from the journal), send its tasks, collect, close and
        aggregate, evaluate, checkpoint, tell every device its verdict, report."""
        started = time.monotonic()
        current = self._current()
        if current is None or current.number != round_number:
            current = self._plan_round(round_number)
        elif not self._fleet_settled:  # resumed: its tasks go out in what each agent reads, so hear them first
            agents = {dispatched.task.agent_id for dispatched in current.tasks.values()}
            self.registry.wait_settled(len(agents), REGISTRY_SETTLE_S, RESUME_SETTLE_S)
            self._fleet_settled = True
        self._round_opened_at = time.time()
        self._outage_at_open = self.link.outage_seconds()
        if self.exporter is not None:
            self.exporter.round_opened(current.number, len(current.tasks), len(current.answers))
        self._announce()
        self.link.call_soon(self.uploads.round_opened)  # what came for it while no round collected
        bytes_down = self.dispatcher.send_round(current) + self._resend_carried(current)
        self._progress("round", current.number, len(current.answers), len(current.tasks))
        outage_before = self.link.outage_seconds()
        phase = time.perf_counter()
        # The deadline moves by any broker outage the coordinator sees meanwhile: updates could not arrive then.
        current.wait(lambda: self.link.outage_seconds() - outage_before)
        current.timing["collecting"] = time.perf_counter() - phase
        self._raise_if_fatal()
        current.close()
        self.states = current.finish()
        carried = current.carried_over()
        self._carry(carried, {dispatched.round: self._bases[dispatched.round] for dispatched in carried})
        records, outcomes = reporting.outcomes(current, self.family, self.log, carried=self._carried_ids)
        self.strategy.observe(current.number, outcomes)
        targets = self.strategy.eval_targets()
        trained = reporting.trained(targets, self.family, list(current.aggregated()), self.strategy.trained_targets)
        self.trained_so_far.add(*trained)
        phase = time.perf_counter()
        accuracies = reporting.evaluate_targets(self._evaluator, targets, self.states, self.trained_so_far.members())
        current.timing["evaluation"] = time.perf_counter() - phase
        deployed = deployable.deployed(targets, self.family, self.trained_so_far, accuracies)
        phase = time.perf_counter()
        # The round's record goes with its checkpoint: a stop before metrics.jsonl has it loses no round's figures.
        self._round_done(current, reporting.round_result(current, records, dict(accuracies), trained, bytes_down,
                                                         time.monotonic() - started, deployed))
        current.timing["checkpoint"] = time.perf_counter() - phase
        # Only now: aggregated is for good. Kept, for a device that sends its update again, killed before the ack.
        self.uploads.remember(reporting.send_verdicts(current, self.link, self.topics, self.log))
        result = reporting.round_result(current, records, accuracies, trained, bytes_down,
                                        time.monotonic() - started, deployed)
        self.metrics.write(result)
        if self.exporter is not None:
            self.exporter.round_done(result)
        with self._round_lock:
            self._round = None
        heap.give_back_free_memory()  # the round's freed megabytes (updates queued, chunks) back to the system
        self._announce()
        self.log.info("round_done", round=current.number, global_accuracy=result.global_accuracy,
                      deployed=result.deployed, deployed_accuracy=result.deployed_accuracy,
                      participants=result.participants, seconds=result.seconds)
        if self.on_round is not None:
            self.on_round(result)
        return result

    def _round_done(self, current: Round, record: RoundResult) -> None:
        """Checkpoint the closed round ``current`` with its ``record``, and leave the journal what the next round
        carries (nothing, after a synchronous round): recorded beside the round's own journal before the checkpoint,
        so that a stop between the two loses no carried task."""
        self.completed_rounds = current.number
        if current.buffer_size is not None:
            self.journal.carry_on(current.number + 1, self._carried, self._bases)
        self._checkpoint(record)
        if self._carried:  # the checkpoint holds the round now, the journal what the next one carries
            self.journal.begin(current.number + 1, 0.0, {}, [], self._carried, self._bases, planned=False)
        else:
            self.journal.clear()

    def left_behind(self) -> list[tuple[str, str, str]]:
        """(agent, task, where) of what no round settled when the run ended: tasks ``carried`` into a round that
        never came (a buffered run without ``buffered.drain_last``), updates ``held`` for it."""
        carried = [(dispatched.task.agent_id, dispatched.task_id, "carried") for dispatched in self._carried]
        return carried + [(agent, task, "held") for agent, task in self.uploads.held()
                          if task not in self._carried_ids]

    def _plan_round(self, round_number: int) -> Round:
        """Wait for the fleet, plan the round, journal it (before any task goes out) and open it."""
        waiting = time.perf_counter()
        online, misfits = self.fleet.online_for_round(
            first=not self._fleet_settled, stopped=lambda: self.fatal is not None,
            on_count=lambda count: self._progress("fleet", round_number, count, self.config.min_agents))
        self._raise_if_fatal()
        self._fleet_settled = True
        planning = time.perf_counter()
        if self.strategy.awaits_fleet and self.completed_rounds == 0:
            self.fit_to_fleet([budget for agent in online if (budget := agent.budget()) is not None])
        carried = self._carried
        training = {dispatched.task.agent_id for dispatched in carried}
        free = [agent for agent in online if agent.agent_id not in training]  # (a buffered round's devices)
        self.fleet.tell_service(free)
        # A generator of the round's own: a run resumed after round k selects as one never stopped would.
        rng = random.Random(f"{self.config.seed}:{round_number}")
        plan = self.strategy.configure_round(round_number, free, rng)
        skipped = [*plan.skipped, *misfits]
        deadline = time.time() + self.config.round_timeout_s
        tasks = {self.dispatcher.task_id(round_number, t.agent_id): t for t in plan.tasks}
        self._bases = {number: self._bases.get(number, self.states)
                       for number in {round_number, *(dispatched.round for dispatched in carried)}}
        # Before any task goes out:
        self.journal.begin(round_number, deadline, tasks, skipped, carried, self._bases)
        planned = self._new_round(round_number, tasks, skipped, deadline, carried)
        planned.timing["waiting_for_agents"] = planning - waiting
        planned.timing["planning"] = time.perf_counter() - planning
        self._install(planned)
        return planned

    def fit_to_fleet(self, budgets: Sequence[int]) -> None:
        """Size what the strategy hands out from the fleet's ``budgets`` (its ``auto`` settings: ScaleFL's and
        FlexFL's ratios, ...) before the first round, and make the initial states of the models it chose. The
        round loop does it with the budgets of the agents online at round 1; the simulator before it starts,
        with the budgets it gives its devices."""
        if self.completed_rounds or self._round is not None:
            raise RuntimeError("the strategy can only be sized to the fleet before the first round")
        told = self.strategy.fit_to_fleet(budgets)
        if told is not None:
            self.states = self.strategy.initial_states(self.config.seed)
            self.fleet.service_log = ServiceLog(self.strategy)
            self._checkpoint()  # (round 0) before any task goes out: a coordinator stopped in round 1 resumes it
            self.log.info("sized_to_fleet", detail=told)

    def _new_round(self, round_number: int, tasks: dict[str, TaskPlan], skipped: list[Skip], deadline: float,
                   carried: Sequence[DispatchedTask] = ()) -> Round:
        """A round of these tasks (and, buffered, the ``carried`` tasks of earlier rounds still training). A
        buffered run's last round waits for every task it holds (``buffered.drain_last``): the run ends with what
        its devices trained aggregated, not carried into a round that never comes."""
        buffered = self.config.buffered
        last = round_number >= self.config.rounds and buffered.drain_last
        size = buffered.size if self.config.round_mode == "buffered" and not last else None
        return Round(round_number, tasks, skipped, deadline, self.strategy.begin_aggregate(self.states),
                     self.config.screening, self.intake, carried=carried, buffer_size=size,
                     max_staleness=self.config.buffered.max_staleness)

    def _resend_carried(self, current: Round) -> int:
        """Send again the carried tasks of the agents that came back online while no round collected (a restart
        may have lost them; an agent that has one ignores the copy); returns the bytes sent."""
        with self._round_lock:
            back, self._back_between_rounds = self._back_between_rounds, set()
        sent = 0
        for dispatched in current.tasks.values():
            if dispatched.round != current.number and dispatched.task.agent_id in back:
                sent += self.dispatcher.send(dispatched.round, dispatched.task_id, dispatched.task,
                                             dispatched.deadline)
                current.mark_sent(dispatched.task_id)
                self.log.info("task_resent", agent=dispatched.task.agent_id, task=dispatched.task_id,
                              round=dispatched.round)
        return sent

    def _carry(self, carried: Sequence[DispatchedTask], bases: dict[int, dict[str, State]]) -> None:
        """Keep what the next round carries (buffered rounds) and only the states those tasks were cut from."""
        self._carried = list(carried)
        self._carried_ids = frozenset(dispatched.task_id for dispatched in carried)
        self._bases = bases

    def _carries(self, task_id: str, agent_id: str, round_number: int) -> bool:
        """Whether the next round carries ``task_id``, of that agent and round (asked between two rounds)."""
        return any(dispatched.task_id == task_id and dispatched.task.agent_id == agent_id
                   and dispatched.round == round_number for dispatched in self._carried)

    def _states_of(self, round_number: int) -> dict[str, State]:
        """The states the tasks of ``round_number`` were cut from: a round's own, kept while tasks of it train
        (buffered rounds); the current states for the round being planned or in progress."""
        return self._bases.get(round_number, self.states)

    def _install(self, planned: Round) -> None:
        """Open a planned round and make it the one in progress: from now on its updates are stored and acked."""
        planned.open()
        with self._round_lock:
            self._round = planned
            if self.fatal is not None:  # refused before this round was there to interrupt
                planned.interrupt()

    def _progress(self, phase: str, round_number: int, done: int, expected: int) -> None:
        """Tell the live display (``on_progress``); whatever it raises is logged, never the round's business."""
        if self.on_progress is None:
            return
        try:
            self.on_progress(Progress(phase, round_number, done, expected))
        except Exception as exc:  # noqa: BLE001 - a display must not stop a round
            self.log.warning("progress_display_failed", error=f"{type(exc).__name__}: {exc}")

    def _checkpoint(self, record: RoundResult | None = None) -> None:
        """Write the checkpoint of the rounds completed, with the last one's ``record`` (what ``metrics.jsonl``
        gets next, restored from here by a coordinator that restarts before it got it)."""
        save_checkpoint(self.checkpoint_path, self.states, {
            "round": self.completed_rounds, "algorithm": self.config.algorithm,
            "family": self.config.model.family, "model_options": model_options(self.config),
            "federation": self.config.federation,
            "strategy": self.strategy.state_dict(), **({"record": record.to_dict()} if record is not None else {})})
