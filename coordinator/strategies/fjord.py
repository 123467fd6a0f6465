"""FjORD (Horvath et al., NeurIPS 2021): ordered dropout, each device training nested widths up to the widest it
affords, with self-distillation from that widest one.

The levels are the widths of ``fjord.widths`` (the paper's grid 1, 0.8, 0.6, 0.4, 0.2, named a, b, ...; channels
of every hidden layer ``ceil(p C)``, the leading ones: nested prefixes as HeteroFL's). A device is sent its
``p_max``, the widest level whose estimated training memory fits the budget it reports (the paper's tiers, in
memory), and trains it with ordered dropout (``TrainingPlan.widths``): every local batch draws ``p`` uniformly from
the grid's widths up to ``p_max`` and trains the ``p``-width prefix of the model it holds. With ``fjord.distill``
(the paper's D-KD, the default) every batch first trains ``p_max`` on the labels and then the drawn width on
``KL(softmax(z_pmax) || softmax(z_p))`` (a ``width_kd`` term, temperature 1), one optimizer step for both; the
estimate counts ``p_max``'s pass and the widest narrower one's after it. Aggregation is masked and
sample-weighted, as the reference code: each element the mean over the devices whose ``p_max`` holds it, weighted
by their samples. Each round every width is evaluated (its own static-BN statistics: FjORD keeps BN statistics per
width) and the global model (width 1).

Where this differs from the reference code (Flower's ``baselines/fjord``): its BN layers keep running statistics
per width and share the affine parameters; here training normalises with batch statistics and the server
recomputes every width's statistics for evaluation (HeteroFL's static BN), which is what per-width statistics
amount to at test time. HeteroFL's Scaler (outputs divided by the width during training) is kept, as for every
width method here. Agents that predate ordered dropout (protocol revision 4) are sent their ``p_max`` without it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from coordinator.levels import Level, width_levels
from coordinator.strategies.base import EvalTarget, TaskResult
from coordinator.strategies.leveled import LevelStrategy
from models import SubmodelSpec
from protocol import LossTerm, TrainingPlan

__all__ = ["FjORD"]


class FjORD(LevelStrategy):
    """The grid's widths as levels, each device's the widest it affords, trained with ordered dropout (see the
    module docstring)."""

    name = "fjord"

    def make_levels(self) -> list[Level]:
        return width_levels(self.config.fjord.widths)

    def setting_to_shrink(self) -> str:
        return f"a smaller last width in fjord.widths (now {self.config.fjord.widths[-1]:g})"

    def level_plan(self, level: Level, round_number: int) -> TrainingPlan:
        """The level's width as p_max: ordered dropout over the grid's widths up to it, with D-KD when
        ``fjord.distill``; the smallest width trains alone (nothing narrower to draw)."""
        p_max = level.spec.width
        widths = tuple(width for width in self.config.fjord.widths if width <= p_max)
        ce = LossTerm.ce(masked=self.masked_ce)
        if len(widths) == 1:
            return self.recipe_plan((ce,))
        loss = (ce, LossTerm.width_kd(tau=1.0)) if self.config.fjord.distill else (ce,)
        return replace(self.recipe_plan(loss), widths=widths)

    def trained_targets(self, spec: SubmodelSpec, targets: Mapping[str, EvalTarget]) -> set[str]:
        """Every width up to the update's p_max: ordered dropout trains each of them."""
        return {level.name for level in self.levels if level.spec.width <= spec.width}

    def weight(self, result: TaskResult) -> float:
        """Sample-weighted, whatever ``weighting`` says (FjORD aggregates by the clients' data)."""
        return float(max(1, result.num_samples))
