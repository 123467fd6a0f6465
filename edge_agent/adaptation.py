"""Adaptation: what the agent trains when it cannot afford the spec it was sent.

The coordinator says how the agent may shrink (the task's ``adaptation`` hint, data not code); an
:class:`Adaptation` turns the sent spec into candidates from largest to smallest, and :func:`choose` takes the
first whose (calibrated) estimate fits. Later methods plug in here: FlexFL's APoZ-guided pruning steps,
AdaptiveFL's (r_w, I) pool, ScaleFL's lower exits, FeDepth's depth-wise decomposition.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from models import SubmodelSpec


class Adaptation(ABC):
    """Candidates to train instead of ``sent``, largest first, ``sent`` itself included first."""

    kind: str = ""

    @abstractmethod
    def candidates(self, sent: SubmodelSpec) -> list[SubmodelSpec]:
        """Specs the agent may train, in order of preference."""


class NoAdaptation(Adaptation):
    """Train exactly what was sent, or decline."""

    kind = "none"

    def candidates(self, sent: SubmodelSpec) -> list[SubmodelSpec]:
        return [sent]


@dataclass(frozen=True)
class WidthLevels(Adaptation):
    """HeteroFL: fall back to the next smaller uniform width level, down to the smallest."""

    rates: tuple[float, ...]
    kind = "width-levels"

    def candidates(self, sent: SubmodelSpec) -> list[SubmodelSpec]:
        smaller = sorted((rate for rate in set(self.rates) if rate < sent.width), reverse=True)
        return [sent, *(SubmodelSpec.uniform(rate) for rate in smaller)]


def adaptation_from_hint(hint: Mapping[str, Any] | None) -> Adaptation:
    """The adaptation a task's hint asks for; ValueError for an unknown or malformed hint."""
    if hint is None or hint.get("kind") in (None, "none"):
        return NoAdaptation()
    if hint.get("kind") == "width-levels":
        rates = hint.get("rates")
        if not isinstance(rates, list) or not rates or not all(
                isinstance(r, (int, float)) and not isinstance(r, bool) and 0 < r <= 1 for r in rates):
            raise ValueError("a width-levels adaptation needs 'rates': a list of numbers in (0, 1]")
        return WidthLevels(tuple(float(r) for r in rates))
    raise ValueError(f"unknown adaptation kind {hint.get('kind')!r}; this agent knows 'none' and 'width-levels'")


@dataclass(frozen=True)
class Choice:
    """The spec chosen to train and its estimated peak (None when nothing fits)."""

    spec: SubmodelSpec | None
    estimate: int
    tried: tuple[tuple[str, int], ...]


def choose(candidates: list[SubmodelSpec], estimate: Callable[[SubmodelSpec], int], available: int) -> Choice:
    """The first candidate whose estimate fits ``available`` bytes."""
    tried = []
    for spec in candidates:
        needed = estimate(spec)
        tried.append((spec.describe(), needed))
        if needed <= available:
            return Choice(spec, needed, tuple(tried))
    return Choice(None, tried[-1][1] if tried else 0, tuple(tried))


def cut_nested(received: Mapping[str, np.ndarray], index_map: Mapping[str, tuple[torch.Tensor, ...]],
               keys: tuple[str, ...]) -> dict[str, np.ndarray]:
    """The weights of a smaller sub-model cut out of the received (larger) one, as new arrays.

    Sub-models are nested prefixes, so the global indices of the smaller spec (``index_map`` of that spec) are
    also positions in the received tensors; a spec that is not nested inside the received one is refused.
    """
    out = {}
    for key in keys:
        array, indices = received[key], [index.numpy() for index in index_map[key]]
        if any(len(idx) and int(idx.max()) >= size for idx, size in zip(indices, array.shape)):
            raise ValueError(f"the adapted spec is not nested inside the received one (tensor {key!r})")
        out[key] = np.ascontiguousarray(array[np.ix_(*indices)] if indices else array.copy())
    return out
