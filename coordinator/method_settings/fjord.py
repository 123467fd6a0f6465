"""FjORD's settings: the ``fjord`` section of a coordinator configuration
(:mod:`coordinator.strategies.fjord` uses them)."""

from __future__ import annotations

from dataclasses import dataclass, field

from protocol.plan import MAX_WIDTHS

#: FjORD's grid of ordered-dropout widths (the paper's and the reference code's).
FJORD_WIDTHS = (1.0, 0.8, 0.6, 0.4, 0.2)


@dataclass
class FjORDConfig:
    """FjORD's settings (the ``fjord`` section): ``widths``, the grid of uniform widths, largest first (default
    the paper's 1, 0.8, 0.6, 0.4, 0.2: a device's p_max is the widest it affords, and each batch trains a width
    drawn from those up to it); ``distill`` (default true), the paper's D-KD: each batch trains p_max and then the
    drawn width towards p_max's prediction (false: the drawn width alone, on the labels)."""

    widths: list[float] = field(default_factory=lambda: list(FJORD_WIDTHS))
    distill: bool = True

    def validate(self) -> None:
        """Raises ValueError with one clear sentence."""
        if (not self.widths or any(not 0 < width <= 1 for width in self.widths)
                or sorted(self.widths, reverse=True) != list(self.widths) or len(set(self.widths)) != len(self.widths)):
            raise ValueError(f"fjord.widths must be distinct width rates in (0, 1], largest first, got {self.widths}")
        if len(self.widths) > MAX_WIDTHS:
            raise ValueError(f"fjord.widths holds {len(self.widths)} widths, more than a plan carries ({MAX_WIDTHS})")
