"""Putting chunks (`protocol.chunking`) back together: each transfer into one buffer of its declared size,
hashed as its chunks arrive in order, so that a payload is copied once and read once on the receiving side."""

from __future__ import annotations

import hashlib
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from protocol.chunking import CHUNK_SIZE, ChunkFields, parse_chunk
from protocol.errors import ProtocolError


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


@dataclass(frozen=True)
class Reassembled:
    """A whole payload: a read-only view on the buffer it was put together in, its sha256 (hex, checked against
    what its chunks declared) and the protocol version of its chunks."""

    payload: memoryview
    sha256: str
    version: int


@dataclass
class _Transfer:
    count: int
    total: int
    version: int
    chunk_size: int  # data bytes of every chunk but the last
    sha256: str  # what the chunks declare ("" until the last chunk of a version 2 transfer)
    last_seen: float
    buffer: np.ndarray[Any, np.dtype[np.uint8]]
    hasher: Any = field(default_factory=hashlib.sha256)
    have: set[int] = field(default_factory=set)
    hashed: int = 0  # chunks 0..hashed-1 are in the hash
    received: int = 0
    charged: int = 0  # bytes of the buffer counted against max_buffered_bytes: up to the furthest byte written

    def span(self, seq: int) -> tuple[int, int]:
        start = seq * self.chunk_size
        return start, min(self.total, start + self.chunk_size)


def _chunk_size(part: ChunkFields) -> int:
    """The size of every chunk but the last of ``part``'s transfer, from ``part`` alone (ProtocolError when no
    split of the total in equal chunks and a last one holds it)."""
    size = len(part.data)
    if part.count == 1:
        if size != part.total:
            raise ProtocolError(f"the only chunk of a transfer of {part.total} bytes holds {size}")
        return size
    if part.last:
        rest = part.total - size
        if rest % (part.count - 1) or not 1 <= size <= rest // (part.count - 1):
            raise ProtocolError(f"a last chunk of {size} bytes is impossible in {part.count} chunks of {part.total} "
                                f"bytes")
        return rest // (part.count - 1)
    if not 1 <= part.total - (part.count - 1) * size <= size:
        raise ProtocolError(f"chunks of {size} bytes cannot make {part.total} bytes in {part.count} chunks")
    return size


