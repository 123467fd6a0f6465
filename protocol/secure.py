"""The messages of a secure round (revision 10; SecAgg+ over masked sub-models, docs/privacy.md): after training, a
device advertises its keys and what it trained; the coordinator answers with its roster; the device seals its
shares to its neighbours, which the coordinator relays with which coordinates enough devices hold; the device
uploads its update masked (an ordinary :class:`~protocol.messages.Update` whose tensors are uint64) and, once asked,
gives back the shares that unmask the round's sum. Agents publish theirs on their update topic, the coordinator on
the agent's ack topic; none carries a tensor.

A slice is named per tensor (``group/key``: the aggregation group and the model's tensor) by runs of indices per
dimension, ``[start0, stop0, start1, stop1, ...]`` (`common.secagg.wire`); neighbours are named by their task ids.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from protocol._ids import shown, validate_task_id
from protocol._reader import FieldReader, check_int, check_text
from protocol.errors import ProtocolError
from protocol.limits import Limits

__all__ = [
    "KEY_BYTES",
    "SECURE_KINDS",
    "SECURE_READERS",
    "SHARE_KINDS",
    "RevealedShare",
    "SecureAdvert",
    "SecurePeer",
    "SecureRelay",
    "SecureReveal",
    "SecureRoster",
    "SecureShares",
    "SecureUnmask",
]

#: An X25519 public key's length.
KEY_BYTES = 32
#: A Shamir share's length (a field element of 2^521 - 1).
SHARE_BYTES = 66
#: A sealed pair of shares: two shares, ChaCha20-Poly1305's nonce (12) and tag (16).
SEALED_BYTES = 2 * SHARE_BYTES + 12 + 16
#: What a revealed share is of: a survivor's self-mask seed, a dropped device's mask key.
SHARE_KINDS: tuple[str, ...] = ("self", "mask")

Runs = dict[str, list[list[int]]]


@dataclass
class SecureAdvert:
    """A device trained its task of a secure round: its two public keys (``cipher`` seals shares to it, ``mask``
    agrees pair masks) and what it trained (``spec_trained``, ``labels``: what its update will say), from which the
    coordinator cuts its slice."""

    task_id: str
    round: int
    agent_id: str
    cipher: bytes
    mask: bytes
    spec_trained: dict[str, Any] | None
    labels: list[int]


@dataclass
class SecurePeer:
    """A neighbour in a roster: its task, keys, Shamir point and slice."""

    task_id: str
    cipher: bytes
    mask: bytes
    point: int
    coverage: Runs


@dataclass
class SecureRoster:
    """The coordinator's answer to an advert: the device's Shamir ``point``, the ``threshold`` of neighbours that give
    a secret back, its slice (``coverage``: global indices; ``positions``: where they sit in the tensors it trained;
    tensors named ``group/key`` with its ``group``), the global ``shapes`` of every tensor named, and its ``peers``."""

    task_id: str
    round: int
    agent_id: str
    group: str
    point: int
    threshold: int
    coverage: Runs
    positions: Runs
    shapes: dict[str, list[int]]
    peers: list[SecurePeer] = field(default_factory=list)


@dataclass
class SecureShares:
    """A device's self-mask seed and mask key shared among its neighbours: per neighbour's task id, the sealed pair."""

    task_id: str
    round: int
    agent_id: str
    sealed: dict[str, bytes]


@dataclass
class SecureRelay:
    """The shares the device's neighbours sealed to it (by their task ids), and per tensor of its slice, as packed
    bits, whether enough devices hold each coordinate for its value to be sent (`common.secagg.wire`)."""

    task_id: str
    round: int
    agent_id: str
    sealed: dict[str, bytes]
    keep: dict[str, bytes]


@dataclass
class SecureUnmask:
    """The coordinator asks a survivor for the shares that unmask the round: of the ``survivors``' self-mask seeds and
    of the ``dropped`` devices' mask keys (task ids)."""

    task_id: str
    round: int
    agent_id: str
    survivors: list[str]
    dropped: list[str]


@dataclass
class RevealedShare:
    """One share given back: of ``owner``'s (a task id) self-mask seed or mask key (``kind``)."""

    owner: str
    kind: str
    value: bytes


@dataclass
class SecureReveal:
    """A survivor's answer to :class:`SecureUnmask`."""

    task_id: str
    round: int
    agent_id: str
    shares: list[RevealedShare]


_HEADER = ("v", "type")  # (protocol._schema.HEADER, which imports this module)


