"""Chunks: how a large payload travels in pieces of at most CHUNK_SIZE data bytes (`split_payload`,
`iter_chunks`), and how one chunk is read (`parse_chunk`; `protocol.reassembly` puts them back together).

Mosquitto 2.1 caps packets at 2,000,000 bytes by default, so tasks and updates travel as chunks. Each chunk is
a msgpack map ``{"v": version, "type": "chunk", "transfer": id, "count": n, "total": payload size, "seq": i,
"sha256": ..., "data": bytes}``, and optionally ``"round": r``: the round of the task it carries, so that a
receiver refusing the transfer at its first chunk can answer the task (its transfer id is the task id) without
having seen the task itself. Every chunk but the last holds the same number of data bytes.

- Version 1: every chunk carries the hex sha256 of the whole payload, which the sender therefore reads once
  before its first chunk.
- Version 2: only the last chunk carries it (the others an empty string), so that both sides hash the payload
  as it goes, chunk by chunk, in one pass each. A version 1 reader refuses a version 2 chunk for its version.

Senders write ``"data"`` last (as a bin32), so a reader takes it as a view on the chunk it received instead of
a copy; it reads any other order too.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import msgpack

from protocol._ids import SHA256_HEX, reason_of, shown, validate_task_id
from protocol._reader import FieldReader
from protocol.errors import ProtocolError
from protocol.framing import Encoded
from protocol.limits import Limits
from protocol.messages import PROTOCOL_VERSION, READABLE_VERSIONS

CHUNK_SIZE = 1 << 20
HEADER_ALLOWANCE = 4096
"""The most bytes a chunk may hold besides its data."""
_CHUNK_LIMITS = Limits(max_str_len=256)
_DATA_KEY = b"\xa4data\xc6"  # "data": bin32 follows
_U32 = struct.Struct(">I")
_BIN_HEADERS = {0xC4: struct.Struct(">B"), 0xC5: struct.Struct(">H"), 0xC6: struct.Struct(">I")}
_UNPACK_LIMITS: dict[str, Any] = {"raw": False, "strict_map_key": True, "max_str_len": 256, "max_array_len": 16,
                                   "max_map_len": 16, "max_ext_len": 0}

Payload = bytes | bytearray | memoryview | Encoded
"""What `split_payload` takes: an encoded message, joined or not."""


@dataclass
class _ChunkWire:
    """The fields of a chunk map after "v" and "type" (what the field set is checked against)."""

    transfer: str
    seq: int
    count: int
    total: int
    sha256: str
    data: bytes
    round: int | None = None


@dataclass
class ChunkFields:
    """One chunk, read: its fields and its protocol version."""

    transfer: str
    seq: int
    count: int
    total: int
    sha256: str
    data: bytes | memoryview
    round: int | None
    version: int

    @property
    def last(self) -> bool:
        """Whether this is the transfer's last chunk."""
        return self.seq == self.count - 1


def _parts(payload: object) -> Encoded:
    if isinstance(payload, Encoded):
        return payload
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise TypeError(f"payload must be bytes, got {type(payload).__name__}")
    view = memoryview(payload)
    return Encoded((view if view.ndim == 1 and view.itemsize == 1 else view.cast("B"),), 1)


def _chunk(header: dict[str, Any], pieces: list[bytes | memoryview], size: int) -> bytes:
    """One chunk: ``header`` (the fields but data), then data of ``size`` bytes made of ``pieces``."""
    packed: bytes = msgpack.packb(header, use_bin_type=True)
    assert len(header) < 15 and packed[0] == 0x80 | len(header)  # a fixmap, one entry short of the chunk's
    return b"".join((bytes((0x80 | (len(header) + 1),)), memoryview(packed)[1:], _DATA_KEY, _U32.pack(size),
                     *pieces))