class Reassembler:
    """Collects chunks per (source, transfer id) and returns each payload once all its chunks are in.

    Each transfer goes into one buffer of its declared total, taken when it opens (the memory is committed as
    chunks fill it) and hashed chunk by chunk as they arrive in order. Bounded: a transfer may total at most
    ``max_total_bytes``; at most ``max_transfers`` are open (the least recently active is dropped beyond that); a
    transfer that received nothing for ``ttl_seconds`` is dropped; if ``max_buffered_bytes`` is given, the least
    recently active transfers are dropped to keep what the open transfers' buffers may have committed (each up to
    the furthest byte written into it) under it. Duplicate
    chunks are ignored, so QoS 1 redelivery is harmless, and a payload sent again in full after completing is
    returned again (the receiver's handler dedupes). ``admit(transfer, total)``, when given, is asked before a
    transfer opens (at whichever of its chunks comes first) and may refuse it by raising ProtocolError; a
    transfer over ``max_total_bytes`` is refused too. A refused transfer raises :class:`TransferRefused` once,
    buffers nothing, and its later chunks are dropped without a word (remembered for ``ttl_seconds``, the
    latest ``max_transfers`` * 16 refusals). Thread-safe.
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
    ) -> memoryview | None:
        """Take one chunk; return the whole payload (a read-only view) when it completes, else None.

        ``source`` separates senders (e.g. the agent id or topic); ``now`` defaults to ``time.monotonic()``.
        Raises ProtocolError for a malformed chunk, one inconsistent with earlier chunks of its transfer, or
        a completed payload whose sha256 does not match (that transfer is dropped); :class:`TransferRefused` at
        the first chunk of a transfer refused (returns None for its later chunks).
        """
        whole = self.feed_transfer(chunk, source, now)
        return None if whole is None else whole.payload

    def feed_transfer(
        self, chunk: bytes | bytearray | memoryview, source: str = "", now: float | None = None
    ) -> Reassembled | None:
        """`feed`, returning the payload with its sha256 (computed once, as the chunks came) and version."""
        # A chunk of the senders' usual size is read even when the limit is lower, so that its transfer can be
        # refused with a reason (and its round) instead of dropped unread.
        part = parse_chunk(chunk, max(self.max_total_bytes, CHUNK_SIZE))
        now = time.monotonic() if now is None else now
        key = (source, part.transfer)
        with self._lock:
            self._evict_expired(now)
            transfer = self._open.get(key)
            if transfer is None:
                if key in self._refused:
                    return None
                self._admit(key, part, now)
                size = _chunk_size(part)
                try:
                    buffer = np.empty(part.total, dtype=np.uint8)
                except MemoryError:
                    self._refused[key] = now
                    raise TransferRefused(f"no memory for a transfer of {part.total} bytes", part.transfer,
                                          part.round) from None
                transfer = _Transfer(part.count, part.total, part.version, size, "", now, buffer)
                self._open[key] = transfer
            else:
                self._check_consistent(transfer, part)
            self._open.move_to_end(key)
            transfer.last_seen = now
            if part.last or part.version == 1:
                transfer.sha256 = part.sha256
            if not self._store(key, transfer, part):
                return None
            del self._open[key]
            self._buffered -= transfer.charged
        digest = transfer.hasher.hexdigest()
        if digest != transfer.sha256:
            raise ProtocolError(f"transfer {part.transfer!r} does not match its sha256; dropped it")
        return Reassembled(transfer.buffer.data.toreadonly(), digest, transfer.version)

    def _check_consistent(self, transfer: _Transfer, part: ChunkFields) -> None:
        """A later chunk must say what the earlier ones said, and be of the transfer's chunk size (lock held)."""
        declared = part.sha256 if part.version == 1 or part.last else transfer.sha256
        if (transfer.count, transfer.total, transfer.version) != (part.count, part.total, part.version) or (
                transfer.sha256 and declared != transfer.sha256):
            raise ProtocolError(
                f"chunk {part.seq} of transfer {part.transfer!r} says count={part.count}, total={part.total}, "
                f"version={part.version}, sha256={part.sha256[:12]}..., but earlier chunks said "
                f"count={transfer.count}, total={transfer.total}, version={transfer.version}, "
                f"sha256={transfer.sha256[:12]}..."
            )
        start, stop = transfer.span(part.seq)
        if len(part.data) != stop - start:
            raise ProtocolError(f"chunk {part.seq} of transfer {part.transfer!r} holds {len(part.data)} bytes, its "
                                f"place {stop - start} (chunks of {transfer.chunk_size} bytes, the last one less)")

    def _admit(self, key: tuple[str, str], part: ChunkFields, now: float) -> None:
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

    def _store(self, key: tuple[str, str], transfer: _Transfer, part: ChunkFields) -> bool:
        """Copy a chunk into its transfer's buffer and hash what is now in order (lock held); True once the
        transfer is complete."""
        start, stop = transfer.span(part.seq)
        view = transfer.buffer.data
        if part.seq in transfer.have:
            if view[start:stop] != part.data:
                raise ProtocolError(
                    f"chunk {part.seq} of transfer {part.transfer!r} arrived twice with different data"
                )
            return False
        transfer.buffer[start:stop] = np.frombuffer(part.data, dtype=np.uint8)  # (numpy copies without the GIL)
        transfer.have.add(part.seq)
        transfer.received += stop - start
        # Counted up to the furthest byte written, not the bytes received: chunks scattered over the buffer commit
        # its pages (huge pages, even) whatever they hold. Chunks in order cost what they hold.
        if stop > transfer.charged:
            self._buffered += stop - transfer.charged
            transfer.charged = stop
        while transfer.hashed in transfer.have:
            transfer.hasher.update(view[slice(*transfer.span(transfer.hashed))])
            transfer.hashed += 1
        if len(transfer.have) == transfer.count:
            return True
        self._enforce_bounds(keep=key)
        return False

    def _drop(self, key: tuple[str, str]) -> None:
        transfer = self._open.pop(key, None)
        if transfer is not None:
            self._buffered -= transfer.charged

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
