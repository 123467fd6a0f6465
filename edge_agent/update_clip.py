"""Client-level differential privacy on the device (:class:`~protocol.UpdateClip`): the update's change from the
weights its task sent, every tensor it uploads taken as one vector, scaled down to L2 norm ``bound`` when it is
longer (DP-FedAvg's clipping, McMahan et al. 2018), and in local DP Gaussian noise of standard deviation
``noise_multiplier * bound`` added to every value sent.

The noise is drawn from a generator seeded by the operating system's entropy (numpy's default), never from the
task's seed: the coordinator that set the seed must not be able to draw the same noise and take it away.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from protocol import UpdateClip

__all__ = ["change_norm", "clip_update"]


def change_norm(trained: Mapping[str, np.ndarray], sent: Mapping[str, np.ndarray]) -> float:
    """``|trained - sent|`` over every tensor of ``trained`` (squares summed in float64)."""
    total = 0.0
    for key, value in trained.items():
        change = value.astype(np.float64) - np.asarray(sent[key], dtype=np.float64)
        total += float(np.dot(change.ravel(), change.ravel()))
    return math.sqrt(total)


def clip_update(trained: dict[str, np.ndarray], sent: Mapping[str, np.ndarray], clip: UpdateClip,
                rng: np.random.Generator | None = None) -> tuple[dict[str, np.ndarray], float]:
    """``trained`` with its change from ``sent`` clipped to ``clip.bound`` (and noised, in local DP), each tensor
    in its own dtype; and the norm of the change before clipping. ValueError when a tensor ``trained`` sends is not
    one ``sent`` holds with the same shape (the change would not be the update's)."""
    for key, value in trained.items():
        if key not in sent or np.shape(sent[key]) != value.shape:
            raise ValueError(f"tensor {key!r} of the update is not one the task sent with its shape: its change "
                             f"cannot be clipped")
    norm = change_norm(trained, sent)
    if not math.isfinite(norm):
        raise ValueError("the update's change is not finite: it cannot be clipped")
    scale = min(1.0, clip.bound / norm) if norm > 0 else 1.0
    noise_std = clip.noise_multiplier * clip.bound
    generator = rng if rng is not None else np.random.default_rng()
    clipped: dict[str, np.ndarray] = {}
    for key, value in trained.items():
        base = np.asarray(sent[key], dtype=np.float64)
        result = base + scale * (value.astype(np.float64) - base)
        if noise_std > 0:
            result += generator.normal(0.0, noise_std, size=value.shape)
        clipped[key] = result.astype(value.dtype)
    return clipped, norm
