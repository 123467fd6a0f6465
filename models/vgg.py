"""VGG with batch norm (Simonyan & Zisserman's VGG-11/13/16, configurations A, B and D), in its CIFAR form."""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, TypeAlias

from torch import nn

from models._checks import check_positive_int
from models.family import LayerDecl, ModelFamily, conv_bn_chain, linear_decl
from models.layers import Scaler, static_bn
from models.net import BodyParts

__all__ = ["VGG11_CONFIG", "VGG13_CONFIG", "VGG16_CONFIG", "Vgg11Family", "Vgg13Family", "Vgg16Family",
           "VggFamily"]

#: One entry of a VGG configuration: a 3x3 convolution's output channels, or ``"M"`` for a 2x2 max pool.
VggEntry: TypeAlias = int | str

#: Configuration "A" (VGG-11).
VGG11_CONFIG: tuple[VggEntry, ...] = (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M")
#: Configuration "B" (VGG-13).
VGG13_CONFIG: tuple[VggEntry, ...] = (64, 64, "M", 128, 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M")
#: Configuration "D" (VGG-16).
VGG16_CONFIG: tuple[VggEntry, ...] = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M",
                                      512, 512, 512, "M")


def _check_config(value: object) -> tuple[VggEntry, ...]:
    """A non-empty sequence of positive ints and ``"M"``, starting with a convolution."""
    if isinstance(value, (str, bytes)) or not isinstance(value, (tuple, list)) or not value:
        raise ValueError(f"config must be a non-empty sequence of positive integers and 'M', got {value!r}.")
    out: list[VggEntry] = []
    for entry in value:
        if entry == "M" and isinstance(entry, str):
            out.append("M")
        elif isinstance(entry, int) and not isinstance(entry, bool) and entry > 0:
            out.append(int(entry))
        else:
            raise ValueError(f"every entry of config must be a positive integer or 'M', got {entry!r}.")
    if out[0] == "M":
        raise ValueError(f"config must start with a convolution (a pool follows the convolution before it), "
                         f"got {value!r}.")
    return tuple(out)


def _check_head(value: object) -> tuple[int, ...]:
    """A (possibly empty) sequence of positive ints: the hidden linear layers' widths."""
    if isinstance(value, (str, bytes)) or not isinstance(value, (tuple, list)):
        raise ValueError(  # noqa: TRY004
            f"head must be a sequence of positive integers (hidden linear widths), got {value!r}.")
    return tuple(check_positive_int("every entry of head", v) for v in value)


def _check_dropout(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not 0.0 <= value < 1.0:
        raise ValueError(f"dropout must be a number in [0, 1), got {value!r}.")
    return float(value)


class VggFamily(ModelFamily):
    """VGG with batch norm: ``Conv2d(3x3, pad 1, bias) -> Scaler -> sBN -> ReLU`` per convolution, a
    ``MaxPool2d(2, ceil_mode=True)`` where the configuration says ``"M"``, then the head
    ``AdaptiveAvgPool2d(1) -> Flatten -> (Linear -> Scaler -> ReLU -> Dropout) per hidden layer -> Linear``.

    The base of :class:`Vgg11Family`, :class:`Vgg13Family` and :class:`Vgg16Family`, which differ only in their
    default ``config``; this class itself (unregistered) needs a ``config``.

    Options
    -------
    config:
        The convolutions: a sequence of output channel counts and ``"M"`` (a max pool after the convolution
        before it; ``k`` consecutive ``"M"`` make one ``MaxPool2d(2**k, ceil_mode=True)``, the same as ``k``
        pools). Must start with a convolution.
    head:
        Widths of the hidden linear layers (default ``(4096, 4096)``: the 512-4096-4096-classes head of the
        CIFAR VGG reference code, 33.6 M parameters for VGG-16 on 10 classes); ``()`` puts the classifier
        directly on the last convolution's channels.
    dropout:
        Dropout probability after each hidden linear layer's ReLU (default 0.5, as in the reference code; 0
        leaves the dropout modules out).
    exit_convs:
        Convolutions per early-exit head (default 0: average pooling and a linear layer, as for the CNN).

    Input sizes: the pools round up (``ceil_mode``), so five pools take 32x32 to 1x1 and 28x28 to 1x1 as well
    (28 -> 14 -> 7 -> 4 -> 2 -> 1); a pool over a 1x1 map keeps it 1x1, so small inputs (8x8 digits:
    8 -> 4 -> 2 -> 1 -> 1 -> 1) work too. The head's ``AdaptiveAvgPool2d(1)`` averages whatever map remains
    (the identity on 1x1), so larger inputs give the same head, unlike torchvision's ImageNet head (7x7 x 512
    inputs).

    Layer names (``layer_widths`` keys, depth order): ``"conv1".."convN"`` (N = 13 for VGG-16), then the hidden
    linear layers ``"fc1".."fcK"``. Body block ``i-1`` is convolution ``i`` with its Scaler, sBN, ReLU and the
    pool that follows it (if any); the final head is everything after the last convolution's block.
    ``state_dict`` keys: ``conv{i}.weight``, ``conv{i}.bias``, ``bn{i}.weight``, ``bn{i}.bias`` (plus the
    running statistics when tracked), ``fc{j}.weight``, ``fc{j}.bias``, ``classifier.weight``,
    ``classifier.bias``. Every Scaler uses the rate of the layer it follows.
    """

    name: ClassVar[str] = "vgg"
    option_defaults: ClassVar[Mapping[str, Any]] = {"config": None, "head": (4096, 4096), "dropout": 0.5}
    default_exit_convs: ClassVar[int] = 0

    def _validate_options(self, options: dict[str, Any]) -> dict[str, Any]:
        if options["config"] is None:
            raise ValueError(f"family {self.name!r} needs a config (vgg11, vgg13 and vgg16 have theirs).")
        return {"config": _check_config(options["config"]), "head": _check_head(options["head"]),
                "dropout": _check_dropout(options["dropout"])}

    @property
    def config(self) -> tuple[VggEntry, ...]:
        """The convolution configuration (channel counts and ``"M"``)."""
        return tuple(self.options["config"])

    @property
    def convs(self) -> tuple[tuple[int, int], ...]:
        """``(output channels, pools after it)`` of every convolution, in depth order."""
        out: list[list[int]] = []
        for entry in self.config:
            if entry == "M":
                out[-1][1] += 1
            else:
                out.append([int(entry), 0])
        return tuple((c, pools) for c, pools in out)

    @property
    def head(self) -> tuple[int, ...]:
        """Widths of the hidden linear layers."""
        return tuple(self.options["head"])

    def _channel_groups(self) -> Mapping[str, int]:
        groups = {f"conv{i}": c for i, (c, _) in enumerate(self.convs, start=1)}
        groups.update({f"fc{j}": h for j, h in enumerate(self.head, start=1)})
        return groups

    def _declare_layers(self) -> Sequence[LayerDecl]:
        decls = conv_bn_chain(len(self.convs))
        previous = f"conv{len(self.convs)}"
        for j in range(1, len(self.head) + 1):
            group = f"fc{j}"
            decls.append(linear_decl(group, previous, group))
            previous = group
        decls.append(linear_decl("classifier", previous, None))
        return decls

    def _build_body(self, channels: Mapping[str, int], rates: Mapping[str, float], track_bn_stats: bool,
                    depth: int) -> BodyParts:
        modules: OrderedDict[str, nn.Module] = OrderedDict()
        blocks: list[nn.Module] = []
        cin = self.in_channels
        for i, (_, pools) in enumerate(self.convs[:depth], start=1):
            group = f"conv{i}"
            cout = channels[group]
            block: dict[str, nn.Module] = {
                f"conv{i}": nn.Conv2d(cin, cout, kernel_size=3, stride=1, padding=1, bias=True),
                f"scaler{i}": Scaler(rates[group]),
                f"bn{i}": static_bn(cout, track_bn_stats),
                f"relu{i}": nn.ReLU(),
            }
            if pools:
                block[f"pool{i}"] = nn.MaxPool2d(2**pools, ceil_mode=True)
            modules.update(block)
            blocks.append(nn.Sequential(*block.values()))
            cin = cout
        head = None
        if depth == len(self.convs):
            tail: dict[str, nn.Module] = {"avgpool": nn.AdaptiveAvgPool2d(1), "flatten": nn.Flatten()}
            dropout = float(self.options["dropout"])
            for j in range(1, len(self.head) + 1):
                group = f"fc{j}"
                tail[group] = nn.Linear(cin, channels[group])
                tail[f"scaler_fc{j}"] = Scaler(rates[group])
                tail[f"relu_fc{j}"] = nn.ReLU()
                if dropout > 0:
                    tail[f"dropout{j}"] = nn.Dropout(dropout)
                cin = channels[group]
            tail["classifier"] = nn.Linear(cin, self.num_classes)
            modules.update(tail)
            head = nn.Sequential(*tail.values())
        return BodyParts(modules, blocks, head)


class Vgg11Family(VggFamily):
    """VGG-11 with batch norm (configuration "A": 8 convolutions); see :class:`VggFamily`."""

    name: ClassVar[str] = "vgg11"
    option_defaults: ClassVar[Mapping[str, Any]] = {**VggFamily.option_defaults, "config": VGG11_CONFIG}


class Vgg13Family(VggFamily):
    """VGG-13 with batch norm (configuration "B": 10 convolutions); see :class:`VggFamily`."""

    name: ClassVar[str] = "vgg13"
    option_defaults: ClassVar[Mapping[str, Any]] = {**VggFamily.option_defaults, "config": VGG13_CONFIG}


class Vgg16Family(VggFamily):
    """VGG-16 with batch norm (configuration "D": 13 convolutions; 33,646,666 parameters for 32x32 RGB inputs and
    10 classes with the default head); see :class:`VggFamily`."""

    name: ClassVar[str] = "vgg16"
    option_defaults: ClassVar[Mapping[str, Any]] = {**VggFamily.option_defaults, "config": VGG16_CONFIG}
