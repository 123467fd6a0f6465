"""FlexFL's settings: the ``flexfl`` section of a coordinator configuration
(:mod:`coordinator.strategies.flexfl` uses them)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Literal

#: FlexFL's default pool ratios (the reference code's 0.25 and 0.5 of the full model): ``flexfl.ratios`` where
#: the fleet is not known.
FLEXFL_RATIOS = (0.25, 0.5, 1.0)


@dataclass
class FlexFLConfig:
    """FlexFL's settings (the ``flexfl`` section; used when ``algorithm: flexfl``).

    Pre-processing (once, at set-up): ``proxy_fraction`` of the server's training split (never the test split) is
    the proxy set, ``proxy_train`` of it pre-trains the global model for ``pretrain_rounds`` rounds and the rest
    scores APoZ. One pre-training round is one pass over the proxy set's training part with the recipe's optimizer
    and batch size (the reference code's ``--pretrain`` rounds: one pass over its proxy training split each); the
    paper trains "for 100 rounds" before scoring, the default 5 is shorter so that the set-up stays affordable on a
    small server (about 10 s a round for the default CNN on Fashion-MNIST's 1% proxy set on 2 CPU cores): a
    deviation, ``pretrain_rounds: 100`` is the paper's. ``apoz_at``: APoZ is the fraction of zeros ``after_relu``
    (the paper's Eq. 2) or, an option, of the values a ReLU would zero ``before_bn`` (per channel, at the input of
    the layer's batch norm; see :mod:`models.pruning`). ``init``: the initial global model is a fresh one
    (``fresh``, the paper: Alg. 2 resets the global model after scoring) or the pre-trained one (``pretrained``).
    Algorithm 1: ``ratios`` (L_p, smallest first, the last 1: the full model; ``auto``, the default with ``size:
    memory``: one pool model per cluster of the budgets the fleet reports at its first round, each just below the
    share its devices can train, at most four below the full model, so that the weakest devices have one; before
    the fleet is known, where every device can train the full model, and with another ``size``,
    :data:`FLEXFL_RATIOS`; an adaptive variant that would not lie
    between its pool model and the next smaller one is left out) of ``size`` (``memory``, the default:
    the model-dependent part of the estimated training memory at the recipe's batch size, the unit of the budgets
    devices report, as ScaleFL's ``cost: memory``; ``params``: all parameters, the paper's unit; ``features``: all
    but the final classifier's, the reference code's), gamma on a grid of ``step`` (xi) searched ``up`` from 0 (the
    paper) or ``down`` (the reference), within ``tolerance`` (eps) of each ratio; ``rounding`` of the kept channels
    (``floor``: the reference's ``int(C * s)``). The pool models M2..Mn each have an adaptive variant, by the same
    rule, with ``adaptive_cut`` (Gamma) less ``size``: ``global``, the paper's "Gamma x size(M) parameters ...
    size(M) is the number of parameters of the global model" (a share of the full model's: M2' = 0.5 - 0.1 = 0.4,
    the reference's targets ``0.5 - d``, ``1 - d``), or ``relative`` (a share of the pool model's own: M2' = 0.45).
    The paper lists no M1' (the order of adaptive pruning is "M3', M2, M2', and M1"): ``full_variant: true`` adds
    one. The coordinator sends only the pool models (P = {M1..Mn}); the variants are rungs of a device's ladder.
    Self-KD (Eq. 4): ``kd_weight`` (lambda), ``tau``; ``kd_reduction`` ``mean`` (the default: the reference code's
    ``KLDivLoss()``, which averages over the classes too) or ``batchmean`` (the KL summed over classes, as the paper
    writes Eq. 4: with lambda 10 it outweighs the cross-entropy, and where the smallest pool model is too small to
    learn, the larger ones follow it down: docs/results.md, "Where learning is lost").
    """

    proxy_fraction: float = 0.01
    proxy_train: float = 0.8
    pretrain_rounds: int = 5
    apoz_at: Literal["after_relu", "before_bn"] = "after_relu"
    init: Literal["fresh", "pretrained"] = "fresh"
    ratios: list[float] | Literal["auto"] = "auto"
    size: Literal["memory", "params", "features"] = "memory"
    step: float = 0.01
    tolerance: float = 0.01
    search: Literal["up", "down"] = "up"
    rounding: Literal["floor", "ceil"] = "floor"
    adaptive_cut: float = 0.1
    adaptive_mode: Literal["global", "relative"] = "global"
    full_variant: bool = False
    kd_weight: float = 10.0
    tau: float = 3.0
    kd_reduction: Literal["batchmean", "mean"] = "mean"

    def validate(self) -> None:
        """Raises ValueError with one clear sentence."""
        if isinstance(self.ratios, str) and self.ratios != "auto":
            raise ValueError(f"flexfl.ratios must be auto or a list of ratios, got {self.ratios!r}")
        ratios = self.fixed_ratios()
        if (not ratios or any(not 0 < r <= 1 for r in ratios)
                or any(a >= b for a, b in itertools.pairwise(ratios)) or ratios[-1] != 1.0):
            raise ValueError(f"flexfl.ratios must increase strictly within (0, 1] and end with 1, got {ratios}")
        if not 0 < self.proxy_fraction <= 1 or not 0 < self.proxy_train < 1:
            raise ValueError("flexfl.proxy_fraction must be in (0, 1] and flexfl.proxy_train in (0, 1)")
        if self.pretrain_rounds < 0:
            raise ValueError(f"flexfl.pretrain_rounds must be non-negative, got {self.pretrain_rounds}")
        if not 0.0001 <= self.step <= 0.5 or not 0 <= self.tolerance < 0.5:
            raise ValueError("flexfl.step must be in [0.0001, 0.5] and flexfl.tolerance in [0, 0.5)")
        if not 0 <= self.adaptive_cut < 1:
            raise ValueError(f"flexfl.adaptive_cut must be in [0, 1), got {self.adaptive_cut}")
        if self.adaptive_cut > 0:
            cut = (f"{self.adaptive_cut} of the full model's size (global)" if self.adaptive_mode == "global"
                   else f"{self.adaptive_cut} of each pool model's own size (relative)")
            for below, ratio in zip([0.0, *ratios], ratios):
                if below == 0.0 and not self.full_variant:
                    continue  # no M1' (the paper's pool)
                if not below < self.adaptive_target(ratio) < ratio:
                    raise ValueError(f"flexfl.adaptive_cut {cut} puts the adaptive variant of the pool model of "
                                     f"{ratio} at {self.adaptive_target(ratio):.3g}, outside the gap to the next "
                                     f"smaller pool model ({below}): Gamma must be smaller than that gap")
        if self.kd_weight < 0 or self.tau <= 0:
            raise ValueError("flexfl.kd_weight must be non-negative and flexfl.tau positive")

    def adaptive_target(self, ratio: float) -> float:
        """The share of the full model's ``size`` an adaptive variant of the pool model of ``ratio`` keeps:
        ``ratio - Gamma`` (``global``, the paper) or ``ratio * (1 - Gamma)`` (``relative``)."""
        return ratio * (1 - self.adaptive_cut) if self.adaptive_mode == "relative" else ratio - self.adaptive_cut

    def fixed_ratios(self) -> list[float]:
        """The configured ratios, or :data:`FLEXFL_RATIOS` where they are ``auto`` (before the fleet is known)."""
        return list(FLEXFL_RATIOS) if self.ratios == "auto" else list(self.ratios)

    def has_variant(self, number: int) -> bool:
        """Whether the pool model ``M{number}`` (1: the smallest) has an adaptive variant."""
        return self.adaptive_cut > 0 and (number > 1 or self.full_variant)
