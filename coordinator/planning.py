"""Setting a strategy up for a configuration and a dataset: the daemon's start and ``fedfit plan`` share it."""

from __future__ import annotations

import json
import threading
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from common.data import Dataset, subsample
from coordinator.config import CoordinatorConfig
from coordinator.strategies import Strategy, StrategyContext, make_strategy
from models import MemoryEstimate, ModelFamily, SubmodelSpec, estimate_plan_memory, get_family
from protocol import TrainingPlan

#: Estimates kept for every strategy this process sets up (the start-of-run checks, the run's coordinator and its
#: sizing to the fleet, each run of a comparison): an estimate depends on nothing but the model, the input size,
#: the device, the spec and the plan, and ScaleFL's split search alone makes hundreds, a quarter second each.
SHARED_ESTIMATES_KEPT = 20_000
_shared_estimates: dict[tuple[Any, ...], MemoryEstimate] = {}
_shared_lock = threading.Lock()


class TrainingMemory:
    """Estimated peak memory of training a (spec, plan) on an agent (pooled heap on this host's CPU, or the CUDA
    allocator's peak): what level planning compares with the budgets agents report. Estimates are kept for the
    process (the oldest dropped past :data:`SHARED_ESTIMATES_KEPT`), shared by every estimator of the same model."""

    def __init__(self, family: ModelFamily, input_size: tuple[int, int], device: str = "cpu") -> None:
        self.family = family
        self.input_size = input_size
        self.device = device
        self._model = (type(family).__module__, type(family).__qualname__, family.num_classes, family.in_channels,
                       json.dumps(family.options, sort_keys=True, default=str), tuple(input_size), device)

    def __call__(self, spec: SubmodelSpec, plan: TrainingPlan) -> MemoryEstimate:
        key = (self._model, spec, replace(plan, seed=0))  # the seed draws batches: it moves no estimate
        with _shared_lock:
            estimate = _shared_estimates.get(key)
        if estimate is None:  # (two threads missing one key both estimate it: the same figure)
            estimate = estimate_plan_memory(self.family, spec, plan, input_size=self.input_size, device=self.device)
            with _shared_lock:
                if len(_shared_estimates) >= SHARED_ESTIMATES_KEPT:
                    _shared_estimates.pop(next(iter(_shared_estimates)))
                _shared_estimates[key] = estimate
        return estimate


def model_family(config: CoordinatorConfig, dataset: Dataset) -> ModelFamily:
    """The configured model family for the dataset's classes and input channels."""
    return get_family(config.model.family, dataset.num_classes, dataset.in_channels, **config.model.options)


def strategy_for(config: CoordinatorConfig, dataset: Dataset, family: ModelFamily | None = None) -> Strategy:
    """Set up the configured strategy: its family, a server sample of ``data.bn_samples`` training examples, and
    the training-memory estimator. Raises ValueError for an unknown algorithm or a method that cannot plan."""
    family = family or model_family(config, dataset)
    server_x, server_y = subsample(dataset.x_train, dataset.y_train, config.data.bn_samples, config.seed)
    return make_strategy(config.algorithm, StrategyContext(
        family=family, config=config, input_size=dataset.image_size,
        server_x=torch.tensor(np.asarray(server_x)), server_y=torch.tensor(np.asarray(server_y), dtype=torch.long),
        training_memory=TrainingMemory(family, dataset.image_size, config.training_device),
        training_sample=lambda count: _tensors(*subsample(dataset.x_train, dataset.y_train, count, config.seed + 1)),
        training_size=len(dataset.x_train)))


def _tensors(x: np.ndarray, y: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor(np.asarray(x)), torch.tensor(np.asarray(y), dtype=torch.long)
