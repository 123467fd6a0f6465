"""Splitting large payloads into chunks of at most CHUNK_SIZE data bytes, and putting them back together.

Mosquitto 2.1 caps packets at 2,000,000 bytes by default, so tasks and updates travel as chunks. Each chunk is
a msgpack map ``{"v": 1, "type": "chunk", "transfer": id, "seq": i, "count": n, "total": payload size,
"sha256": hex digest of the whole payload, "data": bytes}``, and optionally ``"round": r``: the round of the task
it carries, so that a receiver refusing the transfer at its first chunk can answer the task (its transfer id is
the task id) without having seen the task itself.
"""

from __future__ import annotations

import hashlib
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import msgpack

from protocol._ids import reason_of, shown, validate_task_id
from protocol._reader import FieldReader
from protocol.errors import ProtocolError
from protocol.limits import Limits
from protocol.messages import PROTOCOL_VERSION

CHUNK_SIZE = 1 << 20
_HEADER_ALLOWANCE = 4096
_SHA256_RE = re.compile(r"[0-9a-f]{64}")
_CHUNK_LIMITS = Limits(max_str_len=256)


@dataclass
class _ChunkFields:
    """The fields of a chunk map after "v" and "type" (used to check the field set)."""

    transfer: str
    seq: int
    count: int
    total: int
    sha256: str
    data: bytes
    round: int | None = None


