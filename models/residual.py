"""The layout shared by the residual families (PreResNet-18, the CIFAR ResNets): stages of blocks, each block
reading one residual stream and writing the next, with a convolutional shortcut where the shape changes."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["ResidualBlock", "residual_blocks", "residual_groups"]


@dataclass(frozen=True)
class ResidualBlock:
    """One residual block: its stage (1-based) and index in it, the channel groups it reads (``in_group``), uses
    inside (``inner_group``, its own) and writes (``out_group``, the stage's stream), its stride, and whether it
    needs a convolutional shortcut (stride 2 or a change of width in the global model)."""

    stage: int
    index: int
    in_group: str
    inner_group: str
    out_group: str
    stride: int
    shortcut: bool

    @property
    def prefix(self) -> str:
        """Module path of the block: ``layer{stage}.{index}``."""
        return f"layer{self.stage}.{self.index}"


def residual_blocks(hidden: Sequence[int], per_stage: Sequence[int]) -> list[ResidualBlock]:
    """Every block of stages of ``hidden[s]`` channels with ``per_stage[s]`` blocks; stage 1 has stride 1, the first
    block of every later stage stride 2. The stem writes stage 1's stream (group ``layer1``)."""
    out: list[ResidualBlock] = []
    prev_group, prev_ch = "layer1", hidden[0]
    for s, ch in enumerate(hidden, start=1):
        for b in range(per_stage[s - 1]):
            stride = 2 if (s > 1 and b == 0) else 1
            out.append(ResidualBlock(s, b, prev_group, f"layer{s}.{b}.conv1", f"layer{s}", stride,
                                     stride != 1 or prev_ch != ch))
            prev_group, prev_ch = f"layer{s}", ch
    return out


def residual_groups(hidden: Sequence[int], blocks: Sequence[ResidualBlock]) -> dict[str, int]:
    """The channel groups: each stage's stream ``layer{s}``, then each block's inner width."""
    groups = {f"layer{s}": ch for s, ch in enumerate(hidden, start=1)}
    for block in blocks:
        groups[block.inner_group] = hidden[block.stage - 1]
    return groups