def _blob(value: object, label: str, size: int | None = None, most: int | None = None) -> bytes:
    if not isinstance(value, bytes):
        raise ProtocolError(f"{label} must be bytes, got {shown(value)}")
    if size is not None and len(value) != size:
        raise ProtocolError(f"{label} must be {size} bytes, got {len(value)}")
    if most is not None and len(value) > most:
        raise ProtocolError(f"{label} is {len(value)} bytes, more than {most}")
    return value


def _map(value: object, label: str, limits: Limits) -> dict[str, object]:
    if not isinstance(value, dict):
        raise ProtocolError(f"{label} must be a map, got {shown(value)}")
    if len(value) > limits.max_list_len:
        raise ProtocolError(f"{label} has {len(value)} entries, more than {limits.max_list_len}")
    for key in value:
        if not isinstance(key, str):
            raise ProtocolError(f"{label} keys must be strings, got {shown(key)}")
        check_text(key, f"{label} key", limits)
    return value


def _list(value: object, label: str, limits: Limits) -> list[object]:
    if not isinstance(value, list):
        raise ProtocolError(f"{label} must be a list, got {shown(value)}")
    if len(value) > limits.max_list_len:
        raise ProtocolError(f"{label} has {len(value)} items, more than {limits.max_list_len}")
    return value


def _runs(value: object, label: str, limits: Limits) -> Runs:
    runs: Runs = {}
    for name, dims in _map(value, label, limits).items():
        where = f"{label}[{name!r}]"
        dims = _list(dims, where, limits)
        if not 0 < len(dims) <= limits.max_dims:
            raise ProtocolError(f"{where} must name 1 to {limits.max_dims} dimensions, got {len(dims)}")
        read = []
        for dim in dims:
            bounds = [check_int(item, f"{where} run bound", 0) for item in _list(dim, where, limits)]
            if len(bounds) > limits.max_list_len or any(bound > limits.max_tensor_elements for bound in bounds):
                raise ProtocolError(f"{where}: a run bound beyond the limit of {limits.max_tensor_elements} elements, "
                                    f"or more than {limits.max_list_len} bounds")
            if not bounds or len(bounds) % 2 or any(stop <= start for start, stop in zip(bounds[::2], bounds[1::2])):
                raise ProtocolError(f"{where}: a dimension's runs must be non-empty (start, stop) pairs, start < stop")
            read.append(bounds)
        runs[name] = read
    return runs


def _shapes(value: object, label: str, limits: Limits) -> dict[str, list[int]]:
    shapes = {}
    for name, dims in _map(value, label, limits).items():
        sizes = [check_int(item, f"{label}[{name!r}] size", 1) for item in _list(dims, f"{label}[{name!r}]", limits)]
        if not 0 < len(sizes) <= limits.max_dims:
            raise ProtocolError(f"{label}[{name!r}] must have 1 to {limits.max_dims} dimensions")
        if math.prod(sizes) > limits.max_tensor_elements:
            raise ProtocolError(f"{label}[{name!r}] has {math.prod(sizes)} elements, more than the limit of "
                                f"{limits.max_tensor_elements}")
        shapes[name] = sizes
    return shapes


def _sealed(value: object, label: str, limits: Limits) -> dict[str, bytes]:
    return {name: _blob(box, f"{label}[{name!r}]", SEALED_BYTES) for name, box in _map(value, label, limits).items()}


def _task_ids(value: object, label: str, limits: Limits) -> list[str]:
    items = _list(value, label, limits)
    return [validate_task_id(item, f"{label} item") for item in items]


def _ids(r: FieldReader) -> dict[str, Any]:
    return {"task_id": r.task_id("task_id"), "round": r.integer("round", minimum=0), "agent_id": r.name("agent_id")}


def read_secure_advert(obj: object, limits: Limits) -> SecureAdvert:
    r = FieldReader(obj, "secure_advert", limits, SecureAdvert, _HEADER)
    return SecureAdvert(**_ids(r), cipher=_blob(r.raw("cipher"), r.label("cipher"), KEY_BYTES),
                        mask=_blob(r.raw("mask"), r.label("mask"), KEY_BYTES), spec_trained=r.opt_tree("spec_trained"),
                        labels=r.labels("labels"))


def _read_peer(obj: object, where: str, limits: Limits) -> SecurePeer:
    r = FieldReader(obj, where, limits, SecurePeer)
    return SecurePeer(task_id=r.task_id("task_id"), cipher=_blob(r.raw("cipher"), r.label("cipher"), KEY_BYTES),
                      mask=_blob(r.raw("mask"), r.label("mask"), KEY_BYTES), point=r.integer("point", minimum=1),
                      coverage=_runs(r.raw("coverage"), r.label("coverage"), limits))


