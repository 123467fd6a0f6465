"""Task dispatch: a planned task cut from the global state, written in what its agent reads, sent in paced chunks.

A task's weights are read from the state as its chunks are made (no joined copy). The coordinator keeps at most
:data:`DISPATCH_WINDOW_BYTES` of task chunks in flight to the broker: a round's tasks (3.9 GB for 1000 agents of a
1M-parameter model) would otherwise queue in paho all at once. Each agent gets the newest protocol version both
sides read, and only the fields its announced revision reads (`protocol.PROTOCOL_REVISION`).
"""

from __future__ import annotations

import hashlib
import time
import uuid
from dataclasses import replace

from common.logs import Logger
from common.mqtt_link import MqttLink
from coordinator.in_flight import InFlight
from coordinator.registry import FleetRegistry
from coordinator.round import Round
from coordinator.tasks import TaskPlan
from models import ModelFamily
from protocol import (
    HEAD_ALONE_REVISION,
    ORDERED_DROPOUT_REVISION,
    PROTOCOL_VERSION,
    UPLOAD_GRANT_REVISION,
    Adaptation,
    ModelRef,
    Task,
    Topics,
    TrainingPlan,
    encode_parts,
    iter_chunks,
)

#: Bytes of task chunks in flight to the broker at most while dispatching (then it waits for the broker's PUBACKs).
DISPATCH_WINDOW_BYTES = 64 * 2**20
#: Seconds to wait for room in that window before sending anyway (the broker is away; paho queues for its return).
DISPATCH_WAIT_S = 30.0


