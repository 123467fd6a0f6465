"""What a CPU convolution allocates inside the operator, beyond its inputs and outputs (oneDNN through ideep).

torch runs float32 convolutions on CPU through oneDNN. Its kernels want channel-blocked layouts (``aBcd16b``:
channels padded to a multiple of the vector width, 16 floats with AVX-512, 8 with AVX2), so every call
reorders the plain NCHW tensors into temporary blocked copies, computes into a blocked result and reorders that
into the plain output tensor. These temporaries never appear as tensors (the memory estimator's dispatch mode
cannot see them), yet they are resident for the duration of the call, and with small channel counts, padded
to the block, they are several times larger than the tensors themselves (4 channels become 16).

The sizes below were measured, not derived: each operator was run alone in a compact-heap process (see
``edge_agent.allocator``), and its RSS high-water mark above the call minus its outputs is the temporaries'
peak (x86-64 with AVX-512, torch 2.14.1, oneDNN 3.12, one thread). With ``xb``, ``wb``, ``yb``, ``gob``, ``gib``
and ``gwb`` the blocked sizes of input, weight, output, output gradient, input gradient and weight gradient:

- forward: ``max(xb + wb, yb)``;
- backward, input gradient (its own oneDNN call, before the weight gradient exists): ``gob + wb`` for unit
  stride, plus ``gib`` when the input has fewer channels than one block; ``2 * gib`` with a stride (oneDNN
  reduces the strided problem to a unit-stride one in a scratch copy of the input's size);
- backward, weight gradient: ``max(xb + gob, gwb)``;
- a first layer's input (fewer than 4 channels: images) is read in place, ``xb = 0``, and its weight keeps its
  input channels unpadded.

On seventeen shapes of the CNN and PreResNet-18 (batch 10-128, 1-512 channels, 3x3 and strided 1x1/3x3
kernels) these match the measurement within 0.1 MB wherever the tensors exceed 1 MB, and over-count a first
layer with one input channel by up to 0.35 MB. Convolutions whose channel counts are both under one block
sometimes run a kernel with less scratch (at batch 10 next to none), where the formula over-counts by up to the
padded output. On AVX2 (blocks of 8; AMD EPYC, torch 2.14.1) the digits CNN's convolutions on 4x4, 2x2 and 1x1 maps
(64-512 channels, batch 10 and 32; oneDNN computes the weight gradients of the last two by GEMM) matched the
formula within 0.1 MB where the weights exceed 1 MB and over-counted the 4x4 layer by up to 0.3 MB. Other ISAs
(aarch64 with ACL) lay out differently and are not measured: the estimate uses the blocking of the ISA torch
reports and the agent's calibration factor learns the rest. Where
torch has no oneDNN, convolutions run torch's own kernels and nothing is added.

More threads, more scratch, on one path. oneDNN on AVX2 computes a weight gradient by GEMM when the input map is
smaller than the kernel (a 3x3 kernel on 2x2 and 1x1 maps; ``ONEDNN_VERBOSE`` names ``x64:gemm:jit`` there and
``jit:avx2`` on 3x3 maps and up), and each further thread accumulates into its own copy of the weight gradient:
measured alone (compact heap, batch 32), a 256->512 3x3 convolution on 1x1 maps (4.5 MiB of weights) rose by
2.9 MiB with two threads and 12.1 MiB with four; a 128->256 one on 2x2 maps (1.1 MiB) by 0.2 and 2.0 MiB; the
``jit:avx2`` kernels not at all. The estimate adds ``(threads - 1)`` weights to that phase (an upper bound on
these measurements). The digits CNN at width 1, batch 32, through the agent: 25.8, 29.2 and 38.9 MB with one,
two and four threads. With blocks of 16 (AVX-512) those shapes ran ``jit:avx512`` and nothing is added.
"""

from __future__ import annotations

import math
import platform
from collections.abc import Sequence
from functools import cache
from typing import Any

import torch

__all__ = ["channel_block", "convolution_workspace", "gemm_weight_gradient"]

_FLOAT_BYTES = 4
#: Inputs with fewer channels are read in place by oneDNN's first-layer kernels (images: 1 or 3 channels).
_FIRST_LAYER_CHANNELS = 4
#: Whether this is an x86 CPU, where the per-thread GEMM scratch was measured (not on aarch64's ACL kernels).
X86_CPU = platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")