def iter_chunks(
    payload: Payload, transfer_id: str, chunk_size: int = CHUNK_SIZE, *, round_number: int | None = None,
    version: int = PROTOCOL_VERSION,
) -> Iterator[bytes]:
    """The chunks of a payload one at a time, each made when asked for (see `split_payload`, which lists them):
    in version 2 the payload is read once, as they are made; the chunks of a joined payload or of an `Encoded`
    one are the same bytes."""
    validate_task_id(transfer_id, "transfer id")
    if round_number is not None and (isinstance(round_number, bool) or not isinstance(round_number, int)
                                     or round_number < 0):
        raise ValueError(f"round_number must be a non-negative int, got {round_number!r}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    if version not in READABLE_VERSIONS:
        raise ValueError(f"cannot write chunks of protocol version {version!r} (this side writes {READABLE_VERSIONS})")
    encoded = _parts(payload)
    return _chunks(encoded, transfer_id, chunk_size, round_number, version)


def _chunks(encoded: Encoded, transfer_id: str, chunk_size: int, round_number: int | None,
            version: int) -> Iterator[bytes]:
    total = len(encoded)
    count = max(1, -(-total // chunk_size))
    hasher = hashlib.sha256()
    if version == 1:  # the digest goes in every chunk: read it all first
        for part in encoded.parts:
            hasher.update(part)
    header: dict[str, Any] = {"v": version, "type": "chunk", "transfer": transfer_id, "count": count,
                              "total": total, **({"round": round_number} if round_number is not None else {})}
    for seq in range(count):
        start, stop = seq * chunk_size, min(total, (seq + 1) * chunk_size)
        pieces = list(encoded.slices(start, stop))
        if version == 2:
            for piece in pieces:
                hasher.update(piece)
        digest = hasher.hexdigest() if version == 1 or seq == count - 1 else ""
        yield _chunk({**header, "seq": seq, "sha256": digest}, pieces, stop - start)


def split_payload(
    payload: Payload, transfer_id: str, chunk_size: int = CHUNK_SIZE, *, round_number: int | None = None,
    version: int = PROTOCOL_VERSION,
) -> list[bytes]:
    """Split a payload into encoded chunks of at most ``chunk_size`` data bytes each (plus a small header).

    ``transfer_id`` (1..128 chars of ``[A-Za-z0-9_.:-]``) must be unique per payload from one sender;
    an empty payload still yields one chunk. ``round_number``: the round of the task the payload is, declared in
    every chunk's header (see :class:`TransferRefused`). ``version``: the chunks' protocol version (1 for a
    receiver that predates version 2). `iter_chunks` makes them one at a time instead.
    """
    return list(iter_chunks(payload, transfer_id, chunk_size, round_number=round_number, version=version))


def _data_last(view: memoryview) -> dict[str, Any] | None:
    """The chunk map with its data as a view on ``view``, when data is its last field (as senders write it);
    None for any other shape (read whole by the caller, which also names what is wrong)."""
    unpacker = msgpack.Unpacker(**_UNPACK_LIMITS, max_bin_len=0)
    unpacker.feed(view[:HEADER_ALLOWANCE])
    try:
        entries = unpacker.read_map_header()
        fields: dict[str, Any] = {}
        for index in range(entries):
            key = unpacker.unpack()
            if key == "data":
                at = unpacker.tell()
                size_of = _BIN_HEADERS.get(view[at])
                if index != entries - 1 or size_of is None:
                    return None
                start = at + 1 + size_of.size
                if start + size_of.unpack_from(view, at + 1)[0] != len(view):
                    return None
                fields["data"] = view[start:]
                return fields
            fields[key] = unpacker.unpack()
    except Exception:  # noqa: BLE001 - anything unusual: the caller reads it whole
        return None
    return None


def _unpack_chunk(chunk: object, max_chunk_bytes: int) -> object:
    if not isinstance(chunk, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"chunk must be bytes, got {shown(chunk)}")
    if len(chunk) > max_chunk_bytes + HEADER_ALLOWANCE:
        raise ProtocolError(f"chunk is {len(chunk)} bytes, larger than any chunk may be ({max_chunk_bytes})")
    view = memoryview(chunk)
    if view.ndim != 1 or view.itemsize != 1:
        view = view.cast("B")
    fast = _data_last(view) if len(view) > 1 else None
    if fast is not None:
        return fast
    try:
        return msgpack.unpackb(view, **_UNPACK_LIMITS, max_bin_len=max_chunk_bytes)
    except Exception as exc:  # noqa: BLE001 - every unpack failure is a malformed chunk
        raise ProtocolError(f"chunk is not valid msgpack ({reason_of(exc)})") from None


def parse_chunk(chunk: object, max_chunk_bytes: int) -> ChunkFields:
    """The fields of one chunk of either version whose data is at most ``max_chunk_bytes`` (the message is in
    memory already: this bounds what decoding it may allocate); its data is a view on ``chunk`` where the
    sender wrote it last. The transfer's total is checked when it opens (`protocol.Reassembler`)."""
    obj = _unpack_chunk(chunk, max_chunk_bytes)
    if isinstance(obj, dict) and obj.get("type") != "chunk":
        raise ProtocolError(f"payload is not a chunk (type {shown(obj.get('type'))})")
    r = FieldReader(obj, "chunk", _CHUNK_LIMITS, _ChunkWire, ("v", "type"), optional=("round",))
    version = r.raw("v")
    if type(version) is not int or version not in READABLE_VERSIONS:
        raise ProtocolError(f"chunk speaks protocol version {shown(version)}, this side reads versions "
                            f"{' and '.join(map(str, READABLE_VERSIONS))}: upgrade the older side")
    transfer = r.task_id("transfer")
    total = r.integer("total", minimum=0)
    round_number = r.opt_integer("round", minimum=0)
    count = r.integer("count", minimum=1)
    if count > max(total, 1):
        raise ProtocolError(f"transfer of {total} bytes cannot have {count} chunks")
    seq = r.integer("seq", minimum=0)
    if seq >= count:
        raise ProtocolError(f"chunk seq {seq} is out of range for {count} chunks")
    sha256 = r.raw("sha256")
    carries = version == 1 or seq == count - 1
    if not isinstance(sha256, str) or not (SHA256_HEX.fullmatch(sha256) if carries else sha256 == ""):
        raise ProtocolError(f"chunk sha256 must be {'64 lowercase hex digits' if carries else 'empty'} in "
                            f"{'this' if version == 2 else 'every'} chunk of version {version}, got {shown(sha256)}")
    data = r.raw("data")
    if not isinstance(data, (bytes, memoryview)):
        raise ProtocolError(f"chunk data must be bytes, got {shown(data)}")
    smallest = 1 if total else 0
    largest = total - (count - 1)
    if not smallest <= len(data) <= largest:
        raise ProtocolError(f"chunk of {len(data)} bytes is impossible in {count} chunks of {total} bytes")
    return ChunkFields(transfer, seq, count, total, sha256, data, round_number, version)
