"""DepthFL (Kim, Yu, Kim and Moon, ICLR 2023): depth-scaled sub-models with a classifier after every stage, trained
with mutual self-distillation among the classifiers.

Levels are the model's depths at the end of each stage (:attr:`models.ModelFamily.stage_ends`: PreResNet-20's
3, 6 and 9 blocks; every block of a plain CNN; or ``depthfl.depths``), named ``1`` (the first stage) to ``S`` (the whole body). A level of
depth ``d`` keeps the first ``d`` blocks with an auxiliary classifier after every stage it holds (the model's
early-exit heads, the last stage's the final head for the full depth), so a client of level ``k`` has ``k``
classifiers. Each trains with the paper's loss: ``sum_i [CE(z_i, y) + w / (k - 1) sum_{j != i}
KL(softmax(z_j / tau) || softmax(z_i / tau))]``, every other classifier a detached teacher (mutual, both ways;
``depthfl.kd_weight`` w, 1 by default, optionally ramped up over ``depthfl.kd_rampup`` rounds as the reference
code does). Clients are mapped to the deepest level whose estimated training memory fits the budget they report
(the paper assigns depth by a device's resources; ``level_assignment: dynamic`` samples it), and one short of
memory falls to a shallower level nested in it. Aggregation is masked: each block and classifier is the mean over
the clients that have it (layers beyond a client's depth are untouched by it). Each round the global model is
evaluated at every classifier, as the ensemble of the trained ones (mean logits: the headline,
``coordinator.deployable``), and each level's sub-model at its own last classifier.

Where this differs from the reference code (``baselines/depthfl`` of Flower): the auxiliary classifiers are the
model family's early-exit heads, by default without their convolutions (pooling and a linear layer:
``coordinator.planning.METHOD_MODEL_OPTIONS``; ``model.options.exit_convs`` adds convolutions with batch norm, as
ScaleFL's), not the reference's attention gates and stacks of stride-2 separable convolutions; FedDyn's server
correction (the reference's default) is not applied: this is DepthFL over FedAvg's masked mean (the paper's
DepthFL (FedAvg) rows, which also turn distillation off: ``depthfl.kd_weight: 0``).
"""

from __future__ import annotations

import math

from coordinator.levels import Level
from coordinator.strategies.base import EvalTarget
from coordinator.strategies.leveled import LevelStrategy
from models import SubmodelSpec
from protocol import LossTerm, TrainingPlan
from protocol.plan import MAX_LOSS_TERMS

__all__ = ["DepthFL", "kd_ramp", "mutual_distillation_loss"]


def mutual_distillation_loss(outputs: int, *, weight: float, tau: float = 1.0,
                             masked: bool = False) -> tuple[LossTerm, ...]:
    """DepthFL's loss over ``outputs`` classifiers, as loss terms: the cross-entropy of each, and for each ordered
    pair ``(i, j)``, ``i != j``, ``weight / (outputs - 1)`` times the distillation of classifier ``i`` towards
    classifier ``j`` (detached: each classifier learns from the others, none is pulled towards its students).
    One classifier: its cross-entropy alone; ``weight`` 0: no distillation."""
    if outputs < 1:
        raise ValueError(f"a sub-model has at least one classifier, got {outputs}")
    terms = [LossTerm.ce(output=i, masked=masked) for i in range(outputs)]
    if outputs > 1 and weight > 0:
        share = weight / (outputs - 1)
        terms += [LossTerm.kd(i, j, weight=share, tau=tau, detach_teacher=True)
                  for i in range(outputs) for j in range(outputs) if i != j]
    return tuple(terms)


def kd_ramp(round_number: int, rampup: int) -> float:
    """The reference code's ramp of the distillation weight: ``exp(-5 (1 - min(r, R) / R)^2)`` for ``R``
    ``rampup`` rounds (1 throughout when ``rampup`` is 0)."""
    if rampup <= 0:
        return 1.0
    progress = min(round_number, rampup) / rampup
    return math.exp(-5.0 * (1.0 - progress) ** 2)


class DepthFL(LevelStrategy):
    """Depth levels at the stage ends, a classifier after every stage, mutual self-distillation (see the module
    docstring)."""

    name = "depthfl"

    def make_levels(self) -> list[Level]:
        ends = tuple(self.config.depthfl.depths or self.family.stage_ends)
        blocks = self.family.num_blocks
        if ends[-1] != blocks or any(end - 1 not in self.family.exit_points for end in ends[:-1]):
            raise ValueError(f"depthfl.depths {list(ends)} must end with every block of model "
                             f"{self.family.name!r} ({blocks}) and cut only where an exit may follow a block")
        if len(ends) ** 2 > MAX_LOSS_TERMS:  # k cross-entropies and k(k-1) distillation terms
            raise ValueError(f"DepthFL's {len(ends)} classifiers on model {self.family.name!r} need {len(ends) ** 2} "
                             f"loss terms, more than a plan holds ({MAX_LOSS_TERMS}): set depthfl.depths to at most "
                             f"{int(MAX_LOSS_TERMS ** 0.5)} stage ends")
        levels = []
        for number, depth in enumerate(ends, start=1):
            exits = tuple(end - 1 for end in ends[:number] if end < blocks)
            spec = SubmodelSpec(depth=depth if depth < blocks else None, exits=exits)
            levels.append(Level(str(number), spec, {"blocks": f"{depth}/{blocks}", "classifiers": number}))
        return levels[::-1]

    def global_spec(self) -> SubmodelSpec:
        """The full model with a classifier after every stage."""
        return self.levels[0].spec

    def setting_to_shrink(self) -> str:
        return "a larger memory budget (the shallowest level is the first stage with its classifier)"

    def kd_weight(self, round_number: int) -> float:
        """The distillation weight of a round (``depthfl.kd_weight``, ramped up over ``depthfl.kd_rampup``)."""
        settings = self.config.depthfl
        return settings.kd_weight * kd_ramp(round_number, settings.kd_rampup)

    def level_plan(self, level: Level, round_number: int) -> TrainingPlan:
        outputs = self.family.num_outputs(level.spec)
        return self.recipe_plan(mutual_distillation_loss(outputs, weight=self.kd_weight(round_number),
                                                         tau=self.config.depthfl.tau, masked=self.masked_ce))

    def eval_targets(self) -> dict[str, EvalTarget]:
        """Every level at its last classifier, the global model at each classifier, and their ensemble."""
        targets = super().eval_targets()
        targets["ensemble"] = EvalTarget(self.group_of(self.levels[0]), self.global_spec(), ensemble=True)
        return targets
