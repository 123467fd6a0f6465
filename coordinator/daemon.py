"""The coordinator daemon: the loop of rounds, read top to bottom, and the rooms it hands work to.

Each round: the planner waits for the fleet (`coordinator.fleet`), plans with the strategy, journals and opens it
(`coordinator.round_planner`); the dispatcher sends its tasks; the upload desk and the intake collect the updates on
the MQTT link's message thread; the round closes and aggregates (`coordinator.round`); it is reviewed and evaluated
(`coordinator.reporting`), checkpointed (`coordinator.run_files`), every device told its verdict, and reported.
What is in flight (the round in progress, the states tasks were cut from, what the next round carries) is one
object every room is handed (`coordinator.in_flight`); the status it announces is `coordinator.announcements`'.

Misconfigurations end loudly: a publish the broker refuses (its ACL: another federation, or a login that is not
the coordinator's) stops the run with :class:`BrokerRefused`; a fleet with no agent of this federation is told
which federations the broker does show; an agent whose data does not fit the model is never planned for.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from common import heap
from common.blas_threads import guard_blas_threads
from common.data import Dataset, load_dataset
from common.logs import get_logger
from common.mqtt_link import BrokerRefused, MqttLink
from coordinator import reporting
from coordinator.announcements import StatusAnnouncer
from coordinator.brief import MethodBrief
from coordinator.config import CoordinatorConfig
from coordinator.dispatch import Dispatcher
from coordinator.evaluation import Evaluator
from coordinator.exporter import CoordinatorMetrics
from coordinator.fleet import REGISTRY_SETTLE_S, FleetWatch, NoAgentsError
from coordinator.in_flight import InFlight
from coordinator.intake import UpdateIntake, single_threaded_torch
from coordinator.metrics import Progress, RoundResult, tell_progress
from coordinator.model_courier import ModelCourier
from coordinator.planning import model_family, model_options, strategy_for
from coordinator.privacy.guard import PrivacyGuard
from coordinator.registry import FleetRegistry
from coordinator.round import Round
from coordinator.round_planner import RoundPlanner
from coordinator.run_files import RunFiles
from coordinator.secure.room import SecureRounds
from coordinator.tasks import State
from coordinator.upload_desk import UploadDesk
from coordinator.upload_grants import UploadGrants
from models import ModelFamily
from protocol import ModelRef, ProtocolError, Topics, parse_agent_topic

__all__ = ["REGISTRY_SETTLE_S", "Coordinator", "NoAgentsError", "Progress", "single_threaded_torch"]

#: Seconds a round resumed from the journal waits at least for the updates its agents are still resending.
RESUME_GRACE_S = 60.0


class Coordinator:
    """Runs the federation described by a :class:`CoordinatorConfig`; each room is made once here and handed what
    it needs (a new cross-cutting feature: a room of its own, made here: docs/architecture.md)."""

    def __init__(self, config: CoordinatorConfig, *, dataset: Dataset | None = None,
                 on_round: Callable[[RoundResult], None] | None = None,
                 on_progress: Callable[[Progress], None] | None = None, resume_grace_s: float = RESUME_GRACE_S) -> None:
        """``resume_grace_s``: seconds a round resumed from the journal waits at least (a simulator whose agents
        restarted with it and train its tasks again gives it a whole round's deadline)."""
        config.validate()
        self.config = config
        self.log = get_logger("coordinator", federation=config.federation)
        if (blas := guard_blas_threads()) is not None:
            self.log.warning("blas_threads_capped", reason=blas)
        self.dataset = dataset if dataset is not None else load_dataset(config.data.dataset, config.data.root)
        self.family: ModelFamily = model_family(config, self.dataset)
        self.strategy = strategy_for(config, self.dataset, self.family)
        #: What the method tells whoever runs it (the simulator asks there, not the strategy).
        self.brief = MethodBrief(config, self.strategy, self.family, self.dataset.image_size)
        self.fleet = FleetWatch(config, FleetRegistry(), self.dataset, self.strategy, self.log)
        self.on_round = on_round
        self.on_progress = on_progress
        self.rejected_messages = 0  # messages refused as malformed
        self.files = RunFiles(config, self.strategy, self.model_ref, self.log)
        self.in_flight = InFlight(self.files.open())
        # The link first, so that every room is handed it once; its Last Will is made as start() connects.
        self.link = MqttLink(client_id=f"fedfit-coordinator-{config.federation}", broker=config.broker,
                             subscriptions=[self.topics.all_agent_status(), self.topics.all_agent_updates()],
                             handler=self._on_message, will=lambda: self.announcer.last_will(),
                             on_ready=lambda: self.announcer.announce(),
                             on_refused=self._on_refused)
        self.announcer = StatusAnnouncer(config.federation, self.link, self.topics, self.registry, self.in_flight,
                                         self.files)
        #: Prometheus metrics (``metrics_port``), None when off.
        self.exporter = (CoordinatorMetrics(config.federation, config.algorithm, self.link.backlog,
                                            lambda: len(self.registry.online()), lambda: self.uploads.window())
                         if config.metrics_port is not None else None)
        if self.exporter is not None and self.files.last_record is not None:  # shown until the next round is done
            self.exporter.round_done(self.files.last_record, counted=False)
        self.secure = SecureRounds(config, self.link, self.topics, self.family, self.dataset.num_classes, self.log)
        self.intake = UpdateIntake(self.family, self.strategy, self.files.journal, self.dataset.num_classes,
                                   self.in_flight, self.link, self.topics, self.log, on_accepted=self._on_answer,
                                   on_receipt=self.exporter.update_received if self.exporter is not None else None,
                                   secure=self.secure)  # (masked updates, and the secure exchange told of answers)
        self._evaluator = Evaluator.for_test_set(self.family, self.dataset, config.data.eval_samples, config.seed,
                                                 self.strategy.context.server_x)
        #: Differential privacy: the clip bound in each task, the private aggregate, the epsilon spent, the budget.
        self.privacy = PrivacyGuard(config.privacy, config.rounds, self.files.last_record, self.completed_rounds,
                                    self.log)
        self.planner = RoundPlanner(config, self.strategy, self.fleet, self.in_flight, self.files, self.intake,
                                    self.privacy, self.secure, self.log)
        if config.resume:
            self.planner.resume(self.completed_rounds, resume_grace_s)
        #: The agents' update topics: requests to upload and chunks (``uploads``: the window, `grants`).
        self.uploads = UploadDesk(self.intake, config.uploads, self.link, self.topics, self.in_flight,
                                  self.registry.revision, self.log, on_secure=self.secure.on_message)
        self.dispatcher = Dispatcher(self.link, self.topics, self.registry, self.family, self.model_ref, self.in_flight,
                                     config.seed, self.log, grants_uploads=self.uploads.grants is not None)
        self.courier = ModelCourier(config, self.link, self.topics, self.registry, self.log,  # the devices' models
                                    reads_reports=self.announcer.fleet_reads_reports, pace=self.dispatcher.pace)

    @property
    def topics(self) -> Topics:  # the federation's
        return Topics(self.config.federation)

    @property
    def registry(self) -> FleetRegistry:
        """The agents heard of, with their last status."""
        return self.fleet.registry

    @property
    def model_ref(self) -> ModelRef:
        """The model every task names: its family, classes, input channels and options."""
        return ModelRef(self.config.model.family, self.dataset.num_classes, self.dataset.in_channels,
                        model_options(self.config))

    @property
    def completed_rounds(self) -> int:
        return self.files.completed_rounds

    @property
    def states(self) -> dict[str, State]:
        """The global model's states as the last closed round left them."""
        return self.in_flight.states

    @property
    def fatal(self) -> str | None:
        """Why the run cannot go on (the broker refused a publish it needs), one sentence; ends the round loop."""
        return self.in_flight.halted

    @property
    def metrics_port(self) -> int | None:  # once the metrics are served
        return self.exporter.port if self.exporter is not None else None

    @property
    def grants(self) -> UploadGrants | None:
        """The window of update bytes in transfer (``uploads``), None when uploads are not granted."""
        return self.uploads.grants

    # --------------------------------------------------------------- lifecycle
    def start(self, timeout: float = 30.0) -> None:
        """Connect to the broker; the retained coordinator status goes out once subscribed."""
        self.announcer.restart()
        if self.exporter is not None and self.exporter.port is None:
            self.exporter.start(self.config.metrics_host, self.config.metrics_port or 0, self.log)
        self.link.start(timeout)

    def stop(self) -> None:
        """Publish the retained 'offline' status and disconnect; then stop serving the metrics once a scrape has read
        their final state, or after ``metrics_linger_s`` (at once when nothing ever scraped them)."""
        self.announcer.stop()  # no 'online' after the 'offline' (a progress re-publication due within the second)
        self.link.stop(final=self.announcer.offline())
        if self.exporter is not None and not self.exporter.stop(linger=self.config.metrics_linger_s):
            self.log.warning("metrics_final_state_not_scraped", linger_s=self.config.metrics_linger_s,
                             message="no scrape read the final metrics before metrics_linger_s passed")

    def _on_refused(self, topic: str, reason: str) -> None:
        """The broker refused a publish (its status, a task or an ack): the federation cannot run."""
        if self.in_flight.halt(f"the MQTT broker at {self.config.broker} refused to let user "
                               f"{self.config.broker.username!r} publish on {topic} ({reason}): federation "
                               f"('{self.config.federation}') must be the one the broker was made for and "
                               f"broker.username its coordinator login (see the coordinator.yaml `fedfit broker init` "
                               f"writes)"):
            self.log.error("coordinator_refused_by_broker", message=self.fatal)
            self.registry.interrupt()

    def _raise_if_fatal(self) -> None:
        if self.fatal is not None:
            raise BrokerRefused(self.fatal)

    def _on_message(self, topic: str, payload: bytes) -> None:
        single_threaded_torch()
        try:
            _, agent_id, kind = parse_agent_topic(topic)
            if kind == "status":
                if self.fleet.on_status(agent_id, payload):
                    current = self.in_flight.current()
                    self.dispatcher.resend_unanswered(current, agent_id)
                    self.in_flight.back_online(agent_id, current)  # (a task the next round carries goes again)
                self.announcer.announce_if_readers_changed()  # an older agent came, or the last went
                record = self.registry.get(agent_id)
                if record is not None and not record.online:
                    self.uploads.forget(agent_id)
            elif kind == "update":
                self.uploads.on_message(agent_id, payload)
        except ProtocolError as exc:
            self.rejected_messages += 1
            self.log.warning("message_rejected", topic=topic, size=len(payload), reason=str(exc))

    def _on_answer(self, current: Round) -> None:
        """The round in progress took an update as new."""
        tell_progress(self.on_progress, self.log, "round", current.number, len(current.answers), len(current.tasks))
        self.announcer.announce_progress(len(current.answers), len(current.tasks))

    # ------------------------------------------------------------------ rounds
    def run(self, rounds: int | None = None) -> list[RoundResult]:
        """Run ``rounds`` rounds (default: up to the configured total) and return their results."""
        last = self.config.rounds if rounds is None else self.completed_rounds + rounds
        results = []
        while self.completed_rounds < last and self.privacy.allows(self.completed_rounds + 1):
            results.append(self.run_round(self.completed_rounds + 1, last_round=last))
        self._raise_if_fatal()  # e.g. the last round's verdicts refused: the run is not one to trust
        if left := self.left_behind():
            self.log.warning("run_ended_with_tasks_left", round=self.completed_rounds,
                             left=[f"{agent} {task} ({where})" for agent, task, where in left])
        if results and self.completed_rounds >= self.config.rounds and self.config.deployment.deliver:
            self.deploy()
        return results

    def deploy(self) -> dict[str, str]:
        """Write the run's trained models and hand each agent online the largest it runs (`coordinator.model_courier`;
        after the last round, and on request: ``fedfit deliver``); per agent, what it holds or why not."""
        return self.courier.finish(self.strategy, self.family, self.dataset, self._evaluator, self.states,
                                   self.files.trained_so_far, self.files.last_record, self.completed_rounds)

    def run_round(self, round_number: int, *, last_round: int | None = None) -> RoundResult:
        """One round: plan it (or take the round resumed from the journal), send its tasks, collect, close and
        aggregate, evaluate (:meth:`CoordinatorConfig.levels_due`), checkpoint, tell every device its verdict, report."""
        started = time.monotonic()
        current = self._open(round_number)
        bytes_down = (self.dispatcher.send_round(current)
                      + self.dispatcher.resend_carried(current, self.in_flight.take_back_online()))
        tell_progress(self.on_progress, self.log, "round", current.number, len(current.answers), len(current.tasks))
        outage_before = self.link.outage_seconds()
        phase = time.perf_counter()
        # The deadline moves by any broker outage seen meanwhile: updates could not arrive then.
        current.wait(lambda: self.link.outage_seconds() - outage_before)
        current.timing["collecting"] = time.perf_counter() - phase
        self._raise_if_fatal()
        current.close()
        self.in_flight.states = current.finish()
        self.in_flight.carry(current.carried_over())
        review = reporting.review(current, self.strategy, self.family, self._evaluator, self.states,
                                  self.files.trained_so_far, self.in_flight.carried_ids, self.log,
                                  every_target=self.config.levels_due(current.number, last_round))
        review.privacy, review.secure = self.privacy.settle(current.number), self.secure.settle(current.number)
        phase = time.perf_counter()
        # The round's record goes with its checkpoint: a stop before metrics.jsonl has it loses no round's figures.
        self.files.round_done(current.number, self.states, review.result(bytes_down, time.monotonic() - started),
                              buffered=current.buffer_size is not None, carried=self.in_flight.carried,
                              bases=self.in_flight.bases)
        current.timing["checkpoint"] = time.perf_counter() - phase
        # Only now: aggregated is for good. Kept, for a device that sends its update again, killed before the ack.
        self.uploads.remember(reporting.send_verdicts(current, self.link, self.topics, self.log))
        return self._report(review.result(bytes_down, time.monotonic() - started))

    def _open(self, round_number: int) -> Round:
        """The round to run (`RoundPlanner.next_round`), opened, announced, and given what the desk held for it."""
        current = self.planner.next_round(
            round_number, stopped=lambda: self.fatal is not None,
            on_count=lambda count: tell_progress(self.on_progress, self.log, "fleet", round_number, count,
                                                 self.config.min_agents))
        self._raise_if_fatal()
        assert current is not None  # (None only when stopped)
        self.announcer.round_opened()
        if self.exporter is not None:
            self.exporter.round_opened(current.number, len(current.tasks), len(current.answers))
        self.announcer.announce()
        self.link.call_soon(self.uploads.round_opened)  # what came for it while no round collected
        return current

    def _report(self, result: RoundResult) -> RoundResult:
        """The round checkpointed and its verdicts sent: record it, end it, tell whoever watches."""
        self.files.metrics.write(result)
        if self.exporter is not None:
            self.exporter.round_done(result)
        self.in_flight.finished()
        heap.give_back_free_memory()  # the round's freed megabytes (updates queued, chunks) back to the system
        self.announcer.announce()
        self.log.info("round_done", round=result.round, global_accuracy=result.global_accuracy,
                      deployed=result.deployed, deployed_accuracy=result.deployed_accuracy,
                      participants=result.participants, seconds=result.seconds)
        if self.on_round is not None:
            self.on_round(result)
        return result

    def left_behind(self) -> list[tuple[str, str, str]]:
        """(agent, task, where) of what no round settled at the run's end: tasks ``carried`` into a round that never
        came (buffered, without ``buffered.drain_last``), updates ``held`` for it."""
        return self.in_flight.left_behind(self.uploads.held())

    def fit_to_fleet(self, budgets: Sequence[int]) -> None:
        """Size what the method hands out to the fleet's ``budgets`` (`RoundPlanner.fit_to_fleet`) before round 1 (the
        loop: the agents online then; the simulator: its devices' budgets); nothing where sized or nothing to size."""
        self.planner.fit_to_fleet(budgets)
