"""A trained (sub-)model as ONNX, for the devices that run it: the whole model in one graph (its answer: the last
output, or the mean logits of an ensemble of its outputs), and its stages between early exits, each a graph of its
own, so that inference can stop at the first exit confident enough without computing the rest.

Exported with torch's exporter (``torch.onnx.export(..., dynamo=True)``: ``torch.export`` then onnxscript), the
batch dimension left free. The graphs take float32 images ``N x C x H x W``, normalised as the model was trained;
a stage after the first takes the previous stage's features. Nothing here is pickled: an ONNX file is a protobuf.
"""

from __future__ import annotations

import contextlib
import io
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from models.net import FamilyNet

__all__ = ["AnswerModule", "Stage", "StageModule", "export_answer", "export_stages", "stages"]

#: Name of every graph's image (or features) input and of its outputs.
INPUT = "input"
FEATURES = "features"
LOGITS = "logits"


class AnswerModule(nn.Module):
    """What a deployed model answers: the logits of ``net``'s last output, or (``members``, 0-based outputs) the mean
    of those outputs' logits (DepthFL's ensemble of its trained classifiers)."""

    def __init__(self, net: FamilyNet, members: Sequence[int] = ()) -> None:
        super().__init__()
        self.net = net
        self.members = tuple(sorted(set(members)))
        if self.members and (self.members[0] < 0 or self.members[-1] >= net.num_outputs):
            raise ValueError(f"ensemble members {self.members} are not outputs of a model with {net.num_outputs}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.members:
            out: torch.Tensor = self.net(x)
            return out
        outputs = self.net.forward_exits(x)
        return torch.stack([outputs[index] for index in self.members]).mean(dim=0)


@dataclass(frozen=True)
class Stage:
    """The blocks ``start .. stop - 1`` of a model and the output after them (``head``: the exit after block
    ``stop - 1``, or None for the final head); ``last``: no stage follows, so it hands on no features."""

    start: int
    stop: int
    exit_block: int | None
    last: bool


def stages(net: FamilyNet) -> list[Stage]:
    """The model cut at its outputs: one stage per output, in depth order (the early exits, then the final head)."""
    cuts: list[Stage] = []
    start = 0
    outputs = [*net.exit_blocks, *([None] if net.head is not None else [])]
    for number, block in enumerate(outputs):
        stop = len(net.blocks) if block is None else block + 1
        cuts.append(Stage(start, stop, block, number == len(outputs) - 1))
        start = stop
    return cuts


class StageModule(nn.Module):
    """One :class:`Stage` of ``net`` as a module: features (or images) in; its output's logits out, and the features
    after its blocks first unless it is the last stage."""

    def __init__(self, net: FamilyNet, stage: Stage) -> None:
        super().__init__()
        self.body = nn.ModuleList(net.blocks[stage.start:stage.stop])
        self.head: nn.Module = net.output_head() if stage.exit_block is None else net.exit_head(stage.exit_block)
        self.last = stage.last

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        for block in self.body:
            x = block(x)
        logits: torch.Tensor = self.head(x)
        return logits if self.last else (x, logits)


def _onnx(module: nn.Module, example: torch.Tensor, outputs: Sequence[str]) -> bytes:
    """``module`` (in eval mode) as a serialised ONNX model, its batch dimension free."""
    module.eval()
    batch = torch.export.Dim("batch", min=1)
    # The exporter reports its progress on stdout and warns about what it decomposes: neither is the caller's.
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), torch.no_grad():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(module, (example,), dynamo=True, input_names=[INPUT],
                                    output_names=list(outputs), dynamic_shapes=({0: batch},), verbose=False)
    if program is None:  # only the legacy exporter returns nothing
        raise RuntimeError("torch.onnx.export returned no program")
    data: bytes = program.model_proto.SerializeToString()
    return data


def export_answer(net: FamilyNet, input_shape: Sequence[int], members: Sequence[int] = ()) -> bytes:
    """The whole model as one ONNX graph: images ``N x input_shape`` in, its answer's logits out
    (:class:`AnswerModule`)."""
    return _onnx(AnswerModule(net, members), torch.zeros(2, *input_shape), [LOGITS])


def export_stages(net: FamilyNet, input_shape: Sequence[int]) -> list[bytes]:
    """One ONNX graph per output of ``net`` (:func:`stages`): the first takes images ``N x input_shape``, each
    later one the features the stage before it hands on."""
    graphs: list[bytes] = []
    x = torch.zeros(2, *input_shape)
    for stage in stages(net):
        module = StageModule(net, stage).eval()
        graphs.append(_onnx(module, x, [LOGITS] if stage.last else [FEATURES, LOGITS]))
        if not stage.last:
            with torch.no_grad():
                x, _ = module(x)
    return graphs