class Dispatcher:
    """Sends the tasks of a round (see the module docstring). ``in_flight`` says which states the tasks of a round
    are cut from (a task a buffered round carries, sent again, is cut as it was first); ``seed`` makes each task's
    training seed (per round and agent); ``grants_uploads``: the coordinator grants uploads
    (`coordinator.upload_grants`), so agents that read revision 6 are told to ask first."""

    def __init__(self, link: MqttLink, topics: Topics, registry: FleetRegistry, family: ModelFamily,
                 model_ref: ModelRef, in_flight: InFlight, seed: int, log: Logger, *,
                 grants_uploads: bool = False) -> None:
        self.link = link
        self.topics = topics
        self.registry = registry
        self.family = family
        self.model_ref = model_ref
        self._in_flight = in_flight  # the states each round's tasks are cut from
        self.seed = seed
        self.log = log
        self.grants_uploads = grants_uploads
        self.unpaced = False  # see pace

    @staticmethod
    def task_id(round_number: int, agent_id: str) -> str:
        """A new task's id: its round and agent, and a random part (a resent task keeps its id)."""
        return f"r{round_number}-{agent_id}-{uuid.uuid4().hex[:8]}"

    def seeded(self, plan: TrainingPlan, round_number: int, agent_id: str) -> TrainingPlan:
        """``plan`` with the training seed of this run, round and agent."""
        material = f"{self.seed}:{round_number}:{agent_id}".encode()
        return replace(plan, seed=int.from_bytes(hashlib.sha256(material).digest()[:4], "little"))

    def send(self, round_number: int, task_id: str, planned: TaskPlan, deadline: float, *,
             paced: bool = True) -> int:
        """Publish one task in chunks; returns the bytes sent. ``paced``: each chunk waits for room in the window
        of bytes in flight (:meth:`pace`), as the round's thread does."""
        spec = planned.spec
        weights = self.family.extract(self._in_flight.states_of(round_number)[planned.group], spec,
                                      keys=self.family.state_keys(spec), views=True)
        seeded = self.seeded(planned.plan, round_number, planned.agent_id)
        plan = self.readable_plan(seeded, planned.agent_id)
        if plan is not seeded:
            self.log.warning("ordered_dropout_not_read", agent=planned.agent_id, task=task_id,
                             revision=self.revision(planned.agent_id),
                             message="the agent predates ordered dropout: it trains its widest sub-model alone")
        # (A rolled window is where the sub-model sits in the global model: the agent trains it as any other.)
        task = Task(task_id, round_number, planned.agent_id, deadline, self.model_ref, spec.unrolled().to_dict(),
                    None, {key: value.detach().cpu().numpy() for key, value in weights.items()},
                    adaptation=self.readable(planned.adaptation, planned.agent_id), plan=plan,
                    ask_to_upload=self.grants_uploads and self.revision(planned.agent_id) >= UPLOAD_GRANT_REVISION,
                    secure=planned.secure)
        version = self.protocol_version(planned.agent_id)
        payload = encode_parts(task, version=version)  # the weights are read as the chunks are made
        topic = self.topics.agent_task(planned.agent_id)
        sent = 0
        for chunk in iter_chunks(payload, task_id, round_number=round_number, version=version):  # round: see
            if paced:                                                                            # TransferRefused
                self.pace(task_id)
            self.link.publish(topic, chunk)
            sent += len(chunk)
        return sent

    def send_round(self, current: Round) -> int:
        """Send every task of ``current`` that has no update yet (all of a fresh round's; a resumed one's without
        a stored update; not those a buffered round carries from earlier rounds: their devices have them), timed
        as the round's ``dispatch``; returns the bytes sent."""
        stored = len(current.answers)
        started = time.perf_counter()
        sent = 0
        for task_id, dispatched in current.tasks.items():
            if task_id not in current.answers and dispatched.round == current.number:
                sent += self.send(current.number, task_id, dispatched.task, dispatched.deadline)
                current.mark_sent(task_id)
        current.timing["dispatch"] = time.perf_counter() - started
        self.log.info("round_dispatched", round=current.number, tasks=len(current.tasks),
                      skipped=len(current.skipped), bytes_down=sent,
                      **({"resumed_with_updates": stored} if stored else {}))
        return sent

    def resend_unanswered(self, current: Round | None, agent_id: str) -> None:
        """Send again the tasks of the round in progress that ``agent_id`` has not answered: it came back online
        (a restart or a reconnect may have lost them; an agent that has one already ignores the copy)."""
        if current is None:
            return
        for dispatched in current.unanswered(agent_id):
            # (Unpaced: this is the message thread, whose waiting would hold up every update and ack meanwhile.)
            self.send(dispatched.round, dispatched.task_id, dispatched.task, dispatched.deadline, paced=False)
            current.mark_sent(dispatched.task_id)
            self.log.info("task_resent", agent=agent_id, task=dispatched.task_id, round=dispatched.round)

    def resend_carried(self, current: Round, back: set[str]) -> int:
        """Send again the carried tasks of the agents ``back`` online while no round collected (a restart may have
        lost them; an agent that has one ignores the copy); returns the bytes sent."""
        sent = 0
        for dispatched in current.tasks.values():
            if dispatched.round != current.number and dispatched.task.agent_id in back:
                sent += self.send(dispatched.round, dispatched.task_id, dispatched.task, dispatched.deadline)
                current.mark_sent(dispatched.task_id)
                self.log.info("task_resent", agent=dispatched.task.agent_id, task=dispatched.task_id,
                              round=dispatched.round)
        return sent

    def pace(self, task_id: str) -> None:
        """Wait until fewer than DISPATCH_WINDOW_BYTES of task chunks are in flight to the broker. After a wait in
        vain (DISPATCH_WAIT_S: the broker is away, paho queues for its return) it sends on without waiting until
        the broker has taken the backlog below the window again, rather than stalling every chunk."""
        if self.unpaced:
            self.unpaced = self.link.bytes_in_flight >= DISPATCH_WINDOW_BYTES
        elif not self.link.wait_for_room(DISPATCH_WINDOW_BYTES, DISPATCH_WAIT_S):
            self.unpaced = True
            self.log.warning("dispatch_not_paced", in_flight=self.link.bytes_in_flight, task=task_id,
                             message=f"no PUBACK from the broker for {DISPATCH_WAIT_S:g} s: sending on without "
                                     f"waiting until it takes them")

    def protocol_version(self, agent_id: str) -> int:
        """The newest protocol version both this coordinator and the agent read (1 for an agent that predates 2)."""
        return min(PROTOCOL_VERSION, self.revision(agent_id))

    def revision(self, agent_id: str) -> int:
        """The protocol revision the agent announced (`protocol.PROTOCOL_REVISION`; 1 when it announced none)."""
        return self.registry.revision(agent_id)

    def readable(self, adaptation: Adaptation | None, agent_id: str) -> Adaptation | None:
        """``adaptation`` without the fields the agent's revision does not read (it would refuse the task): an
        agent older than `HEAD_ALONE_REVISION` is not offered the head alone, and so declines where it would
        train only that; its candidates' plans are as :meth:`readable_plan` makes them."""
        if adaptation is not None and adaptation.head_alone and self.revision(agent_id) < HEAD_ALONE_REVISION:
            adaptation = replace(adaptation, head_alone=False)
        if adaptation is not None and any(candidate.plan.ordered_dropout for candidate in adaptation.candidates):
            adaptation = replace(adaptation, candidates=[
                replace(candidate, plan=self.readable_plan(candidate.plan, agent_id))
                for candidate in adaptation.candidates])
        return adaptation

    def readable_plan(self, plan: TrainingPlan, agent_id: str) -> TrainingPlan:
        """``plan`` as the agent's revision reads it: an agent older than `ORDERED_DROPOUT_REVISION` is sent the
        plan without ordered dropout (it trains the spec itself, on the other terms; :meth:`send` logs it once);
        ``plan`` itself when the agent reads it."""
        if not plan.ordered_dropout or self.revision(agent_id) >= ORDERED_DROPOUT_REVISION:
            return plan
        return plan.without_ordered_dropout()
