"""Version 2 payloads: the layout, zero-copy encoding and decoding, every rejection, and mixed versions."""

from __future__ import annotations

import gc
import random
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np
import pytest

from protocol import (
    AgentStatus,
    Capabilities,
    Encoded,
    Limits,
    Message,
    ProtocolError,
    Task,
    Update,
    decode,
    encode,
    encode_parts,
    payload_version,
)
from protocol.framing import ALIGNMENT

from .conftest import framed, head_of, wire_of


def _update(weights: dict[str, np.ndarray]) -> Update:
    return Update("t-1", 2, "pi-01", "ok", None, 10, [0, 1], weights, {"loss": 0.5})


def _offsets(payload: bytes) -> tuple[int, dict[str, dict[str, Any]]]:
    """The payload offset of the tensor section's aligned start, and the tensor entries."""
    head, data = head_of(payload)
    section_at = len(payload) - len(data)
    return section_at + (-section_at % ALIGNMENT), head["weights"]


def test_layout_places_every_tensor_aligned_in_order_after_the_header(messages: dict[str, Message]) -> None:
    task = messages["task"]
    assert isinstance(task, Task)
    payload = encode(task)
    base, entries = _offsets(payload)
    assert base % ALIGNMENT == 0
    assert list(entries) == list(task.weights)  # the map's order is the data's order
    end = 0
    for name, entry in entries.items():
        array = task.weights[name]
        assert set(entry) == {"dtype", "shape", "offset", "length"}
        assert entry["offset"] == -(-end // ALIGNMENT) * ALIGNMENT  # the next multiple after the previous one
        assert (entry["dtype"], entry["shape"], entry["length"]) == (array.dtype.name, list(array.shape), array.nbytes)
        at = base + entry["offset"]
        assert payload[at : at + entry["length"]] == np.ascontiguousarray(array).astype(
            array.dtype.newbyteorder("<")).tobytes()
        assert payload[base + end : at] == bytes(at - base - end)  # zeros between
        end = entry["offset"] + entry["length"]
    assert len(payload) == base + end  # nothing after the last tensor


def test_one_message_has_one_encoding(messages: dict[str, Message]) -> None:
    for name in ("task", "task_recipe", "update"):
        payload = encode(messages[name])
        assert encode(messages[name]) == payload
        assert encode(decode(payload)) == payload  # what is decoded encodes back to the same bytes
        assert encode_parts(messages[name]).tobytes() == payload


def test_encoding_copies_no_tensor_that_is_already_on_wire_terms() -> None:
    rng = np.random.default_rng(1)
    ready = rng.standard_normal((64, 32), dtype=np.float32)
    transposed = rng.standard_normal((16, 8)).T  # not C order: laid out anew
    big_endian = np.arange(10, dtype=">i4")  # not little-endian: converted
    encoded = encode_parts(_update({"ready": ready, "transposed": transposed, "big": big_endian}))
    assert isinstance(encoded, Encoded) and len(encoded) == len(encoded.tobytes())
    views = [np.frombuffer(part, dtype=np.uint8) for part in encoded.parts]
    assert any(np.shares_memory(view, ready) for view in views)
    assert not any(np.shares_memory(view, transposed) or np.shares_memory(view, big_endian) for view in views)
    decoded = decode(encoded.tobytes(), expected=Update)
    assert isinstance(decoded, Update)
    for name, array in (("ready", ready), ("transposed", transposed), ("big", big_endian)):
        np.testing.assert_array_equal(decoded.weights[name], array)
        assert decoded.weights[name].dtype.isnative and decoded.weights[name].shape == array.shape


@pytest.mark.parametrize("kind", [bytes, bytearray, memoryview])
def test_decoded_tensors_are_read_only_views_on_the_payload(kind: Callable[[bytes], Any]) -> None:
    weights = {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.array([True, False])}
    payload = kind(encode(_update(weights)))
    decoded = decode(payload, expected=Update)
    assert isinstance(decoded, Update)
    whole = np.frombuffer(payload, dtype=np.uint8)
    for name, array in decoded.weights.items():
        assert np.shares_memory(array, whole), name
        assert not array.flags.writeable, name  # even on a writable buffer
        assert array.ctypes.data % array.dtype.itemsize == 0
        with pytest.raises(ValueError, match="read-only"):
            array[...] = 0
    del payload, whole
    gc.collect()
    np.testing.assert_array_equal(decoded.weights["w"], weights["w"])  # the views keep the buffer alive


def test_payload_version_tells_the_layout(messages: dict[str, Message]) -> None:
    assert payload_version(encode(messages["update"])) == 2
    assert payload_version(encode(messages["update"], version=1)) == 1
    assert payload_version(encode(messages["ack"])) == 1  # no tensors: always version 1
    assert payload_version(memoryview(encode(messages["task"]))) == 2


def test_a_version_1_reader_refuses_a_version_2_payload_for_its_version(messages: dict[str, Message]) -> None:
    """A version 1 reader unpacks the whole payload as one msgpack map and checks its "v" first: it says which
    version it got and to upgrade, instead of failing on the layout."""
    outer = msgpack.unpackb(encode(messages["update"]), raw=False)
    assert isinstance(outer, dict) and outer["v"] == 2 and next(iter(outer)) == "v"


@pytest.mark.parametrize("version", [1, 2])
def test_mixed_versions_decode_alike(
    version: int, messages: dict[str, Message], assert_same: Callable[[object, Message], None]
) -> None:
    """A task written for an agent that reads only version 1, and an update from one: the new side reads both."""
    for name in ("task", "update"):
        payload = encode(messages[name], version=version)
        assert payload_version(payload) == version
        assert_same(decode(payload), messages[name])
    with pytest.raises(ValueError, match="cannot write protocol version 3"):
        encode(messages["ack"], version=3)


def test_capabilities_say_which_version_an_agent_reads(messages: dict[str, Message]) -> None:
    status = messages["status"]
    assert isinstance(status, AgentStatus) and status.capabilities is not None
    assert status.capabilities.protocol_version == 1
    assert "protocol_version" not in wire_of(status)["capabilities"]  # an older coordinator still reads it
    status.capabilities.protocol_version = 2
    wire = wire_of(status)
    assert wire["capabilities"]["protocol_version"] == 2
    assert decode(encode(status)) == status
    for bad in (0, "2", True, 1.5):
        wire["capabilities"]["protocol_version"] = bad
        with pytest.raises(ProtocolError, match="capabilities.protocol_version"):
            decode(msgpack.packb(wire))
    assert Capabilities("pi", 1, 1, None, 0, []).protocol_version == 1


# ---- rejections -------------------------------------------------------------------------------------------


def _parts(weights: dict[str, np.ndarray] | None = None) -> tuple[dict[str, Any], bytes]:
    """The header and tensor data (without the leading padding) of an update."""
    payload = encode(_update(weights if weights is not None else {
        "a": np.arange(5, dtype=np.float32), "b": np.ones((2, 3), dtype=np.int16)}))
    head, data = head_of(payload)
    base, _ = _offsets(payload)
    return head, data[len(data) - (len(payload) - base):]


def test_hand_made_payloads_decode() -> None:
    head, data = _parts()
    decoded = decode(framed(head, data), expected=Update)
    assert isinstance(decoded, Update)
    np.testing.assert_array_equal(decoded.weights["a"], np.arange(5, dtype=np.float32))


def _rejection(head: dict[str, Any], data: bytes, pad: int | None = None, limits: Limits | None = None) -> str:
    with pytest.raises(ProtocolError) as caught:
        decode(framed(head, data, pad), limits=limits or Limits())
    return str(caught.value)


def _entry(head: dict[str, Any], name: str, **changes: Any) -> dict[str, Any]:
    head["weights"][name] = {**head["weights"][name], **changes}
    return head


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (lambda h, d: (_entry(h, "b", offset=20), d), "tensor offset int 20 is not where the layout puts it (64"),
        (lambda h, d: (_entry(h, "b", offset=0), d), "is not where the layout puts it"),  # overlaps a
        (lambda h, d: (_entry(h, "b", offset=128), d + bytes(64)), "is not where the layout puts it"),  # a gap
        (lambda h, d: (_entry(h, "a", offset=True), d), "offset bool True"),
        (lambda h, d: (_entry(h, "a", length=24), d), "tensor length int 24 does not match shape [5]"),
        (lambda h, d: (_entry(h, "a", length="20"), d), "tensor length"),
        (lambda h, d: (_entry(h, "b", shape=[2, 4]), d), "does not match shape [2, 4]"),
        (lambda h, d: (_entry(h, "b", shape=[2, 4], length=16), d), "runs past the end"),
        (lambda h, d: (_entry(h, "a", dtype="complex64"), d), "not allowed"),
        (lambda h, d: (_entry(h, "a", dtype="<f4"), d), "not allowed"),
        (lambda h, d: (_entry(h, "a", shape=[1] * 9, length=4), d), "dimensions"),
        (lambda h, d: (_entry(h, "a", shape=[2**40], length=2**42), d), "elements"),
        (lambda h, d: (_entry(h, "a", data=b""), d), "exactly dtype, shape, offset, length"),
        (lambda h, d: ({**h, "weights": {**h["weights"], "a": [1, 2]}}, d), "exactly dtype, shape, offset, length"),
        (lambda h, d: ({**h, "weights": {k: v for k, v in h["weights"].items() if k != "b"}}, d), "trailing bytes"),
        (lambda h, d: (h, d + b"\x00"), "trailing bytes"),
        (lambda h, d: (h, d[:-1]), "runs past the end"),
        (lambda h, d: (h, d[:20] + b"\x01" + d[21:]), "padding of the tensor data holds bytes other than zero"),
        (lambda h, d: ({**h, "weights": []}, d), "update.weights must be a map of tensors"),
        (lambda h, d: ({**h, "v": 1}, d), "says protocol version 1 but is laid out as version 2"),
        (lambda h, d: ({**h, "reason": b"bytes"}, d), "not valid msgpack"),  # no bin in the header
        (lambda h, d: ({**h, "type": "ack"}, d), "unknown field"),
    ],
)
def test_malformed_tensor_placement_is_rejected(
    change: Callable[[dict[str, Any], bytes], tuple[dict[str, Any], bytes]], reason: str
) -> None:
    head, data = change(*_parts())
    assert reason in _rejection(head, data)


