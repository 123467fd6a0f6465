"""FedAvg (and the All-Large and All-Small baselines)'s settings: the ``fedavg`` section of a coordinator configuration
(:mod:`coordinator.strategies.fedavg` uses them)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class FedAvgConfig:
    """FedAvg's setting (the ``fedavg`` section): the uniform ``width`` every device trains (1: the full model,
    the memory-ignoring upper reference; e.g. 1/6: FeDepth's and HeteroFL's "FedAvg (x 1/6)")."""

    width: float = 1.0

    def validate(self) -> None:
        """Raises ValueError with one clear sentence."""
        if not 0 < self.width <= 1:
            raise ValueError(f"fedavg.width must be in (0, 1], got {self.width}")
