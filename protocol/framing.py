"""Layout of a version 2 payload: a msgpack header, then every tensor's raw bytes, each aligned.

The payload is one msgpack map of four entries, written in this order and no other::

    {"v": 2, "h": H (uint32), "m": the message map (H bytes), "d": the tensor section (bin32)}

so that a version 1 reader unpacks it and refuses it for its version with the sentence that says to upgrade.
The message map is version 1's, except that each tensor in ``weights`` is ``{"dtype", "shape", "offset",
"length"}``: ``length`` bytes of little-endian C-order data at ``offset`` from the first byte of the payload
aligned on ALIGNMENT that lies in the tensor section. The section is zero bytes up to that point, then the
tensors in the order of the map, each at the next multiple of ALIGNMENT after the previous one ends, zero bytes
between them, and nothing after the last. A layout without choices: one message has one encoding.

Encoding copies no tensor: `frame` returns the payload as its list of parts (`Encoded`), which the chunker or a
file takes as is. Decoding reads the tensors as read-only numpy views on the received buffer (`TensorSection`).
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from typing import Any

import msgpack
import numpy as np

from protocol._ids import reason_of, shown
from protocol.errors import ProtocolError
from protocol.limits import Limits
from protocol.tensors import allowed_dtype, check_shape, dtype_name, view_tensor

ALIGNMENT = 64
"""Tensors start at multiples of this many bytes from the start of the payload (a cache line; any dtype)."""
VERSION = 2
_PREFIX = b"\x84\xa1v\x02\xa1h\xce"  # fixmap(4), "v": 2, "h": uint32 follows
_HEAD_KEY = b"\xa1m"
_DATA_KEY = b"\xa1d\xc6"  # "d": bin32 follows
_HEAD_AT = len(_PREFIX) + 4 + len(_HEAD_KEY)
_DATA_HEADER = len(_DATA_KEY) + 4
_ZEROS = bytes(ALIGNMENT)
_U32 = struct.Struct(">I")
ENTRY_KEYS = frozenset({"dtype", "shape", "offset", "length"})

Part = bytes | memoryview


def _aligned(offset: int) -> int:
    return -(-offset // ALIGNMENT) * ALIGNMENT


class Encoded:
    """An encoded message as the buffers it is made of, in order (the header, the tensors' own memory and the
    zero bytes between them): nothing joined, nothing copied. ``len()`` is its size in bytes; `tobytes` joins
    it. The tensors are the caller's arrays: they must not change until the payload is sent."""

    __slots__ = ("nbytes", "parts", "version")

    def __init__(self, parts: tuple[Part, ...], version: int) -> None:
        self.parts = parts
        self.version = version
        self.nbytes = sum(len(part) for part in parts)

    def __len__(self) -> int:
        return self.nbytes

    def __repr__(self) -> str:
        return f"Encoded(version={self.version}, {self.nbytes} bytes in {len(self.parts)} parts)"

    def tobytes(self) -> bytes:
        """The payload as one bytes object (one copy)."""
        return b"".join(self.parts)

    def slices(self, start: int, stop: int) -> Iterator[Part]:
        """The payload's bytes ``start:stop`` as views on its parts (nothing copied)."""
        at = 0
        for part in self.parts:
            end = at + len(part)
            if end > start and at < stop:
                view = part if isinstance(part, memoryview) else memoryview(part)
                yield view[max(start - at, 0) : min(stop, end) - at]
            if end >= stop:
                return
            at = end


def _bytes_of(array: np.ndarray) -> memoryview:
    """A C-contiguous array's memory as a flat memoryview of bytes."""
    return array.reshape(-1).view(np.uint8).data


def frame(body: dict[str, Any], weights: dict[str, np.ndarray] | None) -> Encoded:
    """Lay out a version 2 payload: ``body`` (the message map, ``"v"`` and ``"type"`` first) with ``weights``
    (name to little-endian C-contiguous array, already checked) in its ``"weights"`` field."""
    entries: dict[str, dict[str, Any]] = {}
    placed: list[tuple[int, np.ndarray]] = []
    end = 0
    for name, array in (weights or {}).items():
        offset = _aligned(end)
        entries[name] = {"dtype": dtype_name(array.dtype), "shape": [int(n) for n in array.shape], "offset": offset,
                         "length": array.nbytes}
        placed.append((offset, array))
        end = offset + array.nbytes
    if weights is not None:
        body = {**body, "weights": entries}
    head: bytes = msgpack.packb(body, use_bin_type=True)
    data_at = _HEAD_AT + len(head) + _DATA_HEADER
    pad = _aligned(data_at) - data_at
    prelude = b"".join((_PREFIX, _U32.pack(len(head)), _HEAD_KEY, head, _DATA_KEY, _U32.pack(pad + end),
                        _ZEROS[:pad]))
    parts: list[Part] = [prelude]
    cursor = 0
    for offset, array in placed:
        if offset > cursor:
            parts.append(_ZEROS[: offset - cursor])
        if array.nbytes:
            parts.append(_bytes_of(array))
        cursor = offset + array.nbytes
    return Encoded(tuple(parts), VERSION)


