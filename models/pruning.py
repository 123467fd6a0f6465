"""APoZ-guided per-layer width pruning (FlexFL, Sec. III): scores, adjustment weights and Algorithm 1.

One function decides what a pruned model keeps, wherever it runs: :func:`prune_to_ratio` makes the coordinator's
pool models (the target ratios L_p) and their adaptive variants (AdaPrune's Gamma fewer parameters), which the
agents receive as the rungs of their adaptation ladder.

- **APoZ** (Eq. 2, :func:`apoz_scores`): per prunable layer (a channel group of the family), the fraction of zero
  activations after its ReLU, over the C x H x W outputs of one sample, averaged over the samples; a group read
  by several ReLUs (a residual stream) gets their mean. A ReLU belongs to the group of the last declared layer
  (convolution, linear layer or batch norm) that ran before it. A group no ReLU reads scores 0. ``at="before_bn"``
  (an option, not the paper's) scores instead the input of each batch norm of the group: per channel, the
  fraction of its values a ReLU would zero there (``<= 0``), averaged over the channels (each channel has the same
  H x W, so this is also the fraction over C x H x W) and the samples; a group no batch norm reads keeps its
  after-ReLU score. Behind a batch norm that normalises with batch statistics every channel's ReLU input has mean
  ``beta`` and spread ``gamma``, so the after-ReLU score sits near 0.5 for every layer; before it, the score
  follows the layer's own outputs (which that batch norm then re-centres).
- **Adjustment weights** (Eq. 3, :func:`adjustment_weights`): ``AdjW(l) = log size(l) / log max_j size(l_j)``,
  size the parameters of the layers producing the group at full width (the classifier is not a group).
- **Keep ratios** (Alg. 1, :func:`keep_ratios`): ``s_l = clamp((1 - A_l * AdjW_l) * gamma, floor, 1)``: layers
  with many dead activations, and large layers, keep fewer channels. Layer ``l`` keeps the leading
  ``s_l`` of its output channels (and its input follows the layer before), so a smaller gamma gives a model
  nested in a larger one's.
- **Search** (:func:`prune_to_ratio`): gamma steps by ``step`` from 0 upwards (the paper) or from the first
  gamma keeping every layer whole downwards (the reference code's order) until the pruned model's size is within
  ``tolerance`` of the target share of the full model's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from models.family import ModelFamily
from models.layers import dropout_off
from models.net import FamilyNet
from models.spec import SubmodelSpec

__all__ = ["Pruned", "adjustment_weights", "apoz_scores", "group_sizes", "keep_ratios", "model_size",
           "prune_to_ratio", "pruned_spec"]

#: The smallest keep ratio Algorithm 1 gives a layer.
MIN_KEEP = 0.01

SizeMeasure = Literal["params", "features"]
Search = Literal["up", "down"]
ApozAt = Literal["after_relu", "before_bn"]


def group_sizes(family: ModelFamily) -> dict[str, int]:
    """Parameters of the layers producing each prunable group, at full width (weights, biases, BN affine)."""
    sizes = dict.fromkeys(family.prunable_layers(), 0)
    for decl, params, _ in family.layer_costs(SubmodelSpec.full()):
        if decl.out_group in sizes and decl.exit is None:
            sizes[decl.out_group] += params
    return sizes


def adjustment_weights(family: ModelFamily) -> dict[str, float]:
    """Eq. 3: ``log size(l) / log max_j size(l_j)`` per prunable group (0 for a group of one parameter)."""
    sizes = group_sizes(family)
    largest = max(sizes.values())
    if largest <= 1:
        return dict.fromkeys(sizes, 0.0)
    return {group: (math.log(size) / math.log(largest) if size > 1 else 0.0) for group, size in sizes.items()}


def apoz_scores(family: ModelFamily, model: FamilyNet, x: torch.Tensor, *, batch_size: int = 100,
                at: ApozAt = "after_relu") -> dict[str, float]:
    """APoZ of every prunable group of ``model`` (the full model of ``family``) over the samples ``x``, after the
    ReLUs (the paper) or ``before_bn`` (see the module docstring). The model runs as it trains (batch statistics;
    dropout off), without gradients, in batches of ``batch_size`` (at least 2: static batch norm normalises with
    batch statistics)."""
    if len(x) < 2:
        raise ValueError(f"APoZ needs at least 2 samples to score on, got {len(x)}")
    if at not in ("after_relu", "before_bn"):
        raise ValueError(f"APoZ is scored 'after_relu' or 'before_bn', got {at!r}")
    groups = set(family.prunable_layers())
    declared = {decl.name: decl.out_group for decl in family.layers()
                if decl.exit is None and decl.out_group in groups}
    norms = {decl.name: decl.out_group for decl in family.layers()
             if at == "before_bn" and decl.kind == "bn" and decl.exit is None and decl.out_group in groups}
    last: dict[str, str | None] = {"group": None}
    zeros: dict[str, float] = {}
    counts: dict[str, int] = {}
    readers: dict[str, set[int]] = {}
    handles = []

    def producer(group: str) -> Any:
        def hook(_module: nn.Module, _inputs: Any, _output: Any) -> None:
            last["group"] = group
        return hook

    def relu_hook(module: nn.Module, _inputs: Any, output: torch.Tensor) -> None:
        group = last["group"]
        if group is None:
            return
        key = f"{group}#{id(module)}"
        readers.setdefault(group, set()).add(id(module))
        zeros[key] = zeros.get(key, 0.0) + float((output == 0).flatten(1).float().mean(1).sum())
        counts[key] = counts.get(key, 0) + len(output)

    def norm_hook(group: str) -> Any:
        def hook(module: nn.Module, inputs: Any) -> None:
            key = f"{group}#{id(module)}"
            readers.setdefault(f"{group}#bn", set()).add(id(module))
            values = inputs[0].flatten(2) if inputs[0].dim() > 2 else inputs[0].unsqueeze(2)
            per_channel = (values <= 0).float().mean(2)  # [samples, channels]
            zeros[key] = zeros.get(key, 0.0) + float(per_channel.mean(1).sum())
            counts[key] = counts.get(key, 0) + len(per_channel)
        return hook

    for name, module in model.named_modules():
        group = declared.get(name)
        if group is not None:
            handles.append(module.register_forward_hook(producer(group)))
            if name in norms:
                handles.append(module.register_forward_pre_hook(norm_hook(group)))
        elif isinstance(module, nn.ReLU):
            handles.append(module.register_forward_hook(relu_hook))
    was_training = model.training
    model.train()
    dropout_off(model)  # the activations the model computes, not a random draw of them
    try:
        with torch.no_grad():
            step = max(2, batch_size)
            for start in range(0, len(x), step):
                batch = x[start:start + step]
                if len(batch) < 2:
                    continue
                last["group"] = None
                model(batch)
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)
    scores: dict[str, float] = {}
    for group in family.prunable_layers():
        readers_of = readers.get(f"{group}#bn") or readers.get(group) or set()
        keys = [f"{group}#{ident}" for ident in sorted(readers_of)]
        scores[group] = sum(zeros[k] / counts[k] for k in keys) / len(keys) if keys else 0.0
    return scores


def keep_ratios(apoz: Mapping[str, float], adjustment: Mapping[str, float], gamma: float,
                floor: float = MIN_KEEP) -> dict[str, float]:
    """Algorithm 1's keep ratio of every group: ``clamp((1 - A * AdjW) * gamma, floor, 1)``."""
    if set(apoz) != set(adjustment):
        raise ValueError(f"APoZ scores and adjustment weights name different layers: {sorted(apoz)} vs "
                         f"{sorted(adjustment)}")
    return {group: min(1.0, max(floor, (1.0 - apoz[group] * adjustment[group]) * gamma)) for group in apoz}


