"""Field-level validation of every message type on decode: types, ranges, ids, missing and unknown fields."""

from __future__ import annotations

import math
import typing
from dataclasses import fields
from typing import Any

import numpy as np
import pytest

from protocol import (
    Ack,
    AgentStatus,
    CoordinatorStatus,
    Message,
    ProtocolError,
    Task,
    Update,
    UpdateStatus,
    UploadGrant,
    UploadRequest,
    UploadWait,
    decode,
    encode,
)

from .conftest import pack, wire_of


def _step(node: Any, part: str) -> Any:
    return node[int(part)] if isinstance(node, list) else node[part]


def _set(wire: dict[str, Any], path: str, value: object) -> None:
    """Set a dotted path; numeric parts index lists (``plan.loss.0.kind``)."""
    *parents, last = path.split(".")
    node: Any = wire
    for part in parents:
        node = _step(node, part)
    node[int(last) if isinstance(node, list) else last] = value


def _delete(wire: dict[str, Any], path: str) -> None:
    *parents, last = path.split(".")
    node: Any = wire
    for part in parents:
        node = _step(node, part)
    del node[int(last) if isinstance(node, list) else last]


def _tensor(dtype: str, shape: list[int], data: bytes) -> dict[str, Any]:
    return {"dtype": dtype, "shape": shape, "data": data}


