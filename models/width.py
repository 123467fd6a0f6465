"""Width-rate rounding: how many channels a layer keeps at a given rate.

HeteroFL's reference code keeps ``ceil(rate * channels)`` hidden channels; ScaleFL's keeps
``floor(rate * channels)`` (its index function ``W[:floor(s_w D_in), :floor(s_w D_out)]``). Plain ``math.ceil``
or ``math.floor`` on the float product is fragile (``0.1 * 30 == 3.0000000000000004`` would round up to 4,
``0.7 * 10 == 6.999999999999999`` down to 6), so products within a relative ``1e-9`` of an integer are snapped
to it first, the way torchvision's ``_make_divisible`` guards its ``width_mult`` arithmetic with a rounding
helper. Either way a layer keeps at least one channel.
"""

from __future__ import annotations

import math

__all__ = ["ROUNDINGS", "scaled_channels"]

#: The rounding modes a :class:`models.SubmodelSpec` may ask for.
ROUNDINGS = ("ceil", "floor")

_SNAP = 1e-9


def scaled_channels(channels: int, rate: float, rounding: str = "ceil") -> int:
    """Channels kept by a layer of ``channels`` outputs at width ``rate``.

    Parameters
    ----------
    channels:
        Number of channels of the full (global) layer, at least 1.
    rate:
        Width rate in (0, 1].
    rounding:
        ``"ceil"`` (HeteroFL) or ``"floor"`` (ScaleFL).

    Returns
    -------
    int
        ``ceil`` or ``floor`` of ``rate * channels`` with float noise removed, at least 1 and at most
        ``channels``.
    """
    if isinstance(channels, bool) or not isinstance(channels, int) or channels < 1:
        raise ValueError(f"channels must be a positive integer, got {channels!r}.")
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0.0 < rate <= 1.0:
        raise ValueError(f"width rate must be a number in (0, 1], got {rate!r}.")
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {', '.join(ROUNDINGS)}, got {rounding!r}.")
    exact = float(rate) * channels
    nearest = round(exact)
    if abs(exact - nearest) <= _SNAP * max(1.0, abs(exact)):
        kept = int(nearest)
    else:
        kept = math.ceil(exact) if rounding == "ceil" else math.floor(exact)
    return max(1, min(channels, kept))
