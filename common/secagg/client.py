"""One device's part of a secure round (SecAgg+, Bell et al. 2020), as pure steps the agent drives:

1. :meth:`SecureClient.advert`: its two public keys (one to seal shares with, one to agree masks with);
2. :meth:`SecureClient.share`: given its neighbours (the coordinator's :class:`Roster`), its self-mask seed and its
   mask key secret-shared among them, each share sealed to its neighbour;
3. :meth:`SecureClient.receive`: the sealed shares its neighbours sent it (relayed by the coordinator, unread);
4. :meth:`SecureClient.mask`: its slice masked with its self mask and a pair mask per neighbour that shared;
5. :meth:`SecureClient.reveal`: told which devices sent their slice (survivors) and which shared and then dropped
   out, the share of a survivor's self-mask seed or of a dropped device's mask key, never both for one device, and
   only once, with at least ``threshold`` survivors.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from common.secagg.graph import threshold_of
from common.secagg.keys import KeyPair, agree, open_sealed, seal
from common.secagg.masking import Coverage, PairMask, mask_slice
from common.secagg.prg import SEED_BYTES
from common.secagg.shamir import split
from protocol.secure import SHARE_BYTES

__all__ = ["MASK", "SELF", "Advert", "Neighbour", "Reveal", "Roster", "SecureClient"]

#: The fewest neighbours a device shares among (with 3 devices in a round, each has 2).
MIN_NEIGHBOURS = 2
SELF, MASK = "self", "mask"


@dataclass(frozen=True)
class Advert:
    """A device's public keys for one round: ``cipher`` seals shares to it, ``mask`` agrees pair masks with it."""

    device: str
    cipher: bytes
    mask: bytes


@dataclass(frozen=True)
class Neighbour:
    """A neighbour as the roster names it: its keys, its Shamir point and the slice it holds."""

    advert: Advert
    point: int
    coverage: Coverage


@dataclass(frozen=True)
class Roster:
    """What the coordinator tells a device before it shares: its own point, its neighbours, the threshold."""

    point: int
    threshold: int
    neighbours: Sequence[Neighbour]


@dataclass(frozen=True)
class Reveal:
    """A share given back to the coordinator: of ``owner``'s self-mask seed (``kind`` SELF) or mask key (MASK), at
    the revealing device's ``point``."""

    owner: str
    kind: str
    point: int
    value: int


def _label(sender: str, recipient: str, context: bytes) -> bytes:
    return context + b":" + sender.encode() + b"->" + recipient.encode()