def test_tensor_values_are_checked_in_place() -> None:
    for array, reason in ((np.array([1.0, np.nan], dtype=np.float32), "NaN or Inf"),
                          (np.array([np.inf], dtype=np.float16), "NaN or Inf"),
                          (np.array([1.0, -np.inf]), "NaN or Inf")):
        head, _ = _parts({"x": np.zeros(array.shape, array.dtype)})
        assert reason in _rejection(head, array.tobytes()), array
    head, _ = _parts({"m": np.array([True, False, True])})
    assert "bool tensor data holds bytes other than 0 and 1" in _rejection(head, b"\x01\x02\x00")
    assert "update.weights['m']" in _rejection(head, b"\x01\x02\x00")


def test_leading_padding_must_be_zeros_of_the_right_length() -> None:
    head, data = _parts()
    assert "trailing bytes" in _rejection(head, data, pad=(-(20 + len(msgpack.packb(head))) % 64) + 64)
    pad = -(20 + len(msgpack.packb(head))) % 64
    if pad:
        assert "runs past the end" in _rejection(head, data, pad=pad - 1)  # every tensor one byte early
        payload = bytearray(framed(head, data))
        payload[len(payload) - len(data) - 1] = 7
        with pytest.raises(ProtocolError, match="padding"):
            decode(bytes(payload))


