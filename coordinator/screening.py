"""Screening updates before aggregation: an update that no honest run of its plan could produce, or that moved far
more than the updates like it, is left out with a reason.

The change of an update is the L2 norm of (trained - sent) over every element it trained. Two rules, both on
quantities that a thin slice, a shallow exit, a few depth-wise blocks or many local steps do not inflate by
construction:

1. **The plan's reach** (by construction, never an honest update). Every optimizer step of the training-plan
   interpreter clips the gradient to ``clip_norm`` and adds weight decay, and momentum ``beta`` sums the past
   steps with weights ``beta^k``; so ``T`` steps at learning rate ``lr`` move the weights by at most
   ``B = lr R (clip + wd W)``, with ``R = sum_t (1 - beta^t) / (1 - beta)`` over the steps of each stage (every
   stage starts a fresh optimizer, so its momentum builds up from nothing) and ``W`` bounding the weights' norm
   (``|sent| + B``, solved for ``B``). The steps count the batches of every stage the device trained (its
   samples, the plan's epochs and batch size; micro-batches accumulate into one step), under the most permissive
   plan its task allowed. An update whose change exceeds ``B`` (by more than :data:`REACH_TOLERANCE`: a single
   clipped step without weight decay uses its whole reach, and float32 rounding lands it a few parts per million
   above) is rejected whatever the rest of the round did. Without ``clip_norm`` there is no such bound and only
   rule 2 applies.
2. **Like with like.** An update is compared with the other updates of the same trained spec in the round that
   passed rule 1, on two figures: its change, and its change divided by the plan's reach ``lr R`` (the mean
   effective gradient norm: steps, learning rate and momentum taken out). It is rejected only when both exceed
   ``max_ratio`` times the peers' medians: the change per step alone would make a device with little data an
   outlier (an honest change grows more slowly than its steps: 24 samples scored 15 times 800 samples' figure at
   15 epochs), the change alone a device with much data. Updates of other specs (another width, depth, exit or
   segment) are never the yardstick, and the rule needs at least ``min_peers`` of them.

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
from coordinator.tasks import TaskResult
from models import SubmodelSpec
from protocol import TrainingPlan

__all__ = ["REACH_TOLERANCE", "Change", "beyond_reach", "change_of", "change_of_result", "momentum_reach", "outliers",
           "plan_steps", "screen"]

#: How far above the plan's reach a change may measure before rule 1 rejects it (relative): rounding only.
REACH_TOLERANCE = 1e-3


def _norm(tensors: Mapping[str, torch.Tensor], minus: Mapping[str, torch.Tensor] | None = None) -> float:
    """The L2 norm over every tensor (of ``tensors - minus``), squares summed in float64."""
    total = 0.0
    for key, tensor in tensors.items():
        value = tensor - minus[key] if minus is not None else tensor
        total += float(torch.linalg.vector_norm(value, dtype=torch.float64)) ** 2
    return math.sqrt(total)


def plan_steps(epochs: int, batch_size: int, samples: int) -> int:
    """Optimizer steps of ``epochs`` epochs over ``samples`` local samples in batches of ``batch_size`` (an upper
    bound: a last batch of one sample is skipped)."""
    return epochs * math.ceil(max(1, samples) / batch_size)


def momentum_reach(steps: int, momentum: float) -> float:
    """How far ``steps`` steps of SGD with ``momentum`` (a fresh buffer, as every stage's optimizer starts with)
    can move the weights per unit of learning rate and gradient norm: ``sum_t (1 - beta^t) / (1 - beta)``."""
    if momentum == 0.0:
        return float(steps)
    return (steps - momentum * (1.0 - momentum ** steps) / (1.0 - momentum)) / (1.0 - momentum)


@dataclass(frozen=True)
class Change:
    """How far an update moved its weights, and how far its plan could move them.

    ``norm``: ``|trained - sent|`` (inf or nan when not finite); ``steps``: the most optimizer steps its plan
    takes on the device's samples; ``reach``: ``lr`` times :func:`momentum_reach` summed over the stages;
    ``bound``: the most an honest run can move them (None without gradient clipping).
    """

    norm: float
    steps: int
    reach: float
    bound: float | None

    @property
    def score(self) -> float:
        """The change per unit of reach: the mean effective gradient norm of the run."""
        return self.norm / self.reach if self.reach > 0 else math.inf

    def as_dict(self) -> dict[str, float | None]:
        """``norm``, ``steps``, ``per_step`` (:attr:`score`) and ``bound`` (None without gradient clipping); a
        value that is not finite is None (standard JSON has no NaN)."""
        values = {"norm": self.norm, "steps": float(self.steps), "per_step": self.score, "bound": self.bound}
        return {key: value if value is not None and math.isfinite(value) else None for key, value in values.items()}


def change_of(trained: Mapping[str, torch.Tensor], sent: Mapping[str, torch.Tensor], plan: TrainingPlan,
              stage_steps: Sequence[int]) -> Change:
    """The :class:`Change` of an update that trained stages of ``stage_steps`` steps each with ``plan``'s
    optimizer from ``sent``."""
    return _change(_norm(trained, sent), _norm(sent), plan, stage_steps)


def _change(norm: float, sent_norm: float, plan: TrainingPlan, stage_steps: Sequence[int]) -> Change:
    """The :class:`Change` of an update that moved ``norm`` from weights of norm ``sent_norm`` with ``plan``."""
    settings = plan.optimizer
    reach = settings.lr * sum(momentum_reach(steps, settings.momentum) for steps in stage_steps)
    bound: float | None = None
    if settings.clip_norm is not None:
        decay = reach * settings.weight_decay
        # B = reach (clip + wd (|sent| + B))  =>  B (1 - reach wd) = reach (clip + wd |sent|)
        bound = math.inf if decay >= 1 else reach * (settings.clip_norm + settings.weight_decay * sent_norm) / (
            1.0 - decay)
    return Change(norm, sum(stage_steps), reach, bound)


def _stage_steps(result: TaskResult, plan: TrainingPlan) -> list[int]:
    """The most steps of each stage the device may have run with ``plan`` on the spec it trained: one stage per
    segment (the plan's epochs each, or its schedule's when that fits the segments), else one."""
    count = len(result.spec.segments) if result.spec.segments is not None else 1
    epochs = ([stage.epochs for stage in plan.schedule] if len(plan.schedule) == count
              else [plan.epochs] * count)
    return [plan_steps(e, plan.batch_size, result.num_samples) for e in epochs]


def change_of_result(result: TaskResult, sent: Mapping[str, torch.Tensor]) -> Change:
    """The :class:`Change` of a validated update, against the most permissive of the plans its task allowed (the
    plan sent, or any of its adaptation's candidates)."""
    plans = [result.task.plan]
    if result.task.adaptation is not None:
        plans += [candidate.plan for candidate in result.task.adaptation.candidates]
    norm, sent_norm = _norm(result.state, sent), _norm(sent)  # measured once, whatever the plans
    changes = [_change(norm, sent_norm, plan, _stage_steps(result, plan)) for plan in plans]
    return max(changes, key=lambda c: (math.inf if c.bound is None else c.bound, c.reach))


def screen(results: Sequence[TaskResult], sent_of: Callable[[TaskResult], Mapping[str, torch.Tensor]],
           config: ScreeningConfig) -> tuple[list[TaskResult], list[tuple[TaskResult, str]], list[Change]]:
    """Split ``results`` into those to aggregate and those rejected, with the reason (see the module docstring),
    and give every result's :class:`Change` (in order). ``sent_of(result)`` gives the weights its task sent, for
    the keys it trained. (The daemon applies the two rules apart: :func:`beyond_reach` as each update comes,
    :func:`outliers` once the round has closed.)"""
    changes = [change_of_result(result, sent_of(result)) for result in results]
    if not config.enabled:
        return list(results), [], changes
    first = [beyond_reach(result, change) for result, change in zip(results, changes)]
    second = outliers([(result.spec, change) for result, change in zip(results, changes)],
                      [reason is None for reason in first], config)
    kept: list[TaskResult] = []
    rejected: list[tuple[TaskResult, str]] = []
    for index, result in enumerate(results):
        reason = first[index] or second[index]
        if reason is None:
            kept.append(result)
        else:
            rejected.append((result, reason))
    return kept, rejected, changes


def local_noise_reach(result: TaskResult) -> float:
    """How far the noise a device adds under local differential privacy (``plan.update_clip``) may move its update:
    ``noise_multiplier * bound * (sqrt(values) + 5)``, the noise vector's norm with five standard deviations' room
    (0 without such noise)."""
    return _local_noise(result, +5.0)


def _local_noise(result: TaskResult, room: float) -> float:
    """``noise_multiplier * bound * (sqrt(values) + room)`` of the noise a device adds under local differential
    privacy (``values``: the floating values it sends); 0 without such noise."""
    clip = result.task.plan.update_clip
    if clip is None or clip.noise_multiplier == 0:
        return 0.0
    values = sum(tensor.numel() for tensor in result.state.values() if tensor.is_floating_point())
    return clip.noise_multiplier * clip.bound * (math.sqrt(values) + room)


def local_noise_floor(result: TaskResult) -> float:
    """The least norm the noise a device adds under local differential privacy gives its update, with five standard
    deviations' room: ``noise_multiplier * bound * (sqrt(values) - 5)`` (0 without such noise)."""
    return max(0.0, _local_noise(result, -5.0))


def beyond_reach(result: TaskResult, change: Change) -> str | None:
    """Rule 1: why no honest run of the plan makes this update (non-finite, or beyond the plan's reach)."""
    if not math.isfinite(change.norm):
        return "update rejected: its weights are not finite"
    if change.bound is not None and change.norm > change.bound * (1 + REACH_TOLERANCE) + local_noise_reach(result):
        optimizer = result.task.plan.optimizer
        return (f"update rejected: its change (norm {change.norm:.3g}) is {change.norm / change.bound:.1f} times "
                f"the most its training plan can move the weights ({change.bound:.3g}: {change.steps} steps at lr "
                f"{optimizer.lr:g}, momentum {optimizer.momentum:g}, gradients clipped to {optimizer.clip_norm:g})")
    return None


def outliers(updates: Sequence[tuple[SubmodelSpec, Change]], passed: Sequence[bool],
             config: ScreeningConfig) -> list[str | None]:
    """Rule 2 over a round's updates (their trained spec and change; ``passed``: whether each passed rule 1): why
    each one that passed is an outlier among the others of its spec that passed, else None. Needs only the
    changes, not the weights."""
    reasons: list[str | None] = []
    for index, (spec, change) in enumerate(updates):
        peers = [other for j, (other_spec, other) in enumerate(updates)
                 if j != index and other_spec == spec and passed[j]]
        reasons.append(_outlier(change, spec, peers, config) if passed[index] else None)
    return reasons


def _outlier(change: Change, spec: SubmodelSpec, peers: Sequence[Change], config: ScreeningConfig) -> str | None:
    """Rule 2 for one update: why its change is an outlier among its ``peers`` (other updates of its spec)."""
    if len(peers) < config.min_peers:
        return None
    per_step = statistics.median(peer.score for peer in peers)
    total = statistics.median(peer.norm for peer in peers)
    if per_step > 0 and total > 0 and change.score > config.max_ratio * per_step and \
            change.norm > config.max_ratio * total:
        return (f"update rejected: its change per step ({change.score:.3g}) is {change.score / per_step:.1f} times "
                f"and its change ({change.norm:.3g}) {change.norm / total:.1f} times the medians of the round's "
                f"{len(peers)} other updates of {spec.describe()} ({per_step:.3g}, {total:.3g}), both above "
                f"screening.max_ratio {config.max_ratio:g}")
    return None
