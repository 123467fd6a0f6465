"""FedRolex's settings: the ``fedrolex`` section of a coordinator configuration
(:mod:`coordinator.strategies.fedrolex` uses them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass
class FedRolexConfig:
    """FedRolex's setting (the ``fedrolex`` section): which way the window of channels rolls, one channel a round:
    ``forward`` (the paper: the window of round t starts at channel t mod C) or ``backward`` (the reference
    code's ``torch.roll``: it starts at -t mod C)."""

    direction: Literal["forward", "backward"] = "forward"

    def validate(self) -> None:
        """Raises ValueError with one clear sentence."""
        if self.direction not in ("forward", "backward"):
            raise ValueError(f"fedrolex.direction must be forward or backward, got {self.direction!r}")
