"""HeteroFL's convolutional model (its MNIST / CIFAR "Conv" model)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from torch import nn

from models._checks import positive_int_tuple
from models.family import LayerDecl, ModelFamily, conv_bn_chain, linear_decl
from models.layers import Scaler, static_bn
from models.net import BodyParts

__all__ = ["ConvFamily"]


class ConvFamily(ModelFamily):
    """Conv blocks ``Conv2d(3x3, pad 1) -> Scaler -> sBN -> ReLU``, ``MaxPool2d(2)`` after all but the last,
    then ``AdaptiveAvgPool2d(1) -> Flatten -> Linear``.

    Options
    -------
    hidden:
        Output channels of conv1..convN (default ``(64, 128, 256, 512)``, HeteroFL's MNIST model).

    exit_convs:
        Convolutions per early-exit head (default 0: an exit is average pooling and a linear layer; ScaleFL's
        three 3x3 convolutions at the width of a 256-channel block would outweigh the rest of this small model).

    Layer names (``layer_widths`` keys) are ``"conv1".."convN"``. Body block ``i-1`` is conv block ``i`` (conv,
    Scaler, sBN, ReLU and its max pool); the final head is the average pool and the classifier.
    ``state_dict`` keys: ``conv{i}.weight``, ``conv{i}.bias``, ``bn{i}.weight``, ``bn{i}.bias`` (plus
    ``bn{i}.running_mean``, ``bn{i}.running_var``, ``bn{i}.num_batches_tracked`` when BN statistics are
    tracked), ``classifier.weight``, ``classifier.bias``. Works on 28x28 and on inputs as small as
    ``2 ** (N - 1)`` pixels a side (8x8 for the default four blocks). The Scaler after ``conv{i}`` uses that
    layer's own rate.
    """

    name: ClassVar[str] = "cnn"
    option_defaults: ClassVar[Mapping[str, Any]] = {"hidden": (64, 128, 256, 512)}
    default_exit_convs: ClassVar[int] = 0

    def _validate_options(self, options: dict[str, Any]) -> dict[str, Any]:
        return {"hidden": positive_int_tuple("hidden", options["hidden"])}

    @property
    def hidden(self) -> tuple[int, ...]:
        return tuple(self.options["hidden"])

    def _channel_groups(self) -> Mapping[str, int]:
        return {f"conv{i}": h for i, h in enumerate(self.hidden, start=1)}

    def _declare_layers(self) -> Sequence[LayerDecl]:
        return [*conv_bn_chain(len(self.hidden)), linear_decl("classifier", f"conv{len(self.hidden)}", None)]

    def _build_body(self, channels: Mapping[str, int], rates: Mapping[str, float], track_bn_stats: bool,
                    depth: int) -> BodyParts:
        modules: OrderedDict[str, nn.Module] = OrderedDict()
        blocks: list[nn.Module] = []
        cin = self.in_channels
        n = len(self.hidden)
        for i in range(1, depth + 1):
            group = f"conv{i}"
            cout = channels[group]
            block = [nn.Conv2d(cin, cout, kernel_size=3, stride=1, padding=1, bias=True), Scaler(rates[group]),
                     static_bn(cout, track_bn_stats), nn.ReLU()]
            names = ["conv", "scaler", "bn", "relu"]
            if i < n:
                block.append(nn.MaxPool2d(2))
                names.append("pool")
            for kind, module in zip(names, block):
                modules[f"{kind}{i}"] = module
            blocks.append(nn.Sequential(*block))
            cin = cout
        head = None
        if depth == n:
            modules["avgpool"] = nn.AdaptiveAvgPool2d(1)
            modules["flatten"] = nn.Flatten()
            modules["classifier"] = nn.Linear(cin, self.num_classes)
            head = nn.Sequential(modules["avgpool"], modules["flatten"], modules["classifier"])
        return BodyParts(modules, blocks, head)
