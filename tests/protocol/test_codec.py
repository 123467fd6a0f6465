"""encode/decode: round trips, envelope checks, limits, and that nothing but ProtocolError escapes decode."""

from __future__ import annotations

import dataclasses
import random
import re
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np
import pytest

from protocol import (
    PROTOCOL_VERSION,
    Ack,
    AgentStatus,
    Capabilities,
    CoordinatorStatus,
    Limits,
    Message,
    ProtocolError,
    Task,
    Update,
    decode,
    encode,
    split_payload,
)

from .conftest import pack, wire_of

MESSAGE_TYPES = (AgentStatus, CoordinatorStatus, Task, Update, Ack)
KINDS = {
    "status": "status",
    "status_offline": "status",
    "coordinator_status": "coordinator_status",
    "task": "task",
    "task_recipe": "task",
    "update": "update",
    "ack": "ack",
}


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("name", sorted(KINDS))
def test_round_trip_every_message_type(
    name: str, version: int, messages: dict[str, Message], assert_same: Callable[[object, Message], None]
) -> None:
    message = messages[name]
    payload = encode(message, version=version)
    assert isinstance(payload, bytes)
    assert_same(decode(payload), message)
    assert_same(decode(bytearray(payload)), message)
    assert_same(decode(memoryview(payload), expected=type(message)), message)


@pytest.mark.parametrize("name", sorted(KINDS))
def test_envelope_has_version_and_type(name: str, messages: dict[str, Message]) -> None:
    wire = wire_of(messages[name])
    assert wire["v"] == 1 and PROTOCOL_VERSION == 2
    assert wire["type"] == KINDS[name]
    outer = msgpack.unpackb(encode(messages[name]))
    if name.startswith(("task", "update")):  # version 2: the message map, then the tensors
        assert list(outer) == ["v", "h", "m", "d"] and outer["v"] == 2
        assert {**outer["m"], "weights": None} == {**wire, "v": 2, "weights": None}
    else:  # no tensors: the same in both versions, written as version 1 for every reader
        assert outer == wire


def test_task_wire_layout(messages: dict[str, Message]) -> None:
    wire = wire_of(messages["task"])
    assert wire["recipe"] is None
    assert wire["plan"]["version"] == 1
    assert wire["plan"]["optimizer"] == {
        "kind": "sgd", "lr": 0.05, "momentum": 0.9, "weight_decay": 5e-4, "clip_norm": 5.0
    }  # fmt: skip
    assert wire["plan"]["loss"][2] == {
        "kind": "kd", "weight": 0.3, "output": -2, "masked": False, "teacher": -1, "tau": 3.0,
        "detach_teacher": True,
    }  # fmt: skip
    assert wire["plan"]["schedule"] == [{"epochs": 2, "route": "skip"}, {"epochs": 1, "route": "exit"}]
    assert wire["adaptation"]["kind"] == "ladder" and wire["adaptation"]["rates"] == []
    assert wire["adaptation"]["candidates"][0]["spec"] == {"width": 0.25, "name": "level-3"}
    assert wire["adaptation"]["candidates"][0]["plan"]["optimizer"]["clip_norm"] is None
    assert wire["model"]["family"] == "resnet"
    old = wire_of(messages["task_recipe"])
    assert old["plan"] is None and old["recipe"]["lr"] == 0.05
    assert old["adaptation"] == {"kind": "width-levels", "candidates": [], "rates": [1.0, 0.5, 0.25]}
    tensor = wire["weights"]["conv.weight"]
    assert set(tensor) == {"dtype", "shape", "data"}
    assert tensor["dtype"] == "float32" and tensor["shape"] == [4, 3, 3, 3]
    assert isinstance(tensor["data"], bytes) and len(tensor["data"]) == 4 * 108


