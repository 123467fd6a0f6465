"""Message types of the protocol (plain dataclasses; `protocol.codec` encodes and validates them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, ClassVar, TypeAlias

import numpy as np

from protocol.plan import Recipe, TrainingPlan
from protocol.secure import SecureAdvert, SecureRelay, SecureReveal, SecureRoster, SecureShares, SecureUnmask

PROTOCOL_VERSION = 2
"""The newest protocol version, the one this side writes by default: version 2 carries a message's tensors as raw
bytes after its header (`protocol.framing`), version 1 inside it as msgpack maps (`protocol.tensors`). A message
without tensors reads the same in both and is always written as version 1, which every reader reads."""
READABLE_VERSIONS: tuple[int, ...] = (1, 2)
"""The protocol versions this side decodes."""
PROTOCOL_REVISION = 10
"""What an agent announces as :attr:`Capabilities.protocol_version`: the newest revision of the protocol it reads.
Revisions 1 and 2 are the layouts above; revision 3 is version 2's layout plus :attr:`Adaptation.head_alone`, a
field older agents refuse; revision 4 adds ordered dropout to training plans (``TrainingPlan.widths`` and
``width_kd`` loss terms); revision 5 the statuses' reports (:class:`AgentReport`, :class:`RoundProgress`);
revision 6 uploads the coordinator grants (:attr:`Task.ask_to_upload`, :class:`UploadRequest`, :class:`UploadGrant`);
revision 7 the coordinator's answer that a request waits its turn (:class:`UploadWait`); revision 8 models delivered
to run (:class:`ModelDelivery`, :attr:`AgentReport.model`); revision 9 updates clipped (and noised) on the device
for differential privacy (:attr:`TrainingPlan.update_clip`); revision 10 secure aggregation (:attr:`Task.secure`,
the messages of `protocol.secure`). A coordinator writes ``min(PROTOCOL_VERSION, announced)`` and sends a field to agents whose revision reads it;
coordinators that predate revision 3 read an announced 3 or more as 2."""
HEAD_ALONE_REVISION = 3
"""The first revision an agent reads :attr:`Adaptation.head_alone` in."""
ORDERED_DROPOUT_REVISION = 4
"""The first revision an agent reads a training plan's ordered dropout in (:attr:`TrainingPlan.ordered_dropout`)."""
STATUS_REPORT_REVISION = 5
"""The first revision whose statuses carry reports: a coordinator's :attr:`CoordinatorStatus.revision` and
:attr:`CoordinatorStatus.progress` (written while every agent it knows reads them), an agent's
:attr:`AgentStatus.report` (written once its coordinator's status says it reads them)."""

UPLOAD_GRANT_REVISION = 6
"""The first revision an agent asks before it uploads in: a coordinator that grants uploads sets
:attr:`Task.ask_to_upload` in the tasks of such agents only (older ones send at once, as before)."""

UPLOAD_WAIT_REVISION = 7
"""The first revision an agent reads :class:`UploadWait` in: a coordinator tells such an agent that its request waits
its turn (older ones hear nothing until their grant, and ask again meanwhile)."""

MODEL_DELIVERY_REVISION = 8
"""The first revision an agent stores a :class:`ModelDelivery` in, and a coordinator reads :attr:`AgentReport.model`
in: a coordinator announces it as its status's :attr:`CoordinatorStatus.revision`, and an agent then says in its
report the model it holds."""

PRIVACY_REVISION = 9
"""The first revision an agent clips its update in (:attr:`TrainingPlan.update_clip`): a coordinator under
differential privacy sends tasks to such agents only."""

SECURE_AGGREGATION_REVISION = 10
"""The first revision an agent takes part in a secure round in (:attr:`Task.secure`, `protocol.secure`): a coordinator
under secure aggregation sends tasks to such agents only."""

AGENT_STATES: tuple[str, ...] = ("online", "busy", "offline", "starting")
COORDINATOR_STATES: tuple[str, ...] = ("online", "offline")


