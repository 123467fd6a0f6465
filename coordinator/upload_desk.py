"""The agents' update topics, from the coordinator's side: requests to upload answered, chunks handed to the intake,
and nothing a device trained left out because it came when no round could take it.

An agent's update topic carries two kinds of message (protocol revision 6): its ``upload_request`` and the chunks of
its update. :class:`UploadDesk` tells them apart (`protocol.message_type`), answers a request (the update's ack at
once when the round would not take it, else a grant from the window, `coordinator.upload_grants`, or at once when
uploads are not granted), and feeds chunks to the :class:`~coordinator.intake.UpdateIntake`, giving each grant back
when its update is in or its transfer ends.

An update for a task the next buffered round carries that comes while no round collects (the round stopped
collecting, or none is open yet) is **held**, never dropped: its request waits at the desk, and a whole update sent
without asking (an agent that predates revision 6, one restored from an agent's outbox, grants off) is kept in
memory, within the window's bytes. :meth:`UploadDesk.round_opened` then takes the held updates and answers the held
requests as soon as the next round collects. An agent of revision 7 or later whose request waits (held, or queued
for room in the window) is told so (:class:`protocol.UploadWait`), and waits for its grant without spending its
attempts. A device that sends an update again after its round closed (killed before it heard its ack) hears the
verdict that round gave it (:meth:`UploadDesk.remember`), not that its task is unknown. Everything here runs on the
thread that takes messages, as the intake does; :meth:`round_opened` is
queued there (`common.mqtt_link.MqttLink.call_soon`); only :meth:`held` and :meth:`window` are read, and
:meth:`remember` called, from other threads.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable

from common.logs import Logger
from common.mqtt_link import MqttLink
from coordinator.config import UploadsConfig
from coordinator.in_flight import InFlight
from coordinator.intake import Arrival, UpdateIntake
from coordinator.round import Receipt, Round, Verdict
from coordinator.upload_grants import UploadGrants
from protocol import (
    UPLOAD_WAIT_REVISION,
    Ack,
    ProtocolError,
    Topics,
    TransferRefused,
    UploadGrant,
    UploadRequest,
    UploadWait,
    decode,
    encode,
    message_type,
)

__all__ = ["VERDICTS_KEPT", "UploadDesk"]

#: How many screened updates' verdicts the desk keeps to answer a device sending one of them again (the latest).
VERDICTS_KEPT = 4096


class UploadDesk:
    """Messages on the agents' update topics (see the module docstring), with the ``uploads`` section's window
    (:attr:`grants`, None when uploads are not granted). ``in_flight``: the round in progress, and what a request
    gets between two rounds; ``revision(agent_id)``: the protocol revision an agent announced; ``on_secure(agent_id,
    payload)``: a secure round's message (`coordinator.secure.room.SecureRounds.on_message`)."""

    def __init__(self, intake: UpdateIntake, uploads: UploadsConfig, link: MqttLink,
                 topics: Topics, in_flight: InFlight, revision: Callable[[str], int], log: Logger, *,
                 on_secure: Callable[[str, bytes], None] | None = None) -> None:
        self.intake = intake
        self._on_secure = on_secure
        #: The window of update bytes in transfer, None when uploads are not granted.
        self.grants = (UploadGrants(uploads.window_bytes, uploads.idle_s, wanted=self.wanted) if uploads.grant
                       else None)
        self._link = link  # answers and grants go out through it
        self._topics = topics
        self._in_flight = in_flight
        self._revision = revision
        self._log = log
        #: Held for the next round: requests by (agent, task), whole updates sent without asking by task id (their
        #: bytes at most ``_held_limit``).
        self._held_requests: OrderedDict[tuple[str, str], UploadRequest] = OrderedDict()
        self._held_updates: OrderedDict[str, Arrival] = OrderedDict()
        self._held_lock = threading.Lock()  # changed on the message thread only; read by held() and window()
        self._held_limit = uploads.window_bytes
        #: The latest verdicts given, by (agent, task, round), with the sha256 of the update they judged.
        self._verdicts: OrderedDict[tuple[str, str, int], tuple[Ack, str]] = OrderedDict()
        #: Counters: requests and whole updates held for a later round, and updates not held (over the limit).
        self.held_total = 0
        self.not_held_total = 0

    def on_message(self, agent_id: str, payload: bytes) -> None:
        """A message on ``agent_id``'s update topic: a chunk of its update, its request to send one, or a secure
        round's message. ProtocolError for a malformed one."""
        kind = message_type(payload)
        if kind is not None and kind.startswith("secure_") and self._on_secure is not None:
            self._on_secure(agent_id, payload)
            return
        if kind == "upload_request":
            request = decode(payload, expected=UploadRequest)
            assert isinstance(request, UploadRequest)
            if request.agent_id != agent_id:
                raise ProtocolError(f"upload request from agent {request.agent_id!r} published on the topic of "
                                    f"{agent_id!r}")
            self._answer(request)
            return
        if self.grants is None:
            self._take(self.intake.on_chunk(agent_id, payload))
            return
        self._grant(self.grants.chunk_from(agent_id))
        try:
            arrival = self.intake.on_chunk(agent_id, payload)
        except TransferRefused as refused:  # that transfer ends here (the agent asks again); others go on
            self._grant(self.grants.finished(agent_id, refused.transfer.rpartition(".")[0] or refused.transfer))
            raise
        except ProtocolError:
            self._grant(self.grants.finished(agent_id))  # a malformed upload ends here; the agent asks again
            raise
        if arrival is not None:
            self._take(arrival)
            self._grant(self.grants.finished(agent_id, arrival.update.task_id))

    def round_opened(self) -> None:
        """A round began collecting: the updates held for it are taken (and acked), the requests held for it
        answered (granted in turn). Run on the message thread."""
        with self._held_lock:
            updates, self._held_updates = self._held_updates, OrderedDict()
            requests, self._held_requests = self._held_requests, OrderedDict()
        if updates or requests:
            self._log.info("held_uploads_released", updates=len(updates), requests=len(requests))
        for arrival in updates.values():
            self._release(arrival.update.agent_id, lambda: self._take(arrival))  # noqa: B023 - called at once
        for request in requests.values():
            self._release(request.agent_id, lambda: self._answer(request))  # noqa: B023 - called at once

    def _release(self, agent_id: str, answer: Callable[[], None]) -> None:
        """Answer one held upload now; one that fails is logged and leaves the others to be answered (its agent
        sends it again)."""
        try:
            answer()
        except Exception as exc:  # noqa: BLE001
            self._log.error("held_upload_failed", agent=agent_id, error=f"{type(exc).__name__}: {exc}")

    def remember(self, verdicts: Iterable[tuple[Ack, str]]) -> None:
        """Keep a closed round's verdicts (each with the sha256 of the update it judged; the latest
        :data:`VERDICTS_KEPT`): an agent sending one of those updates again is answered with its verdict."""
        with self._held_lock:
            for ack, digest in verdicts:
                key = (ack.agent_id, ack.task_id, ack.round)
                self._verdicts.pop(key, None)
                self._verdicts[key] = (ack, digest)
            while len(self._verdicts) > VERDICTS_KEPT:
                self._verdicts.popitem(last=False)

    def _recall(self, agent_id: str, task_id: str, round_number: int, digest: str) -> bool:
        """Answer an update (or a request to send it) that an earlier round judged already with that verdict again
        (the same update: ``digest`` equal, or empty); False when no verdict is kept for it."""
        with self._held_lock:
            kept = self._verdicts.get((agent_id, task_id, round_number))
        if kept is None or (digest and kept[1] and digest != kept[1]):
            return False
        self._log.info("verdict_sent_again", agent=agent_id, task=task_id, round=round_number, verdict=kept[0].verdict)
        self._link.publish(self._topics.agent_ack(agent_id), encode(kept[0]))
        return True

    def forget(self, agent_id: str) -> None:
        """``agent_id`` went offline: its requests leave the queue and the desk, its grants the window (it asks
        again when it is back; an update of its held whole is still taken)."""
        with self._held_lock:
            for key in [key for key in self._held_requests if key[0] == agent_id]:
                del self._held_requests[key]
        if self.grants is not None:
            self._grant(self.grants.forget(agent_id))

    def wanted(self, agent_id: str, task_id: str, round_number: int) -> bool:
        """Whether the round would take the update a waiting request is for now (one whose round closed, whose
        update is in already, or that the next round will take, leaves the queue when its turn comes, and is
        answered then: its ack, or held); the window's ``wanted``."""
        return self._receipt_before_upload(self._in_flight.current(), agent_id, task_id, round_number, "") is None

    def window(self) -> tuple[float, float]:
        """The window's bytes granted, and the requests waiting: for room in the window, or held for the next
        round."""
        with self._held_lock:
            held = len(self._held_requests)
        if self.grants is None:
            return 0.0, float(held)
        return self.grants.in_flight, self.grants.waiting + held

    def held(self) -> list[tuple[str, str]]:
        """(agent, task) of the requests and whole updates held now for the next round."""
        with self._held_lock:
            return sorted({*self._held_requests,
                           *((arrival.update.agent_id, task) for task, arrival in self._held_updates.items())})

    def _answer(self, request: UploadRequest) -> None:
        """Answer an agent asking to upload: its ack at once when the round would not take the update (stored
        already, or refused); held when the next round takes it; else a grant, at once when uploads are not
        granted (a coordinator restarted with ``uploads.grant`` off answers the agents its tasks told to ask), or
        in turn (told to wait meanwhile). One judged in an earlier round is answered with its verdict."""
        current = self._in_flight.current()  # read before the recall: verdicts are kept before the closed round goes
        if self._recall(request.agent_id, request.task_id, request.round, request.sha256):
            if self.grants is not None:
                self.grants.withdraw(request.agent_id, request.task_id)
            return
        receipt = self._receipt_before_upload(current, request.agent_id, request.task_id, request.round,
                                              request.sha256)
        if receipt is not None:
            self._settle(request, receipt)
        elif self.grants is None:
            self._grant([UploadGrant(request.task_id, request.round, request.agent_id)])
        else:
            self._grant(self.grants.ask(request.agent_id, request.task_id, request.round, request.size,
                                        request.sha256))
            if self.grants.is_waiting(request.agent_id, request.task_id):
                self._tell_to_wait(request, "waiting for room in the coordinator's upload window: granted in the "
                                            "order asked")

    def _settle(self, request: UploadRequest, receipt: Receipt) -> None:
        """Answer a request the round would not take now: held (and the agent told to wait) when the next round
        takes it, else its ack."""
        if self.grants is not None:
            self.grants.withdraw(request.agent_id, request.task_id)  # (asked again while it waited in the queue)
        if receipt.verdict is Verdict.DEFERRED:
            key = (request.agent_id, request.task_id)
            with self._held_lock:
                new = key not in self._held_requests
                self._held_requests[key] = request
            if new:
                self.held_total += 1
                self._log.info("upload_request_held", agent=request.agent_id, task=request.task_id,
                               round=request.round)
            self._tell_to_wait(request, "no round is collecting updates now: the next round takes this one")
            return
        self._link.publish(self._topics.agent_ack(request.agent_id),
                      encode(Ack(request.task_id, request.round, request.agent_id, receipt.refusal)))

    def _take(self, arrival: Arrival | None) -> None:
        """Hand a whole update to the round in progress; one deferred to the next round is held (within the
        window's bytes; beyond them it is not answered, and its agent sends it again; a copy of it held before
        stays held); one judged in an earlier round is answered with its verdict."""
        if arrival is None:
            return
        current = self._in_flight.current()  # read before the recall: verdicts are kept before the closed round goes
        if self._recall(arrival.update.agent_id, arrival.update.task_id, arrival.update.round, arrival.digest):
            return
        receipt = self.intake.take(arrival, current)
        if receipt is None or receipt.verdict is not Verdict.DEFERRED:
            return
        update = arrival.update
        with self._held_lock:  # a copy held already is replaced only where the new one has room
            others = {task: kept for task, kept in self._held_updates.items() if task != update.task_id}
            held = sum(len(kept.payload) for kept in others.values())
            room = held + len(arrival.payload) <= self._held_limit or not others
            again = update.task_id in self._held_updates
            if room:
                self._held_updates[update.task_id] = arrival
        if not room:
            self.not_held_total += 1
            self._log.warning("update_not_held", agent=update.agent_id, task=update.task_id,
                              bytes=len(arrival.payload), held_bytes=held,
                              message="the updates held for the next round fill the upload window: "
                                      + ("the copy held before is kept" if again else
                                         "not answered, the agent sends it again"))
            return
        if not again:  # an update held once counts once, however often it is sent
            self.held_total += 1
        self._log.info("update_held", agent=update.agent_id, task=update.task_id, round=update.round)

    def _tell_to_wait(self, request: UploadRequest, reason: str) -> None:
        """Tell an agent that reads it (revision 7) that its request waits its turn."""
        if self._revision(request.agent_id) >= UPLOAD_WAIT_REVISION:
            self._link.publish(self._topics.agent_ack(request.agent_id),
                          encode(UploadWait(request.task_id, request.round, request.agent_id, reason)))

    def _receipt_before_upload(self, current: Round | None, agent_id: str, task_id: str, round_number: int,
                               digest: str) -> Receipt | None:
        """What the update a request is for would get from ``current``, the round in progress
        (`Round.receipt_before_upload`; between two rounds: deferred for a task the next round carries, else refused
        as the intake refuses it); None: it would be taken."""
        if current is not None:
            return current.receipt_before_upload(task_id, round_number, agent_id, digest)
        return self._in_flight.between_rounds(task_id, agent_id, round_number)

    def _grant(self, grants: list[UploadGrant]) -> None:
        """Send ``grants``; then answer the requests that left the window's queue unwanted meanwhile."""
        for grant in grants:
            self._link.publish(self._topics.agent_ack(grant.agent_id), encode(grant))
        if self.grants is not None:
            for asked in self.grants.take_dropped():
                self._answer(UploadRequest(asked.task_id, asked.round, asked.agent_id, asked.size, asked.sha256))
