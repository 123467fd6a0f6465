"""A task's work directory: the files the agent process and the children it starts exchange.

The agent process holds no torch (``edge_agent.forkserver``); for each task it writes the received task and a
:class:`DecisionRequest` here, a *decision child* answers with a :class:`Decision` (and, when it adapted the task,
the task to train in its place), then the agent writes a :class:`TrainingRequest` and a *training child* answers
with an encoded update or an error text. Tasks and updates are protocol msgpack, the rest JSON: nothing here is
pickled. Every name in this module is torch-free, so both sides import it.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from edge_agent.limits import TaskLimits
from protocol import BytesLike, Message, ModelRef, UpdateStatus, encode_parts

TASK_FILE = "task.msgpack"
DECISION_REQUEST_FILE = "decide.json"
DECISION_FILE = "decision.json"
PLAN_FILE = "plan.json"
UPDATE_FILE = "update.msgpack"
ERROR_FILE = "error.txt"
PROGRESS_FILE = "progress"
CUDA_START_FILE = "cuda_start.json"


class TaskRejected(Exception):
    """The task cannot be served; ``status`` is declined (not affordable, too late) or failed."""

    def __init__(self, status: UpdateStatus, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


def model_key(model: ModelRef) -> str:
    """A model's identity as text: its family, classes, input channels and options (the estimates of one model
    are remembered together)."""
    return json.dumps([model.family, model.num_classes, model.in_channels, model.options], sort_keys=True,
                      default=str)


def write_message(path: Path, message: Message | BytesLike) -> None:
    """Write a task or an update into the work directory: a message encoded straight from its arrays (the parts of
    `protocol.encode_parts`: no joined copy of the weights), or an encoded one as it came."""
    parts = (message,) if isinstance(message, (bytes, bytearray, memoryview)) else encode_parts(message).parts
    with open(path, "wb") as handle:
        handle.writelines(parts)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data))


def _read_json(path: Path) -> dict[str, Any]:
    data = json.loads(path.read_text())
    if not isinstance(data, dict):
        raise TypeError(f"{path.name} holds {type(data).__name__}, not an object")
    return data


@dataclass(frozen=True)
class DataShape:
    """What the decision needs to know of the local data, without the data: its size, labels and image shape."""

    samples: int
    labels: tuple[int, ...]
    in_channels: int
    image_size: tuple[int, int]


@dataclass(frozen=True)
class DecisionRequest:
    """What the agent tells the decision child besides the task.

    ``available`` is the memory training may use now, ``factor`` the calibration's current factor (the decision
    compares ``overhead + (raw - overhead) * factor`` with ``available``), ``known`` the raw estimates the agent
    remembers from earlier decisions of the task's model (keyed by :func:`edge_agent.decision.estimate_key`),
    ``threads`` the torch threads the agent trains with (the decision may train with fewer, to fit).
    """

    device: str
    allocator: str
    available: int
    factor: float
    data: DataShape
    limits: TaskLimits = field(default_factory=TaskLimits)
    known: dict[str, dict[str, Any]] = field(default_factory=dict)
    threads: int = 1

    def write(self, workdir: Path) -> None:
        _write_json(workdir / DECISION_REQUEST_FILE, asdict(self))

    @classmethod
    def read(cls, workdir: Path) -> DecisionRequest:
        raw = _read_json(workdir / DECISION_REQUEST_FILE)
        data = raw["data"]
        return cls(device=str(raw["device"]), allocator=str(raw["allocator"]), available=int(raw["available"]),
                   factor=float(raw["factor"]),
                   data=DataShape(int(data["samples"]), tuple(int(v) for v in data["labels"]),
                                  int(data["in_channels"]), (int(data["image_size"][0]), int(data["image_size"][1]))),
                   limits=TaskLimits(**raw["limits"]),
                   known={str(k): dict(parts) for k, parts in raw["known"].items()},
                   threads=int(raw.get("threads", 1)))


@dataclass(frozen=True)
class Decision:
    """What the decision child decided for a task.

    ``status`` ``ok`` or ``adapted``: train ``spec`` (the task file now holds the task to train, its weights cut
    and its plan chosen); ``declined`` or ``failed``: answer with ``reason`` and train nothing. ``raw_total`` and
    ``raw_overhead`` are the estimator's prediction for what is trained (the calibration learns from them),
    ``estimate`` its calibrated value, ``metrics`` what the update reports besides, ``estimates`` the raw
    estimates this decision made (the agent remembers them for the next), ``threads`` the torch threads to train
    with (0: the agent's own).
    """

    status: UpdateStatus
    reason: str | None = None
    spec: dict[str, Any] | None = None
    raw_total: int = 0
    raw_overhead: int = 0
    estimate: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    estimates: dict[str, dict[str, Any]] = field(default_factory=dict)
    threads: int = 0

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "status", UpdateStatus(self.status))
        except ValueError:
            known = tuple(status.value for status in UpdateStatus)
            raise ValueError(f"a decision's status is one of {known}, got {self.status!r}") from None
        if self.status.trained and self.spec is None:
            raise ValueError("a decision to train names the spec")

    @property
    def trains(self) -> bool:
        return self.status.trained

    def write(self, workdir: Path) -> None:
        _write_json(workdir / DECISION_FILE, asdict(self))

    @classmethod
    def read(cls, workdir: Path) -> Decision:
        raw = _read_json(workdir / DECISION_FILE)
        return cls(status=raw["status"], reason=raw.get("reason"), spec=raw.get("spec"),
                   raw_total=int(raw.get("raw_total", 0)), raw_overhead=int(raw.get("raw_overhead", 0)),
                   estimate=int(raw.get("estimate", 0)),
                   metrics={str(k): float(v) for k, v in raw.get("metrics", {}).items()},
                   estimates={str(k): dict(parts) for k, parts in raw.get("estimates", {}).items()},
                   threads=int(raw.get("threads", 0)))


@dataclass(frozen=True)
class TrainingRequest:
    """What the training child needs besides the task: the spec to build (it must be the task's), where the data
    and the device's own auxiliary copies (m-FeDepth, ``edge_agent.copies``) live, and how to run."""

    spec: dict[str, Any]
    device: str
    labels: list[int]
    data_path: str
    copies_dir: str
    torch_threads: int
    allocator: str

    def write(self, workdir: Path) -> None:
        _write_json(workdir / PLAN_FILE, asdict(self))

    @classmethod
    def read(cls, workdir: Path) -> TrainingRequest:
        raw = _read_json(workdir / PLAN_FILE)
        return cls(spec=dict(raw["spec"]), device=str(raw["device"]), labels=[int(v) for v in raw["labels"]],
                   data_path=str(raw["data_path"]), copies_dir=str(raw["copies_dir"]),
                   torch_threads=int(raw["torch_threads"]), allocator=str(raw["allocator"]))


class ProgressBeacon:
    """A training child's sign of life: a count of the work it got through (its start, each training step, each
    batch of buffered frozen outputs, each stage), written in place as 8 bytes into the work directory's
    :data:`PROGRESS_FILE` (one ``pwrite`` a beat) for the agent to watch (:func:`read_progress`)."""

    def __init__(self, workdir: Path) -> None:
        self._fd = os.open(workdir / PROGRESS_FILE, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        self.count = 0
        self.beat()

    def beat(self) -> None:
        """One more piece of work done."""
        self.count += 1
        os.pwrite(self._fd, self.count.to_bytes(8, "little"), 0)

    def close(self) -> None:
        os.close(self._fd)


def read_progress(workdir: Path) -> int | None:
    """The count a training child's :class:`ProgressBeacon` last wrote; None before it wrote one."""
    try:
        data = (workdir / PROGRESS_FILE).read_bytes()
    except OSError:
        return None
    return int.from_bytes(data[:8], "little") if len(data) >= 8 else None

