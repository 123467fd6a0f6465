"""The agents' update topics, from the coordinator's side: requests to upload answered, chunks handed to the intake.

An agent's update topic carries two kinds of message (protocol revision 6): its ``upload_request`` and the chunks of
its update. :class:`UploadDesk` tells them apart (`protocol.message_type`), answers a request (the update's ack at
once when the round would not take it, nothing yet for a task the next buffered round carries, else a grant from
the window, `coordinator.upload_grants`, or at once when uploads are not granted), and feeds chunks to the
:class:`~coordinator.intake.UpdateIntake`, giving each grant back when its update is in or its transfer ends. It
runs on the thread that takes messages, as the intake does.
"""

from __future__ import annotations

from collections.abc import Callable

from coordinator.config import UploadsConfig
from coordinator.intake import UpdateIntake
from coordinator.round import Receipt, Round, Verdict
from coordinator.upload_grants import UploadGrants
from protocol import (
    Ack,
    ProtocolError,
    Topics,
    TransferRefused,
    UploadGrant,
    UploadRequest,
    decode,
    encode,
    message_type,
)

__all__ = ["UploadDesk"]


class UploadDesk:
    """Messages on the agents' update topics (see the module docstring), with the ``uploads`` section's window
    (:attr:`grants`, None when uploads are not granted). ``current()``: the round in progress; ``carried(task_id)``:
    whether the next round carries that task (between two rounds); ``on_answer(round)``: an update the round took
    as new."""

    def __init__(self, intake: UpdateIntake, uploads: UploadsConfig, publish: Callable[[str, bytes], object],
                 topics: Topics, current: Callable[[], Round | None], carried: Callable[[str], bool],
                 on_answer: Callable[[Round], None]) -> None:
        self.intake = intake
        #: The window of update bytes in transfer, None when uploads are not granted.
        self.grants = (UploadGrants(uploads.window_bytes, uploads.idle_s, wanted=self.wanted) if uploads.grant
                       else None)
        self._publish = publish
        self._topics = topics
        self._current = current
        self._carried = carried
        self._on_answer = on_answer

    def on_message(self, agent_id: str, payload: bytes) -> None:
        """A message on ``agent_id``'s update topic: a chunk of its update, or its request to send one.
        ProtocolError for a malformed one."""
        if message_type(payload) == "upload_request":
            request = decode(payload, expected=UploadRequest)
            assert isinstance(request, UploadRequest)
            if request.agent_id != agent_id:
                raise ProtocolError(f"upload request from agent {request.agent_id!r} published on the topic of "
                                    f"{agent_id!r}")
            self._answer(request)
            return
        if self.grants is None:
            self.intake.on_chunk(agent_id, payload, self._current(), self._on_answer)
            return
        self._grant(self.grants.chunk_from(agent_id))
        try:
            task_id = self.intake.on_chunk(agent_id, payload, self._current(), self._on_answer)
        except TransferRefused as refused:  # that transfer ends here (the agent asks again); others go on
            self._grant(self.grants.finished(agent_id, refused.transfer.rpartition(".")[0] or refused.transfer))
            raise
        except ProtocolError:
            self._grant(self.grants.finished(agent_id))  # a malformed upload ends here; the agent asks again
            raise
        if task_id is not None:
            self._grant(self.grants.finished(agent_id, task_id))

    def forget(self, agent_id: str) -> None:
        """``agent_id`` went offline: its requests leave the queue and its grants the window."""
        if self.grants is not None:
            self._grant(self.grants.forget(agent_id))

    def wanted(self, agent_id: str, task_id: str, round_number: int) -> bool:
        """Whether the round would take the update a waiting request is for now (one whose round closed, whose
        update is in already, or that the next round will take, is dropped when its turn comes: asked again, it
        is answered); the window's ``wanted``."""
        return self._receipt_before_upload(agent_id, task_id, round_number, "") is None

    def window(self) -> tuple[float, float]:
        """The window's bytes granted and requests waiting (zeros when uploads are not granted)."""
        return (self.grants.in_flight, self.grants.waiting) if self.grants is not None else (0.0, 0.0)

    def _answer(self, request: UploadRequest) -> None:
        """Answer an agent asking to upload: its ack at once when the round would not take the update (stored
        already, or refused), else a grant, at once when uploads are not granted (a coordinator restarted with
        ``uploads.grant`` off answers the agents its tasks told to ask)."""
        receipt = self._receipt_before_upload(request.agent_id, request.task_id, request.round, request.sha256)
        if receipt is not None and receipt.verdict is Verdict.DEFERRED:
            return  # the next round takes it: asked again then, it is granted
        if receipt is not None:
            self._publish(self._topics.agent_ack(request.agent_id),
                          encode(Ack(request.task_id, request.round, request.agent_id, receipt.refusal)))
        elif self.grants is None:
            self._grant([UploadGrant(request.task_id, request.round, request.agent_id)])
        else:
            self._grant(self.grants.ask(request.agent_id, request.task_id, request.round, request.size))

    def _receipt_before_upload(self, agent_id: str, task_id: str, round_number: int, digest: str) -> Receipt | None:
        """What the update a request is for would get (`Round.receipt_before_upload`; between two rounds: deferred
        for a task the next round carries, else refused as the intake refuses it); None: it would be taken."""
        current = self._current()
        if current is not None:
            return current.receipt_before_upload(task_id, round_number, agent_id, digest)
        if self._carried(task_id):
            return Receipt(Verdict.DEFERRED)
        return Receipt(Verdict.UNKNOWN, f"unknown task {task_id!r} of round {round_number}: no round is in progress")

    def _grant(self, grants: list[UploadGrant]) -> None:
        for grant in grants:
            self._publish(self._topics.agent_ack(grant.agent_id), encode(grant))
