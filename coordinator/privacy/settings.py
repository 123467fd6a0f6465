"""The ``privacy`` section: client-level differential privacy (DP-FedAvg) over masked updates."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

__all__ = ["AdaptiveClipConfig", "PrivacyConfig"]


@dataclass
class AdaptiveClipConfig:
    """Adaptive clipping (Andrew et al. 2021, "Differentially private learning with adaptive clipping"): after each
    round the bound moves geometrically towards the ``target_quantile`` of the updates' change norms, ``bound *=
    exp(-learning_rate * (b - target_quantile))`` with ``b`` the noised share of updates that needed no clipping.
    ``count_noise`` is that count's noise standard deviation (None: the paper's "expected updates / 20", at least
    ``noise_multiplier``); it must exceed ``noise_multiplier / 2``, and the updates' sum then takes noise
    ``(noise_multiplier^-2 - (2 count_noise)^-2)^-1/2`` so that the round as a whole is a Gaussian mechanism of
    ``noise_multiplier`` (the paper's Theorem 1)."""

    target_quantile: float = 0.5
    learning_rate: float = 0.2
    count_noise: float | None = None

    def validate(self, noise_multiplier: float) -> None:
        """Raises ValueError with one clear sentence."""
        if not 0 < self.target_quantile < 1:
            raise ValueError(f"privacy.adaptive.target_quantile must be in (0, 1), got {self.target_quantile}")
        if not (math.isfinite(self.learning_rate) and self.learning_rate > 0):
            raise ValueError(f"privacy.adaptive.learning_rate must be positive, got {self.learning_rate}")
        if self.count_noise is not None and not math.isfinite(self.count_noise):
            raise ValueError(f"privacy.adaptive.count_noise must be finite, got {self.count_noise}")
        if self.count_noise is not None and not self.count_noise > noise_multiplier / 2:
            raise ValueError(f"privacy.adaptive.count_noise must exceed half of privacy.noise_multiplier "
                             f"({noise_multiplier / 2:g}), got {self.count_noise}: the updates' own noise would "
                             f"have to be infinite")


@dataclass
class PrivacyConfig:
    """The ``privacy`` section (docs/privacy.md). ``mode``: ``off`` (the default), ``central`` (the devices clip,
    the coordinator adds the noise to each round's sums) or ``local`` (each device noises its own clipped update).
    ``clip``: the L2 bound on an update's change (the initial one with ``adaptive``); ``noise_multiplier``: the
    noise's standard deviation over the bound; ``delta`` and ``accountant`` (``rdp`` or ``pld``, Google's
    dp-accounting) say how epsilon is reported; ``max_epsilon`` (None: no budget) stops a run before a round would
    spend more, and refuses to start one whose rounds would."""

    mode: Literal["off", "central", "local"] = "off"
    clip: float = 1.0
    noise_multiplier: float = 1.0
    adaptive: AdaptiveClipConfig | None = None
    delta: float = 1e-5
    accountant: Literal["rdp", "pld"] = "rdp"
    max_epsilon: float | None = None

    @property
    def enabled(self) -> bool:
        """Whether updates are clipped and noised."""
        return self.mode != "off"

    def validate(self, weighting: str) -> None:
        """Raises ValueError with one clear sentence (``weighting``: the run's aggregation weighting)."""
        if not self.enabled:
            return
        if not (math.isfinite(self.clip) and self.clip > 0):
            raise ValueError(f"privacy.clip must be a positive L2 bound, got {self.clip}")
        if not (math.isfinite(self.noise_multiplier) and self.noise_multiplier > 0):
            raise ValueError(f"privacy.noise_multiplier must be positive, got {self.noise_multiplier}")
        if not 0 < self.delta < 1:
            raise ValueError(f"privacy.delta must be in (0, 1), got {self.delta}")
        if self.max_epsilon is not None and not (math.isfinite(self.max_epsilon) and self.max_epsilon > 0):
            raise ValueError(f"privacy.max_epsilon must be a positive number (none: no budget), got {self.max_epsilon}")
        if weighting != "uniform":
            raise ValueError("privacy needs weighting: uniform: a sample-count weight would let one device's update "
                             "count for more than its clip bound")
        if self.adaptive is not None:
            if self.mode == "local":
                raise ValueError("privacy.adaptive needs mode: central: in local mode each device's clipping bit "
                                 "would reach the coordinator without noise")
            self.adaptive.validate(self.noise_multiplier)