class SecureClient:
    """One device's keys, seeds and shares for one secure round (``context``: the federation and round, binding
    every key agreed and every share sealed to it)."""

    def __init__(self, device: str, context: bytes) -> None:
        self.device = device
        self.context = context
        self._cipher = KeyPair()
        self._masks = KeyPair()
        self._self_seed = os.urandom(SEED_BYTES)
        self._roster: Roster | None = None
        self._held: dict[str, bytes] = {}  # sealed shares from neighbours, by sender
        self._revealed = False

    def advert(self) -> Advert:
        """Its public keys."""
        return Advert(self.device, self._cipher.public, self._masks.public)

    def share(self, roster: Roster) -> dict[str, bytes]:
        """Its self-mask seed and mask key split among its neighbours (``roster.threshold`` of them give each back),
        each neighbour's two shares sealed to it."""
        count = len(roster.neighbours)
        if count < MIN_NEIGHBOURS or not threshold_of(count) <= roster.threshold <= count:
            raise ValueError(f"a roster of {count} neighbour(s) with threshold {roster.threshold}: a device shares "
                             f"among at least {MIN_NEIGHBOURS} neighbours, a majority of them needed to give a secret "
                             f"back")
        self._roster = roster
        points = [neighbour.point for neighbour in roster.neighbours]
        own = split(self._self_seed, roster.threshold, points)
        key = split(self._masks.secret_bytes(), roster.threshold, points)
        sealed = {}
        for neighbour in roster.neighbours:
            name = neighbour.advert.device
            plaintext = own[neighbour.point].to_bytes(SHARE_BYTES, "big") + key[neighbour.point].to_bytes(
                SHARE_BYTES, "big")
            secret = agree(self._cipher, neighbour.advert.cipher, self.context, b"seal")
            sealed[name] = seal(secret, plaintext, _label(self.device, name, self.context))
        return sealed

    def receive(self, sealed: Mapping[str, bytes]) -> None:
        """The shares its neighbours sealed to it (by sender); each is opened now to check it, kept sealed."""
        roster = self._need_roster()
        known = {neighbour.advert.device: neighbour for neighbour in roster.neighbours}
        for sender, box in sealed.items():
            if sender not in known:
                raise ValueError(f"a share came from {sender!r}, who is not a neighbour of {self.device!r}")
            self._open(known[sender], box)
            self._held[sender] = box

    def mask(self, values: Mapping[str, np.ndarray], coverage: Coverage, shapes: Mapping[str, Sequence[int]],
             keep: Mapping[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        """Its slice ``values`` (over ``coverage`` of the global tensors of ``shapes``) masked: its self mask, and a
        pair mask with every neighbour whose shares it holds (those that shared: the others drop out of its
        masks). ``keep``: per tensor, over the slice, whether its value at each coordinate is hidden among at least
        ``MIN_HOLDERS`` holders joined as neighbours (the coordinator's `SecureServer.keep`): a value where it is not
        is sent as 0, so that no sum the coordinator unmasks is one device's value, or two devices' that each could
        read the other's from."""
        roster = self._need_roster()
        if keep is not None:
            for name, value in values.items():
                if name not in keep or np.shape(keep[name]) != np.shape(value):
                    raise ValueError(f"the holder bits of tensor {name!r} are not over its slice")
            values = {name: np.where(np.asarray(keep[name], dtype=bool), value, 0.0) for name, value in values.items()}
        pairs = [PairMask(agree(self._masks, neighbour.advert.mask, self.context, b"mask"),
                          1 if self.device < neighbour.advert.device else -1, neighbour.coverage)
                 for neighbour in roster.neighbours if neighbour.advert.device in self._held]
        return mask_slice(values, coverage, shapes, self._self_seed, pairs)

    def reveal(self, survivors: Collection[str], dropped: Collection[str]) -> list[Reveal]:
        """The shares it holds given back: of a surviving neighbour's self-mask seed, of a dropped one's mask key;
        ValueError (revealing nothing) when asked twice, when a device is named both ways, when it is not among the
        survivors itself, or when fewer than the threshold survived."""
        roster = self._need_roster()
        survived, gone = set(survivors), set(dropped)
        if self._revealed:
            raise ValueError("this round's shares were given back already: a second request could ask a device's "
                             "self mask and its mask key both")
        if survived & gone:
            raise ValueError(f"devices named both as survivors and as dropped: {', '.join(sorted(survived & gone))}")
        if self.device not in survived:
            raise ValueError(f"{self.device!r} is not among the survivors named: it gives back nothing")
        known = {neighbour.advert.device: neighbour for neighbour in roster.neighbours}
        if len(survived & set(known)) < roster.threshold:  # (survivors it does not know would not hold its shares)
            raise ValueError(f"{len(survived & set(known))} of its neighbours survived, fewer than the threshold "
                             f"{roster.threshold}: no share is given back")
        self._revealed = True
        reveals = []
        for sender, box in sorted(self._held.items()):
            own, key = self._open(known[sender], box)
            if sender in survived:
                reveals.append(Reveal(sender, SELF, roster.point, own))
            elif sender in gone:
                reveals.append(Reveal(sender, MASK, roster.point, key))
        return reveals

    def _open(self, neighbour: Neighbour, box: bytes) -> tuple[int, int]:
        secret = agree(self._cipher, neighbour.advert.cipher, self.context, b"seal")
        plaintext = open_sealed(secret, box, _label(neighbour.advert.device, self.device, self.context))
        if len(plaintext) != 2 * SHARE_BYTES:
            raise ValueError(f"a share from {neighbour.advert.device!r} is {len(plaintext)} bytes, not "
                             f"{2 * SHARE_BYTES}")
        return (int.from_bytes(plaintext[:SHARE_BYTES], "big"), int.from_bytes(plaintext[SHARE_BYTES:], "big"))

    def _need_roster(self) -> Roster:
        if self._roster is None:
            raise ValueError("no roster yet: a device shares before it receives or masks")
        return self._roster
