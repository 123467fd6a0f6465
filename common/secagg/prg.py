"""Masks expanded from a 32-byte seed: AES-256 in counter mode over zeros, one stream per tensor (its nonce the
first 16 bytes of SHA-256 of the tensor's name), read as uint64 in the global tensor's row-major order, so that two
devices holding different slices draw the same mask value for the same global coordinate."""

from __future__ import annotations

import hashlib

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

__all__ = ["SEED_BYTES", "tensor_mask"]

SEED_BYTES = 32


def tensor_mask(seed: bytes, name: str, size: int) -> np.ndarray:
    """``size`` uint64 mask values of tensor ``name`` under ``seed`` (the global tensor's elements, flat)."""
    if len(seed) != SEED_BYTES:
        raise ValueError(f"a mask seed is {SEED_BYTES} bytes, got {len(seed)}")
    nonce = hashlib.sha256(name.encode()).digest()[:16]
    stream = Cipher(algorithms.AES(seed), modes.CTR(nonce)).encryptor().update(bytes(8 * size))
    return np.frombuffer(stream, dtype=np.uint64).copy()
