"""Per-round results and the metrics file (one JSON object per line)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from common.durable import write_atomic
from common.logs import Logger
from protocol import TextEnum, UpdateStatus

#: A round's phases on the coordinator, in order (seconds in :attr:`RoundResult.timing`): waiting for the fleet,
#: planning (the strategy and the journal), dispatch (encoding and publishing the tasks), collecting (waiting for
#: the updates: the devices' work), validation (decoding is not in it: examining each update against its task and
#: measuring its change, on the thread that takes messages, while collecting), aggregation (folding updates in as
#: they come, screening's second rule and the new states), evaluation and the checkpoint.
COORDINATOR_PHASES = ("waiting_for_agents", "planning", "dispatch", "collecting", "validation", "aggregation",
                      "evaluation", "checkpoint")
#: The devices' phases (the slowest device's seconds of each, from the update metrics): waiting for a training slot
#: (``fedfit sim`` shares a few among its agents; a device has its own), the decision child, the training loop,
#: the slowdown (a simulated slow device's update held back after training: the agent's ``slowdown``, which the
#: device reports as its own time) and the transfer (the time from the task's dispatch to its update's arrival
#: that the device did not report as its own: the task's download, the update's encoding and upload, the broker on
#: the way).
DEVICE_PHASES = ("queued", "decision", "training", "slowdown", "transfer")


def round_timing(coordinator: Mapping[str, float], devices: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """A round's :attr:`RoundResult.timing`: the coordinator's seconds per phase (:data:`COORDINATOR_PHASES`,
    those it went through) and, per device phase (:data:`DEVICE_PHASES`), the most any device took (of those that
    reported it)."""
    timing = {phase: round(coordinator[phase], 4) for phase in COORDINATOR_PHASES if phase in coordinator}
    devices = list(devices)
    for phase in DEVICE_PHASES:
        values = [device[phase] for device in devices if phase in device]
        if values:
            timing[phase] = round(max(values), 4)
    return timing


class TaskStatus(TextEnum):
    """How a task of a round ended, as the report counts it: the agent's answer (:class:`protocol.UpdateStatus`),
    or ``rejected`` (its update could not be aggregated: invalid, not fitting its model, or screened out),
    ``skipped`` (the device was selected but served no task) or ``missing`` (no update by the deadline)."""

    OK = "ok"
    ADAPTED = "adapted"
    DECLINED = "declined"
    FAILED = "failed"
    REJECTED = "rejected"
    SKIPPED = "skipped"
    MISSING = "missing"

    @classmethod
    def answered(cls, status: UpdateStatus) -> TaskStatus:
        """The record of an update the agent answered with ``status``."""
        return cls(status.value)

    @property
    def trained(self) -> bool:
        """Whether the device trained and its update counts (ok or adapted)."""
        return self in (TaskStatus.OK, TaskStatus.ADAPTED)


@dataclass
class TaskRecord:
    """What happened to one task of a round."""

    agent: str
    level: str
    status: TaskStatus
    spec_sent: str
    spec_trained: str | None = None
    reason: str | None = None
    num_samples: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    #: What screening measured of an update it saw (:meth:`coordinator.screening.Change.as_dict`).
    screening: dict[str, float | None] = field(default_factory=dict)
    #: The level (or pool model) whose spec the update trained, when it is one (an adapted task: a lower one).
    level_trained: str | None = None
    #: Parameters of the model sent, and of the one that came back (0: nothing came back, or nothing readable; an
    #: update screening refused did come back and counts).
    params_sent: int = 0
    params_returned: int = 0
    #: Rounds between the task's and the one its update was aggregated in (buffered rounds; 0: the same).
    staleness: int = 0

    def __post_init__(self) -> None:
        self.status = TaskStatus(self.status)

    @property
    def waste(self) -> float | None:
        """Communication waste of the task, ``1 - size(returned) / size(sent)`` (None: nothing was sent)."""
        return 1.0 - self.params_returned / self.params_sent if self.params_sent else None

    def memory(self, name: str) -> int | None:
        """A memory figure the agent reported (budget_bytes, estimated_bytes, peak_bytes), if any."""
        value = self.metrics.get(name)
        return int(value) if value is not None else None

    def stage_peaks(self) -> list[int]:
        """The measured peak of every depth-wise stage, in order (empty for a model trained whole)."""
        peaks: list[int] = []
        while (value := self.memory(f"stage_peak_bytes.{len(peaks)}")) is not None:
            peaks.append(value)
        return peaks


@dataclass
class RoundResult:
    """One round as reported: accuracy (the global model at its last output, each level's sub-model at its last
    output, and every output of the global model when it has early exits), participation, traffic and time."""

    round: int
    global_accuracy: float
    level_accuracy: dict[str, float]
    participants: int
    selected: int  # devices selected this round (with a task of its own, or skipped)
    bytes_down: int
    bytes_up: int
    seconds: float
    tasks: list[TaskRecord] = field(default_factory=list)
    exit_accuracy: dict[str, float] = field(default_factory=dict)
    #: The levels some aggregated update trained as such this round (the others are slices others trained).
    trained_levels: list[str] = field(default_factory=list)
    #: The outputs of the global model (``exit<i>``) whose head some aggregated update trained this round.
    trained_exits: list[str] = field(default_factory=list)
    #: Where the round's time went, in seconds (:func:`round_timing`).
    timing: dict[str, float] = field(default_factory=dict)
    #: Tasks of earlier rounds still training that this round held (buffered rounds): its updates may come from
    #: those too, so participants can exceed ``selected``.
    carried: int = 0
    #: The model a user would deploy (``coordinator.deployable``): ``global``, a level's name or an ensemble's,
    #: and its accuracy (None in records written before it was kept: the global model's then).
    deployed: str = "global"
    deployed_accuracy: float | None = None
    #: False in a round that evaluated only the global model, its ensembles and the deployable model
    #: (``data.levels_every``): its ``level_accuracy`` lacks the others.
    levels_evaluated: bool = True
    #: Differential privacy (``coordinator.privacy.guard``): epsilon spent after the round and how; None when off.
    privacy: dict[str, Any] | None = None
    #: Secure aggregation (``coordinator.secure``): how the round's exchange went; None when off.
    secure: dict[str, Any] | None = None

    @property
    def headline(self) -> float:
        """The accuracy of the model a user would deploy: the round's headline."""
        return self.global_accuracy if self.deployed_accuracy is None else self.deployed_accuracy

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RoundResult:
        """The result :meth:`to_dict` gave (a line of ``metrics.jsonl``)."""
        try:
            fields = dict(data)
            fields["tasks"] = [TaskRecord(**task) for task in fields.get("tasks", [])]
            return cls(**fields)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"not a round's result as this version writes it: {exc}") from None


