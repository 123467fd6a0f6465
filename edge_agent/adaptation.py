"""Adaptation: what the agent trains when it cannot afford the spec it was sent.

The coordinator says how the agent may shrink, as data (the task's ``adaptation``): a ladder of candidate
(spec, plan) pairs, largest first (HeteroFL's smaller width levels, ScaleFL's lower exits, later FlexFL's and
AdaptiveFL's pools), or, from coordinators that predate ladders, HeteroFL's ``width-levels``. :func:`options`
turns the task into what the agent may train, the sent spec first, and :func:`choose` takes the first whose
(calibrated) estimate fits. A candidate must be nested inside the sent spec (its weights are cut out of the
received ones); others are ignored.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

import numpy as np
import torch

from models import ModelFamily, SubmodelSpec
from models.training import check_plan
from protocol import Adaptation, TrainingPlan


@dataclass(frozen=True)
class Option:
    """Something the agent may train: a sub-model spec and the plan to train it with."""

    spec: SubmodelSpec
    plan: TrainingPlan

    def describe(self) -> str:
        """The spec in readable form, and the copies when the plan trains more than one."""
        return self.spec.describe() + (f" x{self.plan.copies} copies" if self.plan.copies > 1 else "")


def options(family: ModelFamily, sent: SubmodelSpec, plan: TrainingPlan, hint: Adaptation | None) -> list[Option]:
    """What the agent may train for a task, in order of preference: ``sent`` with ``plan``, ``sent`` with fewer
    of the plan's copies (down to one: ``copies`` is a cap, the device takes as many as its memory holds), then
    the hint's candidates nested inside ``sent`` (each with its own plan, run with the task's seed).

    A ``depthwise`` hint's whole-model options drop the sent spec's exits: they are the auxiliary classifiers
    of depth-wise stages (route ``"exit"``), and a model trained whole learns through its own head.

    Raises ``ValueError`` for a spec that is malformed or does not fit the family, or a plan that cannot run on
    its spec (:func:`models.training.check_plan`); the message names the candidate. A ``width-levels`` level the
    task's plan cannot run on (a ``nested_kd`` teacher wider than the level) is left out.
    """
    check_plan(family, sent, plan)
    if hint is not None and hint.kind == "depthwise" and any(term.kind == "nested_kd" for term in plan.loss):
        raise ValueError("a depth-wise adaptation cannot train a plan with nested_kd terms (its stages have no "
                         "nested teachers)")
    if hint is not None and hint.kind == "depthwise" and plan.ordered_dropout:
        raise ValueError("a depth-wise adaptation cannot train a plan with ordered dropout (its widths are of the "
                         "whole model)")
    whole = replace(sent, exits=()) if hint is not None and hint.kind == "depthwise" else sent
    found = [Option(whole, replace(plan, copies=count)) for count in range(plan.copies, 0, -1)]
    if hint is None or hint.kind == "none":
        return found
    if hint.kind == "width-levels":  # the task's plan on each level it can run on (nested_kd teachers must fit)
        smaller = sorted((rate for rate in set(hint.rates) if rate < sent.width), reverse=True)
        levels = [SubmodelSpec.uniform(rate, sent.rounding) for rate in smaller]
        candidates = [Option(level, plan) for level in levels if _runs(family, level, plan)]
    else:
        candidates = []
        for index, candidate in enumerate(hint.candidates):
            try:
                spec = family.validate_spec(SubmodelSpec.from_dict(candidate.spec))
                check_plan(family, spec, candidate.plan)
            except ValueError as exc:
                raise ValueError(f"adaptation candidate {index}: {exc}") from None
            # (The task's clip bound holds for whatever the device trains instead: differential privacy.)
            candidates.append(Option(spec, replace(candidate.plan, seed=plan.seed,
                                                   update_clip=candidate.plan.update_clip or plan.update_clip)))
    for option in candidates:
        if option.spec != sent and family.is_nested(option.spec, sent) and option not in found:
            found.append(option)
    return found


def _runs(family: ModelFamily, spec: SubmodelSpec, plan: TrainingPlan) -> bool:
    """Whether ``plan`` can run on ``spec`` (:func:`models.training.check_plan`)."""
    try:
        check_plan(family, spec, plan)
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class Choice:
    """The option chosen to train and its estimated peak (None when nothing fits)."""

    option: Option | None
    estimate: int
    tried: tuple[tuple[str, int], ...]


def choose(candidates: list[Option], estimate: Callable[[Option], int], available: int) -> Choice:
    """The first candidate whose estimate fits ``available`` bytes."""
    tried = []
    for option in candidates:
        needed = estimate(option)
        tried.append((option.describe(), needed))
        if needed <= available:
            return Choice(option, needed, tuple(tried))
    return Choice(None, tried[-1][1] if tried else 0, tuple(tried))


def cut_nested(received: Mapping[str, np.ndarray], index_map: Mapping[str, tuple[torch.Tensor, ...]],
               keys: tuple[str, ...]) -> dict[str, np.ndarray]:
    """The weights of a smaller sub-model cut out of the received (larger) one, as new arrays.

    Sub-models are nested prefixes, so the global indices of the smaller spec (``index_map`` of that spec) are
    also positions in the received tensors; a spec that is not nested inside the received one is refused.
    """
    out = {}
    for key in keys:
        if key not in received:
            raise ValueError(f"the adapted spec needs tensor {key!r}, which the task did not carry")
        array, indices = received[key], [index.numpy() for index in index_map[key]]
        if any(len(idx) and int(idx.max()) >= size for idx, size in zip(indices, array.shape)):
            raise ValueError(f"the adapted spec is not nested inside the received one (tensor {key!r})")
        out[key] = np.ascontiguousarray(array[np.ix_(*indices)] if indices else array.copy())
    return out
