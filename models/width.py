"""Width-rate rounding: how many channels a layer keeps at a given rate.

HeteroFL's reference code keeps ``ceil(rate * channels)`` hidden channels. Plain ``math.ceil`` on the float
product is fragile (``0.1 * 30 == 3.0000000000000004`` would round up to 4), so products within a relative
``1e-9`` of an integer are snapped to it first, the way torchvision's ``_make_divisible`` guards its
``width_mult`` arithmetic with a rounding helper.
"""

from __future__ import annotations

import math

__all__ = ["scaled_channels"]

_SNAP = 1e-9


def scaled_channels(channels: int, rate: float) -> int:
    """Channels kept by a layer of ``channels`` outputs at width ``rate``.

    Parameters
    ----------
    channels:
        Number of channels of the full (global) layer, at least 1.
    rate:
        Width rate in (0, 1].

    Returns
    -------
    int
        ``ceil(rate * channels)`` with float noise removed, at least 1 and at most ``channels``.
    """
    if isinstance(channels, bool) or not isinstance(channels, int) or channels < 1:
        raise ValueError(f"channels must be a positive integer, got {channels!r}.")
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0.0 < rate <= 1.0:
        raise ValueError(f"width rate must be a number in (0, 1], got {rate!r}.")
    exact = float(rate) * channels
    nearest = round(exact)
    if abs(exact - nearest) <= _SNAP * max(1.0, abs(exact)):
        kept = int(nearest)
    else:
        kept = math.ceil(exact)
    return max(1, min(channels, kept))
