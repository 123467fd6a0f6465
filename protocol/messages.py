"""Message types of the protocol (plain dataclasses; `protocol.codec` encodes and validates them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeAlias

import numpy as np

PROTOCOL_VERSION = 1

AGENT_STATES: tuple[str, ...] = ("online", "busy", "offline")
COORDINATOR_STATES: tuple[str, ...] = ("online", "offline")
UPDATE_STATUSES: tuple[str, ...] = ("ok", "adapted", "declined", "failed")


@dataclass
class Capabilities:
    """What an agent can afford: memory in bytes, its local data size and label set."""

    device_kind: str
    memory_total: int
    memory_available: int
    budget_bytes: int | None
    num_samples: int
    labels: list[int]


@dataclass
class AgentStatus:
    """Retained agent status; state is "online", "busy" or "offline" (the Last Will has no capabilities)."""

    agent_id: str
    state: str
    capabilities: Capabilities | None
    sent_at: float


@dataclass
class CoordinatorStatus:
    """Retained coordinator status; state is "online" or "offline"."""

    federation: str
    state: str
    round: int
    sent_at: float


@dataclass
class ModelRef:
    """Which model family to build; options hold msgpack primitives or flat lists of them."""

    family: str
    num_classes: int
    in_channels: int
    options: dict[str, Any]


@dataclass
class Recipe:
    """Local training hyperparameters sent with a task."""

    epochs: int
    batch_size: int
    lr: float
    momentum: float
    weight_decay: float
    clip_norm: float | None
    masked_ce: bool
    seed: int


@dataclass
class Task:
    """One round of work for one agent: the sub-model spec, the recipe and the sliced weights."""

    task_id: str
    round: int
    agent_id: str
    deadline: float
    model: ModelRef
    spec: dict[str, Any]
    recipe: Recipe
    weights: dict[str, np.ndarray]
    adaptation: dict[str, Any] | None = None
    """How the agent may shrink the spec when it cannot afford it (e.g. ``{"kind": "width-levels",
    "rates": [...]}``); None: train exactly ``spec`` or decline."""


@dataclass
class Update:
    """An agent's answer to a task; status is "ok", "adapted", "declined" or "failed"."""

    task_id: str
    round: int
    agent_id: str
    status: str
    spec_trained: dict[str, Any] | None
    num_samples: int
    labels: list[int]
    weights: dict[str, np.ndarray]
    metrics: dict[str, float]
    reason: str | None = None


@dataclass
class Ack:
    """The coordinator received (and stored) the update of this task."""

    task_id: str
    round: int
    agent_id: str


Message: TypeAlias = AgentStatus | CoordinatorStatus | Task | Update | Ack
"""Any top-level message (the nested Capabilities, ModelRef and Recipe are not)."""
