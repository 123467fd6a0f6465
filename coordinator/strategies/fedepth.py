"""FeDepth (memory-adaptive depth-wise learning): every device trains the full model, block by block, sized to
the memory it has.

Every selected device gets the whole full-size model and a ``depthwise`` adaptation: it trains the model whole
when that fits its memory, and otherwise cuts the body into the fewest consecutive segments whose training each
fits (memory-adaptive decomposition, decided on the device from its own calibrated estimates) and trains them one
after another, each with the classifier head through the skip path, the blocks before it frozen (depth-wise
sequential learning), or, with ``fedepth.route: exit``, each through the auxiliary classifier after it (the
global model then carries one after every block, trained only by the devices whose segments end there). Blocks
that fit nowhere are skipped (partial training): not trained, not uploaded; where no block fits, the device
trains the classifier head alone on the frozen output of every block (partial training of what fits: on a CPU
the frozen body runs from the weights it received, so only the head and one batch's pass count). A device
that can hold more than one copy of the whole model trains up to ``fedepth.max_copies`` of them with mutual
distillation (m-FeDepth) and uploads one. Aggregation is the sample-weighted mean of what each device trained
(Alg. 1 line 7), masked so that skipped blocks do not dilute it.
"""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Any

from coordinator.levels import Level
from coordinator.registry import AgentRecord
from coordinator.strategies.base import EvalTarget, TaskResult
from coordinator.strategies.leveled import LevelStrategy
from models import SubmodelSpec
from models.depthwise import cut_segments, micro_batch_ladder
from protocol import Adaptation, LossTerm, Stage, TrainingPlan

__all__ = ["FeDepth"]

#: What serves a budget that no block alone, nor the head alone, fits at any micro-batch.
_LIGHTER = ("a model with lighter blocks (even the head alone runs every block frozen, whatever the micro-batch; "
            "FeDepth's paper model: preresnet20)")


class FeDepth(LevelStrategy):
    """The full model for every device, trained whole or depth-wise as its memory allows (see the module)."""

    name = "fedepth"

    def largest_whole_model(self) -> str | None:
        return None  # a device that cannot train the whole model trains it block by block

    def setting_to_shrink(self) -> str:
        floor = self.config.fedepth.min_micro_batch
        return (f"smaller micro-batches (fedepth.min_micro_batch, now {floor}{': none' * (floor == 0)})"
                if floor != 2 else _LIGHTER)

    def make_levels(self) -> list[Level]:
        exits = self.family.exit_points if self.config.fedepth.route == "exit" else ()
        return [Level("full", SubmodelSpec(exits=exits), {})]

    def global_spec(self) -> SubmodelSpec:
        """The full model, with an auxiliary classifier after every block when segments train through them."""
        return self.levels[0].spec

    def choose_level(self, agent: AgentRecord, rng: random.Random, round_number: int) -> Level | None:
        return self.levels[0]  # the device decides how to fit it

    def ladder(self, level: Level, round_number: int) -> Adaptation | None:
        settings = self.config.fedepth
        return Adaptation("depthwise", route=settings.route, min_micro_batch=settings.min_micro_batch,
                          head_alone=True)  # the daemon clears it for agents that cannot read it

    def whole_once(self) -> tuple[SubmodelSpec, TrainingPlan]:
        """The full model trained whole, once (one copy, no auxiliary classifiers)."""
        return SubmodelSpec.full(), self.recipe_plan()

    def level_plan(self, level: Level, round_number: int) -> TrainingPlan:
        """The recipe's plan, with up to ``fedepth.max_copies`` copies and their mutual distillation term (a
        device trains as many copies as its memory holds, one when it trains depth-wise)."""
        plan = super().level_plan(level, round_number)
        settings = self.config.fedepth
        if settings.max_copies == 1:
            return plan
        mutual = LossTerm.mutual_kd(weight=settings.mutual_weight, tau=1.0)
        return replace(plan, loss=(*plan.loss, mutual), copies=settings.max_copies)

    def weight(self, result: TaskResult) -> float:
        """Sample-weighted, whatever ``weighting`` says (FeDepth aggregates by the clients' data shares)."""
        return float(max(1, result.num_samples))

    def eval_targets(self) -> dict[str, EvalTarget]:
        return {"global": EvalTarget("global", self.global_spec(), store_bn=True)}

    def describe(self) -> list[dict[str, Any]]:
        """The one model every device gets, with the memory of training it whole once and, when m-FeDepth is on,
        with all its copies."""
        spec, plan = self.whole_once()
        row: dict[str, Any] = {"name": "full", "spec": self.global_spec().describe(),
                               "params": self.family.param_count(self.global_spec()),
                               "macs": self.family.flops(spec, self.context.input_size),
                               "train_bytes": self.training_cost(spec, plan)}
        copies = self.config.fedepth.max_copies
        if copies > 1:
            row[f"x{copies}_copies_train_bytes"] = self.training_cost(spec, self.level_plan(self.levels[0], 1))
        return [row]

    def plan_for_budget(self, budget: int) -> dict[str, Any]:
        """The decomposition a device with ``budget`` bytes would train, by the device's own rule
        (:meth:`training_cost`): its segments, the blocks it skips, and each segment's memory; the head alone
        where no block fits; nothing (with the least it would need) where not even the head fits."""
        capped = self.level_plan(self.levels[0], 1)
        for copies in range(capped.copies, 1, -1):
            train_bytes = self.training_cost(SubmodelSpec.full(), replace(capped, copies=copies))
            if train_bytes <= budget:
                return {"trains": f"whole, {copies} copies", "train_bytes": train_bytes}
        plan = replace(capped, copies=1)
        whole = self.training_cost(SubmodelSpec.full(), plan)
        if whole <= budget:
            return {"trains": "whole", "train_bytes": whole}
        blocks = self.family.num_blocks
        route = self.config.fedepth.route
        ladder = micro_batch_ladder(plan.batch_size, self.config.fedepth.min_micro_batch)

        def cost(start: int, stop: int, micro: int = 0) -> float:
            exits = (stop - 1,) if route == "exit" and stop < blocks else ()
            staged = replace(plan, schedule=(Stage(plan.epochs, route, micro_batch=micro),))
            return float(self.training_cost(SubmodelSpec(exits=exits, segments=((start, stop),)), staged))

        cut = cut_segments(cost, blocks, budget, micro_cost=cost, micro_batches=ladder, head_only=True)
        if not cut.segments:  # no block alone, nor the head alone on the frozen blocks
            least = ladder[-1] if ladder else 0
            answer = self.nothing_fits(int(min(cost(b, min(b + 1, blocks), least) for b in range(blocks + 1))))
            if least != 2 and min(cost(b, min(b + 1, blocks), 2) for b in range(blocks + 1)) > budget:
                answer["to_fit"] = _LIGHTER  # not even micro-batches of 2 would do
            return answer
        if cut.head_only:
            micro = cut.micro_batch(0)
            return {"trains": "head alone", "segments": f"on frozen blocks 0-{blocks - 1}" + (
                        f" (micro-batches of {micro})" if micro else ""), "cut": [list(cut.segments[0])],
                    "train_bytes": [int(cost(blocks, blocks, micro))]}
        return {"trains": "depth-wise" + (" via auxiliary classifiers" if route == "exit" else ""),
                "segments": cut.describe(), "cut": [list(segment) for segment in cut.segments],
                "train_bytes": [int(cost(*segment, cut.micro_batch(i))) for i, segment in enumerate(cut.segments)]}
