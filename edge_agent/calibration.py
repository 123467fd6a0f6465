"""Per-device calibration of the training-memory estimator, learnt from measured peaks and failures.

The factor multiplies the model-dependent part of the raw estimate (everything but the runtime's fixed
overhead, which the estimator states separately and which is measured, not predicted); a run whose
model-dependent part is too small to measure against that overhead teaches nothing. The factor starts at
``initial`` (:data:`common.device_need.INITIAL_FACTOR`, a 10% margin), then follows a conservative envelope of
recent measured/estimated ratios. An out-of-memory kill suggests the real need exceeded
what was available, so the factor rises towards that (at most doubling per failure) and never falls below it
again.
Stored as JSON in the agent's state directory (never pickled).
"""

from __future__ import annotations

import json
import math
import threading
from pathlib import Path

from common.device_need import INITIAL_FACTOR, corrected
from common.durable import write_atomic

__all__ = ["INITIAL_FACTOR", "Calibration", "corrected"]

# A single measurement moves the factor at most this far (noise in a small run must not freeze the device).
MIN_RATIO, MAX_RATIO = 0.5, 3.0


class Calibration:
    """Thread-safe calibration factor with an optional JSON file behind it."""

    def __init__(self, path: str | Path | None = None, initial: float = INITIAL_FACTOR, margin: float = 1.05,
                 window: int = 20, resolution: int = 0, label: str | None = None) -> None:
        """``resolution``: how far the measured peak of identical runs moves (bytes); a run whose
        model-dependent part is under ten times that teaches nothing, since its ratio would be mostly noise.
        ``label`` says in the file what the calibration is of (e.g. the model)."""
        self.path = Path(path) if path is not None else None
        self.label = label
        self.initial = initial
        self.margin = margin
        self.window = window
        self.resolution = resolution
        self.ratios: list[float] = []
        self.floor = 0.0  # raised by failures: the factor never goes below it again
        self._lock = threading.Lock()
        self._save_lock = threading.Lock()
        if self.path is not None and self.path.exists():
            self._load()

    @property
    def factor(self) -> float:
        with self._lock:
            learnt = max(self.ratios) * self.margin if self.ratios else self.initial
            return max(learnt, self.floor)

    def corrected(self, raw_estimate: int, overhead: int = 0) -> int:
        """The raw estimate with its model-dependent part (``raw_estimate - overhead``) times the factor."""
        return corrected(raw_estimate, overhead, self.factor)

    def observe(self, raw_estimate: int, measured_peak: int, overhead: int = 0) -> None:
        """Learn from a completed run (ignored when the model-dependent part is under 10% of the estimate or
        under ten times the measurement's resolution)."""
        variable = raw_estimate - overhead
        if raw_estimate <= 0 or measured_peak <= 0 or variable < max(0.1 * raw_estimate, 10 * self.resolution):
            return
        ratio = min(MAX_RATIO, max(MIN_RATIO, (measured_peak - overhead) / variable))
        with self._lock:
            self.ratios = [*self.ratios, ratio][-self.window:]
        self._save()

    def observe_failure(self, raw_estimate: int, available: int, overhead: int = 0) -> None:
        """Learn from a run killed by SIGKILL, most likely for memory: the real need was above ``available``.

        The factor rises to what that implies, but at most doubles per failure: a kill for another reason
        (an operator, a watchdog) while gigabytes were free must not make every later model look unaffordable.
        """
        variable = raw_estimate - overhead
        if variable <= 0:
            return
        current = self.factor
        implied = (available - overhead) / variable * self.margin
        with self._lock:
            self.floor = max(self.floor, min(implied, current * 2.0))
        self._save()

    def _load(self) -> None:
        assert self.path is not None
        try:
            data = json.loads(self.path.read_text())
            ratios = [float(r) for r in data.get("ratios", []) if 0 < float(r) < 100]
            floor = float(data.get("floor", 0.0))
        except (OSError, ValueError, TypeError, AttributeError):
            return  # a damaged file only loses what was learnt
        if not math.isfinite(floor):
            return
        self.ratios, self.floor = ratios[-self.window:], max(0.0, floor)

    def _save(self) -> None:
        if self.path is None:
            return
        with self._lock:
            data: dict[str, object] = {"ratios": self.ratios, "floor": self.floor}
            if self.label is not None:
                data["of"] = self.label
        with self._save_lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(self.path, json.dumps(data).encode())
