"""The CIFAR-style ResNets of He et al. (2016) by depth 6n + 2: ResNet-20, -56 and -110 (ScaleFL's Table 1 model).

Stem ``conv3x3(16) -> Scaler -> sBN -> ReLU``; three stages of ``n`` basic blocks with 16, 32 and 64 channels
(stride 2 entering stages 2 and 3); each block ``conv3x3 -> Scaler -> sBN -> ReLU -> conv3x3 -> Scaler -> sBN``
plus the shortcut, then ReLU; average pooling and a linear classifier. Where a block changes the shape, the
shortcut is a 1x1 convolution followed by sBN (He et al.'s option B, as in ScaleFL's reference code); otherwise
it is the identity. Convolutions have no bias. ResNet-110 has 1,730,714 parameters for 10 classes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from models._checks import positive_int_tuple
from models.family import LayerDecl, ModelFamily, bn_decl, conv_decl, linear_decl
from models.layers import Scaler, static_bn
from models.net import BodyParts
from models.residual import ResidualBlock, residual_blocks, residual_groups

__all__ = ["ResNet20Family", "ResNet56Family", "ResNet110Family", "ResNetFamily"]


class BasicBlock(nn.Module):
    """``conv -> Scaler -> sBN -> ReLU -> conv -> Scaler -> sBN``, plus the shortcut, then ReLU."""

    def __init__(self, in_ch: int, mid_ch: int, out_ch: int, *, stride: int, rate_mid: float, rate_out: float,
                 track_bn_stats: bool, with_shortcut: bool) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_ch, mid_ch, kernel_size=3, stride=stride, padding=1, bias=False)
        self.scaler1 = Scaler(rate_mid)
        self.bn1 = static_bn(mid_ch, track_bn_stats)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(mid_ch, out_ch, kernel_size=3, stride=1, padding=1, bias=False)
        self.scaler2 = Scaler(rate_out)
        self.bn2 = static_bn(out_ch, track_bn_stats)
        self.shortcut: nn.Conv2d | None = None
        self.shortcut_bn: nn.BatchNorm2d | None = None
        if with_shortcut:
            self.shortcut = nn.Conv2d(in_ch, out_ch, kernel_size=1, stride=stride, bias=False)
            self.shortcut_scaler = Scaler(rate_out)
            self.shortcut_bn = static_bn(out_ch, track_bn_stats)
        self.relu2 = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu1(self.bn1(self.scaler1(self.conv1(x))))
        out = self.bn2(self.scaler2(self.conv2(out)))
        if self.shortcut is not None and self.shortcut_bn is not None:
            x = self.shortcut_bn(self.shortcut_scaler(self.shortcut(x)))
        out = self.relu2(out + x)
        return out


class ResNetFamily(ModelFamily):
    """A CIFAR ResNet of any depth ``6n + 2`` (``resnet``; ``resnet20``, ``resnet56`` and ``resnet110`` fix it).

    Options
    -------
    depth:
        Layers, ``2 * stages * n + 2`` for ``n`` basic blocks per stage (``resnet`` only; default 20).
    hidden:
        Channels of each stage (default ``(16, 32, 64)``); the first has stride 1, the others stride 2.
    exit_convs:
        Convolutions per early-exit head (default 3, ScaleFL's reference).

    Layer names (``layer_widths`` keys): ``"layer{s}"`` is the residual stream of stage ``s`` (the stem writes
    stage 1's; each block's ``conv2`` and shortcut write theirs), ``"layer{s}.{b}.conv1"`` the inner width of
    block ``b`` of stage ``s``. Body blocks are the residual blocks in order (3n of them), the stem in block 0.

    ``state_dict`` keys: ``conv1.weight`` and ``bn1.*`` (stem), ``layer{s}.{b}.conv1.weight``, ``.bn1.*``,
    ``.conv2.weight``, ``.bn2.*``, ``.shortcut.weight`` and ``.shortcut_bn.*`` where the shape changes,
    ``classifier.weight``, ``classifier.bias``.
    """

    name: ClassVar[str] = "resnet"
    option_defaults: ClassVar[Mapping[str, Any]] = {"hidden": (16, 32, 64), "depth": 20}

    #: Blocks per stage of a named preset (``resnet110``: 18); ``resnet`` derives them from its ``depth`` option.
    preset_blocks_per_stage: ClassVar[int | None] = None

    def _validate_options(self, options: dict[str, Any]) -> dict[str, Any]:
        hidden = positive_int_tuple("hidden", options["hidden"])
        if self.preset_blocks_per_stage is not None:
            self.blocks_per_stage = self.preset_blocks_per_stage
            return {"hidden": hidden}
        depth = options["depth"]
        per_stage, rest = divmod(depth - 2, 2 * len(hidden)) if isinstance(depth, int) else (0, 1)
        if isinstance(depth, bool) or rest or per_stage < 1:
            raise ValueError(f"depth must be 2 * {len(hidden)} * n + 2 layers for {len(hidden)} stages "
                             f"(e.g. {2 * len(hidden) + 2}, {6 * len(hidden) + 2}), got {depth!r}.")
        self.blocks_per_stage = per_stage
        return {"hidden": hidden, "depth": depth}

    @property
    def hidden(self) -> tuple[int, ...]:
        return tuple(self.options["hidden"])

    def _blocks(self) -> list[ResidualBlock]:
        return residual_blocks(self.hidden, [self.blocks_per_stage] * len(self.hidden))

    def _channel_groups(self) -> Mapping[str, int]:
        return residual_groups(self.hidden, self._blocks())

    def _declare_layers(self) -> Sequence[LayerDecl]:
        decls = [conv_decl("conv1", None, "layer1", (3, 3), bias=False, block=0), bn_decl("bn1", "layer1", block=0)]
        for index, blk in enumerate(self._blocks()):
            p, gin, inner, gout = blk.prefix, blk.in_group, blk.inner_group, blk.out_group
            decls.append(conv_decl(f"{p}.conv1", gin, inner, (3, 3), bias=False, block=index))
            decls.append(bn_decl(f"{p}.bn1", inner, block=index))
            decls.append(conv_decl(f"{p}.conv2", inner, gout, (3, 3), bias=False, block=index))
            decls.append(bn_decl(f"{p}.bn2", gout, block=index))
            if blk.shortcut:
                decls.append(conv_decl(f"{p}.shortcut", gin, gout, (1, 1), bias=False, block=index))
                decls.append(bn_decl(f"{p}.shortcut_bn", gout, block=index))
        decls.append(linear_decl("classifier", f"layer{len(self.hidden)}", None))
        return decls

    def _build_body(self, channels: Mapping[str, int], rates: Mapping[str, float], track_bn_stats: bool,
                    depth: int) -> BodyParts:
        stem_parts = {"conv1": nn.Conv2d(self.in_channels, channels["layer1"], kernel_size=3, padding=1, bias=False),
                      "scaler1": Scaler(rates["layer1"]), "bn1": static_bn(channels["layer1"], track_bn_stats),
                      "relu1": nn.ReLU()}
        modules: dict[str, nn.Module] = dict(stem_parts)
        stages: list[nn.Sequential] = [nn.Sequential() for _ in self.hidden]
        blocks: list[nn.Module] = []
        for index, blk in enumerate(self._blocks()[:depth]):
            block = BasicBlock(channels[blk.in_group], channels[blk.inner_group], channels[blk.out_group],
                               stride=blk.stride, rate_mid=rates[blk.inner_group], rate_out=rates[blk.out_group],
                               track_bn_stats=track_bn_stats, with_shortcut=blk.shortcut)
            stages[blk.stage - 1].append(block)
            blocks.append(nn.Sequential(*stem_parts.values(), block) if index == 0 else block)
        for s, stage in enumerate(stages, start=1):
            if len(stage):
                modules[f"layer{s}"] = stage
        head = None
        if depth == len(self._blocks()):
            last = channels[f"layer{len(self.hidden)}"]
            tail = {"avgpool": nn.AdaptiveAvgPool2d(1), "flatten": nn.Flatten(),
                    "classifier": nn.Linear(last, self.num_classes)}
            modules.update(tail)
            head = nn.Sequential(*tail.values())
        return BodyParts(modules, blocks, head)


class ResNet20Family(ResNetFamily):
    """ResNet-20: 3 blocks per stage."""

    name: ClassVar[str] = "resnet20"
    option_defaults: ClassVar[Mapping[str, Any]] = {"hidden": (16, 32, 64)}
    preset_blocks_per_stage: ClassVar[int | None] = 3


class ResNet56Family(ResNetFamily):
    """ResNet-56: 9 blocks per stage."""

    name: ClassVar[str] = "resnet56"
    option_defaults: ClassVar[Mapping[str, Any]] = {"hidden": (16, 32, 64)}
    preset_blocks_per_stage: ClassVar[int | None] = 9


class ResNet110Family(ResNetFamily):
    """ResNet-110: 18 blocks per stage (ScaleFL's Table 1 model)."""

    name: ClassVar[str] = "resnet110"
    option_defaults: ClassVar[Mapping[str, Any]] = {"hidden": (16, 32, 64)}
    preset_blocks_per_stage: ClassVar[int | None] = 18
