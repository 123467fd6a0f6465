"""Local training recipes. The recipe arrives as data in the task; the agent never knows the paper."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from protocol import Recipe


@dataclass(frozen=True)
class TrainResult:
    """What a local training run reports back."""

    loss: float
    steps: int
    samples: int
    seconds: float


def label_mask(labels: Sequence[int], num_classes: int) -> torch.Tensor:
    """Boolean vector of the classes present in the local data."""
    mask = torch.zeros(num_classes, dtype=torch.bool)
    mask[torch.as_tensor([label for label in labels if 0 <= label < num_classes], dtype=torch.long)] = True
    return mask


def masked_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """HeteroFL's masked cross-entropy: logits of classes absent locally are set to 0 (not -inf)."""
    return nn.functional.cross_entropy(logits.masked_fill(~mask, 0.0), targets)


def train_plain(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    recipe: Recipe,
    labels: Sequence[int],
    num_classes: int,
    device: torch.device | str = "cpu",
) -> TrainResult:
    """SGD over the local data for ``recipe.epochs`` epochs, in train mode (static BN: batch statistics)."""
    if len(x) == 0:
        raise ValueError("no local training data")
    if recipe.batch_size < 2:
        raise ValueError("batch_size must be at least 2: static BN normalises with batch statistics")
    started = time.monotonic()
    generator = torch.Generator().manual_seed(recipe.seed)
    model.to(device).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=recipe.lr, momentum=recipe.momentum,
                                weight_decay=recipe.weight_decay)
    mask = label_mask(labels, num_classes).to(device)
    total_loss, steps, seen = 0.0, 0, 0
    for _ in range(recipe.epochs):
        order = torch.randperm(len(x), generator=generator)
        for start in range(0, len(x), recipe.batch_size):
            batch = order[start:start + recipe.batch_size]
            if len(batch) < 2:
                continue  # a last batch of one sample: batch-statistics BN cannot normalise it
            inputs, targets = x[batch].to(device), y[batch].to(device)
            optimizer.zero_grad(set_to_none=True)
            logits = model(inputs)
            loss = (masked_cross_entropy(logits, targets, mask) if recipe.masked_ce
                    else nn.functional.cross_entropy(logits, targets))
            if not torch.isfinite(loss):
                raise FloatingPointError(f"training diverged (loss {loss.item()}) at step {steps}")
            loss.backward()
            if recipe.clip_norm is not None:
                nn.utils.clip_grad_norm_(model.parameters(), recipe.clip_norm)
            optimizer.step()
            total_loss += loss.item() * len(batch)
            seen += len(batch)
            steps += 1
    mean_loss = total_loss / seen if seen else math.nan
    return TrainResult(loss=mean_loss, steps=steps, samples=seen, seconds=time.monotonic() - started)
