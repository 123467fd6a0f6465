"""split_payload, iter_chunks and Reassembler: both chunk versions, order, duplicates, integrity, consistency,
eviction and bounds."""

from __future__ import annotations

import hashlib
import random
import threading
from typing import Any

import msgpack
import numpy as np
import pytest

from protocol import (
    CHUNK_SIZE,
    Encoded,
    ProtocolError,
    Reassembler,
    TransferRefused,
    Update,
    encode,
    encode_parts,
    iter_chunks,
    split_payload,
)


def unpack(chunk: bytes) -> dict[str, Any]:
    obj: dict[str, Any] = msgpack.unpackb(chunk, raw=False)
    return obj


def pack(obj: object) -> bytes:
    packed: bytes = msgpack.packb(obj, use_bin_type=True)
    return packed


def chunk_map(**changes: Any) -> dict[str, Any]:
    """A valid version 1 2-chunk header (payload b"abcdef" in chunks of 3), seq 0, with changes applied."""
    base = unpack(split_payload(b"abcdef", "t-1", 3, version=1)[0])
    base.update(changes)
    return base


V1_FIELDS = {"v", "type", "transfer", "seq", "count", "total", "sha256", "data"}


@pytest.mark.parametrize("version", [1, 2])
def test_split_headers_and_sizes(version: int) -> None:
    payload = bytes(range(256)) * 10  # 2560 bytes
    chunks = split_payload(payload, "r1:pi-01", 1000, version=version)
    maps = [unpack(chunk) for chunk in chunks]
    digest = hashlib.sha256(payload).hexdigest()
    assert [m["seq"] for m in maps] == [0, 1, 2]
    assert [len(m["data"]) for m in maps] == [1000, 1000, 560]
    for m, chunk in zip(maps, chunks, strict=True):
        # Version 2 keeps version 1's field set: a version 1 reader gets as far as the version and refuses it.
        assert set(m) == V1_FIELDS
        assert (m["v"], m["type"], m["transfer"], m["count"], m["total"]) == (version, "chunk", "r1:pi-01", 3, 2560)
        assert m["sha256"] == (digest if version == 1 or m["seq"] == 2 else "")
        assert list(m)[-1] == "data" and chunk.endswith(m["data"])  # data last: read in place
    assert b"".join(m["data"] for m in maps) == payload


def test_chunks_of_an_encoded_payload_are_those_of_its_bytes() -> None:
    rng = np.random.default_rng(5)
    weights = {f"w{i}": rng.standard_normal(300 + i, dtype=np.float32) for i in range(7)}
    update = Update("t-9", 1, "pi-01", "ok", None, 3, [0], weights, {})
    parts = encode_parts(update)
    assert isinstance(parts, Encoded) and len(parts.parts) > 7
    for size in (1, 64, 1000, 4096, len(parts), len(parts) + 1):
        assert split_payload(parts, "t-9", size) == split_payload(encode(update), "t-9", size)
    assert list(iter_chunks(parts, "t-9", 500, round_number=4)) == split_payload(parts, "t-9", 500, round_number=4)
    reassembler = Reassembler()
    results = [reassembler.feed(chunk) for chunk in iter_chunks(parts, "t-9", 700)]
    assert results[-1] == encode(update)


def test_split_edge_sizes() -> None:
    empty = split_payload(b"", "t")
    assert len(empty) == 1
    header = unpack(empty[0])
    assert (header["count"], header["total"], header["data"]) == (1, 0, b"")
    assert header["sha256"] == hashlib.sha256(b"").hexdigest()
    assert len(split_payload(b"x" * 3000, "t", 1000)) == 3
    assert len(split_payload(b"x" * 3001, "t", 1000)) == 4
    assert len(split_payload(bytearray(b"xyz"), "t", 1)) == 3