class TextEnum(str, Enum):
    """A closed set of strings: each member compares, prints, formats and serialises as its value."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


class UpdateStatus(TextEnum):
    """How an agent answers a task: trained what was sent (``ok``), trained a smaller model than sent
    (``adapted``), could not afford it or it came too late (``declined``), or something broke (``failed``)."""

    OK = "ok"
    ADAPTED = "adapted"
    DECLINED = "declined"
    FAILED = "failed"

    @property
    def trained(self) -> bool:
        """Whether the answer carries trained weights."""
        return self in (UpdateStatus.OK, UpdateStatus.ADAPTED)


UPDATE_STATUSES: tuple[str, ...] = tuple(status.value for status in UpdateStatus)


@dataclass
class Capabilities:
    """What an agent can afford: memory in bytes, its local data size, label set and the shape of one sample
    (``sample_shape``: channels, height, width; empty from agents that predate it), and the newest protocol
    revision it reads (``protocol_version``: 1 from agents that predate version 2; see `PROTOCOL_REVISION`).
    """

    OMITTED_AT_DEFAULT: ClassVar[tuple[str, ...]] = ("sample_shape", "protocol_version")

    device_kind: str
    memory_total: int
    memory_available: int
    budget_bytes: int | None
    num_samples: int
    labels: list[int]
    sample_shape: tuple[int, ...] = ()
    protocol_version: int = 1


@dataclass
class AgentReport:
    """What an agent is doing and last did, in its status for ``fedfit status`` (revision 5).

    ``since``: when it went online or busy (wall clock); ``task`` and ``task_round``: the task it trains now (empty
    and 0 when idle); ``last_*``: its last answer (``last_status`` an :class:`UpdateStatus` value, empty before
    its first; ``last_trained`` the sub-model it trained, as text; ``last_reason`` why it adapted, declined or
    failed); ``outbox`` and ``outbox_bytes``: updates it has sent or holds that the coordinator has not yet
    acknowledged as stored; ``model``: the model it holds to run (:class:`ModelDelivery`), as ``name@sha256`` of its
    ONNX graph, and ``model_refused``: the last delivery it refused and why, ``name@sha256: reason`` (revision 8,
    written to coordinators that announce it; empty while there is none).
    """

    OMITTED_AT_DEFAULT: ClassVar[tuple[str, ...]] = ("model", "model_refused")

    since: float
    task: str = ""
    task_round: int = 0
    last_task: str = ""
    last_round: int = 0
    last_status: str = ""
    last_trained: str = ""
    last_reason: str = ""
    last_finished_at: float = 0.0
    outbox: int = 0
    outbox_bytes: int = 0
    model: str = ""
    model_refused: str = ""


@dataclass
class AgentStatus:
    """Retained agent status; state is "online", "busy" or "offline" (the Last Will has no capabilities).
    ``instance`` names the agent process (random per start; empty from agents that predate it), so that one id
    reporting from two processes shows. A process starting with an id asks first whether another one is running
    it: it publishes a non-retained "starting" status, which a running agent of that id answers at once with its
    own status (and which the coordinator does not record). ``report``: see :class:`AgentReport` (None from agents
    that predate it, and while the coordinator does not read it)."""

    OMITTED_AT_DEFAULT: ClassVar[tuple[str, ...]] = ("instance", "report")

    agent_id: str
    state: str
    capabilities: Capabilities | None
    sent_at: float
    instance: str = ""
    report: AgentReport | None = None


@dataclass
class RoundProgress:
    """The round in progress, in the coordinator's status: ``received`` of ``expected`` answers, when it opened
    and its deadline (wall clock; the deadline moves out by a broker outage)."""

    round: int
    expected: int
    received: int
    started_at: float
    deadline: float


@dataclass
class PrivacySpent:
    """What a private run has spent after its last round (revision 9, in the coordinator's status): ``epsilon`` at
    ``delta``, and its budget ``max_epsilon`` (0: none)."""

    epsilon: float
    delta: float
    max_epsilon: float = 0.0


@dataclass
class CoordinatorStatus:
    """Retained coordinator status; state is "online" or "offline"; round is the round in progress, else the last
    one completed. ``revision`` (:data:`STATUS_REPORT_REVISION` or 0) says whether it reads agents' reports;
    ``progress`` the round in progress (None between rounds, and where it is not written: see
    :data:`STATUS_REPORT_REVISION`); ``privacy`` what a private run has spent (None when it is not private, and
    while an agent older than :data:`PRIVACY_REVISION` is online)."""

    OMITTED_AT_DEFAULT: ClassVar[tuple[str, ...]] = ("revision", "progress", "privacy")

    federation: str
    state: str
    round: int
    sent_at: float
    revision: int = 0
    progress: RoundProgress | None = None
    privacy: PrivacySpent | None = None


@dataclass
class ModelRef:
    """Which model family to build; options hold msgpack primitives or flat lists of them."""

    family: str
    num_classes: int
    in_channels: int
    options: dict[str, Any]


ADAPTATION_KINDS: tuple[str, ...] = ("none", "ladder", "depthwise", "width-levels")


@dataclass
class Candidate:
    """Something an agent may train instead of the task's spec: a sub-model spec and its training plan."""

    spec: dict[str, Any]
    plan: TrainingPlan


@dataclass
class Adaptation:
    """How an agent may shrink a task it cannot afford (``ADAPTATION_KINDS``).

    ``"ladder"``: the ``candidates``, largest first; the agent trains the first that fits (the plan of the task
    keeps its seed). ``"depthwise"`` (FeDepth): the agent trains the spec it was sent whole if that fits, else
    depth-wise, in the fewest consecutive segments of blocks that each fit what it has, skipping the blocks that
    fit nowhere (partial training); ``route`` says how a segment's output reaches a classifier (``ROUTES``:
    ``"skip"``, the skip connection to the final head, or ``"exit"``, the auxiliary classifier after the
    segment, which the sent spec must carry); a block that does not fit alone at the plan's batch size trains in
    micro-batches (:attr:`Stage.micro_batch`) of at least ``min_micro_batch`` samples (0: never), and is skipped
    only when even those do not fit; where no block fits and ``head_alone`` allows it (a coordinator that aggregates
    such updates, sent to agents of `HEAD_ALONE_REVISION` or later), the agent trains the head alone on the frozen
    output of every block (one empty segment after the last block) if that fits. ``"width-levels"``: the hint of coordinators that predate ladders,
    HeteroFL's uniform width ``rates`` with the task's own plan. ``"none"``: train the spec or decline.
    """

    OMITTED_AT_DEFAULT: ClassVar[tuple[str, ...]] = ("route", "min_micro_batch", "head_alone")

    kind: str
    candidates: list[Candidate] = field(default_factory=list)
    rates: list[float] = field(default_factory=list)
    route: str = "skip"
    min_micro_batch: int = 0
    head_alone: bool = False


@dataclass
class Task:
    """One round of work for one agent: the sub-model spec, how to train it, and the sliced weights.

    A task carries a training ``plan``; tasks from coordinators that predate plans carry a ``recipe`` instead
    (exactly one of the two is set, see :meth:`training_plan`). ``ask_to_upload`` (revision 6): the coordinator
    grants uploads; the agent sends its update only once an :class:`UploadGrant` answers its
    :class:`UploadRequest`. ``secure`` (revision 10): see the field.
    """

    OMITTED_AT_DEFAULT: ClassVar[tuple[str, ...]] = ("ask_to_upload", "secure")

    task_id: str
    round: int
    agent_id: str
    deadline: float
    model: ModelRef
    spec: dict[str, Any]
    recipe: Recipe | None
    weights: dict[str, np.ndarray]
    adaptation: Adaptation | None = None
    """How the agent may shrink the spec when it cannot afford it; None: train exactly ``spec`` or decline."""
    plan: TrainingPlan | None = None
    ask_to_upload: bool = False
    secure: bool = False
    """Revision 10: the round is secure (`protocol.secure`): the agent advertises keys once trained and uploads its
    update masked."""

    def training_plan(self) -> TrainingPlan:
        """The plan to run: ``plan``, or the plan an old-style task's ``recipe`` stands for."""
        if self.plan is not None:
            return self.plan
        assert self.recipe is not None, "a decoded task has a plan or a recipe"
        return TrainingPlan.from_recipe(self.recipe)


#: How an update's ``reason`` begins when the agent declined because nothing it may train fits its memory now, and
#: when its training process was killed for memory: what a coordinator may learn a device's memory from (the other
#: declines and failures, e.g. a deadline passed or the agent stopping, say nothing of it).
MEMORY_DECLINE_REASON = "nothing fits"
MEMORY_KILL_REASON = "training process was killed by the kernel's OOM killer"


@dataclass
class Update:
    """An agent's answer to a task (its :class:`UpdateStatus`; a string naming one is taken as it)."""

    task_id: str
    round: int
    agent_id: str
    status: UpdateStatus
    spec_trained: dict[str, Any] | None
    num_samples: int
    labels: list[int]
    weights: dict[str, np.ndarray]
    metrics: dict[str, float]
    reason: str | None = None

    def __post_init__(self) -> None:
        self.status = UpdateStatus(self.status)


@dataclass
class Ack:
    """The coordinator's answer to the update of this task: stored for aggregation (``reason`` None), or refused
    for good with the reason (a closed or unknown round, an unknown task, an invalid update). Either way the agent
    stops sending it.

    ``verdict`` is set on a second answer, sent once the round's updates are screened (:data:`VERDICTS`): the
    stored update was ``aggregated``, or ``rejected`` with the reason. Without it, the answer is the first one.
    """

    OMITTED_AT_DEFAULT: ClassVar[tuple[str, ...]] = ("reason", "verdict")

    task_id: str
    round: int
    agent_id: str
    reason: str | None = None
    verdict: str | None = None


@dataclass
class UploadRequest:
    """An agent asks leave to send the update of ``task_id``, ``size`` bytes encoded with that ``sha256`` (hex; on
    its update topic, where its chunks go), when its task said :attr:`Task.ask_to_upload`; it asks again while no
    grant comes. A coordinator that has the update already answers with its ack instead (the digest tells the same
    update from another one for the task)."""

    OMITTED_AT_DEFAULT: ClassVar[tuple[str, ...]] = ("sha256",)

    task_id: str
    round: int
    agent_id: str
    size: int
    sha256: str = ""


@dataclass
class UploadGrant:
    """The coordinator's leave to send the update of ``task_id`` now (on the agent's ack topic). It holds a place
    in the coordinator's window of bytes in transfer until the update is in, or until no chunk of it came for a
    while."""

    task_id: str
    round: int
    agent_id: str


@dataclass
class UploadWait:
    """The coordinator's answer that the request to upload ``task_id`` waits its turn (on the agent's ack topic,
    revision 7): the window of bytes in transfer is full, or no round takes the update now and the next one will
    (``reason`` says which). The agent keeps waiting for its grant, asking again now and then to keep its place,
    without spending its attempts."""

    task_id: str
    round: int
    agent_id: str
    reason: str


@dataclass
class ModelDelivery:
    """A trained model handed to an agent to run (on its task topic, in chunks like a task; revision 8): the model
    ``name`` a run's round ``round`` deployed, ``manifest`` the JSON form of a model folder's manifest naming that one
    model (:mod:`common.model_package`), and ``weights`` its files (path in the folder -> its bytes, uint8), each
    checked by the agent against the manifest's digests before it stores them. ``delivery_id`` names the transfer."""

    delivery_id: str
    round: int
    agent_id: str
    name: str
    manifest: dict[str, Any]
    weights: dict[str, np.ndarray]


#: What the coordinator's screening made of a stored update (:attr:`Ack.verdict`).
VERDICTS: tuple[str, ...] = ("aggregated", "rejected")


Message: TypeAlias = (AgentStatus | CoordinatorStatus | Task | Update | Ack | UploadRequest | UploadGrant
                      | UploadWait | ModelDelivery | SecureAdvert | SecureRoster | SecureShares | SecureRelay
                      | SecureUnmask | SecureReveal)
"""Any top-level message (the nested Capabilities, ModelRef, Recipe, TrainingPlan and Adaptation are not)."""
