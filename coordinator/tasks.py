"""The values a round passes between the planner, the strategies, the aggregate and the report: a task planned
(:class:`TaskPlan`), an agent skipped (:class:`Skip`), a round's plan, a validated update (:class:`TaskResult`), how
a task ended (:class:`TaskOutcome`) and a model to evaluate (:class:`EvalTarget`). They sit below the strategies and
the aggregation, which both use them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from coordinator.metrics import TaskStatus
from models import SubmodelSpec
from protocol import Adaptation, TrainingPlan

State = dict[str, torch.Tensor]
IndexMap = Mapping[str, tuple[torch.Tensor, ...]]


@dataclass(frozen=True)
class TaskPlan:
    """One agent's part of a round: what it trains (spec and plan), how it may shrink it, which model state
    (aggregation group) it trains, and the level name it is reported under."""

    agent_id: str
    level: str
    spec: SubmodelSpec
    plan: TrainingPlan
    group: str = "global"
    adaptation: Adaptation | None = None
    #: A secure round's task (``secure_aggregation``): its update comes masked (`coordinator.secure`).
    secure: bool = False


@dataclass(frozen=True)
class Skip:
    """An agent selected but given nothing, with the reason."""

    agent_id: str
    reason: str


@dataclass
class RoundPlan:
    """What a strategy hands out in one round."""

    tasks: list[TaskPlan] = field(default_factory=list)
    skipped: list[Skip] = field(default_factory=list)


@dataclass
class TaskResult:
    """A validated update to aggregate: the spec trained (nested in the one sent), its tensors and index map."""

    task: TaskPlan
    spec: SubmodelSpec
    state: State
    index_map: IndexMap
    num_samples: int
    labels: list[int]
    #: Rounds late (a buffered round's stale update, rebased: its change scaled by FedBuff's weight).
    staleness: int = 0
    #: A secure round's masked slice (uint64 per tensor named ``group/key``; ``state`` is then empty).
    masked: Mapping[str, np.ndarray] | None = None


@dataclass(frozen=True)
class TaskOutcome:
    """How one task ended (status ok, adapted, declined, failed, rejected or missing), for selection that learns:
    the spec of the aggregated update, the agent's metrics and reason, and the spec it tried (for a failure)."""

    task: TaskPlan
    status: TaskStatus
    spec_trained: SubmodelSpec | None
    metrics: Mapping[str, float]
    reason: str | None = None
    spec_tried: SubmodelSpec | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "status", TaskStatus(self.status))


@dataclass(frozen=True)
class EvalTarget:
    """A model to evaluate each round: the sub-model ``spec`` of the state kept for ``group``. ``store_bn``: its
    recomputed BN statistics are kept in that state (the global model's). ``ensemble``: the target is the mean
    of the sub-model's outputs' logits (one accuracy), not each output."""

    group: str
    spec: SubmodelSpec
    store_bn: bool = False
    ensemble: bool = False
