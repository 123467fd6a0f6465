"""The coordinator's part of a secure round (SecAgg+), as pure steps its round drives: the roster from the devices'
adverts, the sealed shares relayed (unread) with where each device's values are hidden among enough others, the
masked slices summed, which shares to ask back, and the sum unmasked. It learns each coordinate's sum over the
devices that sent it, and their count, where each sender's value is hidden in a group of at least ``MIN_HOLDERS``
holders joined by pair masks (elsewhere the devices sent 0: `SecureServer.safe`; a sender whose dropped neighbours
leave such a group smaller is left out of the sum, `SecureServer.request`); no device's slice. The devices are honest but curious
(SecAgg's semi-honest model): a coordinator that lies about who survived to different devices, or swaps keys in the
rosters, is not defended against (the papers' signed adverts and consistency check are not built).

Sets of devices, as the papers name them: ``U1`` advertised keys, ``U2`` shared (a subset of ``U1``), ``U3`` sent a
masked slice (a subset of ``U2``); a device of ``U2`` outside ``U3`` dropped out after its neighbours masked with it.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Collection, Mapping, Sequence

import numpy as np

from common.secagg.client import MASK, SELF, Advert, Neighbour, Reveal, Roster
from common.secagg.graph import neighbour_count, neighbours, threshold_of
from common.secagg.keys import KeyPair, agree
from common.secagg.masking import MIN_HOLDERS, Coverage, SecureSum, check_coverage
from common.secagg.shamir import combine

__all__ = ["SecureServer"]


class SecureServer:
    """One secure round at the coordinator (see the module docstring). ``shapes``: the global tensors;
    ``coverages``: the slice each device's task holds."""

    def __init__(self, context: bytes, shapes: Mapping[str, Sequence[int]], coverages: Mapping[str, Coverage],
                 rng: random.Random) -> None:
        self.context = context
        self.coverages = dict(coverages)
        self._rng = rng
        self.adverts: dict[str, Advert] = {}
        self.graph: dict[str, list[str]] = {}
        self.points: dict[str, int] = {}
        self.threshold = 0
        self.shared: set[str] = set()  # U2
        self.total = SecureSum(shapes)
        self.sent: set[str] = set()  # U3
        self._kept: dict[str, dict[str, np.ndarray]] = {}  # per sharer, over its slice: the values it sends
        self._uploads: dict[str, dict[str, np.ndarray]] = {}  # each sender's masked slice, until the request
        #: Senders left out of the sum because dropouts left a value of theirs too thinly hidden (`request`).
        self.left_out: set[str] = set()
        self.unmasked = False

    def rosters(self, adverts: Mapping[str, Advert]) -> dict[str, Roster]:
        """Each advertising device's roster (U1: the adverts); ValueError when fewer than three advertised (two
        devices' sum gives each the other's slice) or one has no slice."""
        if len(adverts) < 3:
            raise ValueError(f"{len(adverts)} device(s) advertised keys: secure aggregation needs at least 3 (with 2, "
                             f"each could read the other's update from the sum)")
        missing = sorted(set(adverts) - set(self.coverages))
        if missing:
            raise ValueError(f"device(s) {', '.join(missing)} advertised keys without a task in this round")
        for name in adverts:
            check_coverage(self.coverages[name], self.total.shapes)
        self.adverts = dict(adverts)
        names = sorted(adverts)
        self.points = {name: index + 1 for index, name in enumerate(names)}
        self.graph = neighbours(names, neighbour_count(len(names)), self._rng)
        self.threshold = threshold_of(min(len(others) for others in self.graph.values()))
        return {name: Roster(self.points[name], self.threshold,
                             [Neighbour(self.adverts[other], self.points[other], self.coverages[other])
                              for other in self.graph[name]]) for name in names}

    def relay(self, bundles: Mapping[str, Mapping[str, bytes]]) -> dict[str, dict[str, bytes]]:
        """The sealed shares each sharing device (U2) receives from its sharing neighbours; a bundle naming a
        device that is not the sender's neighbour is refused (ValueError)."""
        for sender, sealed in bundles.items():
            if sender not in self.graph:
                raise ValueError(f"shares came from {sender!r}, who advertised no keys this round")
            strangers = set(sealed) - set(self.graph[sender])
            if strangers:
                raise ValueError(f"{sender!r} sealed shares for {', '.join(sorted(strangers))}, not its neighbours")
            if set(sealed) != set(self.graph[sender]):  # its neighbours would mask with it one-sidedly
                raise ValueError(f"{sender!r} sealed shares for {len(sealed)} of its {len(self.graph[sender])} "
                                 f"neighbours: a device shares with every neighbour or not at all")
        self.shared = set(bundles)
        self._kept = self.safe(self.shared)
        return {recipient: {sender: bundles[sender][recipient] for sender in self.graph[recipient]
                            if sender in bundles and recipient in bundles[sender]} for recipient in self.shared}

    def safe(self, members: Collection[str]) -> dict[str, dict[str, np.ndarray]]:
        """Per device of ``members``, per tensor of its slice, whether its value at each coordinate is hidden in a sum
        of at least ``MIN_HOLDERS`` devices' values: pair masks cancel only between neighbours that both hold a
        coordinate, so what the coordinator can unmask there is the sum over each connected group of ``members``
        holding it (neighbours joined); a group of one or two would give values away. With every device a neighbour
        of every other (up to 17 devices) a group is all of a coordinate's holders."""
        members = sorted(set(members))
        safe: dict[str, dict[str, np.ndarray]] = {name: {} for name in members}
        for tensor, shape in self.total.shapes.items():
            holding = [name for name in members if tensor in self.coverages[name]]
            if not holding:
                continue
            # A slice is a cartesian product, so who holds a coordinate is, per dimension, who holds its index there,
            # intersected: the distinct holder sets come from each dimension's few distinct columns.
            ids, columns = [], []
            for dim, size in enumerate(shape):
                member = np.zeros((len(holding), size), dtype=bool)
                for row, name in enumerate(holding):
                    member[row, np.asarray(self.coverages[name][tensor][dim])] = True
                distinct, which = np.unique(member, axis=1, return_inverse=True)
                columns.append(distinct)
                ids.append(which.reshape(-1))
            grouped = np.zeros((len(holding), *shape), dtype=bool)  # per device: in a group of MIN_HOLDERS or more
            for combination in itertools.product(*(range(distinct.shape[1]) for distinct in columns)):
                holds = np.logical_and.reduce([columns[dim][:, pick] for dim, pick in enumerate(combination)])
                big = _in_big_groups([holding[row] for row in np.flatnonzero(holds)], self.graph)
                rows = [row for row, name in enumerate(holding) if name in big]
                if rows:
                    grouped[np.ix_(np.asarray(rows), *[np.flatnonzero(ids[dim] == pick)
                                                       for dim, pick in enumerate(combination)])] = True
            for row, name in enumerate(holding):
                safe[name][tensor] = grouped[row][np.ix_(*[np.asarray(index)
                                                           for index in self.coverages[name][tensor]])]
        return safe

    def keep(self) -> dict[str, dict[str, np.ndarray]]:
        """Per device that shared (U2), over its slice, where its value is hidden among enough devices (`safe`, worked
        out by :meth:`relay`): what it is told with its relayed shares, to send 0 elsewhere (`SecureClient.mask`)."""
        return self._kept

    def add(self, device: str, masked: Mapping[str, np.ndarray]) -> None:
        """A masked slice in (U3); ValueError for a device that did not share, or sent one already."""
        if device not in self.shared:
            raise ValueError(f"a masked update came from {device!r}, who did not share its keys this round: its "
                             f"masks could not be taken away")
        if device in self.sent:
            raise ValueError(f"{device!r} sent its masked update twice")
        self.total.add(masked, self.coverages[device])
        self.sent.add(device)
        self._uploads[device] = {name: np.array(value, dtype=np.uint64) for name, value in masked.items()}

    def request(self) -> tuple[list[str], list[str]]:
        """The survivors (U3) and the dropped (U2 less U3) to tell every survivor; ValueError when a secret to recover
        has fewer surviving neighbours than the threshold. A sender whose dropped neighbours left a value it sent in a
        group of fewer than ``MIN_HOLDERS`` senders (whose sum would give values away) is left out as if it had
        dropped (:attr:`left_out`): its upload is taken out of the sum, its mask key asked for and never its self-mask
        seed, so its values stay hidden; and so on until every sent value is hidden among enough senders."""
        sent, out = set(self.sent), set()  # (nothing changes until the round is known to unmask)
        while True:
            still = self.safe(sent)
            thin = {name for name in sent for tensor, kept in self._kept.get(name, {}).items()
                    if (kept & ~still[name][tensor]).any()}
            if not thin:
                break
            sent -= thin
            out |= thin
        because = (f" ({len(out)} sender(s) left out, once others dropped, for values of theirs hidden among fewer "
                   f"than {MIN_HOLDERS})" if out else "")
        for owner in sorted(self.shared):
            holders = [other for other in self.graph[owner] if other in sent]
            if len(holders) < self.threshold:
                raise ValueError(f"the round cannot be unmasked: {len(holders)} of the neighbours of {owner!r} remain "
                                 f"among the senders, the threshold is {self.threshold}{because}")
        for name in sorted(out):
            self.total.subtract(self._uploads[name], self.coverages[name])
        self.sent, self.left_out = sent, self.left_out | out
        self._uploads.clear()  # (needed no more)
        survivors, dropped = sorted(self.sent), sorted(self.shared - self.sent)
        return survivors, dropped

    def unmask(self, reveals: Mapping[str, Sequence[Reveal]]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """The plain sums and counts (`SecureSum.result`), from the shares the survivors gave back (by revealer);
        ValueError when a secret has fewer than the threshold, a mask key given back is not the advertised one, or
        the round was unmasked already. A coordinate's count is the senders that sent a value there (`safe`: hidden in
        a group of at least ``MIN_HOLDERS``); where none did, its sum and count are 0 (not aggregated)."""
        if self.unmasked:
            raise ValueError("the round is unmasked already: its masks cannot be taken away twice")
        wanted = {(owner, SELF) for owner in self.sent} | {(owner, MASK) for owner in self.shared - self.sent}
        shares: dict[tuple[str, str], dict[int, int]] = {asked: {} for asked in wanted}
        for revealer, given in reveals.items():
            for reveal in given:
                asked = (reveal.owner, reveal.kind)
                if asked not in wanted or reveal.point != self.points.get(revealer):
                    raise ValueError(f"{revealer!r} gave back a share the round did not ask for ({reveal.kind} of "
                                     f"{reveal.owner!r})")
                shares[asked][reveal.point] = reveal.value
        secrets = {wanted_key: _combined(wanted_key, held, self.threshold)  # all, before any is used
                   for wanted_key, held in sorted(shares.items())}
        keys = {owner: KeyPair.from_secret(secret) for (owner, kind), secret in secrets.items() if kind == MASK}
        for owner, pair in keys.items():
            if pair.public != self.adverts[owner].mask:
                raise ValueError(f"the shares of {owner!r}'s mask key give back another key: a share was altered")
        for (owner, kind), secret in secrets.items():
            if kind == SELF:
                self.total.remove_self_mask(secret, self.coverages[owner])
        for owner, pair in keys.items():
            for survivor in (other for other in self.graph[owner] if other in self.sent):
                seed = agree(pair, self.adverts[survivor].mask, self.context, b"mask")
                sign = 1 if survivor < owner else -1
                self.total.remove_pair_mask(seed, sign, self.coverages[survivor], self.coverages[owner])
        self.unmasked = True
        counts = {name: np.zeros(shape, dtype=np.int64) for name, shape in self.total.shapes.items()}
        for name in self.sent:  # a coordinate counts the senders that kept it (the others sent 0 there)
            for tensor, kept in self._kept.get(name, {}).items():
                counts[tensor][np.ix_(*[np.asarray(index) for index in self.coverages[name][tensor]])] += kept
        return {name: (np.where(counts[name] > 0, sums, 0.0), counts[name])
                for name, (sums, _) in self.total.result().items()}


def _in_big_groups(holders: Sequence[str], graph: Mapping[str, Sequence[str]]) -> set[str]:
    """The ``holders`` that are joined (through neighbours that are holders too) to at least ``MIN_HOLDERS - 1``
    others."""
    left, big = set(holders), set()
    while left:
        group, frontier = set(), [left.pop()]
        while frontier:
            name = frontier.pop()
            group.add(name)
            joined = [other for other in graph.get(name, ()) if other in left]
            left.difference_update(joined)
            frontier.extend(joined)
        if len(group) >= MIN_HOLDERS:
            big |= group
    return big


def _combined(owner_kind: tuple[str, str], held: Mapping[int, int], threshold: int) -> bytes:
    """The secret ``held`` shares give back, or ValueError naming whose secret could not be."""
    owner, kind = owner_kind
    try:
        return combine(held, threshold)
    except ValueError as exc:
        what = "self-mask seed" if kind == SELF else "mask key"
        raise ValueError(f"{owner!r}'s {what}: {exc}") from None
