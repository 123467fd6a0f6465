"""Edge agent configuration (YAML, validated by :func:`common.config.from_mapping`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from common.mqtt_link import BrokerConfig
from edge_agent.limits import TaskLimits
from protocol import validate_name

__all__ = ["AgentConfig", "AgentDataConfig", "TaskLimits"]


@dataclass
class AgentDataConfig:
    """Where the agent's private data comes from.

    Either ``path`` (an .npz file with ``x`` and ``y``, or a folder with one sub-folder per integer label) or a
    shard of a known dataset (``dataset`` + ``partition`` + ``num_shards`` + ``shard``), as in simulations.
    """

    path: str | None = None
    normalize: list[float] | None = None
    dataset: str | None = None
    root: str | None = None
    partition: str = "iid"
    num_shards: int = 1
    shard: int = 0
    seed: int = 0


@dataclass
class AgentConfig:
    """Everything one edge agent needs.

    ``state_dir`` holds the calibration and the training children's scratch files (default: a temporary
    directory; under systemd, ``$STATE_DIRECTORY``). ``torch_threads`` is what each training child uses
    (default: the cores the agent may use, ``common.cores``: its CPU affinity capped by its cgroup's ``CPUQuota``;
    a device trains one task at a time, so a Raspberry Pi 4 trains on its 4 cores, a Jetson on its CPU cores,
    where on CUDA they only feed the GPU).
    ``allocator`` is how a CPU training child manages its heap (``edge_agent.allocator``): ``pooled`` (low,
    predictable peaks at full speed; ``compact`` where the page pool cannot be built), ``compact`` (the same
    peaks, slower steps) or glibc's ``default`` (higher, noisier peaks). ``forkserver`` is when the training forkserver
    (the process that holds torch, ``edge_agent.forkserver``) starts: at the ``first-task`` (an idle agent stays
    small) or at ``start-up`` (the first task starts sooner).
    Updates waiting for the coordinator's ack are kept in ``<state_dir>/<agent_id>/outbox`` (at most
    ``outbox_max_bytes``, the oldest dropped first) and sent again after a restart. ``update_attempts`` sends are
    made while the broker is connected (an outage uses none of them), each waiting ``ack_timeout_s`` for its ack,
    doubled with every send up to 8 times it (``edge_agent.uplink.MAX_BACKOFF``).
    A training child that shows no progress (no step or stage ended) for ``stall_timeout_s`` is killed and its
    task failed with that reason.
    ``slowdown`` (at least 1; for simulated or test fleets) makes training take that many times its compute: each
    trained update is held back (slowdown - 1) times the seconds its task took (decision and training) before it is
    sent (``edge_agent.holdback``), the agent busy meanwhile, as a device that many times slower would be.
    """

    agent_id: str
    federation: str = "default"
    broker: BrokerConfig = field(default_factory=BrokerConfig)
    data: AgentDataConfig = field(default_factory=AgentDataConfig)
    device_kind: str = "auto"
    device: Literal["cpu", "cuda", "auto"] = "cpu"
    budget_bytes: int | None = None
    status_interval_s: float = 30.0
    ack_timeout_s: float = 10.0
    update_attempts: int = 30
    outbox_max_bytes: int = 512 * 2**20
    torch_threads: int | None = None
    state_dir: str | None = None
    allocator: Literal["pooled", "compact", "default"] = "pooled"
    forkserver: Literal["first-task", "start-up"] = "first-task"
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    limits: TaskLimits = field(default_factory=TaskLimits)
    stall_timeout_s: float = 300.0
    slowdown: float = 1.0

    def validate(self) -> None:
        """Cross-field checks; raises ValueError with one clear sentence. The agent id and the federation are
        checked first: both become topic levels, and the id a directory under ``state_dir``."""
        validate_name(self.agent_id, "agent_id")
        validate_name(self.federation, "federation")
        self.limits.validate()
        self.broker.validate()
        if self.budget_bytes is not None and self.budget_bytes <= 0:
            raise ValueError("budget_bytes must be positive when set")
        if self.data.path is None and self.data.dataset is None:
            raise ValueError("data needs either 'path' (a file or folder on the device) or 'dataset'")
        if not 0 <= self.data.shard < self.data.num_shards:
            raise ValueError(f"data.shard must be in [0, num_shards), got {self.data.shard} of {self.data.num_shards}")
        if self.outbox_max_bytes <= 0:
            raise ValueError(f"outbox_max_bytes must be positive, got {self.outbox_max_bytes}")
        if self.stall_timeout_s <= 0:
            raise ValueError(f"stall_timeout_s must be positive, got {self.stall_timeout_s}")
        if not math.isfinite(self.slowdown) or self.slowdown < 1:
            raise ValueError(f"slowdown must be a number of at least 1 (1: training at this device's own speed), "
                             f"got {self.slowdown}")
        if self.ack_timeout_s <= 0 or self.update_attempts < 1 or self.status_interval_s <= 0:
            raise ValueError("ack_timeout_s and status_interval_s must be positive, update_attempts at least 1")