def test_limits_hold_in_version_2(messages: dict[str, Message]) -> None:
    payload = encode(messages["update"])
    assert payload_version(payload) == 2
    with pytest.raises(ProtocolError, match="payload is"):
        decode(payload, limits=Limits(max_payload_bytes=len(payload) - 1))
    with pytest.raises(ProtocolError, match="tensors, more than the limit of 4"):
        decode(payload, limits=Limits(max_tensors=4))
    with pytest.raises(ProtocolError, match="elements"):
        decode(payload, limits=Limits(max_tensor_elements=10))
    with pytest.raises(ProtocolError, match="dimensions"):
        decode(payload, limits=Limits(max_dims=3))
    assert isinstance(decode(payload, limits=Limits(max_payload_bytes=len(payload))), Update)


def test_every_truncation_and_extension_is_rejected(messages: dict[str, Message]) -> None:
    payload = encode(messages["update"])
    for length in range(len(payload)):
        with pytest.raises(ProtocolError):
            decode(payload[:length])
    for extra in (b"\x00", b"\xc0" * 3, bytes(64)):
        with pytest.raises(ProtocolError):
            decode(payload + extra)


def test_header_fields_of_the_layout_are_checked(messages: dict[str, Message]) -> None:
    payload = bytearray(encode(messages["update"]))
    head_length = int.from_bytes(payload[7:11], "big")
    for wrong in (head_length - 1, head_length + 1, 0, 2**32 - 1):
        bad = bytearray(payload)
        bad[7:11] = wrong.to_bytes(4, "big")
        with pytest.raises(ProtocolError):
            decode(bytes(bad))
    data_length_at = 13 + head_length + 3
    bad = bytearray(payload)
    bad[data_length_at : data_length_at + 4] = (len(payload) - data_length_at).to_bytes(4, "big")
    with pytest.raises(ProtocolError, match="tensor data is"):
        decode(bytes(bad))


def test_structured_mutations_only_ever_raise_protocol_error(messages: dict[str, Message]) -> None:
    rng = random.Random(21)
    payload = encode(messages["task"])
    accepted = 0
    for _ in range(1500):
        data = bytearray(payload)
        for _ in range(rng.randint(1, 4)):
            at = rng.randrange(len(data))
            data[at] = rng.choice((0, 1, 0x40, 0x7F, 0x80, 0xC6, 0xCE, 0xFF, data[at] ^ 1))
        try:
            decoded = decode(bytes(data))
        except ProtocolError:
            continue
        accepted += 1
        assert isinstance(decoded, Task)
    assert accepted > 10  # a changed tensor byte still decodes
