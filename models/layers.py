"""Building blocks shared by the model families: HeteroFL's Scaler and static batch norm, and switching dropout off."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["Scaler", "dropout_off", "static_bn"]


class Scaler(nn.Module):
    """Divide the input by the width ``rate`` while training; identity in evaluation.

    HeteroFL appends it right after each sliced parametric layer (conv -> Scaler -> norm -> ReLU), like
    inverted dropout, so that a sub-model trained at rate ``r`` produces activations on the scale the full
    model sees at inference time. At rate 1 it returns its input itself (no copy).
    """

    def __init__(self, rate: float) -> None:
        super().__init__()
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0.0 < rate <= 1.0:
            raise ValueError(f"Scaler rate must be a number in (0, 1], got {rate!r}.")
        self.rate = float(rate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # At rate 1 dividing would change nothing but allocate (and keep for backward) a copy of x.
        return x / self.rate if self.training and self.rate != 1.0 else x

    def extra_repr(self) -> str:
        return f"rate={self.rate:g}"


def static_bn(channels: int, track_running_stats: bool) -> nn.BatchNorm2d:
    """HeteroFL's static batch norm (sBN).

    With ``track_running_stats=False`` (edge training) the layer always normalises with batch statistics and
    has no running buffers, so no statistics travel. With ``True`` (server) it has running buffers with
    ``momentum=None``: a cumulative average, which the server fills by a no-grad forward pass in train mode
    after aggregation.
    """
    return nn.BatchNorm2d(channels, momentum=None, affine=True, track_running_stats=track_running_stats)


def dropout_off(model: nn.Module) -> None:
    """Put every dropout module of ``model`` in eval mode (the rest keeps its mode): it computes its
    prediction, not a random draw of it, and takes nothing from the random stream."""
    for module in model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd):
            module.eval()