def test_round_trip_through_chunks(messages: dict[str, Message], assert_same: Callable[..., None]) -> None:
    from protocol import Reassembler

    payload = encode(messages["task"])
    reassembler = Reassembler()
    results = [reassembler.feed(chunk, "pi-01") for chunk in split_payload(payload, "r3:pi-01", 100)]
    assert results[:-1] == [None] * (len(results) - 1)
    assert results[-1] is not None
    assert_same(decode(results[-1], expected=Task), messages["task"])


# ---- decode rejections ------------------------------------------------------------------------------------


def test_every_truncation_is_rejected(messages: dict[str, Message]) -> None:
    payload = encode(messages["task"])
    assert len(payload) > 500
    for length in range(len(payload)):
        with pytest.raises(ProtocolError):
            decode(payload[:length])


def test_trailing_bytes_are_rejected(messages: dict[str, Message]) -> None:
    with pytest.raises(ProtocolError, match="trailing"):
        decode(encode(messages["ack"]) + b"\x00")


def test_random_bytes_are_rejected() -> None:
    rng = random.Random(20240501)
    for _ in range(2000):
        junk = rng.randbytes(rng.randrange(0, 200))
        with pytest.raises(ProtocolError):
            decode(junk)


@pytest.mark.parametrize("payload", [pack([1, 2, 3]), pack(7), pack(None), pack("task"), pack(b"\x00" * 8)])
def test_non_map_payload_is_rejected(payload: bytes) -> None:
    with pytest.raises(ProtocolError, match="must be a msgpack map"):
        decode(payload)


@pytest.mark.parametrize("payload", ["not bytes", None, 12, [b"\x80"]])
def test_non_bytes_payload_is_rejected(payload: Any) -> None:
    with pytest.raises(ProtocolError, match="bytes"):
        decode(payload)


@pytest.mark.parametrize("version", [3, 0, -1, "1", 1.0, True, None])
def test_wrong_version_is_rejected_naming_both_versions(
    version: object, messages: dict[str, Message]
) -> None:
    wire = wire_of(messages["ack"])
    wire["v"] = version
    with pytest.raises(ProtocolError, match="version") as caught:
        decode(pack(wire))
    assert repr(version) in str(caught.value)
    assert f"versions 1 and 2 (it speaks version {PROTOCOL_VERSION}): upgrade the older side" in str(caught.value)


def test_a_version_1_map_that_says_version_2_is_rejected(messages: dict[str, Message]) -> None:
    wire = wire_of(messages["update"])
    wire["v"] = 2
    with pytest.raises(ProtocolError, match="says protocol version 2 but is laid out as version 1"):
        decode(pack(wire))


def test_missing_version_is_rejected(messages: dict[str, Message]) -> None:
    wire = wire_of(messages["ack"])
    del wire["v"]
    with pytest.raises(ProtocolError, match="'v'"):
        decode(pack(wire))


@pytest.mark.parametrize("kind", ["bogus", "Task", "", None, 3, "capabilities", "recipe"])
def test_unknown_type_is_rejected(kind: object, messages: dict[str, Message]) -> None:
    wire = wire_of(messages["ack"])
    wire["type"] = kind
    with pytest.raises(ProtocolError, match="unknown message type") as caught:
        decode(pack(wire))
    assert repr(kind) in str(caught.value)


def test_a_chunk_passed_to_decode_points_at_the_reassembler() -> None:
    chunk = split_payload(b"hello", "t-1")[0]
    with pytest.raises(ProtocolError, match="Reassembler"):
        decode(chunk)


def test_expected_type_mismatch(messages: dict[str, Message]) -> None:
    payload = encode(messages["ack"])
    with pytest.raises(ProtocolError, match="expected Task message, got 'ack'"):
        decode(payload, expected=Task)
    with pytest.raises(ProtocolError, match="Task or Update"):
        decode(payload, expected=(Task, Update))
    assert isinstance(decode(payload, expected=(Task, Ack)), Ack)