BAD_FIELDS: list[tuple[str, str, object, str]] = [
    # (sample, dotted field, bad value, expected text in the reason)
    ("ack", "round", True, "ack.round must be an integer, got bool"),
    ("ack", "round", 1.0, "ack.round must be an integer"),
    ("ack", "round", "3", "ack.round must be an integer"),
    ("ack", "round", -1, "ack.round must be >= 0"),
    ("coordinator_status", "round", -5, "coordinator_status.round must be >= 0"),
    ("task", "round", -1, "task.round must be >= 0"),
    ("ack", "agent_id", "pi/01", "ack.agent_id"),
    ("task", "agent_id", "+", "task.agent_id"),
    ("update", "agent_id", "", "update.agent_id"),
    ("status", "agent_id", 5, "status.agent_id"),
    ("coordinator_status", "federation", "a b", "coordinator_status.federation"),
    ("ack", "task_id", "", "ack.task_id"),
    ("ack", "task_id", "x" * 129, "ack.task_id"),
    ("task", "task_id", "r3/pi", "task.task_id"),
    ("task", "deadline", "soon", "task.deadline must be a number, got str"),
    ("task", "deadline", True, "task.deadline must be a number, got bool"),
    ("task", "deadline", math.inf, "task.deadline must be finite"),
    ("status", "sent_at", math.nan, "status.sent_at must be finite"),
    ("status", "sent_at", None, "status.sent_at must be a number"),
    ("status", "state", "sleeping", "status.state must be one of online, busy, offline"),
    ("coordinator_status", "state", "busy", "coordinator_status.state must be one of online, offline"),
    ("update", "status", "great", "update.status must be one of ok, adapted, declined, failed"),
    ("status", "capabilities", "none", "status.capabilities must be a map"),
    ("status", "capabilities.memory_total", -1, "status.capabilities.memory_total must be >= 0"),
    ("status", "capabilities.memory_available", 2.5, "memory_available must be an integer"),
    ("status", "capabilities.budget_bytes", -2, "budget_bytes must be >= 0"),
    ("status", "capabilities.num_samples", False, "num_samples must be an integer, got bool"),
    ("status", "capabilities.labels", [0, -1], "labels item must be >= 0"),
    ("status", "capabilities.device_kind", "", "device_kind must not be empty"),
    ("update", "labels", "0,1", "update.labels must be a list"),
    ("update", "labels", [0, True], "update.labels item must be an integer, got bool"),
    ("update", "num_samples", -3, "update.num_samples must be >= 0"),
    ("update", "metrics", {"loss": "low"}, "update.metrics.loss must be a number"),
    ("update", "metrics", {"loss": math.nan}, "update.metrics.loss must be finite"),
    ("update", "metrics", {"loss": math.inf}, "update.metrics.loss must be finite"),
    ("update", "metrics", {"ok": True}, "update.metrics.ok must be a number, got bool"),
    ("update", "metrics", [0.5], "update.metrics must be a map"),
    ("update", "reason", 5, "update.reason must be a string"),
    ("update", "spec_trained", [1, 2], "update.spec_trained must be a map"),
    ("task", "spec", None, "task.spec must be a map"),
    ("task", "spec", {"blob": b"\x00"}, "task.spec.blob must be None, bool, int, float, str"),
    ("task", "spec", {"levels": [{"w": math.nan}]}, "task.spec.levels[0].w must be finite"),
    ("task", "model.family", 7, "task.model.family must be a string"),
    ("task", "model.num_classes", 0, "task.model.num_classes must be >= 1"),
    ("task", "model.in_channels", -3, "task.model.in_channels must be >= 1"),
    ("task", "model.options", {"nested": {"a": 1}}, "task.model.options.nested must be None, bool"),
    ("task", "model.options", {"xs": [[1]]}, "task.model.options.xs must be None, bool"),
    ("task_recipe", "recipe.epochs", 0, "task.recipe.epochs must be >= 1"),
    ("task_recipe", "recipe.epochs", 2.0, "task.recipe.epochs must be an integer"),
    ("task_recipe", "recipe.batch_size", 0, "task.recipe.batch_size must be >= 1"),
    ("task_recipe", "recipe.lr", 0.0, "task.recipe.lr must be > 0"),
    ("task_recipe", "recipe.lr", "0.1", "task.recipe.lr must be a number, got str"),
    ("task_recipe", "recipe.momentum", 1.0, "task.recipe.momentum must be < 1"),
    ("task_recipe", "recipe.momentum", -0.1, "task.recipe.momentum must be >= 0"),
    ("task_recipe", "recipe.weight_decay", -1e-4, "task.recipe.weight_decay must be >= 0"),
    ("task_recipe", "recipe.clip_norm", 0.0, "task.recipe.clip_norm must be > 0"),
    ("task_recipe", "recipe.masked_ce", 1, "task.recipe.masked_ce must be true or false"),
    ("task_recipe", "recipe.seed", 4.0, "task.recipe.seed must be an integer"),
    ("task", "plan", "sgd", "task.plan must be a map, got str"),
    ("task", "plan.epochs", 0, "task.plan.epochs must be >= 1"),
    ("task", "plan.epochs", 1.0, "task.plan.epochs must be an integer"),
    ("task", "plan.batch_size", 1, "task.plan.batch_size must be >= 2"),
    ("task", "plan.batch_size", True, "task.plan.batch_size must be an integer, got bool"),
    ("task", "plan.seed", 1.5, "task.plan.seed must be an integer"),
    ("task", "plan.seed", None, "task.plan.seed must be an integer"),
    ("task", "plan.optimizer", None, "task.plan.optimizer must be a map"),
    ("task", "plan.optimizer.kind", "adam", "task.plan.optimizer.kind must be one of sgd; got str 'adam'"),
    ("task", "plan.optimizer.lr", math.nan, "task.plan.optimizer.lr must be finite"),
    ("task", "plan.optimizer.lr", math.inf, "task.plan.optimizer.lr must be finite"),
    ("task", "plan.optimizer.lr", 0, "task.plan.optimizer.lr must be > 0"),
    ("task", "plan.optimizer.momentum", 1.0, "task.plan.optimizer.momentum must be < 1"),
    ("task", "plan.optimizer.weight_decay", -1.0, "task.plan.optimizer.weight_decay must be >= 0"),
    ("task", "plan.optimizer.clip_norm", -math.inf, "task.plan.optimizer.clip_norm must be finite"),
    ("task", "plan.optimizer.clip_norm", 0.0, "task.plan.optimizer.clip_norm must be > 0"),
    ("task", "plan.loss", [], "task.plan.loss must hold at least one term"),
    ("task", "plan.loss", {"kind": "ce"}, "task.plan.loss must be a list"),
    ("task", "plan.loss", [{"kind": "ce"}] * 65, "task.plan.loss has 65 entries, more than the limit of 64"),
    ("task", "plan.loss.0", "ce", "task.plan.loss[0] must be a map"),
    ("task", "plan.loss.0.weight", -0.5, "task.plan.loss[0].weight must be >= 0"),
    ("task", "plan.loss.0.weight", math.nan, "task.plan.loss[0].weight must be finite"),
    ("task", "plan.loss.0.output", -1.0, "task.plan.loss[0].output must be an integer"),
    ("task", "plan.loss.0.masked", None, "task.plan.loss[0].masked must be true or false"),
    ("task", "plan.loss.2.teacher", "-1", "task.plan.loss[2].teacher must be an integer"),
    ("task", "plan.loss.2.tau", 0.0, "task.plan.loss[2].tau must be > 0"),
    ("task", "plan.loss.2.tau", math.inf, "task.plan.loss[2].tau must be finite"),
    ("task", "plan.loss.2.detach_teacher", 1, "task.plan.loss[2].detach_teacher must be true or false"),
    ("task", "plan.schedule", None, "task.plan.schedule must be a list"),
    ("task", "plan.schedule", [{"epochs": 1, "route": "skip"}] * 1025, "more than the limit of 1024"),
    ("task", "plan.schedule.0", [2, "skip"], "task.plan.schedule[0] must be a map"),
    ("task", "plan.schedule.1.epochs", 0, "task.plan.schedule[1].epochs must be >= 1"),
    ("task", "plan.schedule.1.route", "jump", "task.plan.schedule[1].route must be one of skip, exit"),
    ("task", "adaptation", [], "task.adaptation must be a map"),
    ("task", "adaptation.candidates", {"spec": {}}, "task.adaptation.candidates must be a list"),
    ("task", "adaptation.candidates.0", None, "task.adaptation.candidates[0] must be a map"),
    ("task", "adaptation.candidates.0.spec", [0.25], "task.adaptation.candidates[0].spec must be a map"),
    ("task", "adaptation.candidates.1.plan", None, "task.adaptation.candidates[1].plan must be a map"),
    ("task", "adaptation.candidates.1.plan.batch_size", 0, "candidates[1].plan.batch_size must be >= 2"),
    ("task_recipe", "adaptation.rates", "1,0.5", "task.adaptation.rates must be a list"),
    ("task_recipe", "adaptation.rates", [1.0, 0.0], "task.adaptation.rates item must be > 0"),
    ("task_recipe", "adaptation.rates", [1.0, True], "task.adaptation.rates item must be a number, got bool"),
    ("task_recipe", "adaptation.rates", [math.nan], "task.adaptation.rates item must be finite"),
    ("task", "weights", [], "task.weights must be a map of tensors"),
    (
        "task",
        "weights",
        {"w": _tensor("float32", [2, 2], b"\x00" * 12)},
        "task.weights['w']: tensor data is 12",
    ),
    ("task", "weights", {"w": _tensor("float32", [2**20, 2**20], b"")}, "task.weights['w']: tensor has"),
    ("task", "weights", {"w": _tensor("float32", [2**40], b"")}, "elements, more than the limit"),
    ("task", "weights", {"w": _tensor("complex64", [1], b"\x00" * 8)}, "tensor dtype str 'complex64' is not"),
    ("task", "weights", {"w": _tensor("object", [1], b"\x00" * 8)}, "is not allowed"),
    ("update", "weights", {"w": _tensor("float32", [1], np.float32(np.nan).tobytes())}, "NaN or Inf"),
    ("update", "weights", {"w": _tensor("float64", [2], np.array([1, np.inf]).tobytes())}, "NaN or Inf"),
    ("update", "weights", {"w": _tensor("float16", [1], np.float16(-np.inf).tobytes())}, "NaN or Inf"),
    ("update", "weights", {"": _tensor("int8", [1], b"\x01")}, "update.weights key must not be empty"),
]


