"""Training-memory estimates (PROTOTYPE, docstring rewritten once calibrated)."""

from __future__ import annotations

import math
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from models.spec import SubmodelSpec

if TYPE_CHECKING:
    from models.family import ModelFamily

__all__ = [
    "BlockTrainingModel",
    "MemoryEstimate",
    "block_training_model",
    "estimate_training_memory",
    "num_blocks",
    "split_blocks",
]


# ---------------------------------------------------------------------------------------------------- blocks
def _split_cnn(model: nn.Module) -> tuple[list[nn.Module], nn.Module]:
    children = dict(model.named_children())
    blocks: list[nn.Module] = []
    i = 1
    while f"conv{i}" in children:
        parts = [children[f"{kind}{i}"] for kind in ("conv", "scaler", "bn", "relu", "pool") if f"{kind}{i}" in children]
        blocks.append(nn.Sequential(*parts))
        i += 1
    head = nn.Sequential(children["avgpool"], children["flatten"], children["classifier"])
    return blocks, head


def _split_preresnet(model: nn.Module) -> tuple[list[nn.Module], nn.Module]:
    blocks: list[nn.Module] = [model.conv1]
    s = 1
    while hasattr(model, f"layer{s}"):
        blocks.extend(getattr(model, f"layer{s}"))
        s += 1
    head = nn.Sequential(model.scaler, model.bn, model.relu, model.avgpool, model.flatten, model.classifier)
    return blocks, head


_SPLITTERS: dict[str, Callable[[nn.Module], tuple[list[nn.Module], nn.Module]]] = {
    "cnn": _split_cnn,
    "preresnet18": _split_preresnet,
}


def split_blocks(family: ModelFamily, model: nn.Module) -> tuple[list[nn.Module], nn.Module]:
    """The body blocks of ``model`` (built by ``family``), input side first, and its head."""
    splitter = _SPLITTERS.get(family.name)
    if splitter is None:
        raise ValueError(f"model family {family.name!r} does not define body blocks for depth-wise training.")
    return splitter(model)


def num_blocks(family: ModelFamily) -> int:
    with torch.device("meta"):
        model = family.build(None, track_bn_stats=False)
    return len(split_blocks(family, model)[0])


class BlockTrainingModel(nn.Module):
    """Depth-wise (FeDepth) view of a model for training body block ``block`` and the head."""

    def __init__(
        self,
        blocks: Sequence[nn.Module],
        head: nn.Module,
        block: int,
        head_channels: int,
        head_size: tuple[int, int],
    ) -> None:
        super().__init__()
        if not 0 <= block < len(blocks):
            raise ValueError(f"block must be in 0..{len(blocks) - 1}, got {block!r}.")
        self.frozen = nn.ModuleList(blocks[:block])
        self.block = blocks[block]
        self.head = head
        self.is_last = block == len(blocks) - 1
        self.head_channels = head_channels
        self.head_size = head_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            for b in self.frozen:
                x = b(x)
        x = self.block(x)
        if not self.is_last:
            sh = max(1, math.ceil(x.shape[2] / self.head_size[0]))
            sw = max(1, math.ceil(x.shape[3] / self.head_size[1]))
            if sh > 1 or sw > 1:
                x = x[:, :, ::sh, ::sw]
            extra = self.head_channels - x.shape[1]
            if extra > 0:
                x = F.pad(x, (0, 0, 0, 0, 0, extra))
            elif extra < 0:
                x = x[:, : self.head_channels]
        return self.head(x)


def block_training_model(
    family: ModelFamily, model: nn.Module, block: int, input_size: tuple[int, int]
) -> BlockTrainingModel:
    """Freeze everything but body block ``block`` and the head of ``model``; return the model to train."""
    blocks, head = split_blocks(family, model)
    if isinstance(block, bool) or not isinstance(block, int) or not 0 <= block < len(blocks):
        raise ValueError(f"block must be an integer in 0..{len(blocks) - 1}, got {block!r}.")
    # Shape probe on meta: what the head receives from the last block.
    with torch.no_grad():
        x = torch.empty(2, family.in_channels, *input_size, device="meta")
        for b in blocks:
            x = _meta_call(b, x)
    for p in model.parameters():
        p.requires_grad_(False)
    for module in (blocks[block], head):
        for p in module.parameters():
            p.requires_grad_(True)
    return BlockTrainingModel(blocks, head, block, int(x.shape[1]), (int(x.shape[2]), int(x.shape[3])))