def test_default_chunks_fit_under_the_mosquitto_packet_cap() -> None:
    payload = random.Random(3).randbytes(2 * CHUNK_SIZE + 12345)
    chunks = split_payload(payload, "big")
    assert CHUNK_SIZE == 1 << 20
    assert len(chunks) == 3
    assert all(len(chunk) <= CHUNK_SIZE + 300 for chunk in chunks)
    assert all(len(chunk) < 2_000_000 for chunk in chunks)


def test_split_rejects_bad_arguments() -> None:
    with pytest.raises(ProtocolError, match="transfer id"):
        split_payload(b"x", "a/b")
    with pytest.raises(ProtocolError, match="transfer id"):
        split_payload(b"x", "")
    with pytest.raises(ValueError, match="chunk_size"):
        split_payload(b"x", "t", 0)
    with pytest.raises(TypeError, match="bytes"):
        split_payload("text", "t")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="version"):
        split_payload(b"x", "t", version=3)


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("seed", range(5))
def test_reassemble_random_order_with_duplicates(seed: int, version: int) -> None:
    rng = random.Random(seed)
    payload = rng.randbytes(rng.randrange(1, 5000))
    chunks = split_payload(payload, f"t-{seed}", rng.randrange(1, 700), version=version)
    stream = chunks + rng.sample(chunks, k=min(len(chunks), 5))  # duplicates before completion
    rng.shuffle(stream)
    reassembler = Reassembler()
    results = []
    completed_at = None
    for index, chunk in enumerate(stream):
        result = reassembler.feed(chunk, source="pi-01", now=float(index))
        if result is not None:
            results.append(result)
            completed_at = index
    assert results[:1] == [payload]
    # duplicates arriving after completion open a new transfer that never completes: harmless, evicted later
    assert len(results) == 1 or results == [payload, payload]
    assert completed_at is not None
    assert reassembler.pending() in (0, 1)


def test_duplicate_chunks_do_not_complete_early_and_resend_completes_again() -> None:
    chunks = split_payload(b"0123456789", "t", 4)
    reassembler = Reassembler()
    assert reassembler.feed(chunks[0]) is None
    assert reassembler.feed(chunks[0]) is None
    assert reassembler.feed(chunks[1]) is None
    assert reassembler.pending() == 1
    assert reassembler.feed(chunks[2]) == b"0123456789"
    assert reassembler.pending() == 0
    # a sender retrying the whole upload (e.g. the ack got lost) gets its payload through again
    assert [reassembler.feed(c) for c in chunks] == [None, None, b"0123456789"]


def test_sources_and_transfers_are_kept_apart() -> None:
    a = split_payload(b"from agent a", "same-id", 5)
    b = split_payload(b"from agent b!", "same-id", 5)
    reassembler = Reassembler()
    out: dict[str, bytes | None] = {}
    for chunk_a, chunk_b in zip(a, b, strict=True):
        out["a"] = reassembler.feed(chunk_a, source="a")
        out["b"] = reassembler.feed(chunk_b, source="b")
    assert out == {"a": b"from agent a", "b": b"from agent b!"}
    assert reassembler.pending() == 0


def test_sha_mismatch_raises_and_drops_the_transfer() -> None:
    wrong = hashlib.sha256(b"something else").hexdigest()
    chunks = [pack({**unpack(c), "sha256": wrong}) for c in split_payload(b"payload!", "t", 3, version=1)]
    reassembler = Reassembler()
    assert reassembler.feed(chunks[0]) is None
    assert reassembler.feed(chunks[1]) is None
    with pytest.raises(ProtocolError, match="sha256"):
        reassembler.feed(chunks[2])
    assert reassembler.pending() == 0


