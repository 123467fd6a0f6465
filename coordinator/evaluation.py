"""Server-side static-BN statistics and accuracy of the global model, each level's sub-model and every exit."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch
from torch import nn

from common.data import Dataset, subsample
from models import FamilyNet, ModelFamily, Scaler, SubmodelSpec

EVAL_BATCH = 100
"""Samples per forward pass when measuring accuracy. With images in channels-last order, the full-width CNN of
`make demo` measured 10,000 Fashion-MNIST images in 6.1 s here (2 threads), against 10.6 s at 1,000 per batch in
the default order: smaller batches stay in cache, and oneDNN's convolutions prefer channels last. In eval mode
with BN statistics the batch size changes no output (a model built without them normalises each batch with its
own, so its outputs depend on the batch size it is given)."""


def channels_last(x: torch.Tensor) -> torch.Tensor:
    """A batch of images (N, C, H, W) in channels-last memory order (the same values); any other tensor as it
    is."""
    return x.contiguous(memory_format=torch.channels_last) if x.dim() == 4 else x


@torch.no_grad()
def recompute_bn_statistics(model: FamilyNet, x: torch.Tensor, batch_size: int = 500) -> None:
    """HeteroFL's sBN: reset every BN layer and accumulate a cumulative average over ``x``.

    BN runs in train mode while the Scalers stay in eval mode, so the statistics describe exactly the
    activations the model sees at evaluation. Each batch's momentum is its share of the samples seen so far,
    which makes the running statistics the sample-weighted average even when the last batch is short. Every
    output runs, so the early-exit heads' BN layers get statistics too.
    """
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    for norm in norms:
        norm.reset_running_stats()
    model.train()
    for module in model.modules():
        if isinstance(module, Scaler):
            module.eval()
    seen = 0
    for start in range(0, len(x), batch_size):
        batch = x[start:start + batch_size]
        seen += len(batch)
        for norm in norms:
            norm.momentum = len(batch) / seen
        model.forward_exits(channels_last(batch))
    for norm in norms:
        norm.momentum = None
    model.eval()


@torch.no_grad()
def accuracies(model: FamilyNet, x: torch.Tensor, y: torch.Tensor, batch_size: int = EVAL_BATCH, *,
               ensemble: bool = False, members: Sequence[int] = ()) -> list[float]:
    """Top-1 accuracy of every output of ``model`` (depth order, the last output last), in eval mode; with
    ``ensemble``, then that of the mean of the logits of the outputs ``members`` (0-based; none: all of them):
    DepthFL's ensemble of its trained classifiers."""
    model.eval()
    chosen = sorted(set(members)) or list(range(model.num_outputs))
    if chosen[0] < 0 or chosen[-1] >= model.num_outputs:
        raise ValueError(f"ensemble members {chosen} are not outputs of a model with {model.num_outputs}")
    correct = [0] * (model.num_outputs + ensemble)
    for start in range(0, len(x), batch_size):
        targets = y[start:start + batch_size]
        outputs = model.forward_exits(channels_last(x[start:start + batch_size]))
        if ensemble:
            outputs = [*outputs, torch.stack([outputs[index] for index in chosen]).mean(dim=0)]
        for index, logits in enumerate(outputs):
            correct[index] += int((logits.argmax(dim=1) == targets).sum())
    return [count / max(1, len(x)) for count in correct]


class Evaluator:
    """Builds a sub-model from a global state, recomputes its BN statistics and measures test accuracy."""

    def __init__(self, family: ModelFamily, bn_x: torch.Tensor, test_x: torch.Tensor, test_y: torch.Tensor):
        self.family = family
        self.bn_x = bn_x
        self.test_x = test_x
        self.test_y = test_y

    @classmethod
    def for_test_set(cls, family: ModelFamily, dataset: Dataset, samples: int | None, seed: int,
                     bn_x: torch.Tensor) -> Evaluator:
        """An evaluator on ``dataset``'s test set (``samples`` of it, drawn with ``seed``, when not None), its
        BN statistics computed on ``bn_x``."""
        test_x, test_y = dataset.x_test, dataset.y_test
        if samples is not None:
            test_x, test_y = subsample(test_x, test_y, samples, seed)
        return cls(family, bn_x, torch.tensor(np.asarray(test_x)), torch.tensor(np.asarray(test_y), dtype=torch.long))

    def prepare(self, state: Mapping[str, torch.Tensor], spec: SubmodelSpec) -> FamilyNet:
        """The sub-model ``spec`` of ``state`` with fresh static-BN statistics, in eval mode (its convolutions'
        weights in channels-last order, as the batches it is given: see `EVAL_BATCH`)."""
        model = self.family.build(spec)
        model.load_state_dict(self.family.extract(state, spec), strict=True)
        model.to(memory_format=torch.channels_last)
        recompute_bn_statistics(model, self.bn_x)
        return model

    def evaluate(self, state: Mapping[str, torch.Tensor], spec: SubmodelSpec, *, ensemble: bool = False,
                 members: Sequence[int] = ()) -> tuple[list[float], dict[str, torch.Tensor]]:
        """Accuracy of every output of the sub-model (the last output last; with ``ensemble``, then that of the
        mean logits of the outputs ``members``, none: all) and its BN statistics (to store back into the global
        state)."""
        model = self.prepare(state, spec)
        bn_state = {key: value for key, value in model.state_dict().items() if "running_" in key
                    or key.endswith("num_batches_tracked")}
        return accuracies(model, self.test_x, self.test_y, ensemble=ensemble, members=members), bn_state