@pytest.mark.parametrize(("sample", "path", "value", "reason"), BAD_FIELDS)
def test_bad_field_is_rejected_with_its_name(
    sample: str, path: str, value: object, reason: str, messages: dict[str, Message]
) -> None:
    wire = wire_of(messages[sample])
    _set(wire, path, value)
    with pytest.raises(ProtocolError) as caught:
        decode(pack(wire))
    assert reason in str(caught.value)


NESTED = ("capabilities", "model", "recipe", "plan", "optimizer", "adaptation")
"""Nested dataclass maps whose fields are checked one by one (not weights, spec or options contents)."""
LISTED = ("loss", "schedule", "candidates")
"""Lists of nested dataclass maps."""
MAY_LACK = {"plan", "adaptation", "adaptation.candidates", "adaptation.rates"}
"""Fields added after a message's first version: an older sender leaves them out (see test_plan)."""
MAY_LACK_IN = {("ack", "reason"), ("status", "instance")}
"""The same, for one message type (an update's reason is as old as the update)."""


def _field_paths(wire: dict[str, Any], prefix: str = "") -> list[str]:
    """Every message field, nested dataclass maps and lists of them included."""
    paths = []
    for key, value in wire.items():
        if key in ("v", "type"):
            continue
        paths.append(prefix + key)
        if key in NESTED and isinstance(value, dict):
            paths.extend(_field_paths(value, f"{prefix}{key}."))
        elif key in LISTED and isinstance(value, list):
            for index, item in enumerate(value):
                paths.extend(_field_paths(item, f"{prefix}{key}.{index}."))
    return paths