@pytest.mark.parametrize("last_first", [False, True])
def test_version_2_checks_the_digest_of_its_last_chunk_in_any_order(last_first: bool) -> None:
    chunks = split_payload(b"payload!", "t", 3)
    wrong = [*chunks[:2], pack({**unpack(chunks[2]), "sha256": hashlib.sha256(b"other").hexdigest()})]
    corrupt = [pack({**unpack(chunks[0]), "data": b"PAY"}), *chunks[1:]]  # a byte changed, the digest kept
    for stream in (wrong, corrupt):
        reassembler = Reassembler()
        order = [stream[2], stream[0], stream[1]] if last_first else stream
        assert [reassembler.feed(chunk) for chunk in order[:2]] == [None, None]
        with pytest.raises(ProtocolError, match="does not match its sha256"):
            reassembler.feed(order[2])
        assert reassembler.pending() == 0
    reassembler = Reassembler()
    order = [chunks[2], chunks[1], chunks[0]] if last_first else chunks
    assert [reassembler.feed(chunk) for chunk in order] == [None, None, b"payload!"]


def test_version_2_chunks_carry_the_digest_in_the_last_one_only() -> None:
    chunks = split_payload(b"abcdef", "t", 3)
    with pytest.raises(ProtocolError, match="sha256 must be empty"):
        Reassembler().feed(pack({**unpack(chunks[0]), "sha256": hashlib.sha256(b"abcdef").hexdigest()}))
    with pytest.raises(ProtocolError, match="sha256 must be 64 lowercase hex digits"):
        Reassembler().feed(pack({**unpack(chunks[1]), "sha256": ""}))
    reassembler = Reassembler()
    assert reassembler.feed(chunks[0]) is None
    with pytest.raises(ProtocolError, match="version=1"):  # one transfer, one version
        reassembler.feed(split_payload(b"abcdef", "t", 3, version=1)[1])
    assert reassembler.feed(chunks[1]) == b"abcdef"


def test_reassembled_carries_the_digest_and_version() -> None:
    payload = random.Random(4).randbytes(5000)
    for version in (1, 2):
        reassembler = Reassembler()
        whole = None
        for chunk in split_payload(payload, "t", 512, version=version):
            whole = reassembler.feed_transfer(chunk, "pi")
        assert whole is not None
        assert (whole.payload, whole.sha256, whole.version) == (payload, hashlib.sha256(payload).hexdigest(), version)
        assert whole.payload.readonly


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"count": 3, "data": b"abc", "total": 9}, "earlier chunks said count=2"),
        ({"total": 7, "data": b"defg"}, "total=6"),
        ({"sha256": "0" * 64}, "sha256="),
    ],
)
def test_inconsistent_headers_are_rejected(change: dict[str, Any], reason: str) -> None:
    chunks = split_payload(b"abcdef", "t-1", 3, version=1)
    reassembler = Reassembler()
    assert reassembler.feed(chunks[0]) is None
    with pytest.raises(ProtocolError, match=reason):
        reassembler.feed(pack({**unpack(chunks[1]), **change}))
    assert reassembler.pending() == 1  # the earlier transfer is kept and still completes
    assert reassembler.feed(chunks[1]) == b"abcdef"


def test_chunks_of_other_sizes_than_the_first_are_rejected() -> None:
    chunks = split_payload(b"abcdefgh", "t-1", 3)  # 3 + 3 + 2
    reassembler = Reassembler()
    assert reassembler.feed(chunks[0]) is None
    with pytest.raises(ProtocolError, match="holds 2 bytes, its place 3"):
        reassembler.feed(pack({**unpack(chunks[1]), "data": b"de"}))
    with pytest.raises(ProtocolError, match="a last chunk of 3 bytes is impossible"):
        Reassembler().feed(pack({**unpack(chunks[2]), "data": b"ghi"}))
    assert reassembler.feed(chunks[2]) is None
    assert reassembler.feed(chunks[1]) == b"abcdefgh"


def test_same_seq_with_different_data_is_rejected() -> None:
    chunks = split_payload(b"abcdef", "t-1", 3)
    reassembler = Reassembler()
    reassembler.feed(chunks[0])
    with pytest.raises(ProtocolError, match="different data"):
        reassembler.feed(pack({**unpack(chunks[0]), "data": b"xyz"}))
    assert reassembler.feed(chunks[1]) == b"abcdef"