@dataclass(frozen=True)
class Progress:
    """What the coordinator is doing, for a live display: ``phase`` "fleet" (waiting for ``expected`` agents
    before the first round, ``done`` online) or "round" (round ``round``, ``done`` of its ``expected`` updates
    in). ``on_progress`` gets these on the round's thread and on the one handling messages: it must not block."""

    phase: str
    round: int
    done: int
    expected: int


def tell_progress(on_progress: Callable[[Progress], None] | None, log: Logger, phase: str, round_number: int,
                  done: int, expected: int) -> None:
    """Tell the live display ``on_progress`` (None: none); whatever it raises is logged, never the round's
    business."""
    if on_progress is None:
        return
    try:
        on_progress(Progress(phase, round_number, done, expected))
    except Exception as exc:  # noqa: BLE001 - a display must not stop a round
        log.warning("progress_display_failed", error=f"{type(exc).__name__}: {exc}")


class MetricsWriter:
    """Appends each round's result to ``metrics.jsonl`` in the state directory."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, result: RoundResult) -> None:
        """Append ``result``'s line, on disk when this returns."""
        with self.path.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps(result.to_dict(), sort_keys=True) + "\n")
            handle.flush()
            os.fsync(handle.fileno())

    def restore(self, completed: int, record: Mapping[str, Any] | None) -> bool:
        """Append ``record`` (the checkpoint's record of round ``completed``) when ``metrics.jsonl`` stops before that
        round (a stop between the checkpoint and the record); whether it did. A last line cut short by a stop is
        dropped, and a last line without its newline ended, either way, so that the next line appended starts a line
        of its own."""
        text = self.path.read_text(encoding="utf-8") if self.path.exists() else ""
        lines = text.splitlines()
        cut = False
        if lines:
            try:
                json.loads(lines[-1])
            except json.JSONDecodeError:
                lines.pop()  # cut short by the stop
                cut = True
        try:
            recorded = [json.loads(line).get("round") for line in lines]
        except (json.JSONDecodeError, AttributeError):
            return False  # damaged before its end: read_metrics says where
        missing = record is not None and record.get("round") == completed and completed not in recorded
        if record is not None and missing:
            lines.append(json.dumps(dict(record), sort_keys=True))
        if missing or cut or (text and not text.endswith("\n")):
            write_atomic(self.path, "".join(line + "\n" for line in lines).encode())
        return missing


def read_metrics(path: str | Path) -> list[RoundResult]:
    """The rounds ``metrics.jsonl`` holds, in the order written (none when there is no file); a line cut short by
    a crash while it was written, the last one only, is left out."""
    path = Path(path)
    if not path.exists():
        return []
    lines = path.read_text(encoding="utf-8").splitlines()
    results = []
    for index, line in enumerate(lines):
        try:
            results.append(RoundResult.from_dict(json.loads(line)))
        except json.JSONDecodeError:
            if index == len(lines) - 1:
                break
            raise ValueError(f"{path} line {index + 1} is not a round's result") from None
        except ValueError as exc:
            raise ValueError(f"{path} line {index + 1}: {exc}") from None
    return results
