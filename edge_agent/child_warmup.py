"""Imported only by the training forkserver (last of its preloads): one tiny training step, so that the torch
runtime's one-time initialisation (thread pools, kernel dispatch tables, allocator arenas) happens once in the
server and every forked training child starts warm instead of paying it again inside its measured peak; then
every object the server holds is frozen out of the garbage collector (``gc.freeze``), so that a collection in a
child does not write to their pages and copy them into the child's memory while it trains (measured: +0.25 to
0.4 MB on the smallest ``benchmarks/memory.py`` rows, 0.9 to 2.4 MB)."""

from __future__ import annotations

import gc

import torch
from torch import nn


def warm_up() -> None:
    """Forward, backward and an SGD step of a small conv net on CPU, with one thread."""
    torch.set_num_threads(1)
    model = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4, track_running_stats=False), nn.ReLU(),
                          nn.MaxPool2d(2), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4)
    loss = nn.functional.cross_entropy(model(torch.randn(4, 1, 8, 8)), torch.tensor([0, 1, 2, 3]))
    loss.backward()
    nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()


warm_up()
gc.collect()
gc.freeze()