def _meta_call(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    # Run a (possibly real) module on a meta input by temporarily using meta copies of its parameters.
    params = {k: torch.empty_like(v, device="meta") for k, v in module.state_dict().items()}
    out: torch.Tensor = torch.func.functional_call(module, params, (x,))
    return out


# ---------------------------------------------------------------------------------------------------- tracking
class _LiveBytes(TorchDispatchMode):
    """Counts the bytes of every tensor storage created while active, until it is freed."""

    def __init__(self, round_to: int = 1) -> None:
        super().__init__()
        self.round_to = round_to
        self.live = 0
        self.peak = 0
        self._refs: dict[int, Any] = {}

    def _size(self, nbytes: int) -> int:
        r = self.round_to
        return max(r, -(-nbytes // r) * r) if r > 1 else nbytes

    def _freed(self, key: int, size: int) -> None:
        self.live -= size
        self._refs.pop(key, None)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = storage._cdata
                if key in self._refs:
                    continue
                size = self._size(storage.nbytes())
                self._refs[key] = weakref.ref(storage, lambda _r, k=key, n=size: self._freed(k, n))
                self.live += size
                if self.live > self.peak:
                    self.peak = self.live
        return out

    def reset_peak(self) -> None:
        self.peak = self.live


@dataclass(frozen=True)
class _Simulation:
    parameters: int
    gradients: int
    optimizer_state: int
    activations: int
    tensor_peak: int


def _optimizer(params: list[nn.Parameter], slots: int, foreach: bool) -> torch.optim.Optimizer:
    if slots == 0:
        return torch.optim.SGD(params, lr=0.01, momentum=0.0, weight_decay=5e-4, foreach=foreach)
    if slots == 1:
        return torch.optim.SGD(params, lr=0.01, momentum=0.9, weight_decay=5e-4, foreach=foreach)
    return torch.optim.Adam(params, lr=0.01, weight_decay=5e-4, foreach=foreach)


def _simulate(
    family: ModelFamily,
    spec: SubmodelSpec,
    batch_size: int,
    input_size: tuple[int, int],
    slots: int,
    device: str,
    block: int | None,
) -> _Simulation:
    with torch.device("meta"):
        model = family.build(spec, track_bn_stats=False)
    net: nn.Module = model if block is None else block_training_model(family, model, block, input_size)
    net.train()
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    p_bytes = sum(p.nbytes for p in params)
    g_bytes = sum(p.nbytes for p in trainable)
    opt = _optimizer(trainable, slots, foreach=device == "cuda")
    tracker = _LiveBytes(round_to=512 if device == "cuda" else 1)
    with torch.enable_grad(), tracker:
        xb = torch.empty(batch_size, family.in_channels, *input_size, device="meta")
        yb = torch.empty(batch_size, dtype=torch.long, device="meta")
        base = tracker.live
        logits = net(xb)
        loss = F.cross_entropy(logits, yb)
        del logits
        activations = tracker.live - base
        loss.backward()
        del loss
        fb_peak = tracker.peak
        tracker.reset_peak()
        nn.utils.clip_grad_norm_(trainable, 1.0)
        opt.step()
        step_peak = tracker.peak
        state = tracker.live - base + 0  # grads + state now
        opt.zero_grad(set_to_none=True)
        s_bytes = tracker.live - base
    del state
    tensor_peak = p_bytes + max(fb_peak + s_bytes, step_peak)
    return _Simulation(p_bytes, g_bytes, s_bytes, activations, tensor_peak)


# ---------------------------------------------------------------------------------------------------- estimate
@dataclass(frozen=True)
class MemoryEstimate:
    """Peak training memory, in bytes, and its parts."""

    parameters: int
    gradients: int
    optimizer_state: int
    activations: int
    workspace: int
    overhead: int
    device: str = "cpu"
    total: int = field(init=False)

    def __post_init__(self) -> None:
        parts = (self.parameters, self.gradients, self.optimizer_state, self.activations, self.workspace,
                 self.overhead)
        object.__setattr__(self, "total", sum(parts))


_cache: weakref.WeakKeyDictionary[Any, dict[tuple[Any, ...], MemoryEstimate]] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def estimate_training_memory(
    family: ModelFamily,
    spec: SubmodelSpec | None = None,
    *,
    batch_size: int,
    input_size: tuple[int, int] = (28, 28),
    optimizer_slots: int = 1,
    device: str = "cpu",
    block: int | None = None,
) -> MemoryEstimate:
    spec = family.validate_spec(spec)
    sim = _simulate(family, spec, batch_size, input_size, optimizer_slots, device, block)
    workspace = max(0, sim.tensor_peak - sim.parameters - sim.gradients - sim.optimizer_state - sim.activations)
    return MemoryEstimate(sim.parameters, sim.gradients, sim.optimizer_state, sim.activations, workspace, 0,
                          device)
