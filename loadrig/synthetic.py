"""SYNTHETIC updates for the load mode: an answer of the right shape to a task, made without any training.

An update carries the trainable tensors of the spec it was sent (the models layer says which keys those are) with
the task's own weights plus a little fixed noise. Its change ``|update - sent|`` is ``CHANGE_SHARE`` times what one
clipped optimizer step of the task's plan may move the weights (times a per-agent factor in [0.5, 1.5]), so the
coordinator's validation and screening accept it (inside the plan's reach; every update of a round has a change
of the same size) and aggregation does real work on it. What the model learns from it is noise: the accuracy of a
load run means nothing.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence

import numpy as np

from protocol import Task, TrainingPlan, Update, UpdateStatus

__all__ = ["CHANGE_SHARE", "SYNTHETIC_NOTICE", "UpdateMaker", "synthetic_change"]

#: What every printout of the load mode says of its figures.
SYNTHETIC_NOTICE = "SYNTHETIC updates, no training: accuracy is meaningless"

#: The change of a synthetic update as a share of one clipped step of the task's plan (``lr * clip_norm``).
CHANGE_SHARE = 0.25


def synthetic_change(plan: TrainingPlan) -> float:
    """The L2 change a synthetic update of a task with ``plan`` makes (before the agent's factor): well inside
    what one optimizer step of the plan may move the weights (``lr * clip_norm``, ``lr`` without clipping)."""
    optimizer = plan.optimizer
    return CHANGE_SHARE * optimizer.lr * (optimizer.clip_norm if optimizer.clip_norm is not None else 1.0)


class UpdateMaker:
    """Makes synthetic updates; one per process (it caches noise per tensor shape and key sets per spec).

    ``seed`` fixes the noise; the models layer (imported on the first task) gives each spec's trainable keys.
    """

    def __init__(self, seed: int = 0) -> None:
        self._rng = np.random.default_rng(seed)
        self._noise: dict[tuple[str, tuple[int, ...]], np.ndarray] = {}
        self._noise_norms: dict[tuple[tuple[str, tuple[int, ...]], ...], float] = {}
        self._keys: dict[str, tuple[str, ...]] = {}

    def trainable_keys(self, task: Task) -> tuple[str, ...]:
        """The keys an update of ``task`` must carry: the trainable keys of its spec (ValueError if invalid)."""
        model = task.model
        cache_key = json.dumps([model.family, model.num_classes, model.in_channels, model.options, task.spec],
                               sort_keys=True, default=str)
        keys = self._keys.get(cache_key)
        if keys is None:
            from models import SubmodelSpec, get_family  # torch: only once a task arrives

            family = get_family(model.family, model.num_classes, model.in_channels, **model.options)
            keys = tuple(family.trainable_keys(SubmodelSpec.from_dict(task.spec)))
            self._keys[cache_key] = keys
        return keys

    def _unit_noise(self, shapes: Sequence[tuple[str, tuple[int, ...]]]) -> tuple[list[np.ndarray], float]:
        """Fixed standard-normal noise per (key, shape), and the L2 norm of all of it together."""
        arrays = []
        for entry in shapes:
            noise = self._noise.get(entry)
            if noise is None:
                noise = self._rng.standard_normal(entry[1], dtype=np.float32)
                self._noise[entry] = noise
            arrays.append(noise)
        signature = tuple(shapes)
        norm = self._noise_norms.get(signature)
        if norm is None:
            norm = math.sqrt(sum(float(np.square(a, dtype=np.float64).sum()) for a in arrays))
            self._noise_norms[signature] = norm
        return arrays, norm

    def make(self, task: Task, agent_id: str, num_samples: int, labels: list[int], factor: float) -> Update:
        """The synthetic update of ``task``: status "ok", the spec sent, its trainable tensors moved by
        :func:`synthetic_change` times ``factor``; a "failed" update (with the reason) when the task lacks a tensor
        its spec trains or names an invalid spec."""
        started = time.perf_counter()
        try:
            keys = self.trainable_keys(task)
        except ValueError as exc:
            return self._failed(task, agent_id, num_samples, labels, f"synthetic agent: invalid spec ({exc})")
        missing = [key for key in keys if key not in task.weights]
        if missing:
            return self._failed(task, agent_id, num_samples, labels,
                                f"synthetic agent: the task lacks {len(missing)} trained tensors ({missing[:3]})")
        shapes = [(key, tuple(task.weights[key].shape)) for key in keys]
        noise, norm = self._unit_noise(shapes)
        scale = np.float32(synthetic_change(task.training_plan()) * factor / norm) if norm > 0 else np.float32(0)
        weights: dict[str, np.ndarray] = {}
        for (key, _shape), unit in zip(shapes, noise):
            sent = task.weights[key]
            moved = np.multiply(unit, scale)
            np.add(moved, sent.astype(np.float32, copy=False), out=moved)
            weights[key] = moved
        made = time.perf_counter() - started
        # What a device's metrics say of its time (edge_agent.runner): here none waited, decided or trained.
        metrics = {"synthetic": 1.0, "make_seconds": made, "seconds_task": made, "seconds_queued": 0.0,
                   "seconds_decision": 0.0, "seconds": 0.0}
        return Update(task.task_id, task.round, agent_id, UpdateStatus.OK, dict(task.spec), num_samples,
                      list(labels), weights, metrics)

    @staticmethod
    def _failed(task: Task, agent_id: str, num_samples: int, labels: list[int], reason: str) -> Update:
        return Update(task.task_id, task.round, agent_id, UpdateStatus.FAILED, None, num_samples, list(labels), {},
                      {"synthetic": 1.0}, reason)
