"""Screening updates before aggregation: an update that no honest run of its plan could produce, or that moved far
more than the updates like it, is left out with a reason.

The change of an update is the L2 norm of (trained - sent) over every element it trained. Two rules, both on
quantities that a thin slice, a shallow exit, a few depth-wise blocks or many local steps do not inflate by
construction:

1. **The plan's reach** (by construction, never an honest update). Every optimizer step of the training-plan
   interpreter clips the gradient to ``clip_norm`` and adds weight decay, and momentum ``beta`` sums the past
   steps with weights ``beta^k``; so ``T`` steps at learning rate ``lr`` move the weights by at most
   ``B = lr T (clip + wd W) / (1 - beta)``, ``W`` bounding the weights' norm (``|sent| + B``, solved for ``B``).
   ``T`` counts the batches of every stage the device trained (its samples, the plan's epochs and batch size;
   micro-batches accumulate into one step). An update whose change exceeds ``B`` is rejected whatever the rest
   of the round did. Without ``clip_norm`` there is no such bound and only rule 2 applies.
2. **Like with like.** The change divided by the plan's reach ``lr T / (1 - beta)`` (the mean effective gradient
   norm: steps and learning rate taken out) is compared with the median of the other updates of the same trained
   spec in the round; one above ``max_ratio`` times that median is rejected. Updates of other specs (another
   width, depth, exit or segment) are never the yardstick, and the rule needs at least ``min_peers`` of them.

What this does not protect against: an update inside its plan's reach and under the ratio (a poisoned direction
of ordinary size: a backdoor, flipped labels), several colluding devices (they move the median), a device that
lies about its sample count to widen its reach, and a round whose spec has too few peers for rule 2 (then rule 1
alone). It stops the blunt attacks: huge, sign-flipped or non-finite weights.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from coordinator.config import ScreeningConfig
from coordinator.strategies.base import TaskResult
from protocol import TrainingPlan

__all__ = ["Change", "change_of", "plan_steps", "screen"]


def _norm(tensors: Mapping[str, torch.Tensor], minus: Mapping[str, torch.Tensor] | None = None) -> float:
    total = 0.0
    for key, tensor in tensors.items():
        value = tensor.double() - minus[key].double() if minus is not None else tensor.double()
        total += float((value * value).sum())
    return math.sqrt(total)


def plan_steps(epochs: int, batch_size: int, samples: int) -> int:
    """Optimizer steps of ``epochs`` epochs over ``samples`` local samples in batches of ``batch_size`` (an upper
    bound: a last batch of one sample is skipped)."""
    return epochs * math.ceil(max(1, samples) / batch_size)


@dataclass(frozen=True)
class Change:
    """How far an update moved its weights, and how far its plan could move them.

    ``norm``: ``|trained - sent|`` (inf or nan when not finite); ``steps``: the most optimizer steps its plan
    takes on the device's samples; ``reach``: ``lr steps / (1 - beta)``; ``bound``: the most an honest run can
    move them (None without gradient clipping).
    """

    norm: float
    steps: int
    reach: float
    bound: float | None

    @property
    def score(self) -> float:
        """The change per unit of reach: the mean effective gradient norm of the run."""
        return self.norm / self.reach if self.reach > 0 else math.inf

    def as_dict(self) -> dict[str, float]:
        """``norm``, ``steps``, ``per_step`` (:attr:`score`) and, with gradient clipping, ``bound``."""
        return {"norm": self.norm, "steps": float(self.steps), "per_step": self.score,
                **({"bound": self.bound} if self.bound is not None else {})}


def change_of(trained: Mapping[str, torch.Tensor], sent: Mapping[str, torch.Tensor], plan: TrainingPlan,
              steps: int) -> Change:
    """The :class:`Change` of an update that trained ``steps`` steps of ``plan`` from ``sent``."""
    norm = _norm(trained, sent)
    settings = plan.optimizer
    damping = 1.0 - settings.momentum
    reach = settings.lr * steps / damping
    bound: float | None = None
    if settings.clip_norm is not None:
        decay = reach * settings.weight_decay
        # B = reach (clip + wd (|sent| + B))  =>  B (1 - reach wd) = reach (clip + wd |sent|)
        bound = math.inf if decay >= 1 else reach * (settings.clip_norm + settings.weight_decay * _norm(sent)) / (
            1.0 - decay)
    return Change(norm, steps, reach, bound)


def _steps_of(result: TaskResult) -> int:
    """The most steps the device may have run: the plan sent or any of its adaptation's candidates, every stage
    of the trained spec (a depth-wise stage runs the plan's epochs)."""
    plans = [result.task.plan]
    if result.task.adaptation is not None:
        plans += [candidate.plan for candidate in result.task.adaptation.candidates]
    stages = len(result.spec.segments) if result.spec.segments is not None else 1
    return max(plan_steps(sum(stage.epochs for stage in plan.schedule) or plan.epochs * stages, plan.batch_size,
                          result.num_samples) for plan in plans)


def screen(results: Sequence[TaskResult], sent_of: Callable[[TaskResult], Mapping[str, torch.Tensor]],
           config: ScreeningConfig) -> tuple[list[TaskResult], list[tuple[TaskResult, str]], list[Change]]:
    """Split ``results`` into those to aggregate and those rejected, with the reason (see the module docstring),
    and give every result's :class:`Change` (in order). ``sent_of(result)`` gives the weights its task sent, for
    the keys it trained."""
    changes = [change_of(result.state, sent_of(result), result.task.plan, _steps_of(result)) for result in results]
    if not config.enabled:
        return list(results), [], changes
    kept: list[TaskResult] = []
    rejected: list[tuple[TaskResult, str]] = []
    for index, (result, change) in enumerate(zip(results, changes)):
        reason = _verdict(index, results, changes, config)
        if reason is None:
            kept.append(result)
        else:
            rejected.append((result, reason))
    return kept, rejected, changes


def _verdict(index: int, results: Sequence[TaskResult], changes: Sequence[Change],
             config: ScreeningConfig) -> str | None:
    """Why update ``index`` is rejected, or None."""
    change = changes[index]
    if not math.isfinite(change.norm):
        return "update rejected: its weights are not finite"
    if change.bound is not None and change.norm > change.bound:
        optimizer = results[index].task.plan.optimizer
        return (f"update rejected: its change (norm {change.norm:.3g}) is {change.norm / change.bound:.1f} times "
                f"the most its training plan can move the weights ({change.bound:.3g}: {change.steps} steps at lr "
                f"{optimizer.lr:g}, momentum {optimizer.momentum:g}, gradients clipped to {optimizer.clip_norm:g})")
    spec = results[index].spec
    peers = [other.score for j, (other, result) in enumerate(zip(changes, results))
             if j != index and result.spec == spec and math.isfinite(other.norm)]
    if len(peers) < config.min_peers:
        return None
    median = statistics.median(peers)
    if median > 0 and change.score > config.max_ratio * median:
        return (f"update rejected: its change per step ({change.score:.3g}) is {change.score / median:.1f} times "
                f"the median of the round's {len(peers)} other updates of {spec.describe()} ({median:.3g}), above "
                f"screening.max_ratio {config.max_ratio:g}")
    return None