def pruned_spec(ratios: Mapping[str, float], rounding: str = "floor") -> SubmodelSpec:
    """The sub-model keeping ``ratios[group]`` of every group's leading channels (rounded as ``rounding``)."""
    kept = tuple((group, round(rate, 6)) for group, rate in ratios.items() if rate < 1.0)
    return SubmodelSpec(layer_widths=kept, rounding=rounding)


def model_size(family: ModelFamily, spec: SubmodelSpec,
               measure: SizeMeasure | Callable[[SubmodelSpec], float] = "params") -> float:
    """Size of a sub-model for the search: all its parameters (``params``), all but the final classifier's
    (``features``, the reference code's measure), or what a callable says (e.g. its training memory)."""
    if callable(measure):
        return measure(spec)
    total = family.param_count(spec)
    if measure == "params":
        return total
    if measure != "features":
        raise ValueError(f"size measure must be 'params' or 'features', got {measure!r}")
    shapes = family.shapes(spec, track_bn_stats=False)
    head = [key for key in family.classifier_keys(spec) if not key.startswith("exits.")]
    return total - sum(math.prod(shapes[key]) for key in head)


@dataclass(frozen=True)
class Pruned:
    """A pruned model: the gamma Algorithm 1 stopped at, the keep ratio of every group, its spec and its size
    as a share of the full model's."""

    target: float
    gamma: float
    ratios: dict[str, float]
    spec: SubmodelSpec
    share: float


