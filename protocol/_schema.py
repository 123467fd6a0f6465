"""One reader per message type: a decoded msgpack map in, a validated dataclass out."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from protocol._ids import SHA256_HEX, shown
from protocol._reader import FieldReader, check_int, check_number
from protocol.errors import ProtocolError
from protocol.framing import TensorSection
from protocol.limits import Limits
from protocol.messages import (
    ADAPTATION_KINDS,
    AGENT_STATES,
    COORDINATOR_STATES,
    PROTOCOL_VERSION,
    READABLE_VERSIONS,
    UPDATE_STATUSES,
    VERDICTS,
    Ack,
    Adaptation,
    AgentReport,
    AgentStatus,
    Candidate,
    Capabilities,
    CoordinatorStatus,
    Message,
    ModelDelivery,
    ModelRef,
    PrivacySpent,
    RoundProgress,
    Task,
    Update,
    UpdateStatus,
    UploadGrant,
    UploadRequest,
    UploadWait,
)
from protocol.plan import ROUTES, Recipe, read_training_plan
from protocol.secure import SECURE_KINDS, SECURE_READERS

HEADER = ("v", "type")
KIND_OF: dict[type, str] = {
    AgentStatus: "status",
    CoordinatorStatus: "coordinator_status",
    Task: "task",
    Update: "update",
    Ack: "ack",
    UploadRequest: "upload_request",
    UploadGrant: "upload_grant",
    UploadWait: "upload_wait",
    ModelDelivery: "model_delivery",
    **SECURE_KINDS,
}


def read_capabilities(obj: object, where: str, limits: Limits) -> Capabilities:
    r = FieldReader(obj, where, limits, Capabilities, optional=("sample_shape", "protocol_version"))
    shape = r.raw("sample_shape")
    if shape is not None and (not isinstance(shape, list) or len(shape) > 8):
        raise ProtocolError(f"{r.label('sample_shape')} must be a list of at most 8 dimensions, got {shown(shape)}")
    return Capabilities(
        device_kind=r.text("device_kind"),
        memory_total=r.integer("memory_total", minimum=0),
        memory_available=r.integer("memory_available", minimum=0),
        budget_bytes=r.opt_integer("budget_bytes", minimum=0),
        num_samples=r.integer("num_samples", minimum=0),
        labels=r.labels("labels"),
        sample_shape=tuple(check_int(size, f"{r.label('sample_shape')} item", 1) for size in shape or ()),
        protocol_version=r.opt_integer("protocol_version", minimum=1) or 1,
    )


def read_model_ref(obj: object, where: str, limits: Limits) -> ModelRef:
    r = FieldReader(obj, where, limits, ModelRef)
    return ModelRef(
        family=r.text("family"),
        num_classes=r.integer("num_classes", minimum=1),
        in_channels=r.integer("in_channels", minimum=1),
        options=r.options("options"),
    )


def read_recipe(obj: object, where: str, limits: Limits) -> Recipe:
    r = FieldReader(obj, where, limits, Recipe)
    return Recipe(
        epochs=r.integer("epochs", minimum=1),
        batch_size=r.integer("batch_size", minimum=1),
        lr=r.number("lr", above=0.0),
        momentum=r.number("momentum", minimum=0.0, below=1.0),
        weight_decay=r.number("weight_decay", minimum=0.0),
        clip_norm=r.opt_number("clip_norm", above=0.0),
        masked_ce=r.boolean("masked_ce"),
        seed=r.integer("seed"),
    )


MAX_CANDIDATES = 64


def read_candidate(obj: object, where: str, limits: Limits) -> Candidate:
    r = FieldReader(obj, where, limits, Candidate)
    return Candidate(spec=r.tree("spec"), plan=r.nested("plan", read_training_plan))


def read_adaptation(obj: object, where: str, limits: Limits) -> Adaptation:
    if isinstance(obj, dict) and "kind" in obj and obj["kind"] not in ADAPTATION_KINDS:
        raise ProtocolError(f"{where}.kind: unknown adaptation kind {shown(obj.get('kind'))}; this side knows "
                            f"{', '.join(ADAPTATION_KINDS)} (upgrade it to run this task)")
    r = FieldReader(obj, where, limits, Adaptation, optional=("candidates", "rates", "route", "min_micro_batch",
                                                                      "head_alone"))
    kind = r.text("kind", ADAPTATION_KINDS)
    route = "skip" if r.raw("route") is None else r.text("route", ROUTES)
    if route != "skip" and kind != "depthwise":
        raise ProtocolError(f"{r.label('route')}: only a 'depthwise' adaptation has a route, got {route!r} with "
                            f"{kind!r}")
    micro = r.opt_integer("min_micro_batch", minimum=0) or 0
    if micro == 1 or (micro and kind != "depthwise"):
        raise ProtocolError(f"{r.label('min_micro_batch')}: only a 'depthwise' adaptation takes one, and it is 0 or "
                            f"at least 2, got {micro} with {kind!r}")
    head_alone = r.raw("head_alone") is not None and r.boolean("head_alone")
    if head_alone and kind != "depthwise":
        raise ProtocolError(f"{r.label('head_alone')}: only a 'depthwise' adaptation trains the head alone, got "
                            f"{kind!r}")
    raw_candidates = r.raw("candidates")
    raw_candidates = [] if raw_candidates is None else raw_candidates
    if not isinstance(raw_candidates, list) or len(raw_candidates) > MAX_CANDIDATES:
        raise ProtocolError(f"{r.label('candidates')} must be a list of at most {MAX_CANDIDATES} candidates, "
                            f"got {shown(raw_candidates)}")
    candidates = [read_candidate(c, f"{r.label('candidates')}[{i}]", limits) for i, c in enumerate(raw_candidates)]
    raw_rates = r.raw("rates")
    raw_rates = [] if raw_rates is None else raw_rates
    if not isinstance(raw_rates, list):
        raise ProtocolError(f"{r.label('rates')} must be a list of width rates, got {shown(raw_rates)}")
    rates = [check_number(rate, f"{r.label('rates')} item", above=0.0) for rate in raw_rates]
    if any(rate > 1.0 for rate in rates):
        raise ProtocolError(f"{r.label('rates')} must hold width rates in (0, 1], got {rates[:8]}")
    if kind == "ladder" and not candidates:
        raise ProtocolError(f"{where}: a 'ladder' adaptation needs at least one candidate")
    if kind == "width-levels" and not rates:
        raise ProtocolError(f"{where}: a 'width-levels' adaptation needs 'rates'")
    return Adaptation(kind=kind, candidates=candidates, rates=rates, route=route, min_micro_batch=micro,
                      head_alone=head_alone)


_REPORT_DEFAULTS = ("task", "task_round", "last_task", "last_round", "last_status", "last_trained", "last_reason",
                    "last_finished_at", "outbox", "outbox_bytes", "model", "model_refused")


def read_agent_report(obj: object, where: str, limits: Limits) -> AgentReport:
    r = FieldReader(obj, where, limits, AgentReport, optional=_REPORT_DEFAULTS)
    last_status = r.raw("last_status")
    return AgentReport(
        since=r.number("since", minimum=0.0),
        task=r.opt_text("task") or "",
        task_round=r.opt_integer("task_round", minimum=0) or 0,
        last_task=r.opt_text("last_task") or "",
        last_round=r.opt_integer("last_round", minimum=0) or 0,
        last_status="" if last_status in (None, "") else r.text("last_status", UPDATE_STATUSES),
        last_trained=r.opt_text("last_trained") or "",
        last_reason=r.opt_text("last_reason") or "",
        last_finished_at=r.opt_number("last_finished_at") or 0.0,
        outbox=r.opt_integer("outbox", minimum=0) or 0,
        outbox_bytes=r.opt_integer("outbox_bytes", minimum=0) or 0,
        model=r.opt_text("model") or "",
        model_refused=r.opt_text("model_refused") or "",
    )


def read_agent_status(obj: object, limits: Limits) -> AgentStatus:
    r = FieldReader(obj, "status", limits, AgentStatus, HEADER, optional=("instance", "report"))
    return AgentStatus(
        agent_id=r.name("agent_id"),
        state=r.text("state", AGENT_STATES),
        capabilities=r.opt_nested("capabilities", read_capabilities),
        sent_at=r.number("sent_at"),
        instance=r.opt_text("instance") or "",
        report=r.opt_nested("report", read_agent_report),
    )


def read_round_progress(obj: object, where: str, limits: Limits) -> RoundProgress:
    r = FieldReader(obj, where, limits, RoundProgress)
    return RoundProgress(
        round=r.integer("round", minimum=1),
        expected=r.integer("expected", minimum=0),
        received=r.integer("received", minimum=0),
        started_at=r.number("started_at", minimum=0.0),
        deadline=r.number("deadline", minimum=0.0),
    )


def read_privacy_spent(obj: object, where: str, limits: Limits) -> PrivacySpent:
    r = FieldReader(obj, where, limits, PrivacySpent)
    return PrivacySpent(epsilon=r.number("epsilon", minimum=0.0), delta=r.number("delta", above=0.0, below=1.0),
                        max_epsilon=r.number("max_epsilon", minimum=0.0))


def read_coordinator_status(obj: object, limits: Limits) -> CoordinatorStatus:
    r = FieldReader(obj, "coordinator_status", limits, CoordinatorStatus, HEADER,
                    optional=("revision", "progress", "privacy"))
    return CoordinatorStatus(
        federation=r.name("federation"),
        state=r.text("state", COORDINATOR_STATES),
        round=r.integer("round", minimum=0),
        sent_at=r.number("sent_at"),
        revision=r.opt_integer("revision", minimum=0) or 0,
        progress=r.opt_nested("progress", read_round_progress),
        privacy=r.opt_nested("privacy", read_privacy_spent),
    )


def read_task(obj: object, limits: Limits, section: TensorSection | None = None) -> Task:
    r = FieldReader(obj, "task", limits, Task, HEADER, optional=("plan", "adaptation", "ask_to_upload", "secure"))
    if (r.raw("plan") is None) == (r.raw("recipe") is None):
        raise ProtocolError("task must carry a training 'plan' (or, from coordinators that predate plans, a "
                            "'recipe'), not both and not neither")
    return Task(
        task_id=r.task_id("task_id"),
        round=r.integer("round", minimum=0),
        agent_id=r.name("agent_id"),
        deadline=r.number("deadline"),
        model=r.nested("model", read_model_ref),
        spec=r.tree("spec"),
        recipe=r.opt_nested("recipe", read_recipe),
        weights=r.weights("weights", section),
        adaptation=r.opt_nested("adaptation", read_adaptation),
        plan=r.opt_nested("plan", read_training_plan),
        ask_to_upload=r.boolean("ask_to_upload") if r.raw("ask_to_upload") is not None else False,
        secure=r.boolean("secure") if r.raw("secure") is not None else False,
    )


def read_update(obj: object, limits: Limits, section: TensorSection | None = None) -> Update:
    r = FieldReader(obj, "update", limits, Update, HEADER)
    return Update(
        task_id=r.task_id("task_id"),
        round=r.integer("round", minimum=0),
        agent_id=r.name("agent_id"),
        status=UpdateStatus(r.text("status", UPDATE_STATUSES)),
        spec_trained=r.opt_tree("spec_trained"),
        num_samples=r.integer("num_samples", minimum=0),
        labels=r.labels("labels"),
        weights=r.weights("weights", section),
        metrics=r.float_map("metrics"),
        reason=r.opt_text("reason"),
    )


def read_ack(obj: object, limits: Limits) -> Ack:
    r = FieldReader(obj, "ack", limits, Ack, HEADER, optional=("reason", "verdict"))
    ack = Ack(task_id=r.task_id("task_id"), round=r.integer("round", minimum=0), agent_id=r.name("agent_id"),
              reason=r.opt_text("reason"), verdict=None if r.raw("verdict") is None else r.text("verdict", VERDICTS))
    if ack.verdict == "rejected" and ack.reason is None:
        raise ProtocolError("ack: a 'rejected' verdict needs its 'reason'")
    return ack


def read_upload_request(obj: object, limits: Limits) -> UploadRequest:
    r = FieldReader(obj, "upload_request", limits, UploadRequest, HEADER, optional=("sha256",))
    digest = r.opt_text("sha256") or ""
    if digest and not SHA256_HEX.fullmatch(digest):
        raise ProtocolError(f"{r.label('sha256')} must be a hex sha256 (64 lowercase digits), got {shown(digest)}")
    return UploadRequest(task_id=r.task_id("task_id"), round=r.integer("round", minimum=0),
                         agent_id=r.name("agent_id"), size=r.integer("size", minimum=0), sha256=digest)


def read_upload_grant(obj: object, limits: Limits) -> UploadGrant:
    r = FieldReader(obj, "upload_grant", limits, UploadGrant, HEADER)
    return UploadGrant(task_id=r.task_id("task_id"), round=r.integer("round", minimum=0),
                       agent_id=r.name("agent_id"))


def read_upload_wait(obj: object, limits: Limits) -> UploadWait:
    r = FieldReader(obj, "upload_wait", limits, UploadWait, HEADER)
    return UploadWait(task_id=r.task_id("task_id"), round=r.integer("round", minimum=0),
                      agent_id=r.name("agent_id"), reason=r.text("reason"))


def read_model_delivery(obj: object, limits: Limits, section: TensorSection | None = None) -> ModelDelivery:
    r = FieldReader(obj, "model_delivery", limits, ModelDelivery, HEADER)
    delivery = ModelDelivery(delivery_id=r.task_id("delivery_id"), round=r.integer("round", minimum=0),
                             agent_id=r.name("agent_id"), name=r.text("name"), manifest=r.tree("manifest"),
                             weights=r.weights("weights", section))
    if any(array.dtype != np.uint8 or array.ndim != 1 for array in delivery.weights.values()):
        raise ProtocolError("model_delivery.weights: every file must be a flat array of bytes (uint8)")
    return delivery


READERS: dict[str, Callable[[object, Limits], Message]] = {
    "status": read_agent_status,
    "coordinator_status": read_coordinator_status,
    "task": read_task,
    "update": read_update,
    "ack": read_ack,
    "upload_request": read_upload_request,
    "upload_grant": read_upload_grant,
    "upload_wait": read_upload_wait,
    "model_delivery": read_model_delivery,
    **SECURE_READERS,
}
WITH_TENSORS: dict[str, Callable[[object, Limits, TensorSection], Message]] = {
    "task": read_task,
    "update": read_update,
    "model_delivery": read_model_delivery,
}
_READABLE = " and ".join(map(str, READABLE_VERSIONS))


def read_message(obj: object, limits: Limits, section: TensorSection | None = None) -> Message:
    """Check the envelope (``v``, ``type``) of a decoded map and read the message it holds: a version 1 map,
    or, with the ``section`` of its payload, the header of a version 2 payload (see `protocol.framing`)."""
    if not isinstance(obj, dict):
        raise ProtocolError(f"message must be a msgpack map, got {shown(obj)}")
    if "v" not in obj:
        raise ProtocolError("message has no protocol version field 'v'")
    version = obj["v"]
    layout = 1 if section is None else 2
    if type(version) is not int or version not in READABLE_VERSIONS:
        got = str(version) if type(version) is int else shown(version)
        raise ProtocolError(
            f"message speaks protocol version {got}, this side reads versions {_READABLE} (it speaks version "
            f"{PROTOCOL_VERSION}): upgrade the older side"
        )
    kind = obj.get("type")
    if kind == "chunk":
        raise ProtocolError("payload is one chunk of a larger message: feed it to protocol.Reassembler first")
    if version != layout:
        raise ProtocolError(f"message says protocol version {version} but is laid out as version {layout} "
                            "(corrupted)")
    reader = READERS.get(kind) if isinstance(kind, str) else None
    if reader is None:
        raise ProtocolError(f"unknown message type {shown(kind)} (known: {', '.join(READERS)})")
    if section is not None and kind in WITH_TENSORS:
        return WITH_TENSORS[kind](obj, limits, section)
    return reader(obj, limits)
