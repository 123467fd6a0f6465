"""The slice a device's update of a secure round holds, cut by the coordinator from what it said it trained, as
the masked aggregation cuts a plain update (`coordinator.intake.UpdateIntake.unpack`,
`coordinator.aggregation.RoundAggregate`): per tensor, the global indices it holds (its coverage) and where they sit
in the tensors it sends (its positions: all of them, but for a masked cross-entropy's classifier rows of classes it
never saw). Tensors are named ``group/key``; only floating ones are aggregated."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from coordinator.tasks import State, TaskPlan
from models import ModelFamily, SubmodelSpec

__all__ = ["Slice", "cut_slice", "global_shapes", "secure_name"]


def secure_name(group: str, key: str) -> str:
    """A global tensor's name in a secure round."""
    return f"{group}/{key}"


@dataclass(frozen=True)
class Slice:
    """What one update holds: its spec, labels, coverage and positions (tensors named ``group/key``), and the model
    keys it sends (each ``secure_name(group, key)``)."""

    spec: SubmodelSpec
    labels: tuple[int, ...]
    group: str
    coverage: dict[str, tuple[np.ndarray, ...]]
    positions: dict[str, tuple[np.ndarray, ...]]

    def key_of(self, name: str) -> str:
        """The model key of the tensor ``name``."""
        return name[len(self.group) + 1:]

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape of the values the update sends for ``name``."""
        return tuple(len(index) for index in self.coverage[name])


def global_shapes(states: Mapping[str, State]) -> dict[str, tuple[int, ...]]:
    """Every floating tensor of every group, by its secure name."""
    return {secure_name(group, key): tuple(value.shape) for group, state in states.items()
            for key, value in state.items() if value.is_floating_point()}


def cut_slice(family: ModelFamily, task: TaskPlan, spec_trained: dict[str, Any] | None, labels: Sequence[int],
              states: Mapping[str, State], classifier_keys: Sequence[str], num_classes: int) -> Slice:
    """The slice of an update that says it trained ``spec_trained`` (None: the task's spec) on ``labels``; ValueError
    when that is not a sub-model of the task's."""
    spec = (SubmodelSpec.from_dict(spec_trained).rolled(task.spec.roll) if spec_trained is not None
            else task.spec)
    family.validate_spec(spec)
    if not family.is_nested(spec, task.spec):
        raise ValueError(f"agent trained {spec.describe()}, which is not inside the {task.spec.describe()} sent")
    state = states[task.group]
    index_map = family.index_map(spec)
    seen = torch.as_tensor(sorted({label for label in labels if label < num_classes}), dtype=torch.long)
    coverage, positions = {}, {}
    for key in family.trainable_keys(spec):
        if not state[key].is_floating_point():
            continue
        indices = [idx.detach().cpu() for idx in index_map[key]]
        where = [torch.arange(len(idx)) for idx in indices]
        if task.plan.uses_masked_ce and key in classifier_keys:
            where[0] = torch.isin(indices[0], seen).nonzero().flatten()
            indices[0] = indices[0][where[0]]
        if any(len(idx) == 0 for idx in indices):
            continue  # (a classifier of no seen class: nothing of it is aggregated)
        name = secure_name(task.group, key)
        coverage[name] = tuple(idx.numpy().astype(np.int64) for idx in indices)
        positions[name] = tuple(pos.numpy().astype(np.int64) for pos in where)
    return Slice(spec, tuple(labels), task.group, coverage, positions)
