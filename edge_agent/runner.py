"""Turns one task into one update: validate, check memory, train, package the weights."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from edge_agent.memory import available_memory
from edge_agent.training import train_plain
from models import ModelFamily, SubmodelSpec, get_family
from protocol import ModelRef, Task, Update


@dataclass
class LocalData:
    """The agent's private training data, already normalised (N x C x H x W float32, int64 labels)."""

    x: torch.Tensor
    y: torch.Tensor

    def __post_init__(self) -> None:
        if self.x.ndim != 4 or len(self.x) != len(self.y) or len(self.x) == 0:
            raise ValueError(f"local data must be a non-empty N x C x H x W batch with N labels, got "
                             f"{tuple(self.x.shape)} and {tuple(self.y.shape)}")
        self.labels = sorted(int(v) for v in torch.unique(self.y))

    @property
    def image_size(self) -> tuple[int, int]:
        return int(self.x.shape[2]), int(self.x.shape[3])

    @property
    def in_channels(self) -> int:
        return int(self.x.shape[1])


class TaskRejected(Exception):
    """The task cannot be served; ``status`` is "declined" (not affordable, too late) or "failed"."""

    def __init__(self, status: str, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


class TaskRunner:
    """Serves tasks for one agent: keeps model families warm and its data in memory."""

    def __init__(self, agent_id: str, data: LocalData, budget_bytes: int | None = None,
                 device: str = "cpu") -> None:
        self.agent_id = agent_id
        self.data = data
        self.budget_bytes = budget_bytes
        self.device = device
        self._families: dict[tuple[str, int, int, str], ModelFamily] = {}

    def run(self, task: Task) -> Update:
        """Run ``task``; any failure becomes an update with status declined/failed and the reason."""
        try:
            return self._train(task)
        except TaskRejected as exc:
            return self._answer(task, exc.status, reason=exc.reason)
        except (ValueError, RuntimeError, FloatingPointError) as exc:
            return self._answer(task, "failed", reason=f"{type(exc).__name__}: {exc}")

    def family_for(self, ref: ModelRef) -> ModelFamily:
        key = (ref.family, ref.num_classes, ref.in_channels, repr(sorted(ref.options.items())))
        if key not in self._families:
            self._families[key] = get_family(ref.family, ref.num_classes, ref.in_channels, **ref.options)
        return self._families[key]

    def estimate(self, family: ModelFamily, spec: SubmodelSpec, batch_size: int) -> int:
        """Predicted peak training memory of ``spec`` on this device."""
        return family.training_memory_bytes(spec, batch_size=batch_size, input_size=self.data.image_size)

    def _train(self, task: Task) -> Update:
        if time.time() > task.deadline:
            raise TaskRejected("declined", "the task's deadline passed before training could start")
        family = self.family_for(task.model)
        if task.model.in_channels != self.data.in_channels:
            raise TaskRejected("failed", f"model expects {task.model.in_channels} input channels, local data has "
                                         f"{self.data.in_channels}")
        if self.data.labels[-1] >= task.model.num_classes:
            raise TaskRejected("failed", f"local label {self.data.labels[-1]} is outside the model's "
                                         f"{task.model.num_classes} classes")
        try:
            spec = SubmodelSpec.from_dict(task.spec)
        except ValueError as exc:
            raise TaskRejected("failed", f"invalid sub-model spec: {exc}") from exc
        estimate = self.estimate(family, spec, task.recipe.batch_size)
        available = available_memory(self.budget_bytes)
        if estimate > available:
            raise TaskRejected("declined", f"training {spec.describe()} needs about {estimate} bytes, "
                                           f"{available} are available")
        model = family.build(spec, track_bn_stats=False)
        self._load(model, task.weights)
        result = train_plain(model, self.data.x, self.data.y, task.recipe, self.data.labels,
                             task.model.num_classes, self.device)
        weights = {key: value.detach().cpu().numpy().astype(np.float32)
                   for key, value in model.state_dict().items()}
        if not all(np.isfinite(w).all() for w in weights.values()):
            raise TaskRejected("failed", "training produced non-finite weights")
        metrics = {"loss": result.loss, "steps": float(result.steps), "seconds": result.seconds,
                   "estimated_bytes": float(estimate), "available_bytes": float(available)}
        return self._answer(task, "ok", spec_trained=spec.to_dict(), weights=weights, metrics=metrics)

    @staticmethod
    def _load(model: torch.nn.Module, weights: Mapping[str, np.ndarray]) -> None:
        expected = model.state_dict()
        if set(weights) != set(expected):
            missing = sorted(set(expected) - set(weights))[:3]
            extra = sorted(set(weights) - set(expected))[:3]
            raise TaskRejected("failed", f"task weights do not fit the spec (missing {missing}, unexpected {extra})")
        state = {}
        for key, array in weights.items():
            if tuple(array.shape) != tuple(expected[key].shape):
                raise TaskRejected("failed", f"tensor {key!r} has shape {tuple(array.shape)}, the spec needs "
                                             f"{tuple(expected[key].shape)}")
            state[key] = torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32))
        model.load_state_dict(state, strict=True)

    def _answer(self, task: Task, status: str, *, spec_trained: dict | None = None,
                weights: dict[str, np.ndarray] | None = None, metrics: dict[str, float] | None = None,
                reason: str | None = None) -> Update:
        return Update(task_id=task.task_id, round=task.round, agent_id=self.agent_id, status=status,
                      spec_trained=spec_trained, num_samples=len(self.data.y), labels=list(self.data.labels),
                      weights=weights or {}, metrics=metrics or {}, reason=reason)
