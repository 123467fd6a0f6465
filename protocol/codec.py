"""msgpack encoding and validating decoding of whole messages.

A message is a msgpack map ``{"v": PROTOCOL_VERSION, "type": kind, **fields}``; nested dataclasses are maps
and weights are maps of tensor name to wire tensor (see `protocol.tensors`).
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import msgpack

from protocol._ids import reason_of, shown
from protocol._plain import plain
from protocol._reader import check_text
from protocol._schema import KIND_OF, read_message
from protocol.errors import ProtocolError
from protocol.limits import DEFAULT_LIMITS, Limits
from protocol.messages import PROTOCOL_VERSION, Message
from protocol.tensors import check_array, encode_tensor


def _encode_weights(weights: object, kind: str, limits: Limits) -> dict[str, dict[str, Any]]:
    label = f"{kind}.weights"
    if not isinstance(weights, dict):
        raise ProtocolError(f"{label} must be a dict of numpy arrays, got {shown(weights)}")
    if len(weights) > limits.max_tensors:
        raise ProtocolError(
            f"{label} has {len(weights)} tensors, more than the limit of {limits.max_tensors}"
        )
    encoded: dict[str, dict[str, Any]] = {}
    for name, array in weights.items():
        check_text(name, f"{label} key", limits)
        try:
            encoded[name] = encode_tensor(check_array(array, limits))
        except ProtocolError as exc:
            raise ProtocolError(f"{label}[{name!r}]: {exc}") from None
    return encoded


def encode(message: Message) -> bytes:
    """Encode a message to msgpack bytes.

    The message is checked with the same rules `decode` applies under DEFAULT_LIMITS (numpy scalars and
    arrays in plain fields are converted first), so whatever this returns the other side can decode.
    Raises ProtocolError, naming the field, when the message would be rejected.
    """
    kind = KIND_OF.get(type(message))
    if kind is None:
        raise ProtocolError(f"cannot encode {type(message).__name__}: not a top-level protocol message")
    try:
        body: dict[str, Any] = {"v": PROTOCOL_VERSION, "type": kind}
        later = getattr(message, "OMITTED_AT_DEFAULT", ())  # fields older readers lack stay off at their default
        for field in fields(message):
            value = getattr(message, field.name)
            if field.name != "weights" and not (field.name in later and value == field.default):
                body[field.name] = plain(value)
        weights = getattr(message, "weights", None)
        if weights is not None:
            body["weights"] = {}
        read_message(body, DEFAULT_LIMITS)  # everything but the tensors, checked as the receiver will
        if weights is not None:
            body["weights"] = _encode_weights(weights, kind, DEFAULT_LIMITS)
        payload: bytes = msgpack.packb(body, use_bin_type=True)
    except ProtocolError as exc:
        raise ProtocolError(f"cannot encode {kind}: {exc}") from None
    except (TypeError, ValueError, OverflowError, RecursionError) as exc:
        raise ProtocolError(f"cannot encode {kind}: {reason_of(exc)}") from exc
    if len(payload) > DEFAULT_LIMITS.max_payload_bytes:
        raise ProtocolError(
            f"encoded {kind} is {len(payload)} bytes, "
            f"more than the limit of {DEFAULT_LIMITS.max_payload_bytes}"
        )
    return payload


def _unpack(payload: object, limits: Limits) -> object:
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"payload must be bytes, got {shown(payload)}")
    if len(payload) > limits.max_payload_bytes:
        raise ProtocolError(
            f"payload is {len(payload)} bytes, more than the limit of {limits.max_payload_bytes}"
        )
    try:
        return msgpack.unpackb(
            payload,
            raw=False,
            strict_map_key=True,
            max_bin_len=limits.max_payload_bytes,
            max_str_len=limits.max_str_len,
            max_array_len=limits.max_list_len,
            max_map_len=max(limits.max_list_len, limits.max_tensors),
            max_ext_len=0,
        )
    except msgpack.ExtraData:
        raise ProtocolError("payload has trailing bytes after the message") from None
    except Exception as exc:  # noqa: BLE001 - every unpack failure is a malformed payload
        raise ProtocolError(
            f"payload is not valid msgpack, truncated or corrupted ({reason_of(exc)})"
        ) from None


def _type_names(expected: type | tuple[type, ...]) -> str:
    types = expected if isinstance(expected, tuple) else (expected,)
    return " or ".join(getattr(t, "__name__", repr(t)) for t in types)


def decode(
    payload: bytes | bytearray | memoryview,
    expected: type | tuple[type, ...] | None = None,
    limits: Limits = DEFAULT_LIMITS,
) -> Message:
    """Decode and validate one message; raises ProtocolError (and nothing else) for any malformed input.

    ``expected``: the message class(es) acceptable here, e.g. ``decode(p, expected=Update)``.
    """
    try:
        message = read_message(_unpack(payload, limits), limits)
    except ProtocolError:
        raise
    except Exception as exc:  # noqa: BLE001 - the boundary: nothing but ProtocolError may escape
        raise ProtocolError(f"malformed message ({reason_of(exc)})") from None
    if expected is not None and not isinstance(message, expected):
        raise ProtocolError(f"expected {_type_names(expected)} message, got {KIND_OF[type(message)]!r}")
    return message