def test_limits_are_enforced(messages: dict[str, Message]) -> None:
    payload = encode(messages["update"])
    with pytest.raises(ProtocolError, match="payload is"):
        decode(payload, limits=Limits(max_payload_bytes=len(payload) - 1))
    with pytest.raises(ProtocolError, match="tensors"):
        decode(payload, limits=Limits(max_tensors=4))
    with pytest.raises(ProtocolError):
        decode(payload, limits=Limits(max_str_len=10))  # the reason string is longer
    with pytest.raises(ProtocolError):
        decode(payload, limits=Limits(max_list_len=3))  # four labels
    with pytest.raises(ProtocolError, match="elements"):
        decode(payload, limits=Limits(max_tensor_elements=100))
    assert isinstance(decode(payload, limits=Limits(max_payload_bytes=len(payload))), Update)


def test_msgpack_extension_types_are_rejected(messages: dict[str, Message]) -> None:
    wire = wire_of(messages["update"])
    wire["reason"] = msgpack.ExtType(5, b"x")
    with pytest.raises(ProtocolError):
        decode(pack(wire))


def test_non_string_map_keys_are_rejected(messages: dict[str, Message]) -> None:
    wire = wire_of(messages["task"])
    wire["spec"] = {1: "one"}
    with pytest.raises(ProtocolError):
        decode(pack(wire))
    wire["spec"] = {b"raw": "bytes key"}
    with pytest.raises(ProtocolError, match="keys must be strings"):
        decode(pack(wire))


def test_deeply_nested_payload_is_rejected(messages: dict[str, Message]) -> None:
    wire = wire_of(messages["task"])
    nested: Any = 1
    for _ in range(20):
        nested = [nested]
    wire["spec"] = {"deep": nested}
    with pytest.raises(ProtocolError, match="nested deeper"):
        decode(pack(wire))
    bomb = b"\x91" * 100_000 + b"\x00"  # 100k nested one-element arrays
    with pytest.raises(ProtocolError):
        decode(bomb)


# ---- encode --------------------------------------------------------------------------------------------


def test_encode_converts_numpy_scalars_and_arrays(messages: dict[str, Message]) -> None:
    update = messages["update"]
    assert isinstance(update, Update)
    update.round = np.int64(3)
    update.labels = np.array([0, 1, 4], dtype=np.int64)  # type: ignore[assignment]
    update.metrics = {"loss": np.float32(0.5), "steps": 10}
    decoded = decode(encode(update), expected=Update)
    assert isinstance(decoded, Update)
    assert decoded.round == 3 and type(decoded.round) is int
    assert decoded.labels == [0, 1, 4]
    assert decoded.metrics == {"loss": 0.5, "steps": 10.0}
    assert all(type(value) is float for value in decoded.metrics.values())


def test_encode_refuses_what_decode_would_reject(messages: dict[str, Message]) -> None:
    task = messages["task"]
    assert isinstance(task, Task)
    task.weights["conv.weight"][0, 0, 0, 0] = np.nan
    with pytest.raises(ProtocolError, match=r"weights\['conv.weight'\]: tensor contains NaN or Inf"):
        encode(task)
    task = messages["task_recipe"]
    assert isinstance(task, Task) and task.recipe is not None
    task.recipe.lr = -0.1
    with pytest.raises(ProtocolError, match=re.escape("cannot encode task: task.recipe.lr must be > 0")):
        encode(task)
    task = messages["task"]
    assert isinstance(task, Task) and task.plan is not None
    task.plan = dataclasses.replace(task.plan, version=2)
    with pytest.raises(ProtocolError, match=re.escape("cannot encode task: task.plan.version")):
        encode(task)


def test_encode_rejects_non_messages_and_bad_weights(messages: dict[str, Message]) -> None:
    with pytest.raises(ProtocolError, match="not a top-level protocol message"):
        encode(Capabilities("pi", 1, 1, None, 0, []))  # type: ignore[arg-type]
    task = messages["task"]
    assert isinstance(task, Task)
    task.weights["x"] = [1.0, 2.0]  # type: ignore[assignment]
    with pytest.raises(ProtocolError, match="numpy array"):
        encode(task)
    task.weights = {"x": np.zeros(2, dtype=np.complex64)}
    with pytest.raises(ProtocolError, match="not allowed"):
        encode(task)
    task.weights = {"": np.zeros(2, dtype=np.float32)}
    with pytest.raises(ProtocolError, match="empty"):
        encode(task)


