"""The module every family builds: body blocks in depth order, early exits, and the final head.

A family registers its modules under the names its declaration uses (so ``state_dict`` keys are the declared
ones) and hands over *views*: the body blocks in depth order and the final head, each a module composed of
registered submodules. Views are kept in a plain tuple, not registered a second time, so each parameter appears
once in the ``state_dict``; ``deepcopy``, ``.to()`` and ``torch.func.functional_call`` see the registered
modules and the views follow them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from models.layers import Scaler, static_bn

__all__ = ["BodyParts", "ExitHead", "FamilyNet"]


@dataclass
class BodyParts:
    """What a family builds for one spec: its registered modules and the views onto them.

    ``modules`` are the top-level children in registration (``state_dict``) order; ``blocks`` the kept body
    blocks in depth order (block 0 includes the stem); ``head`` the final head, None when the body is cut.
    """

    modules: Mapping[str, nn.Module]
    blocks: Sequence[nn.Module]
    head: nn.Module | None


class ExitHead(nn.Sequential):
    """An early-exit classifier: ``convs`` times ``conv3x3 -> Scaler -> sBN -> ReLU`` at ``channels[i]``
    channels, then average pooling and a linear layer (ScaleFL's exit heads; no convolutions: pool + linear)."""

    def __init__(self, in_channels: int, channels: Sequence[int], rates: Sequence[float], num_classes: int,
                 track_bn_stats: bool) -> None:
        layers: OrderedDict[str, nn.Module] = OrderedDict()
        cin = in_channels
        for i, (cout, rate) in enumerate(zip(channels, rates), start=1):
            layers[f"conv{i}"] = nn.Conv2d(cin, cout, kernel_size=3, padding=1, bias=False)
            layers[f"scaler{i}"] = Scaler(rate)
            layers[f"bn{i}"] = static_bn(cout, track_bn_stats)
            layers[f"relu{i}"] = nn.ReLU()
            cin = cout
        layers["avgpool"] = nn.AdaptiveAvgPool2d(1)
        layers["flatten"] = nn.Flatten()
        layers["classifier"] = nn.Linear(cin, num_classes)
        super().__init__(layers)


class FamilyNet(nn.Module):
    """A (sub-)model of a family: ``forward`` gives the logits of its last output, ``forward_exits`` those of
    every output in depth order (the early exits after their blocks, then the final head when it is kept)."""

    def __init__(self, parts: BodyParts, exits: Mapping[int, nn.Module]) -> None:
        super().__init__()
        for name, module in parts.modules.items():
            self.add_module(name, module)
        if exits:
            self.add_module("exits", nn.ModuleDict({str(b): exits[b] for b in sorted(exits)}))
        if parts.head is None and (not exits or max(exits) != len(parts.blocks) - 1):
            raise ValueError("a model cut before its final head needs an exit after its last kept block")
        self._views: tuple[tuple[nn.Module, ...], nn.Module | None] = (tuple(parts.blocks), parts.head)
        self.exit_blocks: tuple[int, ...] = tuple(sorted(exits))

    @property
    def blocks(self) -> tuple[nn.Module, ...]:
        """The body blocks in depth order (views onto registered modules)."""
        return self._views[0]

    @property
    def head(self) -> nn.Module | None:
        """The final head, or None when the body is cut before it."""
        return self._views[1]

    @property
    def num_outputs(self) -> int:
        """How many logits ``forward_exits`` returns."""
        return len(self.exit_blocks) + (self.head is not None)

    def exit_head(self, block: int) -> nn.Module:
        """The early-exit head after ``block``."""
        exits = self._modules.get("exits")
        if not isinstance(exits, nn.ModuleDict) or str(block) not in exits:
            raise KeyError(f"this model has no exit after block {block}")
        return exits[str(block)]

    def output_head(self) -> nn.Module:
        """The module producing the last output: the final head, or the exit after the last kept block."""
        return self.head if self.head is not None else self.exit_head(len(self.blocks) - 1)

    def forward_exits(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Logits of every output, the early exits in depth order and the final head last."""
        outputs: list[torch.Tensor] = []
        exits = set(self.exit_blocks)
        for index, block in enumerate(self.blocks):
            x = block(x)
            if index in exits:
                outputs.append(self.exit_head(index)(x))
        if self.head is not None:
            outputs.append(self.head(x))
        return outputs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of the last output only (the early exits before it are not computed)."""
        for block in self.blocks:
            x = block(x)
        out: torch.Tensor = self.output_head()(x)
        return out
