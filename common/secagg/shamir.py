"""Shamir's t-out-of-n secret sharing of a 32-byte secret over the prime field of 2^521 - 1 (one field element holds
the whole secret): any ``threshold`` shares give it back, fewer say nothing of it."""

from __future__ import annotations

import secrets
from collections.abc import Mapping, Sequence

__all__ = ["PRIME", "combine", "split"]

PRIME = 2**521 - 1
SECRET_BYTES = 32


def split(secret: bytes, threshold: int, points: Sequence[int]) -> dict[int, int]:
    """Shares of ``secret`` at the nonzero field ``points`` (one per holder), ``threshold`` of them needed."""
    if len(secret) != SECRET_BYTES:
        raise ValueError(f"a shared secret is {SECRET_BYTES} bytes, got {len(secret)}")
    if not 1 <= threshold <= len(points):
        raise ValueError(f"a threshold of {threshold} needs at least that many holders, there are {len(points)}")
    if len(set(points)) != len(points) or any(not 0 < point < PRIME for point in points):
        raise ValueError("share points must be distinct and nonzero")
    coefficients = [int.from_bytes(secret, "big")] + [secrets.randbelow(PRIME) for _ in range(threshold - 1)]
    shares = {}
    for point in points:
        value = 0
        for coefficient in reversed(coefficients):  # Horner
            value = (value * point + coefficient) % PRIME
        shares[point] = value
    return shares


def combine(shares: Mapping[int, int], threshold: int) -> bytes:
    """The secret ``threshold`` of the ``shares`` (point -> value) give back by Lagrange interpolation at 0;
    ValueError with fewer."""
    if len(shares) < threshold:
        raise ValueError(f"{len(shares)} share(s) cannot give back a secret shared with threshold {threshold}")
    points = list(shares)[:threshold]
    secret = 0
    for point in points:
        numerator, denominator = 1, 1
        for other in points:
            if other != point:
                numerator = numerator * (-other) % PRIME
                denominator = denominator * (point - other) % PRIME
        secret = (secret + shares[point] * numerator * pow(denominator, -1, PRIME)) % PRIME
    if secret >= 2 ** (8 * SECRET_BYTES):
        raise ValueError("the shares do not belong together: they give back no 32-byte secret")
    return secret.to_bytes(SECRET_BYTES, "big")