@cache
def channel_block() -> int:
    """Floats per channel block of oneDNN's layouts on this CPU (16 with AVX-512, else 8); 0 without oneDNN."""
    if not torch.backends.mkldnn.is_available():
        return 0
    capability = torch.backends.cpu.get_cpu_capability()
    return 16 if capability.startswith("AVX512") else 8


def _blocked(shape: Sequence[int], block: int) -> int:
    """Bytes of an NCHW float tensor of ``shape`` with its channels padded to a multiple of ``block``."""
    n, c, *rest = (int(size) for size in shape)
    return _FLOAT_BYTES * n * (-(-c // block) * block) * math.prod(rest)


def _weight_blocked(shape: Sequence[int], block: int) -> int:
    """Bytes of an OIHW weight in oneDNN's blocked layout: output channels padded, input channels too unless
    they are fewer than one block (the first layer's ``Acdb16a``)."""
    out_channels, in_channels, *kernel = (int(size) for size in shape)
    padded_in = -(-in_channels // block) * block if in_channels >= block else in_channels
    return _FLOAT_BYTES * (-(-out_channels // block) * block) * padded_in * math.prod(kernel)


def _source_copy(shape: Sequence[int], block: int) -> int:
    """Bytes of the blocked copy of a convolution's input; a first layer's input is read as it is (no copy)."""
    return 0 if int(shape[1]) < _FIRST_LAYER_CHANNELS else _blocked(shape, block)


def gemm_weight_gradient(x_shape: Sequence[int], weight_shape: Sequence[int], block: int) -> bool:
    """Whether oneDNN computes this convolution's weight gradient by GEMM, with a weight-gradient copy for each
    further thread: on x86 with blocks of 8 (AVX2; measured there, not on aarch64) when the input map is smaller
    than the kernel in either direction."""
    return X86_CPU and block == 8 and any(int(size) < int(kernel)
                                          for size, kernel in zip(x_shape[2:], weight_shape[2:]))


def convolution_workspace(func: Any, args: Sequence[Any], output: Any, block: int | None = None,
                          threads: int = 1) -> int:
    """Bytes resident inside ``func`` (``aten.convolution`` or ``aten.convolution_backward``, called with
    ``args``, returning ``output``) beyond its arguments and outputs, at its peak; 0 for other operators, for
    transposed, grouped or non-2-D convolutions (not measured; the families here have none) and where oneDNN is
    missing. ``block`` defaults to :func:`channel_block`; ``threads`` is the torch threads the step runs with
    (they matter where :func:`gemm_weight_gradient`).

    The backward figure is relative to the moment all its outputs exist: its input-gradient phase runs before
    the weight and bias gradients are allocated, so their bytes are subtracted from that phase.
    """
    block = channel_block() if block is None else block
    if not block:
        return 0
    if func is torch.ops.aten.convolution.default:
        x, weight, transposed, groups = args[0], args[1], args[6], args[8]
        if transposed or groups != 1 or x.dim() != 4:
            return 0
        xb = _source_copy(x.shape, block)
        return max(xb + _weight_blocked(weight.shape, block), _blocked(output.shape, block))
    if func is torch.ops.aten.convolution_backward.default:
        grad_output, x, weight, stride, transposed = args[0], args[1], args[2], args[4], args[7]
        groups, output_mask = args[9], args[10]
        if transposed or groups != 1 or x.dim() != 4:
            return 0
        gob, wb = _blocked(grad_output.shape, block), _weight_blocked(weight.shape, block)
        xb = _source_copy(x.shape, block)
        phases = [0]
        if output_mask[0]:
            strided = any(int(step) > 1 for step in stride)
            gib = _blocked(x.shape, block)
            data = 2 * gib if strided else gob + wb + (gib if x.shape[1] < block else 0)
            later = sum(t.nbytes for t, wanted in zip(output[1:], output_mask[1:], strict=True) if wanted)
            phases.append(data - later)
        if output_mask[1]:
            per_thread = (threads - 1) * weight.nbytes if gemm_weight_gradient(x.shape, weight.shape, block) else 0
            phases.append(max(xb + gob, wb) + per_thread)
        return max(phases)
    return 0
