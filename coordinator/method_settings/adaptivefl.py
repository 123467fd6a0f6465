"""AdaptiveFL's settings: the ``adaptivefl`` section of a coordinator configuration
(:mod:`coordinator.strategies.adaptivefl` uses them)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Literal

#: AdaptiveFL's widths r_w of the L, M and S types (the paper's Table 1): ``adaptivefl.widths`` where the fleet is
#: not known.
ADAPTIVEFL_WIDTHS = (1.0, 0.66, 0.4)


@dataclass
class AdaptiveFLConfig:
    """AdaptiveFL's settings (the ``adaptivefl`` section; used when ``algorithm: adaptivefl``).

    The pool (the paper's Table 1): one model per width in ``widths`` (largest first; the first is type L, then M,
    S, XS, XXS) and value of I in ``full_layers`` (largest first; null: the family's default, VGG-16's 8, 6, 4, see
    :func:`models.fine_grained.default_full_layers`); a width of 1 is the full model alone. ``widths: auto`` (the
    default): the paper's 1, 0.66, 0.4 (:data:`ADAPTIVEFL_WIDTHS`), the S type's narrowed, when the fleet reports its
    budgets at its first round, to the widest that its weakest devices can train (its smallest model, at the
    smallest I); where none can, the plan says so with what the smallest would need. No I may be below
    ``min_full_layers``: the shallow layers are never pruned. ``selection``: ``rl`` (Algorithm 1: the resource
    reward capped at ``success_cap`` times the curiosity reward), or the paper's ablations ``greedy`` (the largest
    model to random clients), ``random`` (a random model to a random client), ``curiosity`` (the curiosity reward
    alone) and ``resource`` (the resource reward alone).

    ``readmit_after`` (K, default 5; not in the paper): a client whose every resource-table score has fallen to 0
    (e.g. after one decline for memory) has reward 0 and, by the paper's rule, is never drawn again; after K rounds
    out its resource table is reset to the initial 1s, so no device is kept out of the draws for more than K
    rounds. 0 or null: never (the paper's strict rule). Why 5: by then the evidence that zeroed the table is stale
    when resources fluctuate, and a device that still cannot train costs at most one declined task per K + 1 rounds.
    ``large_divisor``: ``paper`` (default; the paper's formula divides R_s by p for every type, L included) or
    ``reference`` (the reference code divides the L type's share by 1, its one model); they differ only in how the
    L type's R_s meets ``success_cap`` (see :mod:`coordinator.client_selection`).
    """

    widths: list[float] | Literal["auto"] = "auto"
    full_layers: list[int] | None = None
    min_full_layers: int = 1
    selection: Literal["rl", "greedy", "random", "curiosity", "resource"] = "rl"
    success_cap: float = 0.5
    readmit_after: int | None = 5
    large_divisor: Literal["paper", "reference"] = "paper"

    def fixed_widths(self) -> list[float]:
        """The configured widths, or :data:`ADAPTIVEFL_WIDTHS` where they are ``auto`` (before the fleet is known)."""
        return list(ADAPTIVEFL_WIDTHS) if self.widths == "auto" else list(self.widths)

    def validate(self) -> None:
        """Raises ValueError with one clear sentence."""
        if isinstance(self.widths, str) and self.widths != "auto":
            raise ValueError(f"adaptivefl.widths must be auto or a list of widths, got {self.widths!r}")
        widths = self.fixed_widths()
        if (not widths or len(widths) > 5 or any(not 0 < w <= 1 for w in widths)
                or any(a <= b for a, b in itertools.pairwise(widths))):
            raise ValueError(f"adaptivefl.widths must be 1 to 5 widths in (0, 1], strictly decreasing, got {widths}")
        if self.min_full_layers < 0:
            raise ValueError(f"adaptivefl.min_full_layers must be non-negative, got {self.min_full_layers}")
        layers = self.full_layers
        if layers is not None and (not layers or any(a <= b for a, b in itertools.pairwise(layers))
                                   or min(layers) < self.min_full_layers):
            raise ValueError(f"adaptivefl.full_layers must be strictly decreasing values of I, none below "
                             f"adaptivefl.min_full_layers ({self.min_full_layers}), got {layers}")
        if self.selection not in ("rl", "greedy", "random", "curiosity", "resource"):
            raise ValueError("adaptivefl.selection must be one of rl, greedy, random, curiosity, resource, got "
                             f"{self.selection!r}")
        if not 0 < self.success_cap <= 1:
            raise ValueError(f"adaptivefl.success_cap must be in (0, 1], got {self.success_cap}")
        if self.readmit_after is not None and self.readmit_after < 0:
            raise ValueError("adaptivefl.readmit_after must be a number of rounds, 0 or null (never: the paper's "
                             f"rule), got {self.readmit_after}")
        if self.large_divisor not in ("paper", "reference"):
            raise ValueError(f"adaptivefl.large_divisor must be paper or reference, got {self.large_divisor!r}")