def _kind_precheck(path: str) -> bool:
    """A term's or an adaptation's missing 'kind' may be reported as an unknown kind (None)."""
    return path.endswith(".kind") and (".loss." in path or path.endswith("adaptation.kind"))


@pytest.mark.parametrize("sample", ["status", "coordinator_status", "task", "task_recipe", "update", "ack"])
def test_every_missing_field_is_rejected_by_name(sample: str, messages: dict[str, Message]) -> None:
    paths = _field_paths(wire_of(messages[sample]))
    assert len(paths) >= 3
    if sample == "task":
        assert {"plan.optimizer.lr", "plan.loss.2.tau", "plan.schedule.1.route", "plan.version",
                "adaptation.candidates.1.plan.seed", "adaptation.candidates.0.spec"} <= set(paths)  # fmt: skip
    checked = 0
    for path in paths:
        if path in MAY_LACK or (sample, path) in MAY_LACK_IN:
            continue
        wire = wire_of(messages[sample])
        _delete(wire, path)
        with pytest.raises(ProtocolError) as caught:
            decode(pack(wire))
        name = path.split(".")[-1]
        if _kind_precheck(path) and "missing field" not in str(caught.value):
            assert ".kind: unknown" in str(caught.value) and "None" in str(caught.value), path
        else:
            assert "missing field" in str(caught.value), path
            assert repr(name) in str(caught.value), path
        checked += 1
    assert checked >= 3


@pytest.mark.parametrize(
    ("sample", "where", "label"),
    [
        ("ack", "", "ack"),
        ("task", "", "task"),
        ("task_recipe", "recipe.", "task.recipe"),
        ("task", "model.", "task.model"),
        ("status", "capabilities.", "status.capabilities"),
        ("task", "plan.", "task.plan"),
        ("task", "plan.optimizer.", "task.plan.optimizer"),
        ("task", "plan.loss.0.", "task.plan.loss[0]"),
        ("task", "plan.loss.2.", "task.plan.loss[2]"),
        ("task", "plan.schedule.1.", "task.plan.schedule[1]"),
        ("task", "adaptation.", "task.adaptation"),
        ("task", "adaptation.candidates.0.", "task.adaptation.candidates[0]"),
        ("task", "adaptation.candidates.1.plan.", "task.adaptation.candidates[1].plan"),
        ("task", "adaptation.candidates.1.plan.loss.0.", "task.adaptation.candidates[1].plan.loss[0]"),
        ("task_recipe", "adaptation.", "task.adaptation"),
    ],
)
def test_unknown_field_is_rejected_by_name(
    sample: str, where: str, label: str, messages: dict[str, Message]
) -> None:
    wire = wire_of(messages[sample])
    _set(wire, where + "surprise_field", 1)
    with pytest.raises(ProtocolError, match="unknown field") as caught:
        decode(pack(wire))
    assert str(caught.value).startswith(f"{label}: unknown field(s) 'surprise_field'"), str(caught.value)