def test_encode_rejects_unencodable_values(messages: dict[str, Message]) -> None:
    task = messages["task"]
    assert isinstance(task, Task)
    task.spec = {"fn": object()}
    with pytest.raises(ProtocolError, match=r"spec\.fn"):
        encode(task)
    loop: dict[str, Any] = {}
    loop["self"] = loop
    task.spec = loop
    with pytest.raises(ProtocolError):
        encode(task)


# ---- fuzz ----------------------------------------------------------------------------------------------

_INTERESTING = bytes.fromhex("007f8090a0c0c1c2c4c6cbcfd3dddfff")  # msgpack markers worth planting


def _mutate(payload: bytes, rng: random.Random) -> bytes:
    data = bytearray(payload)
    for _ in range(rng.randint(1, 3)):
        op = rng.randrange(6)
        at = rng.randrange(len(data) + 1)
        if op == 0 and data:  # flip bits
            data[min(at, len(data) - 1)] ^= 1 << rng.randrange(8)
        elif op == 1 and data:  # overwrite with a msgpack marker byte
            data[min(at, len(data) - 1)] = rng.choice(_INTERESTING)
        elif op == 2:  # truncate
            del data[at:]
        elif op == 3:  # insert random bytes
            data[at:at] = rng.randbytes(rng.randint(1, 8))
        elif op == 4:  # delete a range
            del data[at : at + rng.randint(1, 16)]
        else:  # duplicate a slice
            data[at:at] = data[rng.randrange(len(data) + 1) :][: rng.randint(1, 32)]
    return bytes(data)


def test_mutation_fuzz_only_ever_raises_protocol_error(
    messages: dict[str, Message], old_task_wire: dict[str, Any]
) -> None:
    rng = random.Random(1234)
    accepted = rejected = 0
    task = messages["task"]
    assert isinstance(task, Task) and task.plan is not None and task.adaptation is not None  # plans are fuzzed
    payloads = [encode(message) for message in messages.values()] + [pack(old_task_wire)]
    for payload in payloads:
        for _ in range(700):
            mutated = _mutate(payload, rng)
            try:
                result = decode(mutated)
            except ProtocolError:
                rejected += 1
            except Exception as exc:  # noqa: BLE001  # pragma: no cover - this is the failure being tested for
                pytest.fail(f"decode leaked {type(exc).__name__}: {exc!r} for payload {mutated!r}")
            else:
                assert isinstance(result, MESSAGE_TYPES)
                accepted += 1
    assert accepted + rejected == 700 * len(payloads)
    assert rejected > 1000  # most mutations break the payload...
    assert accepted > 10  # ...but a flipped bit in tensor data or a float still decodes


def test_task_adaptation_hint_round_trips_and_is_validated() -> None:
    from protocol import Adaptation, ModelRef, Recipe, Task

    task = Task("t-1", 1, "dev-a", 10.0, ModelRef("cnn", 10, 1, {}), {"width": 0.5},
                Recipe(1, 8, 0.1, 0.0, 0.0, None, False, 0), {"w": np.zeros(2, dtype=np.float32)},
                adaptation=Adaptation("width-levels", rates=[1.0, 0.5, 0.25]))
    decoded = decode(encode(task), expected=Task)
    assert isinstance(decoded, Task)
    assert decoded.adaptation == Adaptation("width-levels", candidates=[], rates=[1.0, 0.5, 0.25])
    raw = msgpack.unpackb(encode(task, version=1))
    raw["adaptation"] = "shrink please"
    with pytest.raises(ProtocolError, match="adaptation"):
        decode(msgpack.packb(raw))
