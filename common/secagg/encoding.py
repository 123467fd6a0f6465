"""Fixed-point encoding of float tensors for sums modulo 2^64: ``round(x * 2^FRACTION_BITS)`` as an unsigned 64-bit
integer (two's complement), so that sums wrap exactly as the devices' masks need, and decode back to float64.

``FRACTION_BITS = 24`` keeps 6e-8 of resolution (a float32's own near 1) and leaves 39 bits of integer range: a
value must lie within ``MAX_ABS = 2^19`` so that a sum over up to 2^20 devices cannot overflow.
"""

from __future__ import annotations

import numpy as np

__all__ = ["FRACTION_BITS", "MAX_ABS", "RESOLUTION", "decode", "encode"]

FRACTION_BITS = 24
RESOLUTION = 2.0**-FRACTION_BITS
MAX_ABS = 2.0**19


def encode(values: np.ndarray) -> np.ndarray:
    """``values`` in fixed point, uint64; ValueError when one is not finite or beyond ``MAX_ABS``."""
    array = np.asarray(values, dtype=np.float64)
    if not np.all(np.isfinite(array)):
        raise ValueError("a value to encode is not finite")
    if array.size and float(np.max(np.abs(array))) >= MAX_ABS:  # (its value not said: it is the device's)
        raise ValueError(f"a value to encode is beyond the fixed point's range of +-{MAX_ABS:g}")
    return np.rint(array * 2.0**FRACTION_BITS).astype(np.int64).view(np.uint64)


def decode(sums: np.ndarray) -> np.ndarray:
    """Fixed-point sums (uint64, modulo 2^64) back to float64."""
    return np.asarray(sums, dtype=np.uint64).view(np.int64).astype(np.float64) * RESOLUTION