def test_optional_fields_accept_none(messages: dict[str, Message]) -> None:
    wire = wire_of(messages["update"])
    wire.update(spec_trained=None, reason=None, weights={}, status="declined")
    update = decode(pack(wire), expected=Update)
    assert isinstance(update, Update)
    assert (update.spec_trained, update.reason, update.weights) == (None, None, {})
    offline = decode(encode(messages["status_offline"]), expected=AgentStatus)
    assert isinstance(offline, AgentStatus) and offline.capabilities is None
    wire = wire_of(messages["task_recipe"])
    wire["recipe"]["clip_norm"] = None
    wire["recipe"]["momentum"] = 0
    wire["adaptation"] = None
    task = decode(pack(wire), expected=Task)
    assert isinstance(task, Task) and task.recipe is not None
    assert task.recipe.clip_norm is None and task.recipe.momentum == 0.0 and task.adaptation is None
    wire = wire_of(messages["task"])
    wire["plan"]["optimizer"]["clip_norm"] = None
    wire["plan"]["optimizer"]["weight_decay"] = 0
    wire["plan"]["loss"][2]["detach_teacher"] = False
    task = decode(pack(wire), expected=Task)
    assert isinstance(task, Task) and task.plan is not None and task.recipe is None
    assert task.plan.optimizer.clip_norm is None and task.plan.optimizer.weight_decay == 0.0
    assert task.plan.loss[2].detach_teacher is False


def test_float_fields_accept_ints_as_floats(messages: dict[str, Message]) -> None:
    wire = wire_of(messages["task_recipe"])
    wire["deadline"] = 1700000600
    wire["recipe"]["lr"] = 1
    wire["adaptation"]["rates"] = [1, 0.5]
    task = decode(pack(wire), expected=Task)
    assert isinstance(task, Task) and task.recipe is not None and task.adaptation is not None
    assert type(task.deadline) is float and task.deadline == 1700000600.0
    assert type(task.recipe.lr) is float and task.recipe.lr == 1.0
    assert [type(rate) for rate in task.adaptation.rates] == [float, float]
    wire = wire_of(messages["task"])
    wire["plan"]["optimizer"]["lr"] = 2
    wire["plan"]["loss"][2]["weight"] = 1
    wire["plan"]["loss"][2]["tau"] = 4
    task = decode(pack(wire), expected=Task)
    assert isinstance(task, Task) and task.plan is not None
    lr, term = task.plan.optimizer.lr, task.plan.loss[2]
    assert (type(lr), type(term.weight), type(term.tau)) == (float, float, float)
    assert (lr, term.weight, term.tau) == (2.0, 1.0, 4.0)


def test_update_reason_defaults_to_none() -> None:
    update = Update("t", 0, "a", "ok", None, 0, [], {}, {})
    assert update.reason is None
    decoded = decode(encode(update), expected=Update)
    assert isinstance(decoded, Update) and decoded.reason is None


def test_an_update_status_is_its_type_and_reads_as_its_value() -> None:
    update = Update("t", 0, "a", "adapted", None, 0, [], {}, {})  # a string naming a status is taken as it
    assert update.status is UpdateStatus.ADAPTED and update.status.trained
    assert (str(update.status), f"{update.status:>8}", update.status == "adapted") == ("adapted", " adapted", True)
    assert not UpdateStatus.DECLINED.trained and not UpdateStatus.FAILED.trained
    decoded = decode(encode(update), expected=Update)
    assert isinstance(decoded, Update) and decoded.status is UpdateStatus.ADAPTED
    assert wire_of(update)["status"] == "adapted" and type(wire_of(update)["status"]) is str
    with pytest.raises(ValueError, match="'trained' is not a valid UpdateStatus"):
        Update("t", 0, "a", "trained", None, 0, [], {}, {})


def test_message_union_lists_the_top_level_messages() -> None:
    from protocol import (
        ModelDelivery,
        SecureAdvert,
        SecureRelay,
        SecureReveal,
        SecureRoster,
        SecureShares,
        SecureUnmask,
    )

    assert set(typing.get_args(Message)) == {AgentStatus, CoordinatorStatus, Task, Update, Ack, UploadRequest,
                                            UploadGrant, UploadWait, ModelDelivery, SecureAdvert, SecureRoster,
                                            SecureShares, SecureRelay, SecureUnmask, SecureReveal}


def test_field_names_are_the_contract() -> None:
    assert [f.name for f in fields(Task)] == [
        "task_id", "round", "agent_id", "deadline", "model", "spec", "recipe", "weights", "adaptation", "plan",
        "ask_to_upload", "secure",
    ]  # fmt: skip
    assert [f.name for f in fields(Update)] == [
        "task_id", "round", "agent_id", "status", "spec_trained", "num_samples", "labels", "weights",
        "metrics", "reason",
    ]  # fmt: skip


