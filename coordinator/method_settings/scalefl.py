"""ScaleFL's settings: the ``scalefl`` section of a coordinator configuration
(:mod:`coordinator.strategies.scalefl` uses them)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Literal

#: ScaleFL's default cost ratios (four levels, as in ALGORITHMS.md): ``scalefl.ratios`` where the fleet is not known.
SCALEFL_RATIOS = (0.125, 0.25, 0.5, 1.0)


@dataclass
class ScaleFLConfig:
    """ScaleFL's settings (the ``scalefl`` section; used when ``algorithm: scalefl``).

    ``ratios``: target cost ratios r_l of the levels, smallest first, the last 1 (the full model), or ``auto``
    (the default): one level per cluster of the budgets the fleet reports at its first round (each at the share
    of the full model's ``memory`` cost its devices can train, at most four below the full model), so that the
    weakest devices have a level; before the fleet is known (``fedfit plan`` without budgets), where every device
    can train the top level, and with ``cost`` ``params``/``flops`` the fixed :data:`SCALEFL_RATIOS`.
    ``cost``: what a level's cost counts: ``memory`` (its estimated training memory at the recipe's batch size,
    what the budgets agents report limit), ``params`` or ``flops`` (per sample, at the dataset's image size; the
    paper's two, for comparing with its Table 1).
    ``tolerance``: eps_l, one for all levels or one per level. ``grid_step``: step of the s_d, s_w grid search.
    ``tau``, ``beta``: the self-distillation temperature and weight of Eq. 5 (paper: 3 and 0.1 for vision).
    ``kd_warmup``: share of the rounds trained without distillation (reference code: 0.25; paper: 0).
    ``detach_teacher``: stop the distillation gradient through the last exit (reference code: no).
    ``normalization``: the weights of Eq. 5, ``reference`` (the default: ``2 i / (l (l + 1))``, summing to 1 as
    in the reference code, so a level-``l`` device steps as far as any other device at the same learning rate) or
    ``paper`` (Eq. 5 as printed, ``i / (l (l + 1))``: the weights sum to 1/2, halving every ScaleFL step).
    ``kd_reduction``: how each KL term is reduced, ``batchmean`` (summed over the classes, as Eq. 5 writes the KL)
    or ``mean`` (averaged over them too, as the reference code's ``KLDivLoss()`` does: ``beta`` weighs a KL a
    class-count times weaker).
    """

    ratios: list[float] | Literal["auto"] = "auto"
    cost: Literal["memory", "params", "flops"] = "memory"
    tolerance: float | list[float] = 0.1
    grid_step: float = 0.01
    tau: float = 3.0
    beta: float = 0.1
    kd_warmup: float = 0.0
    detach_teacher: bool = False
    normalization: Literal["paper", "reference"] = "reference"
    kd_reduction: Literal["batchmean", "mean"] = "batchmean"

    def fixed_ratios(self) -> list[float]:
        """The configured ratios, or :data:`SCALEFL_RATIOS` where they are ``auto`` (before the fleet is known)."""
        return list(SCALEFL_RATIOS) if self.ratios == "auto" else list(self.ratios)

    def tolerances(self) -> list[float]:
        """eps_l for every level of :meth:`fixed_ratios`."""
        if isinstance(self.tolerance, list):
            return list(self.tolerance)
        return [self.tolerance] * len(self.fixed_ratios())

    def validate(self) -> None:
        """Raises ValueError with one clear sentence."""
        if isinstance(self.ratios, str) and self.ratios != "auto":
            raise ValueError(f"scalefl.ratios must be auto or a list of ratios, got {self.ratios!r}")
        if self.ratios == "auto" and isinstance(self.tolerance, list):
            raise ValueError("scalefl.tolerance must be one number with scalefl.ratios: auto (the levels come from "
                             "the fleet)")
        ratios = self.fixed_ratios()
        if (not ratios or any(not 0 < r <= 1 for r in ratios)
                or any(a >= b for a, b in itertools.pairwise(ratios)) or ratios[-1] != 1.0):
            raise ValueError(f"scalefl.ratios must increase strictly within (0, 1] and end with 1, got {ratios}")
        tolerances = self.tolerances()
        if len(tolerances) != len(ratios) or any(t < 0 for t in tolerances):
            raise ValueError("scalefl.tolerance must be one non-negative number or one per level")
        if not 0 < self.grid_step <= 0.5:
            raise ValueError(f"scalefl.grid_step must be in (0, 0.5], got {self.grid_step}")
        if self.tau <= 0 or self.beta < 0 or not 0 <= self.kd_warmup < 1:
            raise ValueError("scalefl.tau must be positive, scalefl.beta non-negative, scalefl.kd_warmup in [0, 1)")