@pytest.mark.parametrize(
    ("chunk", "reason"),
    [
        (chunk_map(seq=2), "out of range"),
        (chunk_map(seq=-1), "seq must be >= 0"),
        (chunk_map(count=0), "count must be >= 1"),
        (chunk_map(count=7), "cannot have 7 chunks"),
        (chunk_map(total=-1), "total must be >= 0"),
        (chunk_map(data=b"abcdef"), "impossible"),  # 6 bytes cannot be one of 2 chunks of 6
        (chunk_map(data=b""), "impossible"),
        (chunk_map(total=0, count=1, data=b"a"), "impossible"),
        (chunk_map(total=7), "cannot make 7 bytes in 2 chunks"),
        (chunk_map(seq=2, count=3, data=b"abc", total=10), "a last chunk of 3 bytes is impossible"),
        (chunk_map(count=1, seq=0, total=4), "the only chunk of a transfer of 4 bytes holds 3"),
        (chunk_map(data="abc"), "data must be bytes"),
        (chunk_map(sha256="ABC"), "sha256"),
        (chunk_map(sha256="A" * 64), "sha256"),
        (chunk_map(transfer="a/b"), "transfer"),
        (chunk_map(v=3), "speaks protocol version int 3, this side reads versions 1 and 2"),
        (chunk_map(seq=True), "seq must be an integer"),
        (chunk_map(type="task"), "not a chunk"),
        ({k: v for k, v in chunk_map().items() if k != "total"}, "missing field(s) 'total'"),
        ({**chunk_map(), "extra": 1}, "unknown field(s)"),
        ([1, 2, 3], "must be a map"),
    ],
)
def test_malformed_chunks_are_rejected(chunk: object, reason: str) -> None:
    reassembler = Reassembler()
    with pytest.raises(ProtocolError) as caught:
        reassembler.feed(pack(chunk))
    assert reason in str(caught.value)
    assert reassembler.pending() == 0


@pytest.mark.parametrize("chunk", [b"", b"\xc1", b"\x88", "not bytes", None])
def test_undecodable_chunks_are_rejected(chunk: Any) -> None:
    with pytest.raises(ProtocolError):
        Reassembler().feed(chunk)


def test_chunk_sizes_must_split_the_total_evenly_but_the_last() -> None:
    reassembler = Reassembler()
    first = chunk_map(transfer="t", count=3, total=10, seq=0, sha256="0" * 64, data=b"12345678")
    with pytest.raises(ProtocolError, match="cannot make 10 bytes in 3 chunks"):
        reassembler.feed(pack(first))  # leaves no byte for chunk 2
    short = chunk_map(transfer="u", count=2, total=10, seq=0, sha256="0" * 64, data=b"1234")
    with pytest.raises(ProtocolError, match="cannot make 10 bytes"):
        reassembler.feed(pack(short))  # leaves 6 for the last, more than 4
    assert reassembler.pending() == 0


def test_oversize_total_is_rejected() -> None:
    reassembler = Reassembler(max_total_bytes=100)
    with pytest.raises(TransferRefused, match="over the limit of 100"):
        reassembler.feed(split_payload(b"x" * 101, "t", 50)[0])
    assert reassembler.feed(split_payload(b"x" * 101, "t", 50)[1]) is None  # refused once, then dropped quietly
    assert reassembler.feed(split_payload(b"x" * 100, "u", 100)[0]) == b"x" * 100
    huge = pack(chunk_map(total=2**40, count=2**21, sha256="0" * 64))
    with pytest.raises(ProtocolError, match="over the limit"):
        Reassembler().feed(huge)