def is_framed(buffer: memoryview) -> bool:
    """Whether a payload is laid out as version 2 (by its first bytes; `unframe` checks the rest)."""
    return buffer[: len(_PREFIX)] == _PREFIX


class TensorSection:
    """The tensor section of one version 2 payload: hands out its tensors in the order of the message's map,
    checking that each is where the layout puts it."""

    def __init__(self, buffer: memoryview, base: int) -> None:
        self._buffer = buffer
        self._base = base  # payload offset of the section's first aligned byte
        self._size = len(buffer) - base
        self._cursor = 0  # end of the last tensor read, from base

    def tensor(self, entry: object, limits: Limits) -> np.ndarray:
        """The next tensor of the message, from its placement entry: a read-only view (ProtocolError if the entry
        is malformed or the tensor is not where the layout puts it)."""
        if not isinstance(entry, dict) or set(entry) != ENTRY_KEYS:
            raise ProtocolError(f"tensor entry must be a map with exactly dtype, shape, offset, length; got "
                                f"{shown(entry) if not isinstance(entry, dict) else sorted(map(repr, entry))[:6]}")
        dtype = allowed_dtype(entry["dtype"])
        shape, count = check_shape(entry["shape"], limits)
        offset, length = entry["offset"], entry["length"]
        if isinstance(length, bool) or not isinstance(length, int) or length != count * dtype.itemsize:
            raise ProtocolError(f"tensor length {shown(length)} does not match shape {list(shape)} of {dtype.name} "
                                f"({count * dtype.itemsize} bytes)")
        expected = _aligned(self._cursor)
        if isinstance(offset, bool) or not isinstance(offset, int) or offset != expected:
            raise ProtocolError(f"tensor offset {shown(offset)} is not where the layout puts it ({expected}: the "
                                f"first multiple of {ALIGNMENT} after the previous tensor)")
        if offset + length > self._size:
            raise ProtocolError(f"tensor of {length} bytes at offset {offset} runs past the end of the payload's "
                                f"{self._size} bytes of tensor data")
        self._zeros(self._cursor, offset)
        self._cursor = offset + length
        return view_tensor(self._buffer, dtype, shape, count, self._base + offset)

    def _zeros(self, start: int, stop: int) -> None:
        if self._buffer[self._base + start : self._base + stop] != _ZEROS[: stop - start]:
            raise ProtocolError("the padding of the tensor data holds bytes other than zero")

    def finish(self) -> None:
        """Check that the tensors read cover the whole section: nothing after the last one."""
        if self._cursor != self._size:
            raise ProtocolError(f"payload has {self._size - self._cursor} bytes of tensor data that no tensor of "
                                f"the message places (trailing bytes)")


def unpack_limited(data: bytes | bytearray | memoryview, limits: Limits, *, max_bin_len: int, what: str,
                   trailing: str) -> object:
    """``data`` unpacked within ``limits`` (strings, lists, maps; no ext types; bins up to ``max_bin_len``):
    ProtocolError naming ``what`` for anything malformed, ``trailing`` for bytes after the one object."""
    try:
        return msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            max_bin_len=max_bin_len,
            max_str_len=limits.max_str_len,
            max_array_len=limits.max_list_len,
            max_map_len=max(limits.max_list_len, limits.max_tensors),
            max_ext_len=0,
        )
    except msgpack.ExtraData:
        raise ProtocolError(trailing) from None
    except Exception as exc:  # noqa: BLE001 - every unpack failure is a malformed payload
        raise ProtocolError(f"{what} is not valid msgpack, truncated or corrupted ({reason_of(exc)})") from None


def unframe(buffer: memoryview, limits: Limits) -> tuple[object, TensorSection]:
    """The message map of a version 2 payload (unpacked, not yet checked) and its tensor section."""
    if len(buffer) < _HEAD_AT or buffer[len(_PREFIX) + 4 : _HEAD_AT] != _HEAD_KEY:
        raise ProtocolError("payload is truncated or corrupted: its version 2 header is incomplete")
    head_end = _HEAD_AT + _U32.unpack_from(buffer, len(_PREFIX))[0]
    data_at = head_end + _DATA_HEADER
    if data_at > len(buffer) or buffer[head_end : head_end + len(_DATA_KEY)] != _DATA_KEY:
        raise ProtocolError("payload is truncated or corrupted: its version 2 header does not end where it says")
    size = _U32.unpack_from(buffer, head_end + len(_DATA_KEY))[0]
    if data_at + size != len(buffer):
        raise ProtocolError(f"payload says its tensor data is {size} bytes, it carries {len(buffer) - data_at}"
                            f"{' (truncated)' if data_at + size > len(buffer) else ' (trailing bytes)'}")
    head = unpack_limited(buffer[_HEAD_AT:head_end], limits, max_bin_len=0, what="the message header",
                          trailing="the message header has trailing bytes")
    base = _aligned(data_at)
    if base > len(buffer):
        raise ProtocolError("payload is truncated: its tensor data is shorter than its alignment")
    section = TensorSection(buffer, base)
    if buffer[data_at:base] != _ZEROS[: base - data_at]:
        raise ProtocolError("the padding of the tensor data holds bytes other than zero")
    return head, section
