"""HeteroFL's pre-activation ResNet-18 (its CIFAR-10 model)."""

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

__all__ = ["PreResNet18Family", "PreResNet20Family"]


class PreActBlock(nn.Module):
    """``Scaler -> sBN -> ReLU -> conv3x3 -> Scaler -> sBN -> ReLU -> conv3x3`` plus the shortcut.

    The shortcut is a 1x1 conv applied to the pre-activated input when ``with_shortcut`` (stride != 1 or the
    channel count changes in the global model), otherwise the raw input.
    """

    def __init__(
        self,
        in_ch: int,
        mid_ch: int,
        out_ch: int,
        *,
        stride: int,
        rate_in: float,
        rate_mid: float,
        track_bn_stats: bool,
        with_shortcut: bool,
    ) -> None:
        super().__init__()
        self.scaler1 = Scaler(rate_in)
        self.bn1 = static_bn(in_ch, track_bn_stats)
        self.relu1 = nn.ReLU()
        self.conv1 = nn.Conv2d(in_ch, mid_ch, kernel_size=3, stride=stride, padding=1, bias=False)
        self.scaler2 = Scaler(rate_mid)
        self.bn2 = static_bn(mid_ch, track_bn_stats)
        self.relu2 = nn.ReLU()
        self.conv2 = nn.Conv2d(mid_ch, out_ch, kernel_size=3, stride=1, padding=1, bias=False)
        self.shortcut: nn.Conv2d | None = (
            nn.Conv2d(in_ch, out_ch, kernel_size=1, stride=stride, bias=False) if with_shortcut else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu1(self.bn1(self.scaler1(x)))
        shortcut = self.shortcut(out) if self.shortcut is not None else x
        out = self.conv1(out)
        out = self.conv2(self.relu2(self.bn2(self.scaler2(out))))
        return out + shortcut


class PreResNet18Family(ModelFamily):
    """HeteroFL's PreResNet18: stem conv3x3 -> 4 stages x 2 pre-activation blocks -> sBN -> ReLU -> pool -> fc.

    Options
    -------
    hidden:
        Channels of each stage (default ``(64, 128, 256, 512)``); stage 1 has stride 1, the others stride 2.
        Any number of stages is accepted (tests use tiny ones).
    blocks:
        Residual blocks per stage (default ``None``: two per stage, the paper's PreResNet18, 11.17 M parameters
        for 10 classes). HeteroFL's public code builds its "resnet18" with ``(1, 1, 1, 2)``, which gives the
        9.6 M parameters of the paper's CIFAR-10 table; pass ``blocks=(1, 1, 1, 2)`` to reproduce that.

    Layer names (``layer_widths`` keys): ``"layer{s}"`` is the residual stream of stage ``s`` (its width is
    shared by every conv writing to it: the stem for stage 1, each block's ``conv2`` and shortcut), and
    ``"layer{s}.{b}.conv1"`` is the inner width of block ``b`` of stage ``s``. Residual shortcuts therefore take
    the block's input indices and the block's output indices. Body blocks are the residual blocks, numbered
    0.. in order, the stem convolution in block 0; the final head is the last Scaler, sBN, ReLU, average pool
    and classifier. Early-exit heads (``exit_convs``, default 3 as in ScaleFL's reference) read a block's raw
    (pre-activation) output.

    ``state_dict`` keys: ``conv1.weight`` (stem), ``layer{s}.{b}.bn1.*``, ``layer{s}.{b}.conv1.weight``,
    ``layer{s}.{b}.bn2.*``, ``layer{s}.{b}.conv2.weight``, ``layer{s}.{b}.shortcut.weight`` (where present),
    ``bn.*``, ``classifier.weight``, ``classifier.bias``. Convs have no bias (as in HeteroFL's code).
    """

    name: ClassVar[str] = "preresnet18"
    option_defaults: ClassVar[Mapping[str, Any]] = {"hidden": (64, 128, 256, 512), "blocks": None}
    #: Residual blocks per stage when the ``blocks`` option is not given.
    blocks_per_stage: ClassVar[int] = 2

    def _validate_options(self, options: dict[str, Any]) -> dict[str, Any]:
        hidden = positive_int_tuple("hidden", options["hidden"])
        if options["blocks"] is None:
            blocks = (self.blocks_per_stage,) * len(hidden)
        else:
            blocks = positive_int_tuple("blocks", options["blocks"])
            if len(blocks) != len(hidden):
                raise ValueError(
                    f"blocks {blocks!r} must give one block count per stage of hidden {hidden!r}."
                )
        return {"hidden": hidden, "blocks": blocks}

    @property
    def hidden(self) -> tuple[int, ...]:
        return tuple(self.options["hidden"])

    @property
    def stage_blocks(self) -> tuple[int, ...]:
        """Residual blocks per stage."""
        return tuple(self.options["blocks"])

    def _blocks(self) -> list[ResidualBlock]:
        return residual_blocks(self.hidden, self.stage_blocks)

    def _channel_groups(self) -> Mapping[str, int]:
        return residual_groups(self.hidden, self._blocks())

    def _declare_layers(self) -> Sequence[LayerDecl]:
        decls = [conv_decl("conv1", None, "layer1", (3, 3), bias=False, block=0)]
        for index, blk in enumerate(self._blocks()):
            p, gin, inner, gout = blk.prefix, blk.in_group, blk.inner_group, blk.out_group
            decls.append(bn_decl(f"{p}.bn1", gin, block=index))
            decls.append(conv_decl(f"{p}.conv1", gin, inner, (3, 3), bias=False, block=index))
            decls.append(bn_decl(f"{p}.bn2", inner, block=index))
            decls.append(conv_decl(f"{p}.conv2", inner, gout, (3, 3), bias=False, block=index))
            if blk.shortcut:
                decls.append(conv_decl(f"{p}.shortcut", gin, gout, (1, 1), bias=False, block=index))
        last = f"layer{len(self.hidden)}"
        decls.append(bn_decl("bn", last))
        decls.append(linear_decl("classifier", last, None))
        return decls

    def _build_body(self, channels: Mapping[str, int], rates: Mapping[str, float], track_bn_stats: bool,
                    depth: int) -> BodyParts:
        stem = nn.Conv2d(self.in_channels, channels["layer1"], kernel_size=3, stride=1, padding=1, bias=False)
        modules: dict[str, nn.Module] = {"conv1": stem}
        stages: list[nn.Sequential] = [nn.Sequential() for _ in self.hidden]
        blocks: list[nn.Module] = []
        for index, blk in enumerate(self._blocks()[:depth]):
            block = PreActBlock(channels[blk.in_group], channels[blk.inner_group], channels[blk.out_group],
                                stride=blk.stride, rate_in=rates[blk.in_group], rate_mid=rates[blk.inner_group],
                                track_bn_stats=track_bn_stats, with_shortcut=blk.shortcut)
            stages[blk.stage - 1].append(block)
            blocks.append(nn.Sequential(stem, block) if index == 0 else block)
        for s, stage in enumerate(stages, start=1):
            if len(stage):
                modules[f"layer{s}"] = stage
        head = None
        if depth == len(self._blocks()):
            last = f"layer{len(self.hidden)}"
            tail = {"scaler": Scaler(rates[last]), "bn": static_bn(channels[last], track_bn_stats), "relu": nn.ReLU(),
                    "avgpool": nn.AdaptiveAvgPool2d(1), "flatten": nn.Flatten(),
                    "classifier": nn.Linear(channels[last], self.num_classes)}
            modules.update(tail)
            head = nn.Sequential(*tail.values())
        return BodyParts(modules, blocks, head)


class PreResNet20Family(PreResNet18Family):
    """FeDepth's PreResNet-20: the same pre-activation blocks, three stages of three (16, 32 and 64 channels), so
    nine residual blocks of two convolutions (the stem in block 0). ``hidden`` and ``blocks`` may be changed."""

    name: ClassVar[str] = "preresnet20"
    option_defaults: ClassVar[Mapping[str, Any]] = {"hidden": (16, 32, 64), "blocks": None}
    blocks_per_stage: ClassVar[int] = 3
