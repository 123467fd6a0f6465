"""The fleet as the coordinator sees it: agents' statuses into the registry, the wait for the first round's fleet,
which agents' data fits the model, and what the method serves each device.

Misconfigurations are said loudly: one agent id answering from two processes, no agent of this federation while the
broker shows others (with their names), an agent whose data does not fit the model (never planned for).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from common.data import Dataset
from common.logs import Logger
from coordinator.config import CoordinatorConfig
from coordinator.data_fit import data_misfit
from coordinator.federations import federations_seen
from coordinator.privacy.guard import privacy_misfit
from coordinator.registry import AgentRecord, FleetRegistry
from coordinator.secure.room import secure_misfit
from coordinator.serving import ServiceLog, answer_text, unserved_text
from coordinator.strategies.base import Strategy
from coordinator.tasks import Skip
from protocol import AgentStatus, ProtocolError, decode

#: A status from a process that another one of its agent id replaced, within this many seconds, means two
#: processes use the id (a restart says 'offline' first, or its Last Will does, unless the broker was down).
TWO_INSTANCES_WINDOW_S = 120.0

#: Seconds without a new agent status after which the registry counts as settled before the first round: the
#: broker delivers the retained statuses of the whole fleet in one burst after the subscription.
REGISTRY_SETTLE_S = 1.0

#: Seconds a round resumed from the journal waits at most for its agents' statuses before its tasks go out again.
RESUME_SETTLE_S = 10.0

#: Seconds the first round waits for an agent of this federation before saying which federations the broker
#: shows (and again every ``FEDERATIONS_REPEAT_S`` while none comes).
FEDERATIONS_CHECK_S = 10.0
FEDERATIONS_REPEAT_S = 60.0


class NoAgentsError(RuntimeError):
    """No agent came online in time (before the first round: fewer than ``min_agents``)."""


class FleetWatch:
    """The registry's reactions to agents' statuses, and the fleet a round is planned for."""

    def __init__(self, config: CoordinatorConfig, registry: FleetRegistry, dataset: Dataset, strategy: Strategy,
                 log: Logger) -> None:
        self.config = config
        self.registry = registry
        self.dataset = dataset
        self.log = log
        self.service_log = ServiceLog(strategy)
        #: Whether this process has seen the fleet (the first round it runs waits for all of it).
        self.settled = False
        self._misfits_told: dict[str, str] = {}  # agents whose data does not fit, with the reason already logged
        #: Per agent id, processes another one of the id replaced while online, with when (see _watch_instances).
        self._replaced_instances: dict[str, dict[str, float]] = {}

    def on_status(self, agent_id: str, payload: bytes) -> bool:
        """Take an agent's status message; True when the agent came back online (its unanswered tasks are sent
        again). ProtocolError for a malformed one."""
        if not payload:
            return False  # a cleared retained status
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
            return False
        previous = self.registry.on_status(status)
        self._watch_instances(agent_id, previous, status)
        back = status.state in ("online", "busy") and status.capabilities is not None
        return back and previous is not None and not previous.online

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

    # ------------------------------------------------------------- before a round
    def settle_for(self, agents: int) -> None:
        """Before a round resumed from the journal goes out (its tasks in what each agent reads): hear its
        ``agents``' statuses, unless this process has seen the fleet already."""
        if not self.settled:
            self.registry.wait_settled(agents, REGISTRY_SETTLE_S, RESUME_SETTLE_S)
            self.settled = True

    def online_for_round(self, *, on_count: Callable[[int], None],
                         stopped: Callable[[], bool]) -> tuple[list[AgentRecord], list[Skip]]:
        """The agents a round is planned for (online, their data fitting the model) and a skip for each online one
        whose data does not fit. The first round of this process waits for the whole fleet (:meth:`wait_for_first`)
        and refuses to start with fewer than ``min_agents``; later ones wait for ``min_agents`` at most
        ``wait_for_agents_s`` and go on with those online. Raises NoAgentsError when none is; returns nothing once
        ``stopped()``."""
        if not self.settled:
            online = self.wait_for_first(on_count, stopped)
            if online and len(online) < self.config.min_agents and not stopped():
                raise NoAgentsError(f"{len(online)} of the {self.config.min_agents} agents of federation "
                                    f"'{self.config.federation}' that min_agents asks for came online within "
                                    f"{self.config.wait_for_agents_s:g} s; start more agents or lower min_agents")
        else:
            online = self.registry.wait_for(self.config.min_agents, self.config.wait_for_agents_s)
        if stopped():
            return [], []
        if not online:
            raise NoAgentsError(f"no agent of federation '{self.config.federation}' came online within "
                                f"{self.config.wait_for_agents_s:g} s; {self.federations_hint()}")
        if len(online) < self.config.min_agents:
            self.log.warning("fewer_agents_than_expected", online=len(online), expected=self.config.min_agents)
        fitting, misfits = self.fitting(online)
        if misfits and len(fitting) < self.config.min_agents:
            self.log.warning("fewer_fitting_agents_than_expected", fitting=len(fitting),
                             expected=self.config.min_agents)
        self.settled = True
        return fitting, misfits

    def wait_for_first(self, on_count: Callable[[int], None], stopped: Callable[[], bool]) -> list[AgentRecord]:
        """Wait for the fleet before the first round (``on_count(online)`` as agents come; ``stopped()``: the run
        is ending); while no agent of this federation is online, say which federations the broker shows after
        :data:`FEDERATIONS_CHECK_S` (and every :data:`FEDERATIONS_REPEAT_S`)."""
        deadline = time.monotonic() + self.config.wait_for_agents_s
        check_at = time.monotonic() + FEDERATIONS_CHECK_S
        while True:
            # Cut into windows only while no agent is online: then the fleet settles as wait_settled says.
            limit = deadline if self.registry.online() else min(deadline, check_at)
            online = self.registry.wait_settled(self.config.min_agents, REGISTRY_SETTLE_S,
                                                max(0.0, limit - time.monotonic()), on_count)
            now = time.monotonic()
            if stopped() or now >= deadline or now < limit:  # before its limit: the fleet is in
                return online
            if not online:
                waited = self.config.wait_for_agents_s - (deadline - now)
                self.log.warning("no_agents_of_this_federation",
                                 message=f"no agent of federation '{self.config.federation}' is online after "
                                         f"{waited:.0f} s; {self.federations_hint()}")
                check_at = time.monotonic() + FEDERATIONS_REPEAT_S

    def federations_hint(self) -> str:
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

    def fitting(self, online: list[AgentRecord]) -> tuple[list[AgentRecord], list[Skip]]:
        """The agents whose data fits the model (and under privacy or secure aggregation, whose revision takes part), and
        a skip (reason logged
        once per agent) for each other one;
        raises NoAgentsError when no online agent's data fits."""
        expected = (self.dataset.in_channels, *self.dataset.image_size)
        fitting, misfits = [], []
        for record in online:
            reason = data_misfit(record.capabilities, expected, self.dataset.num_classes, self.dataset.name)
            event = "agent_data_does_not_fit"
            if reason is None:
                revision = record.capabilities.protocol_version if record.capabilities is not None else 1
                reason = (privacy_misfit(self.config.privacy, revision)
                          or secure_misfit(self.config.secure_aggregation, revision))
                event = "agent_cannot_serve_private_run"  # (differential privacy or secure aggregation)
            if reason is None:
                self._misfits_told.pop(record.agent_id, None)
                fitting.append(record)
                continue
            misfits.append(Skip(record.agent_id, reason))
            if self._misfits_told.get(record.agent_id) != reason:
                self._misfits_told[record.agent_id] = reason
                self.log.error(event, agent=record.agent_id, reason=reason)
        if not fitting:
            first = misfits[0]
            private = self.config.privacy.enabled or self.config.secure_aggregation.enabled
            what = "the data of none of the" if not private else "none of the"
            fits = "fits the model" if not private else "can serve this private run"
            raise NoAgentsError(f"{what} {len(online)} online agents of federation '{self.config.federation}' "
                                f"{fits}, so no round can be planned: agent '{first.agent_id}': {first.reason}")
        return fitting, misfits

    def tell_service(self, online: Sequence[AgentRecord]) -> None:
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
