"""The edge agent daemon: retained status with a Last Will, tasks in, updates out, never crash.

Threads: paho's network thread (only queues messages), the link's dispatcher (decodes, dedupes, hands tasks
to the training executor), the training executor (shared by a simulated fleet, or the agent's own), the
uplink sender, and a status timer that also feeds the systemd watchdog while the dispatcher keeps up (through a
broker outage too: the watchdog is about this process, not the broker).

A publish (or resubscription) the broker refuses on one of the agent's own topics (its ACL: an agent_id that is not
the login's, or another federation) stops the agent with one sentence: at start, :class:`BrokerRefused`; later,
:attr:`EdgeAgent.fatal`.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections import OrderedDict
from concurrent.futures import Executor, ThreadPoolExecutor
from functools import partial
from pathlib import Path

from common import systemd_notify
from common.cores import available_cores
from common.logs import get_logger
from common.mqtt_link import BrokerRefused, MqttLink, Will
from edge_agent import forkserver
from edge_agent.activity import SEEN_TASKS, AgentActivity
from edge_agent.config import AgentConfig
from edge_agent.holdback import HoldBack, hold_seconds
from edge_agent.id_probe import probe_agent_id
from edge_agent.memory import admit_task, detect_device_kind, total_memory
from edge_agent.model_store import ModelStore
from edge_agent.runner import BudgetFn, LocalData, TaskRunner
from edge_agent.secure_round import FROM_COORDINATOR, SecureTasks
from edge_agent.spool import UpdateSpool
from edge_agent.uplink import Uplink
from protocol import (
    PROTOCOL_REVISION,
    STATUS_REPORT_REVISION,
    Ack,
    AgentStatus,
    BytesLike,
    Capabilities,
    CoordinatorStatus,
    Message,
    ModelDelivery,
    ProtocolError,
    Reassembler,
    Task,
    Topics,
    TransferRefused,
    Update,
    UpdateStatus,
    UploadGrant,
    UploadWait,
    decode,
    encode,
    parse_agent_topic,
    payload_version,
)

_SEEN_TASKS = SEEN_TASKS


#: The watchdog is fed while the dispatcher got through its last heartbeat within this many seconds plus two ticks.
_DISPATCHER_SLACK_S = 5.0


def _declare_forkserver(config: AgentConfig) -> int:
    """Declare the training forkserver before anything starts it (device "auto" asks torch there): "cpu" keeps
    torch's GPU packages out of it, the threads are its OpenMP default (the pools its children start), "pooled"
    preloads the pool. Returns the threads."""
    threads = config.torch_threads or available_cores()
    forkserver.declare(config.device, threads, page_pool=config.allocator == "pooled")
    return threads


class EdgeAgent:
    """One device of the federation."""

    def __init__(self, config: AgentConfig, data: LocalData, *, executor: Executor | None = None,
                 budget_schedule: BudgetFn | None = None) -> None:
        config.validate()
        self.config = config
        self.agent_id = config.agent_id
        self.instance = uuid.uuid4().hex[:12]  # this process, in every status it publishes
        self.topics = Topics(config.federation)
        self.data = data.shape()  # the runner writes the data for the training children; the agent keeps no copy
        self.device_kind = detect_device_kind() if config.device_kind == "auto" else config.device_kind
        threads = _declare_forkserver(config)
        self.budget_schedule: BudgetFn = budget_schedule or (lambda _round: config.budget_bytes)
        state_dir = config.state_dir or os.environ.get("STATE_DIRECTORY")
        own_dir = Path(state_dir) / self.agent_id if state_dir else None
        self.runner = TaskRunner(self.agent_id, data, self.budget_schedule, self._torch_device(),
                                 state_dir=own_dir, torch_threads=threads,
                                 allocator=config.allocator, limits=config.limits,
                                 stall_timeout=config.stall_timeout_s,
                                 unified_memory=detect_device_kind() == "jetson")  # the board, not its label
        self.log = get_logger("agent", agent=self.agent_id, federation=config.federation)
        self._own_executor = executor is None
        self.executor = executor or ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{self.agent_id}-train")
        self.reassembler = Reassembler(max_total_bytes=config.limits.max_task_bytes, max_transfers=8,
                                       admit=lambda _transfer, total: admit_task(total, self.config.limits.max_task_bytes))
        #: The tasks it serves and the answers it gave (its status's busy, its report).
        self.activity = AgentActivity(_SEEN_TASKS)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._stopping = False  # stop() has begun (it runs once)
        self.rejected_messages = 0
        #: Updates the coordinator stored but its screening rejected, by task id, with the reason (the latest).
        self.rejected_updates: OrderedDict[str, str] = OrderedDict()
        self.coordinator_state = "unknown"  # as its retained status last said
        self.coordinator_reads_reports = False  # its status said so (protocol.STATUS_REPORT_REVISION)
        self.models = ModelStore(own_dir, self.log)  # the model it holds to run, delivered at a federation's end
        #: Why the agent stopped on its own (the broker refused what it cannot work without), one sentence.
        self.fatal: str | None = None
        self.link = MqttLink(
            client_id=f"fedfit-agent-{self.agent_id}",
            broker=config.broker,
            subscriptions=[self.topics.agent_task(self.agent_id), self.topics.agent_ack(self.agent_id),
                           self.topics.coordinator_status(), self.topics.agent_status(self.agent_id)],
            handler=self._on_message,
            will=Will(self.topics.agent_status(self.agent_id), encode(self._offline_status())),
            on_ready=self.publish_status,
            on_taken_over=self._taken_over,
            on_refused=self._on_refused,
        )
        #: Updates waiting for their ack, on disk (none without a state directory: then a restart loses them).
        self.spool = UpdateSpool(own_dir / "outbox", config.outbox_max_bytes) if own_dir is not None else None
        self.uplink = Uplink(self.agent_id, self.topics.agent_update(self.agent_id),
                             lambda topic, payload: self.link.publish(topic, payload),
                             config.ack_timeout_s, config.update_attempts,
                             connected=lambda: self.link.connected, spool=self.spool,
                             on_backlog=self._outbox_changed)
        self._timer = threading.Thread(target=self._status_loop, name=f"{self.agent_id}-status", daemon=True)
        #: Trained updates held back by ``slowdown`` (spooled already), released to the uplink when due.
        self.holdback = HoldBack(self.agent_id)
        #: Secure rounds' updates, held until masked (`edge_agent.secure_round`).
        self.secure = SecureTasks(self.agent_id, config.federation, self._publish_update, self.uplink.send, self.log)

    def _torch_device(self) -> str:
        if self.config.device == "auto":  # torch is asked in the training forkserver, which starts for it
            return "cuda" if forkserver.cuda_available() else "cpu"
        return self.config.device

    # --------------------------------------------------------------- lifecycle
    def start(self, timeout: float = 30.0) -> None:
        """Connect and subscribe; tell systemd we are ready only then. Refuses (:class:`AgentIdInUse`) when
        another process is this agent already (it answers this one's "starting" status). Updates a previous
        process left waiting for their ack are sent first."""
        self._refuse_if_online(timeout)
        if self.config.forkserver == "start-up":
            forkserver.start()
        self.uplink.start()
        self.link.start(timeout)
        self._timer.start()
        systemd_notify.notify("READY=1")

    def stop(self) -> None:
        """Say 'offline' (retained) and disconnect; queued tasks are abandoned and the one in training loses its
        child (killed, not left training). (Not 'offline' when another process took this agent id over: the status
        is that process's now.) Only the first call does anything."""
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
        self._stop.set()
        # What was held back stays in the outbox spool (the next start sends it); a task waiting for the device to be
        # free is not answered (the coordinator sends it again to the next process).
        held = [key for key in self.holdback.close() if not key.startswith("start-")]
        if held:
            self.log.info("held_updates_left_for_next_start", tasks=held, spooled=self.spool is not None)
        self.secure.close()  # (a secure round's secrets are this process's only)
        self.uplink.stop()
        if self._own_executor:
            self.executor.shutdown(wait=False, cancel_futures=True)
        final = None if self.link.taken_over else (self.topics.agent_status(self.agent_id),
                                                    encode(self._offline_status()), True)
        self.link.stop(final=final)
        if self._timer.is_alive():
            self._timer.join(2.0)
        self.runner.close()

    def _refuse_if_online(self, timeout: float) -> None:
        """Refuse (:class:`AgentIdInUse`) when another process runs this agent (`edge_agent.id_probe`)."""
        stale = probe_agent_id(self.config.broker, self.topics, self.agent_id, self.instance, timeout,
                               refused=lambda topic, reason: BrokerRefused(self._refusal_message(topic, reason)),
                               in_use=self.config.federation)
        if stale is not None:
            self.log.info("stale_status_replaced", instance=stale.instance, state=stale.state,
                          message="the retained status named another process, which did not answer: it is gone")

    def _refusal_message(self, topic: str, reason: str) -> str:
        """The sentence for a publish the broker refused on one of this agent's own topics."""
        return (f"the MQTT broker at {self.config.broker} refused to let user {self.config.broker.username!r} "
                f"publish on {topic} ({reason}): this agent's agent_id ('{self.agent_id}') must be its login's "
                f"username and its federation ('{self.config.federation}') the one the broker was made for (see "
                f"the agent.yaml `fedfit broker add-device` writes)")

    def _on_refused(self, topic: str, reason: str) -> None:
        """The broker refused a publish (or, after a reconnect, a subscription): on the agent's own topics it cannot
        work at all."""
        own = (self.topics.agent_status(self.agent_id), self.topics.agent_update(self.agent_id),
               self.topics.agent_task(self.agent_id), self.topics.agent_ack(self.agent_id))
        if topic not in own:
            return
        with self._lock:
            if self.fatal is not None or self._stop.is_set():
                return
            self.fatal = self._refusal_message(topic, reason)
        self.log.error("agent_refused_by_broker", message=self.fatal)
        self.stop()

    @property
    def tasks_done(self) -> int:
        """Tasks answered."""
        return self.activity.tasks_done

    @property
    def taken_over(self) -> bool:
        """Whether another process connected to the broker as this agent and this one stopped for it."""
        return self.link.taken_over

    def _taken_over(self) -> None:
        self.log.error("agent_id_taken_over", message=self.taken_over_message())
        self.stop()

    def taken_over_message(self) -> str:
        """The sentence saying why the agent stopped after a takeover."""
        return (f"another process connected to the broker as agent '{self.agent_id}' of federation "
                f"'{self.config.federation}', so this one stopped; give every device its own agent_id")

    def run_forever(self) -> None:
        """Block until :meth:`stop` is called (from a signal handler, say)."""
        self._stop.wait()

    # ------------------------------------------------------------------ status
    def status(self, report: bool = True) -> AgentStatus:
        """The current status with fresh memory figures (its report when ``report`` and the coordinator reads it)."""
        state = "busy" if self.activity.busy else "online"
        summary = (self.activity.report(*self.uplink.backlog()) if report and self.coordinator_reads_reports
                   else None)
        if summary is not None:
            self.models.fill(summary)
        budget = self.budget_schedule(self.activity.last_round)
        capabilities = Capabilities(
            device_kind=self.device_kind,
            memory_total=total_memory(),
            memory_available=self.runner.available(self.activity.last_round),
            budget_bytes=budget,
            num_samples=self.data.samples,
            labels=list(self.data.labels),
            sample_shape=(self.data.in_channels, *self.data.image_size),
            protocol_version=PROTOCOL_REVISION,
        )
        return AgentStatus(self.agent_id, state, capabilities, time.time(), self.instance, summary)

    def unsettled(self) -> list[tuple[str, str]]:
        """The tasks the coordinator has not settled, with where each is: ``training``, ``held back`` (trained,
        its update in the outbox spool, held back by ``slowdown``) or ``outbox`` (its update waiting for its
        ack)."""
        training = self.activity.training()
        held = set(self.holdback.held())
        return [(task_id, "held back" if task_id in held else "training") for task_id in training] + [
            (task_id, "outbox") for task_id in self.uplink.unacked() if task_id not in training]

    def _offline_status(self) -> AgentStatus:
        return AgentStatus(self.agent_id, "offline", None, time.time(), self.instance)

    def _outbox_changed(self) -> None:
        """The uplink's backlog changed (an update queued, acked, refused or parked): the report says it now, once
        the coordinator reads reports (older ones see the status change at the next tick)."""
        if self.coordinator_reads_reports and not self._stopping:
            self.publish_status()

    def publish_status(self, report: bool = True) -> None:
        """Publish the retained status (called on every (re)connect, on a timer and around tasks)."""
        self.link.publish(self.topics.agent_status(self.agent_id), encode(self.status(report)), retain=True)

    def _status_loop(self) -> None:
        interval = self.config.status_interval_s
        watchdog = systemd_notify.watchdog_interval()
        tick = min(interval, watchdog) if watchdog else interval
        last_status = time.monotonic()
        while not self._stop.wait(tick):
            # The dispatcher got through the last tick's heartbeat: this process works (the broker may be away).
            if watchdog and self.link.pulse() <= 2 * tick + _DISPATCHER_SLACK_S:
                systemd_notify.notify("WATCHDOG=1")
            if time.monotonic() - last_status >= interval:
                self.publish_status()
                last_status = time.monotonic()

    # ---------------------------------------------------------------- messages
    def _on_message(self, topic: str, payload: bytes) -> None:
        try:
            if topic == self.topics.coordinator_status():
                self._on_coordinator_status(payload)
                return
            _, agent_id, kind = parse_agent_topic(topic)
            if agent_id != self.agent_id:
                raise ProtocolError(f"message for agent {agent_id!r} reached {self.agent_id!r}")
            if kind == "status":
                self._on_own_status(payload)
            elif kind == "task":
                self._on_task_chunk(payload)
            elif kind == "ack":
                ack = decode(payload, expected=(Ack, UploadGrant, UploadWait, *FROM_COORDINATOR))
                if self.secure.take(ack):  # a secure round's message, or a refusal of an update it holds
                    return
                if isinstance(ack, UploadWait):
                    if not self.uplink.on_wait(ack.task_id, ack.reason):
                        self.log.debug("wait_ignored", task=ack.task_id)
                    return
                if isinstance(ack, UploadGrant):
                    if not self.uplink.on_grant(ack.task_id):
                        self.log.debug("grant_ignored", task=ack.task_id)
                    return
                assert isinstance(ack, Ack)
                if ack.verdict is not None:
                    self._on_verdict(ack)
                elif not self.uplink.on_ack(ack.task_id, ack.reason):
                    self.log.debug("ack_ignored", task=ack.task_id)
        except ProtocolError as exc:
            self.rejected_messages += 1
            self.log.warning("message_rejected", topic=topic, size=len(payload), reason=str(exc))

    def _on_own_status(self, payload: bytes) -> None:
        """Another process starting with this agent id asks whether one runs it: answer with a fresh status."""
        if not payload:
            return
        status = decode(payload, expected=AgentStatus)
        assert isinstance(status, AgentStatus)
        if status.state == "starting" and status.instance != self.instance and not self._stop.is_set():
            self.log.warning("agent_id_claimed_by_another_process", instance=status.instance,
                             message=f"another process tried to start as agent '{self.agent_id}'; it is told this "
                                     f"one is running")
            self.publish_status(report=False)  # a process of any revision must read the answer

    def _on_verdict(self, ack: Ack) -> None:
        """What the coordinator's screening made of a stored update: aggregated, or rejected with the reason (the
        last :data:`_SEEN_TASKS` kept in :attr:`rejected_updates`). It settles the update too, should its first
        ack have been lost: the round is over, sending it again would only be refused."""
        self.uplink.on_ack(ack.task_id, ack.reason if ack.verdict == "rejected" else None)
        if ack.verdict == "rejected":
            with self._lock:
                self.rejected_updates[ack.task_id] = ack.reason or ""
                while len(self.rejected_updates) > _SEEN_TASKS:
                    self.rejected_updates.popitem(last=False)
            self.log.warning("update_rejected_by_coordinator", task=ack.task_id, round=ack.round, reason=ack.reason)
        else:
            self.log.info("update_aggregated", task=ack.task_id, round=ack.round)

    def _on_coordinator_status(self, payload: bytes) -> None:
        """Log when the coordinator goes offline and when it comes back (its retained status and Last Will), and
        repeat this agent's status when it comes online: a coordinator started after its agents then sees them at
        once, even through a broker that keeps retained messages from wildcard subscriptions (RabbitMQ)."""
        if not payload:
            return  # a cleared retained status
        status = decode(payload, expected=CoordinatorStatus)
        assert isinstance(status, CoordinatorStatus)
        reads_reports = status.state == "online" and status.revision >= STATUS_REPORT_REVISION
        self.models.note_coordinator(status)
        if status.state == self.coordinator_state:
            if reads_reports != self.coordinator_reads_reports and status.state == "online":
                self.coordinator_reads_reports = reads_reports  # (the fleet's oldest agent changed)
                if not self._stop.is_set():
                    self.publish_status()
            return
        self.coordinator_reads_reports = reads_reports  # (offline: a coordinator of any revision may come next)
        if status.state == "offline":
            self.log.warning("coordinator_offline", round=status.round)
        elif self.coordinator_state == "offline":
            self.log.info("coordinator_back", round=status.round)
            self.uplink.resend_parked()
        else:
            self.log.info("coordinator_online", round=status.round)
        self.coordinator_state = status.state
        if status.state == "online" and not self._stop.is_set():  # (stopping: its last word is "offline")
            self.publish_status()

    def _on_task_chunk(self, payload: bytes) -> None:
        try:
            complete = self.reassembler.feed(payload, source="coordinator")
        except TransferRefused as refused:
            self._decline_refused(refused)
            return
        if complete is None:
            return
        task = decode(complete, expected=(Task, ModelDelivery))
        if isinstance(task, ModelDelivery):  # a trained model to run (edge_agent.model_store)
            self.models.take(task, self.agent_id, self.runner.available(self.activity.last_round))
            self.publish_status()
            return
        assert isinstance(task, Task)
        if task.agent_id != self.agent_id:
            raise ProtocolError(f"task addressed to {task.agent_id!r} arrived at {self.agent_id!r}")
        waiting = self.uplink.pending(task.task_id)  # its update is out already (e.g. a previous process's)
        if not self.activity.take(task, answered_already=waiting):
            self.log.info("duplicate_task_ignored", task=task.task_id, update_waiting=waiting)
            return
        self.log.info("task_received", task=task.task_id, round=task.round, spec=task.spec, bytes=len(complete))
        self.publish_status()
        self._start(task, time.perf_counter(), complete)  # answered in the version the task came in

    def _start(self, task: Task, received: float, payload: BytesLike) -> None:
        """Hand ``task`` to the training executor; a slowed device still busy with an update it holds back starts it
        only once it is free (holding no training slot meanwhile), as a device that slow would."""
        busy = self.holdback.busy_for()
        if busy <= 0 or not self.holdback.hold(f"start-{task.task_id}", busy, lambda: self.executor.submit(
                self._serve, task, received, payload)):
            self.executor.submit(self._serve, task, received, payload)

    def _decline_refused(self, refused: TransferRefused) -> None:
        """Answer a task refused at its first chunk with a ``declined`` update, when its chunks name the round
        (the transfer id is the task id); from a coordinator that names none, only log it."""
        self.rejected_messages += 1
        if refused.round is None:
            self.log.warning("task_refused", transfer=refused.transfer, reason=refused.reason,
                             answered=False, why_not="its chunks do not say the round")
            return
        if not self.activity.first_sight(refused.transfer):
            return
        self.log.warning("task_refused", task=refused.transfer, round=refused.round, reason=refused.reason,
                         answered=True)
        self.uplink.send(Update(task_id=refused.transfer, round=refused.round, agent_id=self.agent_id,
                                status=UpdateStatus.DECLINED, spec_trained=None, num_samples=self.data.samples,
                                labels=list(self.data.labels), weights={}, metrics={}, reason=refused.reason))

    def _serve(self, task: Task, received: float, payload: BytesLike | None = None) -> None:
        """Train ``task`` (``received``: time.perf_counter() when it arrived; ``payload``: the message it came
        as, handed to the training children as it is) and send its update in the task's protocol version; its
        ``seconds_queued`` metric says how long the task waited for a slot. With ``slowdown``, the update is held
        back (:meth:`_answer`) and the agent stays busy with the task until it goes."""
        held = False
        try:
            queued = time.perf_counter() - received
            update = self.runner.run(task, payload)
            update.metrics["seconds_queued"] = queued
            if self._stop.is_set() and update.status is UpdateStatus.FAILED:
                # Cut short by this agent's own stop (a restart, an upgrade): no answer, so that the coordinator
                # sends the task again to the next process, which trains it.
                self.log.info("task_left_for_next_start", task=task.task_id, reason=update.reason)
                return
            self.log.info("task_done", task=task.task_id, status=update.status, reason=update.reason,
                          **{k: v for k, v in update.metrics.items() if k in ("loss", "seconds")})
            held = self._answer(task, update, payload_version(payload) if payload is not None else 1)
        except Exception:
            self.log.exception("task_crashed", task=task.task_id)
        finally:
            if not held:
                self._task_over(task)

    def _answer(self, task: Task, update: Update, version: int) -> bool:
        """Send ``update``, or, with ``slowdown``, spool it now and send it (f - 1) x its task's seconds later
        (``edge_agent.holdback``; its metrics say so: ``seconds_slowdown``, and ``seconds_task`` includes it, the
        device's own time). True when it is held back: the task is over once it goes."""
        # The task's own seconds (the decision and the training child as measured, not the wait for a slot):
        hold = hold_seconds(self.config.slowdown,
                            float(update.metrics.get("seconds_task", update.metrics.get("seconds", 0.0))))
        if hold > 0:
            update.metrics["seconds_slowdown"] = hold
            update.metrics["seconds_task"] = float(update.metrics.get("seconds_task", 0.0)) + hold
        if task.secure and update.status.trained:  # never sent in the clear: masked once its round agreed keys
            self.secure.advertise(task, update, version, partial(self._answered, task), hold, self.holdback)
            return True
        if hold <= 0:
            self.uplink.send(update, version=version, ask=task.ask_to_upload)
            self.activity.answered(task, update)
            return False
        queue = self.uplink.send_later(update, version=version, ask=task.ask_to_upload)

        def release() -> None:
            try:
                queue()
                self.activity.answered(task, update)
            finally:
                self._task_over(task)

        held = self.holdback.hold(task.task_id, hold, release)
        if held:
            self.log.info("update_held_back", task=task.task_id, seconds=round(hold, 3),
                          slowdown=self.config.slowdown)
        return held

    def _publish_update(self, message: Message) -> None:  # (a secure round's small messages)
        self.link.publish(self.topics.agent_update(self.agent_id), encode(message))

    def _answered(self, task: Task, update: Update | None) -> None:
        if update is not None:
            self.activity.answered(task, update)
        self._task_over(task)

    def _task_over(self, task: Task) -> None:
        """The agent is done with ``task`` (its update sent, or none coming): busy no more unless with another."""
        self.activity.over(task.task_id)
        if not self._stop.is_set():
            self.publish_status()
