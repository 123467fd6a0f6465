"""Encoding and validating decoding of whole messages, in either protocol version.

A message is a msgpack map ``{"v": version, "type": kind, **fields}``; nested dataclasses are maps. Version 1
carries the weights inside it as maps of tensor name to wire tensor (see `protocol.tensors`); version 2 carries
them as raw bytes after it (see `protocol.framing`), which is what makes encoding copy no tensor and decoding
read them as views. A message without tensors is written as version 1 whatever version is asked for: it reads
the same in both, and so every reader reads it.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import msgpack
import numpy as np

from protocol._ids import reason_of, shown
from protocol._plain import plain
from protocol._reader import check_text
from protocol._schema import KIND_OF, read_message
from protocol.errors import ProtocolError
from protocol.framing import Encoded, frame, is_framed, unframe, unpack_limited
from protocol.limits import DEFAULT_LIMITS, Limits
from protocol.messages import PROTOCOL_VERSION, READABLE_VERSIONS, Message
from protocol.tensors import check_array, encode_tensor, wire_array

BytesLike = bytes | bytearray | memoryview
"""What `decode` reads: any contiguous buffer of bytes."""


def _checked_weights(weights: object, kind: str, limits: Limits) -> dict[str, np.ndarray]:
    """The weights as wire arrays (little-endian, C order: the caller's own arrays where they are so already),
    each checked as the receiver will check it."""
    label = f"{kind}.weights"
    if not isinstance(weights, dict):
        raise ProtocolError(f"{label} must be a dict of numpy arrays, got {shown(weights)}")
    if len(weights) > limits.max_tensors:
        raise ProtocolError(
            f"{label} has {len(weights)} tensors, more than the limit of {limits.max_tensors}"
        )
    checked: dict[str, np.ndarray] = {}
    for name, array in weights.items():
        check_text(name, f"{label} key", limits)
        try:
            checked[name] = check_array(wire_array(array), limits)
        except ProtocolError as exc:
            raise ProtocolError(f"{label}[{name!r}]: {exc}") from None
    return checked


def encode_parts(message: Message, *, version: int = PROTOCOL_VERSION) -> Encoded:
    """Encode a message without joining it: its payload as a list of buffers (`Encoded`), the tensors' own
    memory among them, for `protocol.split_payload` or a file to take as they are.

    ``version``: the protocol version to write (1 for a reader that predates version 2; see
    :attr:`Capabilities.protocol_version`). Checks as `encode` does.
    """
    if version not in READABLE_VERSIONS:
        raise ValueError(f"cannot write protocol version {version!r} (this side writes {READABLE_VERSIONS})")
    kind = KIND_OF.get(type(message))
    if kind is None:
        raise ProtocolError(f"cannot encode {type(message).__name__}: not a top-level protocol message")
    try:
        body: dict[str, Any] = {"v": 1, "type": kind}
        later = getattr(message, "OMITTED_AT_DEFAULT", ())  # fields older readers lack stay off at their default
        for field in fields(message):
            value = getattr(message, field.name)
            if field.name != "weights" and not (field.name in later and value == field.default):
                body[field.name] = plain(value)
        weights = getattr(message, "weights", None)
        if weights is not None:
            body["weights"] = {}
        read_message(body, DEFAULT_LIMITS)  # everything but the tensors, checked as the receiver will
        arrays = None if weights is None else _checked_weights(weights, kind, DEFAULT_LIMITS)
        if arrays and version == 2:  # (a message without tensors reads the same in both: version 1)
            encoded = frame({**body, "v": 2}, arrays)
        else:
            if arrays is not None:
                body["weights"] = {name: encode_tensor(array) for name, array in arrays.items()}
            encoded = Encoded((msgpack.packb(body, use_bin_type=True),), 1)
    except ProtocolError as exc:
        raise ProtocolError(f"cannot encode {kind}: {exc}") from None
    except (TypeError, ValueError, OverflowError, RecursionError) as exc:
        raise ProtocolError(f"cannot encode {kind}: {reason_of(exc)}") from exc
    if len(encoded) > DEFAULT_LIMITS.max_payload_bytes:
        raise ProtocolError(
            f"encoded {kind} is {len(encoded)} bytes, "
            f"more than the limit of {DEFAULT_LIMITS.max_payload_bytes}"
        )
    return encoded


def encode(message: Message, *, version: int = PROTOCOL_VERSION) -> bytes:
    """Encode a message to bytes, in protocol ``version`` (default: the newest; see `encode_parts`).

    The message is checked with the same rules `decode` applies under DEFAULT_LIMITS (numpy scalars and
    arrays in plain fields are converted first), so whatever this returns the other side can decode.
    Raises ProtocolError, naming the field, when the message would be rejected.
    """
    encoded = encode_parts(message, version=version)
    only = encoded.parts[0]
    return only if len(encoded.parts) == 1 and isinstance(only, bytes) else encoded.tobytes()


def _buffer(payload: object) -> memoryview:
    """A payload as a flat memoryview of bytes."""
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"payload must be bytes, got {shown(payload)}")
    view = memoryview(payload)
    if view.ndim != 1 or view.format not in ("B", "b", "c"):
        if not view.c_contiguous:
            raise ProtocolError("payload must be a contiguous buffer of bytes")
        view = view.cast("B")
    return view


def payload_version(payload: BytesLike) -> int:
    """The protocol version an encoded message is written in (2: version 2's layout; else 1), from its first
    bytes: what an agent answers a task in, since a coordinator that writes version 2 reads it."""
    return 2 if is_framed(_buffer(payload)) else 1


#: Bytes of a payload :func:`message_type` reads at most: the envelope comes first in what every writer here writes.
_PEEK_BYTES = 64


def message_type(payload: BytesLike) -> str | None:
    """The ``type`` of a plain (version 1 layout) message or chunk from its first bytes, without decoding the rest:
    how a topic that carries both chunks and small messages (an agent's update topic: its chunks and its
    :class:`~protocol.messages.UploadRequest`) tells them apart. None when the envelope is not among its first
    entries, or it is no msgpack map (`decode` then says what is wrong)."""
    try:
        buffer = _buffer(payload)
        if is_framed(buffer):
            return None
        unpacker = msgpack.Unpacker(raw=False, max_bin_len=0, max_str_len=64, max_array_len=0, max_map_len=64,
                                    max_ext_len=0)
        unpacker.feed(buffer[:_PEEK_BYTES])
        for _ in range(min(2, unpacker.read_map_header())):
            key, value = unpacker.unpack(), unpacker.unpack()
            if key == "type":
                return value if isinstance(value, str) else None
    except Exception:  # noqa: BLE001 - anything unusual: not a message this can tell
        return None
    return None


def _unpack(buffer: memoryview, limits: Limits) -> object:
    return unpack_limited(buffer, limits, max_bin_len=limits.max_payload_bytes, what="payload",
                          trailing="payload has trailing bytes after the message")


def _type_names(expected: type | tuple[type, ...]) -> str:
    types = expected if isinstance(expected, tuple) else (expected,)
    return " or ".join(getattr(t, "__name__", repr(t)) for t in types)


def _read(payload: object, limits: Limits) -> Message:
    buffer = _buffer(payload)
    if len(buffer) > limits.max_payload_bytes:
        raise ProtocolError(
            f"payload is {len(buffer)} bytes, more than the limit of {limits.max_payload_bytes}"
        )
    if not is_framed(buffer):
        return read_message(_unpack(buffer, limits), limits)
    head, section = unframe(buffer, limits)
    message = read_message(head, limits, section)
    section.finish()
    return message


def decode(
    payload: BytesLike,
    expected: type | tuple[type, ...] | None = None,
    limits: Limits = DEFAULT_LIMITS,
) -> Message:
    """Decode and validate one message of either protocol version; raises ProtocolError (and nothing else) for
    any malformed input.

    ``expected``: the message class(es) acceptable here, e.g. ``decode(p, expected=Update)``. The weights of a
    task or update are read-only numpy arrays; those of a version 2 payload are views on ``payload``, which
    they keep alive.
    """
    try:
        message = _read(payload, limits)
    except ProtocolError:
        raise
    except Exception as exc:  # noqa: BLE001 - the boundary: nothing but ProtocolError may escape
        raise ProtocolError(f"malformed message ({reason_of(exc)})") from None
    if expected is not None and not isinstance(message, expected):
        raise ProtocolError(f"expected {_type_names(expected)} message, got {KIND_OF[type(message)]!r}")
    return message
