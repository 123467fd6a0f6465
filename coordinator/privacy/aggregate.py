"""A round's aggregate under differential privacy: every update weighs 1, its change is checked against the clip
bound its task set (an update beyond it is rejected, never folded), and the sums take Gaussian noise before they
are divided.

The noise is calibrated to the clip bound, not to any coordinate's contributor count: adding or removing one device
changes the round's sums, over every coordinate at once, by at most the bound in L2, whatever slice it trained; so
every coordinate some update covers gets noise of standard deviation ``noise_multiplier * bound`` on its sum, and
its mean, divided by its own count ``n``, ``noise_multiplier * bound / n``. A coordinate no update covers keeps its
value and takes no noise: nothing of any device's data is in it.

The change an update made is read against the states the round folds into (a stale update of a buffered round,
rebased, is ``current + s * change`` with ``s <= 1``): its L2 norm over every tensor it sent. Whether it needed
clipping is read there too: a change clipped on the device has norm ``bound`` (to float32 rounding), one that needed
none is shorter (adaptive clipping's count).
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from coordinator.aggregation import RoundAggregate, grid, leading, leading_sizes
from coordinator.screening import local_noise_floor, local_noise_reach
from coordinator.staleness import staleness_weight
from coordinator.tasks import State, TaskResult

__all__ = ["PrivateAggregate", "RoundRelease", "change_norms"]

#: Relative slack on the clip bound for float32 rounding of a clipped update (``1e-3`` of the bound, plus the
#: rounding of the weights it was added to: ``2^-22`` of their norm).
BOUND_SLACK = 1e-3
WEIGHT_ROUNDING = 2.0**-22


@dataclass
class RoundRelease:
    """What one private round releases: its sums' noise (``noise_multiplier`` over the largest bound of the updates
    folded; 0 in local mode, where each device noised its own), and per update folded its bound and whether it
    needed no clipping; ``planned``: the round's tasks (adaptive clipping's expected count)."""

    round: int
    noise_multiplier: float
    planned: int = 0
    local: bool = False
    bounds: list[float] = field(default_factory=list)
    unclipped: list[bool] = field(default_factory=list)

    def reset(self) -> None:
        """Forget the updates folded (the aggregate is built again)."""
        self.bounds.clear()
        self.unclipped.clear()

    @property
    def noise_std(self) -> float:
        """The standard deviation of the noise on each covered coordinate's sum."""
        return 0.0 if self.local or not self.bounds else self.noise_multiplier * max(self.bounds)


def change_norms(result: TaskResult, states: Mapping[str, State]) -> tuple[float, float]:
    """The L2 norm of ``result``'s change against ``states`` over every floating tensor it sent, and the norm of the
    weights it started from (squares summed in float64)."""
    state = states[result.task.group]
    change, base = 0.0, 0.0
    for key, trained in result.state.items():
        if not trained.is_floating_point():
            continue
        indices = result.index_map[key]
        sizes = leading_sizes(indices)
        start = leading(state[key], sizes) if sizes is not None else state[key][grid(indices)]
        start = start.to(torch.float64)
        change += float(torch.linalg.vector_norm(trained.to(torch.float64) - start)) ** 2
        base += float(torch.linalg.vector_norm(start)) ** 2
    return math.sqrt(change), math.sqrt(base)


class PrivateAggregate(RoundAggregate):
    """A :class:`RoundAggregate` of uniform weights whose updates must keep within their clip bound and whose sums
    take the noise of ``release`` (see the module docstring)."""

    def __init__(self, states: Mapping[str, State], classifier_keys: list[str], release: RoundRelease) -> None:
        super().__init__(states, _uniform, classifier_keys)
        self.release = release
        #: The noise's generator, seeded from the operating system's entropy: not from the run's seed, which the
        #: configuration (and so whoever reads it) knows.
        self.generator = torch.Generator().manual_seed(secrets.randbits(63))

    def add(self, result: TaskResult) -> None:
        """Fold ``result`` in; ValueError (folding nothing) when its change exceeds its task's clip bound or it does
        not fit its group's model."""
        clip = result.task.plan.update_clip
        if clip is None:
            raise ValueError("its task set no clip bound (it was planned before privacy was on), so its change is "
                             "not bounded")
        rebased, base = change_norms(result, self.states)
        change = rebased / staleness_weight(result.staleness)  # (a stale update's change, as the device sent it)
        noise = local_noise_reach(result)
        limit = clip.bound * (1 + BOUND_SLACK) + WEIGHT_ROUNDING * base + noise
        if not change <= limit:
            raise ValueError(f"its change has L2 norm {change:.4g}, above the clip bound {clip.bound:.4g} its task "
                             f"set{' and its noise' if noise else ''}: under differential privacy every update is "
                             f"clipped on the device (an agent that ignores the bound?)")
        if noise and change < local_noise_floor(result) - clip.bound:
            raise ValueError(f"its change has L2 norm {change:.4g}, below what the noise its task set gives "
                             f"({local_noise_floor(result):.4g} at least): under local differential privacy every "
                             f"update is noised on the device (an agent that ignores the noise?)")
        super().add(result)
        self.release.bounds.append(clip.bound)
        self.release.unclipped.append(change < clip.bound * (1 - BOUND_SLACK) - WEIGHT_ROUNDING * base)

    def fresh(self) -> PrivateAggregate:
        """An empty aggregate over the same states, its release's updates forgotten."""
        self.release.reset()
        return PrivateAggregate(self.states, self.classifier_keys, self.release)

    def result(self, noise_std: float = 0.0, generator: torch.Generator | None = None) -> dict[str, State]:
        """The new states, each covered coordinate's sum noised (the release's noise, whatever is asked)."""
        return super().result(self.release.noise_std, self.generator)


def _uniform(_result: TaskResult) -> float:
    return 1.0
