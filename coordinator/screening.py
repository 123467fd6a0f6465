"""Screening updates before aggregation: an update whose change is not finite, or far larger than the round's
other updates', is left out with a reason.

The change of an update is the root mean square, over every element it trained, of (trained - sent): per element,
so that a thin sub-model or a few depth-wise blocks compare with the full model. An update is rejected when its
change is not finite, or when it exceeds ``max_ratio`` times the median change of the round's other updates
(checked only where the round has another update that changed something).

What this does not protect against: an update scaled just under the ratio, many colluding devices (they move the
median), a poisoned direction of ordinary size (a backdoor, labels flipped on the device), and a round with a single
update. It stops the blunt attacks: huge, sign-flipped or non-finite weights.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence

import torch

from coordinator.config import ScreeningConfig
from coordinator.strategies.base import TaskResult

__all__ = ["change_of", "screen"]


def change_of(trained: Mapping[str, torch.Tensor], sent: Mapping[str, torch.Tensor]) -> float:
    """Root mean square of ``trained - sent`` over every element of ``trained`` (inf or nan when not finite)."""
    total, count = 0.0, 0
    for key, tensor in trained.items():
        delta = tensor.double() - sent[key].double()
        total += float((delta * delta).sum())
        count += delta.numel()
    return math.sqrt(total / count) if count else 0.0


def screen(results: Sequence[TaskResult], sent_of: Callable[[TaskResult], Mapping[str, torch.Tensor]],
           config: ScreeningConfig) -> tuple[list[TaskResult], list[tuple[TaskResult, str]]]:
    """Split ``results`` into those to aggregate and those rejected, with the reason (see the module docstring).
    ``sent_of(result)`` gives the weights its task sent, for the keys it trained."""
    if not config.enabled:
        return list(results), []
    changes = [change_of(result.state, sent_of(result)) for result in results]
    kept: list[TaskResult] = []
    rejected: list[tuple[TaskResult, str]] = []
    for index, (result, change) in enumerate(zip(results, changes)):
        if not math.isfinite(change):
            rejected.append((result, "update rejected: its weights are not finite"))
            continue
        others = [c for j, c in enumerate(changes) if j != index and math.isfinite(c)]
        median = statistics.median(others) if others else 0.0
        if median > 0 and change > config.max_ratio * median:
            reason = (f"update rejected: its change (rms {change:.3g}) is {change / median:.1f} times the median of "
                      f"the round's other updates ({median:.3g}), above screening.max_ratio {config.max_ratio:g}")
            rejected.append((result, reason))
            continue
        kept.append(result)
    return kept, rejected