class TransferRefused(ProtocolError):
    """The receiver refused a transfer when it opened (its size is over the limit, or ``admit`` said no).

    Carries the ``transfer`` id and the ``round`` its chunks declare (None from senders that declare none), so
    the receiver can answer the refused task; the transfer's later chunks are dropped without a word.
    """

    def __init__(self, reason: str, transfer: str, round_number: int | None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.transfer = transfer
        self.round = round_number


@dataclass
class _Transfer:
    count: int
    total: int
    sha256: str
    last_seen: float
    parts: dict[int, bytes] = field(default_factory=dict)
    received: int = 0


def split_payload(
    payload: bytes | bytearray | memoryview, transfer_id: str, chunk_size: int = CHUNK_SIZE,
    *, round_number: int | None = None,
) -> list[bytes]:
    """Split a payload into encoded chunks of at most ``chunk_size`` data bytes each (plus a small header).

    ``transfer_id`` (1..128 chars of ``[A-Za-z0-9_.:-]``) must be unique per payload from one sender;
    an empty payload still yields one chunk. ``round_number``: the round of the task the payload is, declared in
    every chunk's header (see :class:`TransferRefused`).
    """
    validate_task_id(transfer_id, "transfer id")
    if round_number is not None and (isinstance(round_number, bool) or not isinstance(round_number, int)
                                     or round_number < 0):
        raise ValueError(f"round_number must be a non-negative int, got {round_number!r}")
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise TypeError(f"payload must be bytes, got {type(payload).__name__}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    data = bytes(payload)
    digest = hashlib.sha256(data).hexdigest()
    count = max(1, -(-len(data) // chunk_size))
    header = {
        "v": PROTOCOL_VERSION,
        "type": "chunk",
        "transfer": transfer_id,
        "count": count,
        "total": len(data),
        "sha256": digest,
        **({"round": round_number} if round_number is not None else {}),
    }
    return [
        msgpack.packb(
            {**header, "seq": seq, "data": data[seq * chunk_size : (seq + 1) * chunk_size]},
            use_bin_type=True,
        )
        for seq in range(count)
    ]


def _parse_chunk(chunk: object, max_chunk_bytes: int) -> _ChunkFields:
    """The fields of one chunk whose data is at most ``max_chunk_bytes`` (the message is in memory already: this
    bounds what decoding it may allocate); the transfer's total is checked when it opens."""
    if not isinstance(chunk, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"chunk must be bytes, got {shown(chunk)}")
    if len(chunk) > max_chunk_bytes + _HEADER_ALLOWANCE:
        raise ProtocolError(f"chunk is {len(chunk)} bytes, larger than any chunk may be ({max_chunk_bytes})")
    try:
        obj = msgpack.unpackb(
            chunk,
            raw=False,
            strict_map_key=True,
            max_bin_len=max_chunk_bytes,
            max_str_len=256,
            max_array_len=16,
            max_map_len=16,
            max_ext_len=0,
        )
    except Exception as exc:  # noqa: BLE001 - every unpack failure is a malformed chunk
        raise ProtocolError(f"chunk is not valid msgpack ({reason_of(exc)})") from None
    if isinstance(obj, dict) and obj.get("type") != "chunk":
        raise ProtocolError(f"payload is not a chunk (type {shown(obj.get('type'))})")
    r = FieldReader(obj, "chunk", _CHUNK_LIMITS, _ChunkFields, ("v", "type"), optional=("round",))
    version = r.raw("v")
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"chunk speaks protocol version {shown(version)}, this side speaks version {PROTOCOL_VERSION}"
        )
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
    if not isinstance(sha256, str) or not _SHA256_RE.fullmatch(sha256):
        raise ProtocolError(f"chunk sha256 must be 64 lowercase hex digits, got {shown(sha256)}")
    data = r.raw("data")
    if not isinstance(data, bytes):
        raise ProtocolError(f"chunk data must be bytes, got {shown(data)}")
    smallest = 1 if total else 0
    largest = total - (count - 1)
    if not smallest <= len(data) <= largest:
        raise ProtocolError(f"chunk of {len(data)} bytes is impossible in {count} chunks of {total} bytes")
    return _ChunkFields(transfer, seq, count, total, sha256, data, round_number)


class Reassembler:
    """Collects chunks per (source, transfer id) and returns each payload once all its chunks are in.

    Bounded: a transfer may total at most ``max_total_bytes``; at most ``max_transfers`` are open (the least
    recently active is dropped beyond that); a transfer that received nothing for ``ttl_seconds`` is dropped;
    if ``max_buffered_bytes`` is given, the least recently active transfers are dropped to keep the bytes held
    across all transfers under it. Duplicate chunks are ignored, so QoS 1 redelivery is harmless, and a
    payload sent again in full after completing is returned again (the receiver's handler dedupes).
    ``admit(transfer, total)``, when given, is asked before a transfer opens (at whichever of its chunks comes
    first) and may refuse it by raising ProtocolError; a transfer over ``max_total_bytes`` is refused too. A
    refused transfer raises :class:`TransferRefused` once, buffers nothing, and its later chunks are dropped
    without a word (remembered for ``ttl_seconds``, the latest ``max_transfers`` * 16 refusals). Thread-safe.
    """

    def __init__(
        self,
        max_total_bytes: int = 512 * 2**20,
        max_transfers: int = 64,
        ttl_seconds: float = 600.0,
        *,
        max_buffered_bytes: int | None = None,
        admit: Callable[[str, int], None] | None = None,
    ) -> None:
        if max_total_bytes < 0 or max_transfers < 1 or ttl_seconds <= 0:
            raise ValueError("max_total_bytes >= 0, max_transfers >= 1 and ttl_seconds > 0 are required")
        if max_buffered_bytes is not None and max_buffered_bytes < max_total_bytes:
            raise ValueError("max_buffered_bytes must be at least max_total_bytes")
        self.max_total_bytes = max_total_bytes
        self.max_transfers = max_transfers
        self.ttl_seconds = ttl_seconds
        self.max_buffered_bytes = max_buffered_bytes
        self.admit = admit
        self._open: OrderedDict[tuple[str, str], _Transfer] = OrderedDict()
        self._refused: OrderedDict[tuple[str, str], float] = OrderedDict()
        self._buffered = 0
        self._lock = threading.Lock()

    def pending(self) -> int:
        """Number of transfers still waiting for chunks."""
        with self._lock:
            return len(self._open)

    def feed(
        self, chunk: bytes | bytearray | memoryview, source: str = "", now: float | None = None
    ) -> bytes | None:
        """Take one chunk; return the whole payload when it completes, else None.

        ``source`` separates senders (e.g. the agent id or topic); ``now`` defaults to ``time.monotonic()``.
        Raises ProtocolError for a malformed chunk, one inconsistent with earlier chunks of its transfer, or
        a completed payload whose sha256 does not match (that transfer is dropped); :class:`TransferRefused` at
        the first chunk of a transfer refused (returns None for its later chunks).
        """
        # A chunk of the senders' usual size is read even when the limit is lower, so that its transfer can be
        # refused with a reason (and its round) instead of dropped unread.
        part = _parse_chunk(chunk, max(self.max_total_bytes, CHUNK_SIZE))
        now = time.monotonic() if now is None else now
        key = (source, part.transfer)
        with self._lock:
            self._evict_expired(now)
            transfer = self._open.get(key)
            if transfer is None:
                if key in self._refused:
                    return None
                self._admit(key, part, now)
                transfer = _Transfer(part.count, part.total, part.sha256, now)
                self._open[key] = transfer
            elif (transfer.count, transfer.total, transfer.sha256) != (part.count, part.total, part.sha256):
                raise ProtocolError(
                    f"chunk {part.seq} of transfer {part.transfer!r} says count={part.count}, "
                    f"total={part.total}, sha256={part.sha256[:12]}..., but earlier chunks said "
                    f"count={transfer.count}, total={transfer.total}, sha256={transfer.sha256[:12]}..."
                )
            self._open.move_to_end(key)
            transfer.last_seen = now
            if not self._store(key, transfer, part):
                return None
            del self._open[key]
            self._buffered -= transfer.received
        payload = b"".join(transfer.parts[seq] for seq in range(transfer.count))
        if hashlib.sha256(payload).hexdigest() != transfer.sha256:
            raise ProtocolError(f"transfer {part.transfer!r} does not match its sha256; dropped it")
        return payload

    def _admit(self, key: tuple[str, str], part: _ChunkFields, now: float) -> None:
        """Open the transfer of ``part`` or refuse it (lock held): ``admit`` first, then the size limit."""
        try:
            if self.admit is not None:
                self.admit(part.transfer, part.total)
            if part.total > self.max_total_bytes:
                raise ProtocolError(f"transfer of {part.total} bytes is over the limit of {self.max_total_bytes}")
        except ProtocolError as exc:
            self._refused[key] = now
            while len(self._refused) > 16 * self.max_transfers:
                self._refused.popitem(last=False)
            raise TransferRefused(str(exc), part.transfer, part.round) from None

    def _store(self, key: tuple[str, str], transfer: _Transfer, part: _ChunkFields) -> bool:
        """Add a chunk to its transfer (lock held); True once the transfer is complete."""
        earlier = transfer.parts.get(part.seq)
        if earlier is not None:
            if earlier != part.data:
                raise ProtocolError(
                    f"chunk {part.seq} of transfer {part.transfer!r} arrived twice with different data"
                )
            return False
        still_missing = transfer.count - len(transfer.parts) - 1
        if transfer.received + len(part.data) + still_missing > transfer.total:
            self._drop(key)
            raise ProtocolError(
                f"chunks of transfer {part.transfer!r} exceed its total of {transfer.total} bytes"
            )
        transfer.parts[part.seq] = part.data
        transfer.received += len(part.data)
        self._buffered += len(part.data)
        if len(transfer.parts) == transfer.count:
            if transfer.received != transfer.total:
                self._drop(key)
                raise ProtocolError(
                    f"chunks of transfer {part.transfer!r} do not add up to {transfer.total} bytes"
                )
            return True
        self._enforce_bounds(keep=key)
        return False

    def _drop(self, key: tuple[str, str]) -> None:
        transfer = self._open.pop(key, None)
        if transfer is not None:
            self._buffered -= transfer.received

    def _evict_expired(self, now: float) -> None:
        expired = [key for key, t in self._open.items() if now - t.last_seen > self.ttl_seconds]
        for key in expired:
            self._drop(key)
        while self._refused and now - next(iter(self._refused.values())) > self.ttl_seconds:
            self._refused.popitem(last=False)

    def _enforce_bounds(self, keep: tuple[str, str]) -> None:
        """Drop the least recently active transfers (never ``keep``) until the bounds hold."""
        for key in list(self._open):
            over_count = len(self._open) > self.max_transfers
            over_bytes = self.max_buffered_bytes is not None and self._buffered > self.max_buffered_bytes
            if not (over_count or over_bytes):
                break
            if key != keep:
                self._drop(key)