def test_idle_transfers_are_evicted_after_ttl() -> None:
    reassembler = Reassembler(ttl_seconds=600.0)
    a = split_payload(b"aaaa", "a", 2)
    b = split_payload(b"bbbb", "b", 2)
    assert reassembler.feed(a[0], now=0.0) is None
    assert reassembler.feed(b[0], now=500.0) is None
    assert reassembler.pending() == 2
    assert reassembler.feed(b[1], now=1000.0) == b"bbbb"  # b was idle 500 s: kept
    assert reassembler.pending() == 0  # a was idle 1000 s: evicted
    assert reassembler.feed(a[1], now=1000.0) is None  # starts over instead of completing
    assert reassembler.pending() == 1


def test_activity_keeps_a_slow_transfer_alive() -> None:
    chunks = split_payload(b"slow but steady", "slow", 4)
    reassembler = Reassembler(ttl_seconds=10.0)
    results = [reassembler.feed(chunk, now=9.0 * i) for i, chunk in enumerate(chunks)]
    assert results[-1] == b"slow but steady"


def test_oldest_transfer_is_dropped_beyond_max_transfers() -> None:
    reassembler = Reassembler(max_transfers=2)
    transfers = [split_payload(bytes([i]) * 4, f"t{i}", 2) for i in range(3)]
    for i, chunks in enumerate(transfers):
        assert reassembler.feed(chunks[0], now=float(i)) is None
    assert reassembler.pending() == 2
    assert reassembler.feed(transfers[1][1], now=3.0) == b"\x01" * 4
    assert reassembler.feed(transfers[2][1], now=3.0) == b"\x02" * 4
    assert reassembler.feed(transfers[0][1], now=3.0) is None  # t0 was dropped: this starts a new one


def test_max_buffered_bytes_must_hold_one_whole_transfer() -> None:
    with pytest.raises(ValueError, match="max_buffered_bytes"):
        Reassembler(max_total_bytes=100, max_buffered_bytes=99)


