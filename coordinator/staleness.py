"""Buffered rounds (``round_mode: buffered``): a round that aggregates once enough answers are in, and updates that
count in a later round, weighted by how stale they are (FedBuff: Nguyen et al., AISTATS 2022).

A round aggregates once ``buffered.size`` trained updates are in (a device that declines fills no buffer) instead of
waiting for its slowest device; its tasks still training are carried into the next round, whose tasks go only to the
devices that are free. An update that comes back ``tau`` rounds after its task was cut from the global model is
folded in as FedBuff folds a client's delta: its change from the weights it was sent, scaled by ``s(tau) = 1 /
sqrt(1 + tau)``, added to the weights the round started from (:func:`rebased`). The round's masked mean of those
stays the strategy's own (each element the weighted mean of the updates that hold it), so a fresh update (``tau =
0``) is folded exactly as in a synchronous round, and a stale one moves the model by ``s(tau)`` of its own change,
toward where it went from where it started. A task more than ``buffered.max_staleness`` rounds old is carried no
further (its update, when it comes, is refused).
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from coordinator.aggregation import grid, leading, leading_sizes
from coordinator.tasks import State, TaskResult

__all__ = ["buffer_size", "rebased", "staleness_weight"]


def staleness_weight(staleness: int) -> float:
    """FedBuff's ``s(tau) = 1 / sqrt(1 + tau)``: 1 for a fresh update, 0.71 one round late, 0.5 three."""
    if staleness < 0:
        raise ValueError(f"staleness is a count of rounds, got {staleness}")
    return 1.0 / math.sqrt(1.0 + staleness)


def buffer_size(configured: int, tasks: int, untrained: int = 0) -> int:
    """The trained updates a buffered round aggregates at, of its ``tasks`` of which ``untrained`` were answered
    without one (declined or failed: they free their device, they fill no buffer): ``configured``, or half of the
    others rounded up when 0; never more than the others, at least one."""
    trainable = max(0, tasks - untrained)
    wanted = configured if configured > 0 else math.ceil(trainable / 2)
    return max(1, min(wanted, trainable))


def _slice(tensor: torch.Tensor, indices: tuple[torch.Tensor, ...] | list[torch.Tensor]) -> torch.Tensor:
    sizes = leading_sizes(indices)
    return leading(tensor, sizes) if sizes is not None else tensor[grid(indices)]


def rebased(result: TaskResult, sent: State, current: State, staleness: int) -> TaskResult:
    """``result`` as a round that started from ``current`` folds it: ``current + s(tau) * (trained - sent)`` at
    the positions its index map names (``sent``: its group's state its task was cut from, ``tau`` rounds ago). A
    fresh update is returned as it is."""
    if staleness == 0:
        return result
    scale = staleness_weight(staleness)
    state: dict[str, torch.Tensor] = {}
    for key, trained in result.state.items():
        if not trained.is_floating_point():
            state[key] = trained
            continue
        indices = result.index_map[key]
        start = _slice(current[key], indices).to(torch.float32)
        change = trained.to(torch.float32) - _slice(sent[key], indices).to(torch.float32)
        state[key] = (start + scale * change).to(trained.dtype)
    return replace(result, state=state, staleness=staleness)

