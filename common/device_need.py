"""What a device needs to train a (spec, plan), by the rule its agent applies before it trains: the estimator's
raw peak with its model-dependent part (everything but the runtime's fixed overhead) times the device's
calibration factor, which starts at :data:`INITIAL_FACTOR` before the device has measured anything.

The agent (``edge_agent.calibration``, ``edge_agent.decision``) and the coordinator's planning (``fedfit plan``,
the strategies' level choice, the simulator's budgets) share this rule, so that what a plan says a device trains
is what the device then trains. It imports nothing heavy: the agent process, which never imports torch, uses it.
"""

from __future__ import annotations

from typing import Protocol


class Estimate(Protocol):
    """An estimate of peak training memory (:class:`models.MemoryEstimate`): its total and its fixed overhead."""

    @property
    def total(self) -> int: ...

    @property
    def overhead(self) -> int: ...

__all__ = ["INITIAL_FACTOR", "corrected", "device_need"]

#: The calibration factor before any measurement: a 10% margin over the raw estimate (with the agent's default
#: ``pooled`` heap the estimator under-predicts no ``benchmarks/memory.py`` row above 5 MB by more than 2% on
#: AVX-512 and 4.5% on AVX2, the smallest ones, of 1-3 MB, by up to 10%).
INITIAL_FACTOR = 1.10


def corrected(raw_estimate: int, overhead: int, factor: float) -> int:
    """``raw_estimate`` with its model-dependent part (``raw_estimate - overhead``) times ``factor``."""
    return overhead + int((raw_estimate - overhead) * factor)


def device_need(estimate: Estimate, factor: float = INITIAL_FACTOR) -> int:
    """The bytes a device with calibration ``factor`` (a fresh one: :data:`INITIAL_FACTOR`) must have available to
    train what ``estimate`` estimates."""
    return corrected(estimate.total, estimate.overhead, factor)