def test_concurrent_feeding_returns_each_payload_once() -> None:
    payloads = {f"t{i}": random.Random(i).randbytes(3000 + i) for i in range(16)}
    streams = {tid: split_payload(data, tid, 256) for tid, data in payloads.items()}
    reassembler = Reassembler()
    results: list[tuple[str, bytes]] = []
    lock = threading.Lock()

    def worker(tids: list[str]) -> None:
        for tid in tids:
            for chunk in streams[tid]:
                result = reassembler.feed(chunk, source="s")
                if result is not None:
                    with lock:
                        results.append((tid, result))

    tids = sorted(payloads)
    threads = [threading.Thread(target=worker, args=(tids[i::4],)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(results) == sorted(payloads.items())
    assert reassembler.pending() == 0


def test_mutated_chunks_only_ever_raise_protocol_error() -> None:
    rng = random.Random(99)
    chunks = split_payload(rng.randbytes(700), "fuzz", 200)
    outcomes = {"none": 0, "payload": 0, "error": 0}
    for _ in range(2000):
        reassembler = Reassembler()
        data = bytearray(rng.choice(chunks))
        for _ in range(rng.randint(1, 3)):
            at = rng.randrange(len(data) + 1)
            op = rng.randrange(3)
            if op == 0 and at < len(data):
                data[at] ^= 1 << rng.randrange(8)
            elif op == 1:
                del data[at:]
            else:
                data[at:at] = rng.randbytes(rng.randint(1, 4))
        try:
            result = reassembler.feed(bytes(data))
        except ProtocolError:
            outcomes["error"] += 1
        except Exception as exc:  # noqa: BLE001  # pragma: no cover - this is the failure being tested for
            pytest.fail(f"feed leaked {type(exc).__name__}: {exc!r}")
        else:
            outcomes["none" if result is None else "payload"] += 1
    assert outcomes["error"] > 500
    assert outcomes["none"] > 0


def test_admit_is_asked_once_per_transfer_and_may_refuse_it_before_anything_is_buffered() -> None:
    asked: list[tuple[str, int]] = []

    def admit(transfer: str, total: int) -> None:
        asked.append((transfer, total))
        if total > 100:
            raise ProtocolError(f"transfer {transfer!r} is too big")

    reassembler = Reassembler(admit=admit)
    big = split_payload(b"x" * 250, "big", chunk_size=100, round_number=7)
    with pytest.raises(TransferRefused, match="'big' is too big") as refused:  # whichever chunk comes first
        reassembler.feed(big[2])
    assert (refused.value.transfer, refused.value.round, refused.value.reason) == ("big", 7, "transfer 'big' is too big")
    for chunk in big[:2]:  # the refused transfer's later chunks are dropped without asking again
        assert reassembler.feed(chunk) is None
    assert reassembler.pending() == 0
    small = split_payload(b"y" * 90, "small", chunk_size=50)
    assert reassembler.feed(small[0]) is None
    assert reassembler.feed(small[1]) == b"y" * 90
    assert asked == [("big", 250), ("small", 90)]
    # Another sender's transfer of the same id is another transfer: asked again.
    with pytest.raises(TransferRefused) as other:
        reassembler.feed(split_payload(b"x" * 250, "big", chunk_size=100)[0], source="elsewhere")
    assert other.value.round is None  # its chunks declare no round


def test_a_refusal_is_forgotten_after_the_ttl() -> None:
    reassembler = Reassembler(max_total_bytes=100, ttl_seconds=10.0)
    chunks = split_payload(b"x" * 150, "t", 100)
    with pytest.raises(TransferRefused):
        reassembler.feed(chunks[0], now=0.0)
    assert reassembler.feed(chunks[1], now=5.0) is None
    with pytest.raises(TransferRefused):
        reassembler.feed(chunks[1], now=20.0)


def test_chunks_may_declare_the_round_of_their_task() -> None:
    chunks = split_payload(b"z" * 30, "r3-pi-1", chunk_size=10, round_number=3)
    assert all(msgpack.unpackb(chunk)["round"] == 3 for chunk in chunks)
    assert "round" not in msgpack.unpackb(split_payload(b"z", "t")[0])  # optional: older receivers still read it
    reassembler = Reassembler()
    assert [reassembler.feed(chunk) for chunk in chunks] == [None, None, b"z" * 30]
    with pytest.raises(ValueError, match="round_number must be a non-negative int"):
        split_payload(b"z", "t", round_number=-1)
    with pytest.raises(ProtocolError, match="chunk.round must be >= 0"):
        Reassembler().feed(pack(chunk_map(round=-2)))
    with pytest.raises(ProtocolError, match="chunk.round must be an integer"):
        Reassembler().feed(pack(chunk_map(round="3")))


def test_an_open_transfer_counts_up_to_the_furthest_byte_written_not_the_bytes_received():
    """Chunks scattered over a declared total commit its buffer's pages whatever they hold: a transfer whose last
    chunk came first counts in full, so a second such one and a third do not fit in 2000 bytes with it."""
    reassembler = Reassembler(max_total_bytes=1000, max_buffered_bytes=2000)
    transfers = {name: split_payload(bytes([index]) * 1000, name, 100)
                 for index, name in enumerate(("t-a", "t-b", "t-c"))}
    for chunks in transfers.values():
        assert reassembler.feed(chunks[-1], "pi") is None  # 100 bytes received, 1000 counted
    assert reassembler.pending() == 2  # t-a, the least recently active, was dropped when t-c came
    for chunk in transfers["t-a"][:-1]:
        assert reassembler.feed(chunk, "pi") is None  # its last chunk is gone: it never completes
    done = [reassembler.feed(chunk, "pi") for chunk in transfers["t-c"][:-1]]
    assert bytes(done[-1]) == bytes([2]) * 1000
    in_order = Reassembler(max_total_bytes=1000, max_buffered_bytes=2000)
    for chunks in transfers.values():  # chunks in order count what they hold: all three fit
        assert in_order.feed(chunks[0], "pi") is None
    assert in_order.pending() == 3
