"""Depth-wise training views (FeDepth): train one segment of consecutive blocks and a head, nothing else.

Blocks before the segment run under ``torch.no_grad()`` (frozen: no gradients, nothing saved for backward, only
their output exists), or ran once before the stage (:func:`frozen_outputs`, FeDepth's buffered activations), the
segment's blocks are trained, blocks after it are skipped. The segment's output
reaches a classifier by one of two routes:

- ``"skip"`` (FeDepth's skip connection): every ``s``-th row and column is kept (``s = ceil(size / head size)``)
  and the channels are zero-padded (or truncated) to what the model's output head expects, then that head (the
  final head, or the exit closing a cut model) runs;
- ``"exit"``: the early exit after the segment's last block (auxiliary classifiers per depth).

The same view serves the training interpreter (:mod:`models.training`) and the memory estimator
(:mod:`models.memory`), so what is estimated is what runs. :func:`cut_segments` is FeDepth's memory-adaptive
decomposition: the fewest consecutive segments that each fit a budget, skipping the blocks that never fit, and
the head alone on every block's frozen output where no block fits (the empty segment at the end).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from models.net import FamilyNet

__all__ = ["Decomposition", "SegmentModel", "cut_by_block_costs", "cut_segments", "frozen_outputs",
           "micro_batch_ladder", "output_shape"]


def output_shape(model: FamilyNet, input_shape: tuple[int, ...]) -> tuple[int, int, int]:
    """(channels, height, width) of the last kept block's output for inputs of ``input_shape`` (N, C, H, W):
    a two-sample shape probe on meta copies of the blocks."""
    x = torch.empty(2, *input_shape[1:], device="meta")
    with torch.no_grad():
        for block in model.blocks:
            meta = {k: torch.empty_like(v, device="meta") for k, v in block.state_dict().items()}
            x = torch.func.functional_call(block, meta, (x,))
    return int(x.shape[1]), int(x.shape[2]), int(x.shape[3])


class SegmentModel(nn.Module):
    """Train blocks ``start..stop-1`` of ``model`` and one head (see the module docstring).

    Construction freezes every parameter of ``model`` but the segment's and the head's (``requires_grad``
    changed in place, so ``[p for p in model.parameters() if p.requires_grad]`` is what an optimizer gets);
    :meth:`release` makes every parameter trainable again. ``forward_exits`` returns the one output.
    ``frozen_input``: inputs are already the frozen blocks' outputs (from :func:`frozen_outputs`);
    ``input_shape`` is still that of the model's own input. ``start == stop == len(model.blocks)`` trains the
    head alone on the frozen output of every block (partial training where no block fits).
    """

    def __init__(self, model: FamilyNet, start: int, stop: int, input_shape: tuple[int, ...],
                 route: str = "skip", *, frozen_input: bool = False) -> None:
        super().__init__()
        count = len(model.blocks)
        if not (0 <= start < stop <= count or start == stop == count):
            raise ValueError(f"a segment must be a block range [start, stop) within 0..{count} (or [{count}, "
                             f"{count}): the head alone), got [{start}, {stop}).")
        if route not in ("skip", "exit"):
            raise ValueError(f"route must be 'skip' or 'exit', got {route!r}.")
        self.model = model
        self.start, self.stop, self.route = start, stop, route
        self.frozen_input = frozen_input
        if route == "exit" and stop < count:
            if stop - 1 not in model.exit_blocks:
                raise ValueError(f"route 'exit' needs an exit after block {stop - 1}; the spec has exits at "
                                 f"{list(model.exit_blocks)}.")
            classifier = model.exit_head(stop - 1)
        else:
            classifier = model.output_head()
        self._classifier = (classifier,)  # a view: registered in the model already
        self.skip = route == "skip" and stop < count
        self.head_channels, self.head_h, self.head_w = output_shape(model, input_shape) if self.skip else (0, 0, 0)
        for p in model.parameters():
            p.requires_grad_(False)
        for module in (*model.blocks[start:stop], classifier):
            for p in module.parameters():
                p.requires_grad_(True)

    @property
    def classifier(self) -> nn.Module:
        """The head the segment's output reaches (the final head, or the exit after the segment)."""
        return self._classifier[0]

    def release(self) -> None:
        """Make every parameter of the model trainable again."""
        for p in self.model.parameters():
            p.requires_grad_(True)

    def forward_exits(self, x: torch.Tensor) -> list[torch.Tensor]:
        blocks = self.model.blocks
        if not self.frozen_input:
            with torch.no_grad():
                for block in blocks[: self.start]:
                    x = block(x)
        for block in blocks[self.start:self.stop]:
            x = block(x)
        if self.skip:
            sh = max(1, math.ceil(x.shape[2] / self.head_h))
            sw = max(1, math.ceil(x.shape[3] / self.head_w))
            if sh > 1 or sw > 1:
                x = x[:, :, ::sh, ::sw]
            extra = self.head_channels - x.shape[1]
            if extra > 0:
                x = F.pad(x, (0, 0, 0, 0, 0, extra))
            elif extra < 0:
                x = x[:, : self.head_channels]
        return [self._classifier[0](x)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_exits(x)[0]


def frozen_outputs(model: FamilyNet, stop: int, x: torch.Tensor, batch_size: int,
                   device: torch.device | str = "cpu", on_batch: Callable[[], None] | None = None) -> torch.Tensor:
    """The outputs of blocks ``0..stop-1`` for every sample of ``x`` (on ``device``), computed without gradients
    in batches of ``batch_size`` in the samples' order, the model in its current (train) mode.

    Under static BN the frozen blocks normalise with the statistics of the batch they run in, so a sample's
    buffered output is the one of its batch here, where recomputing gives that of the training batch it falls
    in each epoch; both are batch statistics of the same frozen weights. A last batch of one sample joins the
    one before it (batch statistics cannot normalise a single sample). ``on_batch()`` is called after each batch.
    """
    bounds = list(range(0, len(x), batch_size)) + [len(x)]
    if len(bounds) > 2 and bounds[-1] - bounds[-2] < 2:
        del bounds[-2]
    result: torch.Tensor | None = None
    with torch.no_grad():
        for start, end in itertools.pairwise(bounds):
            out = x[start:end].to(device)
            for block in model.blocks[:stop]:
                out = block(out)
            if result is None:  # filled in place: the buffer is all that stays
                result = out.new_empty((len(x), *out.shape[1:]))
            result[start:end] = out
            del out
            if on_batch is not None:
                on_batch()
    assert result is not None, "no samples"
    return result


@dataclass(frozen=True)
class Decomposition:
    """How a body of blocks is trained under a memory budget (FeDepth): ``skipped`` blocks are not trained at all
    (partial training: they do not fit even alone), ``segments`` are the consecutive block ranges trained one
    after another, input side first, and ``micro_batches`` the micro-batch of each (0: whole batches; empty: all
    whole)."""

    segments: tuple[tuple[int, int], ...]
    skipped: tuple[int, ...]
    micro_batches: tuple[int, ...] = ()

    def micro_batch(self, index: int) -> int:
        """The micro-batch segment ``index`` trains in (0: whole batches)."""
        return self.micro_batches[index] if self.micro_batches else 0

    @property
    def head_only(self) -> bool:
        """Whether the head alone is trained (one empty segment: no block fits)."""
        return len(self.segments) == 1 and self.segments[0][0] == self.segments[0][1]

    def describe(self) -> str:
        """E.g. ``"0 (micro-batches of 8) | 1 | 2-3 | 4-8"`` (block numbers, 0-based), skipped blocks noted;
        ``"head alone (skipped 0, 1, 2, 3)"`` when no block fits."""
        parts = []
        for index, (a, b) in enumerate(self.segments):
            micro = self.micro_batch(index)
            name = "head alone" if a == b else f"{a}" if b - a == 1 else f"{a}-{b - 1}"
            parts.append(name + (f" (micro-batches of {micro})" if micro else ""))
        text = " | ".join(parts) or "nothing"
        return f"{text} (skipped {', '.join(map(str, self.skipped))})" if self.skipped else text


def micro_batch_ladder(batch_size: int, floor: int) -> list[int]:
    """The micro-batches a block that does not fit at ``batch_size`` may train in: the batch halved again and
    again, largest first, down to ``floor`` samples (none when ``floor`` is below 2)."""
    ladder: list[int] = []
    size = batch_size // 2
    while floor >= 2 and size >= floor:
        ladder.append(size)
        size //= 2
    return ladder


def cut_segments(cost: Callable[[int, int], float], num_blocks: int, budget: float, *,
                 micro_cost: Callable[[int, int, int], float] | None = None,
                 micro_batches: Sequence[int] = (), head_only: bool = False) -> Decomposition:
    """The fewest consecutive segments of blocks ``0..num_blocks-1`` whose training each fits ``budget``.

    ``cost(start, stop)`` is the memory of training blocks ``start..stop-1`` together (and the head) at the plan's
    batch size; it must not shrink when a segment grows. Starting at the input side, each segment is extended while
    it fits (greedy, which gives the fewest segments for such costs).

    A block that does not fit alone trains in micro-batches: the largest of ``micro_batches`` (tried in order,
    largest first) at which it fits, ``micro_cost(start, stop, micro)`` being the memory then; its segment takes
    the next blocks while they fit at that micro-batch and do not fit alone at the whole batch (micro-batches only
    where they are needed). A block that fits at none of them is skipped (partial training) and the next segment
    starts after it.

    ``head_only``: when every block is skipped, the head alone is trained on the frozen output of every block,
    the empty segment ``(num_blocks, num_blocks)`` (its cost ``cost(num_blocks, num_blocks)``, or in the largest
    micro-batch at which it fits), if that fits: partial training of what fits, where no block does.
    """
    segments: list[tuple[int, int]] = []
    micros: list[int] = []
    skipped: list[int] = []
    start = 0
    while start < num_blocks:
        if cost(start, start + 1) <= budget:
            stop = start + 1
            while stop < num_blocks and cost(start, stop + 1) <= budget:
                stop += 1
            segments.append((start, stop))
            micros.append(0)
            start = stop
            continue
        micro = next((m for m in micro_batches if micro_cost is not None and micro_cost(start, start + 1, m) <= budget),
                     0)
        if not micro:
            skipped.append(start)
            start += 1
            continue
        assert micro_cost is not None
        stop = start + 1
        while stop < num_blocks and cost(stop, stop + 1) > budget and micro_cost(start, stop + 1, micro) <= budget:
            stop += 1
        segments.append((start, stop))
        micros.append(micro)
        start = stop
    if head_only and not segments and num_blocks > 0:
        end = num_blocks
        if cost(end, end) <= budget:
            return Decomposition(((end, end),), tuple(skipped))
        micro = next((m for m in micro_batches if micro_cost is not None and micro_cost(end, end, m) <= budget), 0)
        if micro:
            return Decomposition(((end, end),), tuple(skipped), (micro,))
    return Decomposition(tuple(segments), tuple(skipped), tuple(micros) if any(micros) else ())


def cut_by_block_costs(costs: Sequence[float], budget: float) -> Decomposition:
    """:func:`cut_segments` for additive per-block costs (a segment costs the sum of its blocks), as in FeDepth's
    paper: blocks of ``{3, 2, 1, 0.5, 0.5, 0.5}`` GB give a 3 GB device ``0 | 1-2 | 3-5`` and a 5 GB one ``0-1 | 2-5``.
    """
    prefix = [0.0]
    for value in costs:
        if value < 0:
            raise ValueError(f"block costs must be non-negative, got {value!r}")
        prefix.append(prefix[-1] + float(value))
    return cut_segments(lambda start, stop: prefix[stop] - prefix[start], len(costs), budget)
