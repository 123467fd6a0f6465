"""Setting a strategy up for a configuration and a dataset: the daemon's start and ``fedfit plan`` share it."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from common.data import Dataset, subsample
from coordinator.config import CoordinatorConfig
from coordinator.strategies import Strategy, StrategyContext, make_strategy
from models import MemoryEstimate, ModelFamily, SubmodelSpec, estimate_plan_memory, get_family
from protocol import TrainingPlan


class TrainingMemory:
    """Estimated peak memory of training a (spec, plan) on an agent (pooled heap on this host's CPU, or the CUDA
    allocator's peak), cached: what level planning compares with the budgets agents report."""

    def __init__(self, family: ModelFamily, input_size: tuple[int, int], device: str = "cpu") -> None:
        self.family = family
        self.input_size = input_size
        self.device = device
        self._cache: dict[tuple[SubmodelSpec, TrainingPlan], MemoryEstimate] = {}

    def __call__(self, spec: SubmodelSpec, plan: TrainingPlan) -> MemoryEstimate:
        key = (spec, replace(plan, seed=0))
        if key not in self._cache:
            self._cache[key] = estimate_plan_memory(self.family, spec, plan, input_size=self.input_size,
                                                    device=self.device)
        return self._cache[key]


#: Model options a method sets where ``model.options`` leaves them out. DepthFL's classifiers are the family's
#: exit heads without their convolutions (pooling and a linear layer: the cheapest head that keeps the paper's
#: mutual distillation): with three 3x3 convolutions each, its levels on PreResNet-20 at 28x28 needed 35.8, 50.8
#: and 58.0 MiB and the `fair` r=1 tier (42.4 MiB, the plain model) trained level 1 only; without, 27.3, 36.2 and
#: 42.4 MiB, and it trains the whole model (``fedfit plan --budgets fair``).
METHOD_MODEL_OPTIONS: dict[str, dict[str, object]] = {"depthfl": {"exit_convs": 0}}


def model_options(config: CoordinatorConfig) -> dict[str, object]:
    """The model options a run builds its family with: ``model.options`` over the method's own
    (:data:`METHOD_MODEL_OPTIONS`)."""
    return {**METHOD_MODEL_OPTIONS.get(config.algorithm, {}), **config.model.options}


def model_family(config: CoordinatorConfig, dataset: Dataset) -> ModelFamily:
    """The configured model family (:func:`model_options`) for the dataset's classes and input channels."""
    return get_family(config.model.family, dataset.num_classes, dataset.in_channels, **model_options(config))


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