def test_upload_requests_and_grants_round_trip_and_a_task_asks_only_when_told() -> None:
    """Revision 6: what an agent asks and the coordinator grants; a task without ``ask_to_upload`` is what older
    agents read (no new key), one with it says so, and `message_type` tells a request from a chunk."""
    import msgpack

    from protocol import message_type, split_payload

    request, grant = UploadRequest("r3-pi-01-ab", 3, "pi-01", 4_000_000), UploadGrant("r3-pi-01-ab", 3, "pi-01")
    assert decode(encode(request)) == request and decode(encode(grant)) == grant
    assert "sha256" not in msgpack.unpackb(encode(request))
    with_digest = UploadRequest("r3-pi-01-ab", 3, "pi-01", 10, "ab" * 32)
    assert decode(encode(with_digest)) == with_digest
    assert message_type(encode(request)) == "upload_request" and message_type(encode(grant)) == "upload_grant"
    assert {message_type(chunk) for chunk in split_payload(b"x" * 3000, "t.1", 1000)} == {"chunk"}
    assert message_type(b"\x00not a map") is None and message_type(b"") is None
    wire = msgpack.unpackb(encode(request))
    for field, bad in (("size", -1), ("agent_id", "a/b"), ("task_id", ""), ("sha256", "xyz")):
        with pytest.raises(ProtocolError, match=field):
            decode(msgpack.packb({**wire, field: bad}))
    with pytest.raises(ProtocolError, match="unexpected|unknown"):
        decode(msgpack.packb({**wire, "extra": 1}))


def test_upload_wait_round_trips_and_is_read_only_from_revision_7() -> None:
    """Revision 7: the coordinator's answer that a request waits its turn; a reader refuses one without a reason
    or with a field it does not know."""
    import msgpack

    from protocol import PROTOCOL_REVISION, UPLOAD_GRANT_REVISION, UPLOAD_WAIT_REVISION, message_type

    assert PROTOCOL_REVISION >= UPLOAD_WAIT_REVISION > UPLOAD_GRANT_REVISION
    wait = UploadWait("r3-pi-01-ab", 3, "pi-01", "round 3 is aggregating: round 4 takes this update")
    assert decode(encode(wait)) == wait and message_type(encode(wait)) == "upload_wait"
    wire = msgpack.unpackb(encode(wait))
    with pytest.raises(ProtocolError, match="reason"):
        decode(msgpack.packb({key: value for key, value in wire.items() if key != "reason"}))
    with pytest.raises(ProtocolError, match="unexpected|unknown"):
        decode(msgpack.packb({**wire, "ahead": 2}))


def test_status_instance_and_ack_reason_stay_off_the_wire_at_their_defaults() -> None:
    import msgpack

    from protocol import Ack, AgentStatus, decode, encode

    old_status = AgentStatus("pi-01", "offline", None, 5.0)
    assert "instance" not in msgpack.unpackb(encode(old_status))
    status = AgentStatus("pi-01", "offline", None, 5.0, "a1b2c3")
    assert decode(encode(status)) == status and decode(encode(old_status)).instance == ""
    assert "reason" not in msgpack.unpackb(encode(Ack("t-1", 1, "pi-01")))
    refused = Ack("t-1", 1, "pi-01", "round 1 closed before the update arrived")
    assert decode(encode(refused)) == refused


def test_an_ack_after_screening_carries_the_verdict_and_older_acks_carry_none() -> None:
    import msgpack

    from protocol import ProtocolError, decode, encode

    assert "verdict" not in msgpack.unpackb(encode(Ack("t-1", 1, "pi-01")))
    for ack in (Ack("t-1", 1, "pi-01", None, "aggregated"), Ack("t-1", 1, "pi-01", "update rejected: x", "rejected")):
        assert decode(encode(ack)) == ack
    wire = msgpack.unpackb(encode(Ack("t-1", 1, "pi-01", None, "aggregated")))
    for verdict, said in (("rejected", "a 'rejected' verdict needs its 'reason'"), ("maybe", "verdict")):
        with pytest.raises(ProtocolError, match=said):
            decode(msgpack.packb({**wire, "verdict": verdict}))