def read_secure_roster(obj: object, limits: Limits) -> SecureRoster:
    r = FieldReader(obj, "secure_roster", limits, SecureRoster, _HEADER)
    peers = [_read_peer(item, f"secure_roster.peers[{index}]", limits)
             for index, item in enumerate(_list(r.raw("peers"), r.label("peers"), limits))]
    roster = SecureRoster(**_ids(r), group=r.text("group"), point=r.integer("point", minimum=1),
                          threshold=r.integer("threshold", minimum=1),
                          coverage=_runs(r.raw("coverage"), r.label("coverage"), limits),
                          positions=_runs(r.raw("positions"), r.label("positions"), limits),
                          shapes=_shapes(r.raw("shapes"), r.label("shapes"), limits), peers=peers)
    named = set(roster.coverage).union(*(peer.coverage for peer in peers))
    if not named <= set(roster.shapes):
        missing = ", ".join(sorted(named - set(roster.shapes))[:3])
        raise ProtocolError(f"secure_roster: tensors without a shape: {missing}")
    if set(roster.positions) != set(roster.coverage):
        raise ProtocolError("secure_roster: positions and coverage must name the same tensors")
    names = [peer.task_id for peer in peers]
    if roster.task_id in names or len(set(names)) != len(names):
        raise ProtocolError("secure_roster: its peers must be other devices, each named once")
    if roster.threshold > len(peers):
        raise ProtocolError(f"secure_roster: threshold {roster.threshold} is above its {len(peers)} peer(s)")
    return roster


def read_secure_shares(obj: object, limits: Limits) -> SecureShares:
    r = FieldReader(obj, "secure_shares", limits, SecureShares, _HEADER)
    return SecureShares(**_ids(r), sealed=_sealed(r.raw("sealed"), r.label("sealed"), limits))


def read_secure_relay(obj: object, limits: Limits) -> SecureRelay:
    r = FieldReader(obj, "secure_relay", limits, SecureRelay, _HEADER)
    keep = {name: _blob(bits, f"secure_relay.keep[{name!r}]", most=limits.max_payload_bytes)
            for name, bits in _map(r.raw("keep"), r.label("keep"), limits).items()}
    return SecureRelay(**_ids(r), sealed=_sealed(r.raw("sealed"), r.label("sealed"), limits), keep=keep)


def read_secure_unmask(obj: object, limits: Limits) -> SecureUnmask:
    r = FieldReader(obj, "secure_unmask", limits, SecureUnmask, _HEADER)
    unmask = SecureUnmask(**_ids(r), survivors=_task_ids(r.raw("survivors"), r.label("survivors"), limits),
                          dropped=_task_ids(r.raw("dropped"), r.label("dropped"), limits))
    if set(unmask.survivors) & set(unmask.dropped):
        raise ProtocolError("secure_unmask: a device is named both a survivor and dropped")
    return unmask


def _read_share(obj: object, where: str, limits: Limits) -> RevealedShare:
    r = FieldReader(obj, where, limits, RevealedShare)
    return RevealedShare(owner=r.text("owner"), kind=r.text("kind", SHARE_KINDS),
                         value=_blob(r.raw("value"), r.label("value"), SHARE_BYTES))


def read_secure_reveal(obj: object, limits: Limits) -> SecureReveal:
    r = FieldReader(obj, "secure_reveal", limits, SecureReveal, _HEADER)
    shares = [_read_share(item, f"secure_reveal.shares[{index}]", limits)
              for index, item in enumerate(_list(r.raw("shares"), r.label("shares"), limits))]
    return SecureReveal(**_ids(r), shares=shares)


#: The messages' wire kinds.
SECURE_KINDS: dict[type, str] = {SecureAdvert: "secure_advert", SecureRoster: "secure_roster",
                                 SecureShares: "secure_shares", SecureRelay: "secure_relay",
                                 SecureUnmask: "secure_unmask", SecureReveal: "secure_reveal"}
SECURE_READERS: dict[str, Callable[[object, Limits], Any]] = {
    "secure_advert": read_secure_advert, "secure_roster": read_secure_roster, "secure_shares": read_secure_shares,
    "secure_relay": read_secure_relay, "secure_unmask": read_secure_unmask, "secure_reveal": read_secure_reveal}