def prune_to_ratio(family: ModelFamily, apoz: Mapping[str, float], adjustment: Mapping[str, float], target: float,
                   *, step: float = 0.01, tolerance: float = 0.02, rounding: str = "floor",
                   measure: SizeMeasure | Callable[[SubmodelSpec], float] = "params",
                   search: Search = "up") -> Pruned:
    """Algorithm 1 for one target share of the full model's size (see the module docstring). A target of 1 is
    the full model itself. Raises ValueError when no gamma on the grid lands within ``tolerance`` (naming the
    closest share found)."""
    if not 0 < target <= 1:
        raise ValueError(f"a pruning target must be a share in (0, 1], got {target}")
    if not 0 < step <= 1 or tolerance < 0:
        raise ValueError(f"the gamma step must be in (0, 1] and the tolerance non-negative, got {step}, {tolerance}")
    full = model_size(family, SubmodelSpec.full(), measure)
    if target >= 1.0:
        return Pruned(1.0, math.inf, dict.fromkeys(apoz, 1.0), SubmodelSpec.full(), 1.0)
    factors = [1.0 - apoz[g] * adjustment[g] for g in apoz]
    growing = [f for f in factors if f > 0]  # a layer whose factor is 0 stays at the floor whatever gamma
    top = 1.0 / min(growing) if growing else 1.0  # from here on every other layer is whole
    count = math.ceil(top / step) + 1
    if count > 1_000_000:
        raise ValueError(f"a gamma grid of step {step} up to {top:.3g} has {count} points: a layer of {family.name!r} "
                         "is nearly all zero activations; use a larger step")
    grid = [step * i for i in range(1, count + 1)]
    if search == "down":
        grid.reverse()
    elif search != "up":
        raise ValueError(f"search must be 'up' or 'down', got {search!r}")
    closest: tuple[float, float] | None = None
    for gamma in grid:
        ratios = keep_ratios(apoz, adjustment, gamma)
        spec = pruned_spec(ratios, rounding)
        share = model_size(family, spec, measure) / full
        if abs(share - target) <= tolerance:
            return Pruned(target, round(gamma, 10), ratios, spec, share)
        if closest is None or abs(share - target) < abs(closest[1] - target):
            closest = (gamma, share)
    assert closest is not None
    raise ValueError(f"no gamma on a grid of step {step} prunes {family.name!r} to {target:.0%} of its size within "
                     f"{tolerance:.1%} (closest: {closest[1]:.1%} at gamma {closest[0]:.2f}); use a smaller step or a "
                     "larger tolerance")
