"""Coordinator configuration (YAML, validated by :func:`common.config.from_mapping`): the run's general sections
here, each method's section in :mod:`coordinator.method_settings` (re-exported here)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

from common.mqtt_link import BrokerConfig
from coordinator.method_settings.adaptivefl import AdaptiveFLConfig
from coordinator.method_settings.depthfl import DepthFLConfig
from coordinator.method_settings.fedavg import FedAvgConfig
from coordinator.method_settings.fedepth import FeDepthConfig
from coordinator.method_settings.fedrolex import FedRolexConfig
from coordinator.method_settings.fjord import FjORDConfig
from coordinator.method_settings.flexfl import FlexFLConfig
from coordinator.method_settings.scalefl import ScaleFLConfig
from coordinator.privacy.settings import PrivacyConfig
from coordinator.secure.settings import SecureAggregationConfig
from models import FAMILY_NAMES
from protocol import validate_name

__all__ = [  # the methods' sections are re-exported, so that a configuration is built from one module
    "HETEROFL_RATES", "AdaptiveFLConfig", "BufferedConfig", "CoordinatorConfig", "DataConfig", "DepthFLConfig",
    "FeDepthConfig", "FedAvgConfig", "FedRolexConfig", "FjORDConfig", "FlexFLConfig", "ModelConfig", "RecipeConfig",
    "ScaleFLConfig", "ScreeningConfig", "UploadsConfig",
]

HETEROFL_RATES = (1.0, 0.5, 0.25, 0.125, 0.0625)


@dataclass
class ModelConfig:
    """The global model: a family from ``models.FAMILY_NAMES`` and its options (e.g. ``hidden``)."""

    family: str = "cnn"
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class DataConfig:
    """Server-side data: the held-out test set and a sample for static-BN statistics.

    ``levels_every``: the models other than the global one, its ensembles and the deployable model (each level,
    pool model or width) are evaluated every that many rounds and in the last round; 1 (the default): every round.
    Each evaluation recomputes the model's static-BN statistics and runs the test set, which can take longer than a
    round's training (AdaptiveFL's seven pool models on PreResNet-20); what is not evaluated changes no training.
    """

    dataset: str = "auto"
    root: str | None = None
    bn_samples: int = 5000
    eval_samples: int | None = None
    levels_every: int = 1


@dataclass
class RecipeConfig:
    """Local training hyperparameters sent to every agent with its task.

    ``masked_ce``: HeteroFL's masked cross-entropy (the logits of classes absent from a device's data are set to 0;
    a no-op where a device holds every class). Left out (null), each method follows its paper: on for HeteroFL,
    off for the others; true or false applies it to every method.
    """

    epochs: int = 1
    batch_size: int = 32
    lr: float = 0.02
    momentum: float = 0.9
    weight_decay: float = 5e-4
    clip_norm: float | None = 1.0
    masked_ce: bool | None = None

    def validate(self) -> None:
        """Raises ValueError with one clear sentence."""
        if self.epochs < 1 or self.batch_size < 2:
            raise ValueError("recipe.epochs must be at least 1 and recipe.batch_size at least 2 (static BN "
                             "normalises with batch statistics)")
        if not self.lr > 0 or not 0 <= self.momentum < 1 or self.weight_decay < 0:
            raise ValueError(f"recipe.lr must be positive, recipe.momentum in [0, 1) and recipe.weight_decay "
                             f"non-negative, got {self.lr}, {self.momentum} and {self.weight_decay}")
        if self.clip_norm is not None and not self.clip_norm > 0:
            raise ValueError(f"recipe.clip_norm must be positive or null, got {self.clip_norm}")


@dataclass
class ScreeningConfig:
    """The ``screening`` section (see :mod:`coordinator.screening`): ``enabled`` (default true); ``max_ratio``
    (default 10), how many times the median change per step of the round's other updates of the same trained spec
    an update's may be; ``min_peers`` (default 2), how many such updates that comparison needs. ``peers`` (default
    true) runs that comparison (rule 2) and ``record`` keeps each update's change in its task's record: a private run
    turns both off (`coordinator.privacy.guard`)."""

    enabled: bool = True
    max_ratio: float = 10.0
    min_peers: int = 2
    peers: bool = True
    record: bool = True

    def validate(self) -> None:
        """Raises ValueError with one clear sentence."""
        if not self.max_ratio > 1:
            raise ValueError(f"screening.max_ratio must be above 1, got {self.max_ratio}")
        if self.min_peers < 1:
            raise ValueError(f"screening.min_peers must be at least 1, got {self.min_peers}")


@dataclass
class BufferedConfig:
    """The ``buffered`` section, read with ``round_mode: buffered`` (see :mod:`coordinator.staleness`): a round
    aggregates once ``size`` trained updates are in (0, the default: half of those its tasks may bring, rounded up:
    those it sent and those still training from earlier rounds, less the ones answered without an update); a task
    more than ``max_staleness`` rounds old (default 16) is carried no further, and its device gets a new task. With
    ``drain_last`` (default true) the run's last round waits for every task it holds, as a synchronous round does,
    so that nothing trained is left carried when the run ends."""

    size: int = 0
    max_staleness: int = 16
    drain_last: bool = True

    def validate(self) -> None:
        """Raises ValueError with one clear sentence."""
        if self.size < 0:
            raise ValueError(f"buffered.size must be a count of answers (0: half of a round's tasks), got {self.size}")
        if self.max_staleness < 1:
            raise ValueError(f"buffered.max_staleness must be at least 1 round, got {self.max_staleness}")


@dataclass
class UploadsConfig:
    """The ``uploads`` section (see :mod:`coordinator.upload_grants`): with ``grant`` (default true) the agents
    that read protocol revision 6 ask before they send an update, and the coordinator lets at most ``window_mib``
    (default 256) MiB of updates be in transfer at once, whatever the fleet's size; a grant whose agent sent
    nothing for ``idle_s`` seconds (default 30) is taken back."""

    grant: bool = True
    window_mib: float = 256.0
    idle_s: float = 30.0

    @property
    def window_bytes(self) -> int:
        return int(self.window_mib * 2**20)

    def validate(self) -> None:
        """Raises ValueError with one clear sentence."""
        if not self.window_mib > 0 or not self.idle_s > 0:
            raise ValueError(f"uploads.window_mib and uploads.idle_s must be positive, got {self.window_mib} and "
                             f"{self.idle_s}")


@dataclass
class DeploymentConfig:
    """The ``deployment`` section (see :mod:`coordinator.model_courier`): with ``deliver`` (default true) the
    coordinator, once its last round is done, writes the run's deployable models into ``state_dir/models`` and hands
    each agent online (of protocol revision 8) the largest trained one its memory runs, waiting up to ``wait_s``
    seconds (default 120) for them to say they hold it."""

    deliver: bool = True
    wait_s: float = 120.0

    def validate(self) -> None:
        """Raises ValueError with one clear sentence."""
        if not 0 <= self.wait_s < float("inf"):
            raise ValueError(f"deployment.wait_s must be a finite number of seconds, zero or more, got {self.wait_s}")


@dataclass
class CoordinatorConfig:
    """Everything the coordinator daemon needs."""

    federation: str = "default"
    broker: BrokerConfig = field(default_factory=BrokerConfig)
    algorithm: str = "heterofl"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    recipe: RecipeConfig = field(default_factory=RecipeConfig)
    rounds: int = 10
    fraction: float = 1.0
    min_agents: int = 1
    wait_for_agents_s: float = 120.0
    round_timeout_s: float = 600.0
    #: ``sync``: a round waits for every task (or its deadline); ``buffered``: it aggregates once ``buffered.size``
    #: trained updates are in, and the others count in a later round, weighted by their staleness (FedBuff).
    round_mode: Literal["sync", "buffered"] = "sync"
    buffered: BufferedConfig = field(default_factory=BufferedConfig)
    levels: list[float] = field(default_factory=lambda: list(HETEROFL_RATES))
    level_assignment: Literal["fix", "dynamic"] = "fix"
    level_proportions: list[float] | None = None
    scalefl: ScaleFLConfig = field(default_factory=ScaleFLConfig)
    fedepth: FeDepthConfig = field(default_factory=FeDepthConfig)
    fedavg: FedAvgConfig = field(default_factory=FedAvgConfig)
    fedrolex: FedRolexConfig = field(default_factory=FedRolexConfig)
    depthfl: DepthFLConfig = field(default_factory=DepthFLConfig)
    fjord: FjORDConfig = field(default_factory=FjORDConfig)
    flexfl: FlexFLConfig = field(default_factory=FlexFLConfig)
    adaptivefl: AdaptiveFLConfig = field(default_factory=AdaptiveFLConfig)
    screening: ScreeningConfig = field(default_factory=ScreeningConfig)
    uploads: UploadsConfig = field(default_factory=UploadsConfig)
    deployment: DeploymentConfig = field(default_factory=DeploymentConfig)
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)
    secure_aggregation: SecureAggregationConfig = field(default_factory=SecureAggregationConfig)
    weighting: Literal["uniform", "samples"] = "uniform"
    #: What the agents train on ("cpu" or "cuda"): the terms of the memory they report, in which level planning
    #: estimates what each sub-model needs.
    training_device: Literal["cpu", "cuda"] = "cpu"
    state_dir: str = "runs/coordinator"
    resume: bool = False
    seed: int = 0
    #: Serve Prometheus metrics on this port (0: a free one; None: not at all) and address (``coordinator.exporter``).
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    #: Seconds a stopping coordinator keeps serving its metrics, at most, for a scrape of its final state (none
    #: when nothing ever scraped them). 20: Prometheus's example configuration scrapes every 15 s, and a scrape
    #: needs a moment; well inside systemd's 90 s to stop a service. Raise it for a longer scrape interval.
    metrics_linger_s: float = 20.0

    def levels_due(self, round_number: int, last_round: int | None = None) -> bool:
        """Whether round ``round_number`` evaluates every level: every ``data.levels_every``-th round, and the run's
        last (``last_round``, default the configured total)."""
        return round_number % self.data.levels_every == 0 or round_number >= (last_round or self.rounds)

    def validate(self) -> None:
        """Cross-field checks; raises ValueError with one clear sentence. (``algorithm`` is checked against the
        strategies' registry when the coordinator makes its strategy.)"""
        validate_name(self.federation, "federation")
        if self.model.family not in FAMILY_NAMES:
            raise ValueError(f"model.family must be one of {', '.join(FAMILY_NAMES)}, got {self.model.family!r}")
        if not 0 < self.fraction <= 1:
            raise ValueError(f"fraction must be in (0, 1], got {self.fraction}")
        if self.rounds < 1 or self.min_agents < 1:
            raise ValueError("rounds and min_agents must be at least 1")
        if not self.levels or any(not 0 < rate <= 1 for rate in self.levels):
            raise ValueError(f"levels must be width rates in (0, 1], got {self.levels}")
        if sorted(self.levels, reverse=True) != list(self.levels) or len(set(self.levels)) != len(self.levels):
            raise ValueError(f"levels must be distinct and listed from largest to smallest, got {self.levels}")
        if self.level_proportions is not None and (
            any(p < 0 for p in self.level_proportions) or sum(self.level_proportions) <= 0
        ):
            raise ValueError("level_proportions needs one non-negative weight per level, not all zero")
        sized = {"scalefl": self.scalefl.ratios == "auto" and self.scalefl.cost == "memory",
                 "flexfl": self.flexfl.ratios == "auto" and self.flexfl.size == "memory"}
        if self.level_proportions is not None and sized.get(self.algorithm):
            raise ValueError(f"level_proportions needs fixed {self.algorithm}.ratios: with auto the number of levels "
                             "comes from the fleet at its first round")
        if self.data.bn_samples < 1 or self.data.levels_every < 1:
            raise ValueError("data.bn_samples and data.levels_every must be at least 1")
        if self.round_timeout_s <= 0:
            raise ValueError("round_timeout_s must be positive")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be a TCP port (0-65535), got {self.metrics_port}")
        if not (math.isfinite(self.metrics_linger_s) and self.metrics_linger_s >= 0):
            raise ValueError(f"metrics_linger_s must be 0 or more seconds, got {self.metrics_linger_s}")
        self.broker.validate()
        self.recipe.validate()
        self.scalefl.validate()
        self.fedepth.validate()
        self.screening.validate()
        self.uploads.validate()
        self.deployment.validate()
        self.privacy.validate(self.weighting)
        self.secure_aggregation.validate(self.round_timeout_s, self.round_mode, self.privacy.mode, self.weighting,
                                         self.min_agents)
        self.buffered.validate()
        self.fedavg.validate()
        self.fedrolex.validate()
        self.depthfl.validate()
        self.fjord.validate()
        self.flexfl.validate()
        self.adaptivefl.validate()
