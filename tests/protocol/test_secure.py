"""protocol.secure: a secure round's messages read back as written, and malformed ones refused in a sentence."""

from __future__ import annotations

import msgpack
import pytest

from protocol import (
    ModelRef,
    ProtocolError,
    RevealedShare,
    SecureAdvert,
    SecurePeer,
    SecureRelay,
    SecureReveal,
    SecureRoster,
    SecureShares,
    SecureUnmask,
    Task,
    TrainingPlan,
    decode,
    encode,
)
from protocol._plain import plain
from protocol.codec import message_type

KEY, SEALED, SHARE = b"k" * 32, b"s" * 160, b"v" * 66
PEERS = [SecurePeer("r1-b", KEY, KEY, 2, {"global/w": [[0, 2], [0, 3]]}),
         SecurePeer("r1-c", KEY, KEY, 3, {"global/w": [[0, 4], [0, 3]]})]
MESSAGES = [
    SecureAdvert("r1-a", 1, "a", KEY, KEY, {"width": 0.5}, [0, 3]),
    SecureRoster("r1-a", 1, "a", "global", 1, 2, {"global/w": [[0, 4], [0, 3]]}, {"global/w": [[0, 4], [0, 3]]},
                 {"global/w": [8, 3]}, PEERS),
    SecureShares("r1-a", 1, "a", {"r1-b": SEALED, "r1-c": SEALED}),
    SecureRelay("r1-a", 1, "a", {"r1-b": SEALED}, {"global/w": b"\xff\x0f"}),
    SecureUnmask("r1-a", 1, "a", ["r1-a", "r1-b"], ["r1-c"]),
    SecureReveal("r1-a", 1, "a", [RevealedShare("r1-b", "self", SHARE), RevealedShare("r1-c", "mask", SHARE)]),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda message: type(message).__name__)
def test_each_reads_back_as_written_and_its_type_is_seen_from_its_first_bytes(message: object) -> None:
    payload = encode(message)  # type: ignore[arg-type]
    assert decode(payload) == message
    assert (message_type(payload) or "").startswith("secure_")


def test_a_task_says_it_is_secure_only_when_it_is() -> None:
    task = Task("r1-a", 1, "a", 10.0, ModelRef("cnn", 10, 1, {}), {}, None, {}, plan=TrainingPlan())
    assert decode(encode(task)).secure is False  # type: ignore[union-attr]
    assert b"secure" not in encode(task)  # off the wire at its default: older agents read it
    assert decode(encode(Task(**{**task.__dict__, "secure": True}))).secure is True  # type: ignore[union-attr]


@pytest.mark.parametrize(("message", "error"), [
    (SecureAdvert("r1-a", 1, "a", b"short", KEY, None, []), "cipher must be 32 bytes"),
    (SecureShares("r1-a", 1, "a", {"r1-b": b"x" * 10}), "must be 160 bytes"),
    (SecureRoster("r1-a", 1, "a", "global", 1, 3, {"global/w": [[0, 4], [0, 3]]}, {"global/w": [[0, 4], [0, 3]]},
                  {"global/w": [8, 3]}, PEERS), "threshold 3 is above its 2 peer"),
    (SecureRoster("r1-a", 1, "a", "global", 1, 2, {"global/w": [[0, 4], [3, 3]]}, {"global/w": [[0, 4], [0, 3]]},
                  {"global/w": [8, 3]}, PEERS), "start < stop"),
    (SecureRoster("r1-a", 1, "a", "global", 1, 2, {"global/v": [[0, 4]]}, {"global/v": [[0, 4]]},
                  {"global/w": [8, 3]}, PEERS), "tensors without a shape"),
    (SecureUnmask("r1-a", 1, "a", ["r1-b"], ["r1-b"]), "both a survivor and dropped"),
    (SecureReveal("r1-a", 1, "a", [RevealedShare("r1-b", "key", SHARE)]), "must be one of self, mask"),
])
def test_malformed_ones_are_refused(message: object, error: str) -> None:

    body = {"v": 1, "type": {SecureAdvert: "secure_advert", SecureShares: "secure_shares",
                             SecureRoster: "secure_roster", SecureUnmask: "secure_unmask",
                             SecureReveal: "secure_reveal"}[type(message)], **plain(message)}  # type: ignore
    with pytest.raises(ProtocolError, match=error):
        decode(msgpack.packb(body))


@pytest.mark.parametrize(("peers", "shapes", "error"), [
    ([SecurePeer("r1-a", KEY, KEY, 2, {"global/w": [[0, 2], [0, 3]]}), PEERS[1]], {"global/w": [8, 3]},
     "peers must be other devices, each named once"),
    ([PEERS[0], PEERS[0]], {"global/w": [8, 3]}, "peers must be other devices, each named once"),
    (PEERS, {"global/w": [2**40, 3]}, "more than the limit of"),
])
def test_a_roster_naming_itself_a_peer_twice_or_a_huge_tensor_is_refused(peers: list[SecurePeer],
                                                                         shapes: dict[str, list[int]],
                                                                         error: str) -> None:
    roster = SecureRoster("r1-a", 1, "a", "global", 1, 2, {"global/w": [[0, 4], [0, 3]]},
                          {"global/w": [[0, 4], [0, 3]]}, shapes, peers)
    with pytest.raises(ProtocolError, match=error):
        decode(msgpack.packb({"v": 1, "type": "secure_roster", **plain(roster)}))  # type: ignore[dict-item]
