"""FedRolex (Alam et al., NeurIPS 2022): HeteroFL's width levels, each cut from a window of channels that rolls
round by round.

A device of width beta trains, in round t, the channels ``(r_t + i) mod C`` (``i < ceil(beta C)``) of every
hidden layer of C channels, r_t advancing by one each round (``fedrolex.direction``: forward, the paper's
``start = t mod C``; backward, the reference code's ``torch.roll``, ``(i - t) mod C``); input channels and
classes stay whole. All devices of a round share the start, so smaller windows are prefixes of larger ones, and
over rounds every channel is trained by every level. Aggregation is HeteroFL's: each element the mean over the
updates that trained it. The window is the coordinator's alone (``SubmodelSpec.roll``): an agent trains its
width as for HeteroFL and is sent it without the roll. As the reference code, only the global model is evaluated.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import replace

from coordinator.registry import AgentRecord
from coordinator.strategies.base import EvalTarget, RoundPlan
from coordinator.strategies.heterofl import HeteroFL


class FedRolex(HeteroFL):
    """HeteroFL's levels and assignment, each task's sub-model at the round's rolling window."""

    name = "fedrolex"

    def roll(self, round_number: int) -> int:
        """Where round ``round_number``'s windows start (round 1 at the leading channels)."""
        steps = round_number - 1
        return steps if self.config.fedrolex.direction == "forward" else -steps

    def configure_round(self, round_number: int, agents: Sequence[AgentRecord], rng: random.Random) -> RoundPlan:
        plan = super().configure_round(round_number, agents, rng)
        roll = self.roll(round_number)
        # Every task, the full width's too (its window is every channel, from r on): an agent that falls down its
        # ladder trains the front of what it was sent, the smaller window at the same start.
        plan.tasks = [replace(task, spec=task.spec.rolled(roll)) for task in plan.tasks]
        return plan

    def eval_targets(self) -> dict[str, EvalTarget]:
        """The global model (a level's prefix is not what any device trains)."""
        return {"global": EvalTarget(self.group_of(self.levels[0]), self.global_spec(), store_bn=True)}