def test_status_reports_round_trip_and_stay_off_the_wire_when_absent() -> None:
    """Revision 5: an agent's report and the coordinator's round in progress; statuses without them are what
    older readers read (no new key)."""
    import msgpack

    from protocol import AgentReport, AgentStatus, CoordinatorStatus, RoundProgress, decode, encode

    assert set(msgpack.unpackb(encode(AgentStatus("pi-01", "online", None, 5.0, "i")))) == {
        "v", "type", "agent_id", "state", "capabilities", "sent_at", "instance"}
    assert set(msgpack.unpackb(encode(CoordinatorStatus("fed", "online", 3, 5.0)))) == {
        "v", "type", "federation", "state", "round", "sent_at"}
    report = AgentReport(since=4.0, task="r3-pi-01", task_round=3, last_task="r2-pi-01", last_round=2,
                         last_status="adapted", last_trained="width=0.5", last_reason="adapted to fit 27 MiB",
                         last_finished_at=4.5, outbox=1, outbox_bytes=2048)
    status = AgentStatus("pi-01", "busy", None, 5.0, "i", report)
    assert decode(encode(status)) == status
    assert decode(encode(AgentStatus("pi-01", "online", None, 5.0, "i", AgentReport(since=4.0)))).report == \
        AgentReport(since=4.0)
    coordinator = CoordinatorStatus("fed", "online", 3, 5.0, 5, RoundProgress(3, 16, 11, 4.0, 64.0))
    assert decode(encode(coordinator)) == coordinator


@pytest.mark.parametrize(("field", "value", "reason"), [
    ("last_status", "maybe", "status.report.last_status"),
    ("outbox", -1, "status.report.outbox must be >= 0"),
    ("since", "yesterday", "status.report.since must be a number"),
])
def test_a_bad_report_is_refused_by_name(field: str, value: object, reason: str) -> None:
    import msgpack

    from protocol import AgentReport, AgentStatus, ProtocolError, decode, encode

    wire = msgpack.unpackb(encode(AgentStatus("pi-01", "online", None, 5.0, "i", AgentReport(since=4.0))))
    wire["report"][field] = value
    with pytest.raises(ProtocolError, match=reason):
        decode(msgpack.packb(wire))


def test_a_model_delivery_round_trips_its_files_as_bytes_from_revision_8() -> None:
    """Revision 8: a model handed to an agent to run, its files carried as uint8 tensors (raw bytes in version 2);
    any other file dtype is refused. The agent's report says the model it holds, off the wire while it holds none."""
    import msgpack
    import numpy as np

    from protocol import MODEL_DELIVERY_REVISION, PROTOCOL_REVISION, AgentReport, ModelDelivery, message_type

    assert PROTOCOL_REVISION >= MODEL_DELIVERY_REVISION > 7
    files = {"b/model.onnx": np.frombuffer(b"\x08\x01graph", dtype=np.uint8),
             "b/model.safetensors": np.frombuffer(b"weights", dtype=np.uint8)}
    sent = ModelDelivery("model-5-pi-01", 5, "pi-01", "b", {"format": "x", "models": [{"name": "b"}]}, files)
    for version in (1, 2):
        got = decode(encode(sent, version=version))
        assert isinstance(got, ModelDelivery) and got.manifest == sent.manifest and got.name == "b"
        assert {path: bytes(data) for path, data in got.weights.items()} == {p: bytes(d) for p, d in files.items()}
    assert message_type(encode(sent, version=1)) == "model_delivery"
    with pytest.raises(ProtocolError, match="flat array of bytes"):
        decode(encode(ModelDelivery("model-5-pi-01", 5, "pi-01", "b", {}, {"x": np.zeros(2, dtype=np.float32)}),
                      version=1))
    report = AgentReport(since=1.0)
    wire = msgpack.unpackb(encode(AgentStatus("pi-01", "online", None, 2.0, report=report)))["report"]
    assert "model" not in wire and "model_refused" not in wire
    held = AgentStatus("pi-01", "online", None, 2.0, report=AgentReport(since=1.0, model="b@" + "0" * 64,
                                                                        model_refused="c@" + "1" * 64 + ": too big"))
    assert decode(encode(held)) == held
