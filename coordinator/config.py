"""Coordinator configuration (YAML, validated by :func:`common.config.from_mapping`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from common.mqtt_link import BrokerConfig

HETEROFL_RATES = (1.0, 0.5, 0.25, 0.125, 0.0625)


@dataclass
class ModelConfig:
    """The global model: a family from ``models`` and its options (e.g. ``hidden``)."""

    family: Literal["cnn", "preresnet18"] = "cnn"
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class DataConfig:
    """Server-side data: the held-out test set and a sample for static-BN statistics."""

    dataset: str = "auto"
    root: str | None = None
    bn_samples: int = 5000
    eval_samples: int | None = None


@dataclass
class RecipeConfig:
    """Local training hyperparameters sent to every agent with its task."""

    epochs: int = 1
    batch_size: int = 32
    lr: float = 0.02
    momentum: float = 0.9
    weight_decay: float = 5e-4
    clip_norm: float | None = 1.0
    masked_ce: bool = False


@dataclass
class CoordinatorConfig:
    """Everything the coordinator daemon needs."""

    federation: str = "default"
    broker: BrokerConfig = field(default_factory=BrokerConfig)
    algorithm: Literal["heterofl", "fedavg", "decoupled"] = "heterofl"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    recipe: RecipeConfig = field(default_factory=RecipeConfig)
    rounds: int = 10
    fraction: float = 1.0
    min_agents: int = 1
    wait_for_agents_s: float = 120.0
    round_timeout_s: float = 600.0
    levels: list[float] = field(default_factory=lambda: list(HETEROFL_RATES))
    level_assignment: Literal["fix", "dynamic"] = "fix"
    level_proportions: list[float] | None = None
    weighting: Literal["uniform", "samples"] = "uniform"
    state_dir: str = "runs/coordinator"
    resume: bool = False
    seed: int = 0

    def validate(self) -> None:
        """Cross-field checks; raises ValueError with one clear sentence."""
        if not 0 < self.fraction <= 1:
            raise ValueError(f"fraction must be in (0, 1], got {self.fraction}")
        if self.rounds < 1 or self.min_agents < 1:
            raise ValueError("rounds and min_agents must be at least 1")
        if not self.levels or any(not 0 < rate <= 1 for rate in self.levels):
            raise ValueError(f"levels must be width rates in (0, 1], got {self.levels}")
        if sorted(self.levels, reverse=True) != list(self.levels) or len(set(self.levels)) != len(self.levels):
            raise ValueError(f"levels must be distinct and listed from largest to smallest, got {self.levels}")
        if self.level_proportions is not None and (
            len(self.level_proportions) != len(self.levels) or any(p < 0 for p in self.level_proportions)
            or sum(self.level_proportions) <= 0
        ):
            raise ValueError("level_proportions needs one non-negative weight per level, not all zero")
        if self.data.bn_samples < 1:
            raise ValueError("data.bn_samples must be at least 1")
        if self.round_timeout_s <= 0:
            raise ValueError("round_timeout_s must be positive")
