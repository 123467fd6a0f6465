"""Inference-memory estimates: the peak bytes of tensors a deployed model holds while it answers one batch.

The forward pass of every output runs on the ``meta`` device under the training estimator's dispatch mode, which
follows each storage's live bytes and oneDNN's convolution scratch on CPU (:mod:`models.memory`); the parameters and
buffers are added. No gradients, no optimizer: what a device needs to run the model, not to train it (a runtime's
own code and arena are not tensors: ``benchmarks/inference.py`` measures them).
"""

from __future__ import annotations

from functools import partial

import torch

from models._checks import check_input_size, check_positive_int
from models.conv_workspace import convolution_workspace
from models.family import ModelFamily
from models.memory import _LiveBytes
from models.spec import SubmodelSpec

__all__ = ["estimate_inference_memory"]


def estimate_inference_memory(family: ModelFamily, spec: SubmodelSpec | None = None,
                              input_size: tuple[int, int] = (28, 28), batch_size: int = 1) -> int:
    """Bytes of the weights of ``spec`` (parameters and BN statistics) plus the peak of the activations and
    convolution scratch of one forward pass of ``batch_size`` images through every output (one thread)."""
    check_positive_int("batch_size", batch_size)
    family.check_input(check_input_size(input_size))
    with torch.device("meta"):
        model = family.build(spec).eval()
    weights = [*model.parameters(), *model.buffers()]
    tracker = _LiveBytes(workspace=partial(convolution_workspace, threads=1))
    tracker.ignore(weights)
    with torch.no_grad(), tracker:
        images = torch.empty(batch_size, family.in_channels, *input_size, device="meta")
        model.forward_exits(images)
        del images
    return sum(tensor.nbytes for tensor in weights) + tracker.peak
