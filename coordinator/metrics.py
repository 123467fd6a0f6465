"""Per-round results and the metrics file (one JSON object per line)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class TaskRecord:
    """What happened to one task of a round."""

    agent: str
    level: str
    status: str
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
    selected: int
    bytes_down: int
    bytes_up: int
    seconds: float
    tasks: list[TaskRecord] = field(default_factory=list)
    exit_accuracy: dict[str, float] = field(default_factory=dict)
    #: The levels some aggregated update trained as such this round (the others are slices others trained).
    trained_levels: list[str] = field(default_factory=list)
    #: The outputs of the global model (``exit<i>``) whose head some aggregated update trained this round.
    trained_exits: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class MetricsWriter:
    """Appends each round's result to ``metrics.jsonl`` in the state directory."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, result: RoundResult) -> None:
        with self.path.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps(result.to_dict(), sort_keys=True) + "\n")
            handle.flush()
