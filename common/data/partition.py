"""Splitting a labelled dataset among federated clients: IID, Dirichlet label skew, or label shards."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["PartitionSpec", "label_set", "parse_partition", "partition_indices"]

_KINDS = ("iid", "dirichlet", "shards")
_FORMS = "'iid', 'dirichlet:ALPHA' (ALPHA a number > 0, e.g. dirichlet:0.5) or 'shards:N' (an integer N >= 1)"
_DIRICHLET_TRIES = 100


@dataclass(frozen=True)
class PartitionSpec:
    """How to split data among clients.

    ``kind`` is ``"iid"``, ``"dirichlet"`` (needs ``alpha > 0``) or ``"shards"`` (needs
    ``labels_per_client >= 1``).
    """

    kind: str
    alpha: float | None = None
    labels_per_client: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"Partition kind {self.kind!r} is not supported; use {_FORMS}.")
        if self.kind == "dirichlet":
            if self.alpha is None or not math.isfinite(self.alpha) or self.alpha <= 0:
                raise ValueError(f"Dirichlet partition needs a finite alpha > 0, got {self.alpha!r}.")
        elif self.alpha is not None:
            raise ValueError(f"alpha only applies to the dirichlet partition, not {self.kind!r}.")
        if self.kind == "shards":
            n = self.labels_per_client
            if n is None or isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"Shards partition needs an integer labels_per_client >= 1, got {n!r}.")
        elif self.labels_per_client is not None:
            raise ValueError(f"labels_per_client only applies to the shards partition, not {self.kind!r}.")

    def describe(self) -> str:
        """Return the text form accepted by :func:`parse_partition`."""
        if self.kind == "dirichlet":
            assert self.alpha is not None
            short = format(self.alpha, "g")
            return f"dirichlet:{short if float(short) == self.alpha else repr(self.alpha)}"
        if self.kind == "shards":
            return f"shards:{self.labels_per_client}"
        return "iid"


def parse_partition(text: str) -> PartitionSpec:
    """Parse ``"iid"``, ``"dirichlet:ALPHA"`` or ``"shards:N"`` (case-insensitive) into a PartitionSpec."""
    bad = ValueError(f"Partition {text!r} is not understood; use {_FORMS}.")
    kind, sep, arg = text.strip().lower().partition(":")
    kind, arg = kind.strip(), arg.strip()
    if kind == "iid" and not sep:
        return PartitionSpec("iid")
    if kind == "dirichlet" and arg:
        try:
            alpha = float(arg)
        except ValueError:
            raise bad from None
        if not math.isfinite(alpha) or alpha <= 0:
            raise bad
        return PartitionSpec("dirichlet", alpha=alpha)
    if kind == "shards" and arg.isdecimal():
        n = int(arg)
        if n < 1:
            raise bad
        return PartitionSpec("shards", labels_per_client=n)
    raise bad


def label_set(labels: np.ndarray) -> list[int]:
    """Sorted distinct labels as Python ints."""
    return [int(v) for v in np.unique(np.asarray(labels))]


def _finish(parts: list[np.ndarray]) -> list[np.ndarray]:
    return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]


def _iid(n: int, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
    return _finish(np.array_split(rng.permutation(n), num_clients))


def _dirichlet_once(
    by_class: list[np.ndarray], num_clients: int, alpha: float, rng: np.random.Generator
) -> list[np.ndarray]:
    buckets: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for idx in by_class:
        shuffled = rng.permutation(idx)
        props = rng.dirichlet(np.full(num_clients, alpha))
        cuts = np.floor(np.cumsum(props)[:-1] * len(shuffled)).astype(np.int64)
        for c, piece in enumerate(np.split(shuffled, cuts)):
            buckets[c].append(piece)
    return [np.concatenate(b) if b else np.empty(0, dtype=np.int64) for b in buckets]


def _dirichlet(
    labels: np.ndarray, num_clients: int, alpha: float, rng: np.random.Generator
) -> list[np.ndarray]:
    """Dirichlet label skew; resample until every client has ``min(10, N // num_clients)`` samples.

    After ``_DIRICHLET_TRIES`` failed draws (very small alpha with many clients) the draw with the largest
    smallest client is repaired by moving random samples from the largest clients to the short ones, so a
    partition is always produced; the skew of the draw is kept as far as possible.
    """
    n = len(labels)
    min_size = min(10, n // num_clients)
    by_class = [np.flatnonzero(labels == c) for c in np.unique(labels)]
    best: list[np.ndarray] | None = None
    for _ in range(_DIRICHLET_TRIES):
        parts = _dirichlet_once(by_class, num_clients, alpha, rng)
        smallest = min(len(p) for p in parts)
        if smallest >= min_size:
            return _finish(parts)
        if best is None or smallest > min(len(p) for p in best):
            best = parts
    assert best is not None
    parts = [rng.permutation(p) for p in best]
    for c in range(num_clients):
        while len(parts[c]) < min_size:
            donor = max(range(num_clients), key=lambda k: len(parts[k]))
            take = min(min_size - len(parts[c]), len(parts[donor]) - min_size)
            parts[c] = np.concatenate([parts[c], parts[donor][:take]])
            parts[donor] = parts[donor][take:]
    return _finish(parts)


def _shards(
    labels: np.ndarray, num_clients: int, per_client: int, rng: np.random.Generator
) -> list[np.ndarray]:
    """Balanced non-IID (HeteroFL): each client holds ``per_client`` distinct classes.

    Classes are laid out in a seeded random order; client ``c`` takes positions ``(c * N + j) mod K`` for
    ``j < N``, so every class is held by ``floor`` or ``ceil`` of ``num_clients * N / K`` clients. Each
    class's shuffled samples are then split equally among the clients holding it.
    """
    classes = np.unique(labels)
    k = len(classes)
    if per_client > k:
        raise ValueError(
            f"shards:{per_client} asks for {per_client} classes per client but the data has only {k}; "
            f"use shards:N with N <= {k}."
        )
    order = rng.permutation(classes)
    holders: dict[int, list[int]] = {int(c): [] for c in classes}
    for c in range(num_clients):
        for j in range(per_client):
            holders[int(order[(c * per_client + j) % k])].append(c)
    buckets: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for cls in classes:
        owners = holders[int(cls)]
        if not owners:
            continue
        idx = rng.permutation(np.flatnonzero(labels == cls))
        if len(idx) < len(owners):
            raise ValueError(
                f"Class {int(cls)} has {len(idx)} samples but shards:{per_client} gives it to {len(owners)} "
                "clients; use fewer clients or fewer labels per client."
            )
        for owner, piece in zip(owners, np.array_split(idx, len(owners)), strict=True):
            buckets[owner].append(piece)
    return _finish([np.concatenate(b) for b in buckets])


def partition_indices(
    labels: np.ndarray, num_clients: int, spec: PartitionSpec, seed: int
) -> list[np.ndarray]:
    """Split sample indices among ``num_clients`` clients.

    Returns one sorted int64 index array per client; the arrays are disjoint and every client gets at least
    one sample (IID and Dirichlet also cover every sample; shards leave out classes no client holds).
    Deterministic for a given ``seed``.

    Raises
    ------
    ValueError
        When the split is impossible (more clients than samples, more shard labels than classes, ...).
    """
    y = np.asarray(labels)
    if y.ndim != 1:
        raise ValueError(f"labels must be a 1-D array, got shape {y.shape}.")
    if y.size and not np.issubdtype(y.dtype, np.integer):
        raise ValueError(f"labels must be integers, got dtype {y.dtype}.")
    if isinstance(num_clients, bool) or num_clients < 1:
        raise ValueError(f"num_clients must be >= 1, got {num_clients}.")
    n = len(y)
    if num_clients > n:
        raise ValueError(
            f"Cannot give {num_clients} clients at least one sample each from {n} samples; use fewer clients."
        )
    rng = np.random.default_rng(seed)
    if spec.kind == "iid":
        return _iid(n, num_clients, rng)
    if spec.kind == "dirichlet":
        assert spec.alpha is not None
        return _dirichlet(y, num_clients, spec.alpha, rng)
    assert spec.labels_per_client is not None
    return _shards(y, num_clients, spec.labels_per_client, rng)
