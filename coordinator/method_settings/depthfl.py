"""DepthFL's settings: the ``depthfl`` section of a coordinator configuration
(:mod:`coordinator.strategies.depthfl` uses them)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class DepthFLConfig:
    """DepthFL's settings (the ``depthfl`` section): ``kd_weight`` (default 1, the paper's mutual distillation;
    0 turns it off: each classifier learns from the labels alone), the weight of the KL terms against the
    cross-entropy ones; ``kd_rampup`` (default 0: none, the paper), rounds over which that weight rises as
    ``exp(-5 (1 - r / R)^2)``, as the reference code does with R = 300; ``tau`` (default 1, the paper's), the
    distillation temperature; ``depths`` (default: the model's stage ends), the blocks each level keeps, shallowest
    first, the last every block (e.g. ``[2, 4, 7, 10, 13]`` for VGG-16's five pooled stages)."""

    kd_weight: float = 1.0
    kd_rampup: int = 0
    tau: float = 1.0
    depths: list[int] | None = None

    def validate(self) -> None:
        """Raises ValueError with one clear sentence."""
        if not (self.kd_weight >= 0 and math.isfinite(self.kd_weight)):
            raise ValueError(f"depthfl.kd_weight must be a non-negative number, got {self.kd_weight}")
        if self.kd_rampup < 0:
            raise ValueError(f"depthfl.kd_rampup must be a number of rounds (0: none), got {self.kd_rampup}")
        if not (self.tau > 0 and math.isfinite(self.tau)):
            raise ValueError(f"depthfl.tau must be positive, got {self.tau}")
        if self.depths is not None and (not self.depths or any(d < 1 for d in self.depths)
                                        or sorted(set(self.depths)) != list(self.depths)):
            raise ValueError(f"depthfl.depths must be increasing block counts, got {self.depths}")
