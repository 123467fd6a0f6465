"""Tests for models.conv_workspace: the bytes oneDNN keeps inside a CPU convolution (the formulas; the
measurements behind them are in the module docstring and ``benchmarks/memory.py``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from models import get_family
from models.conv_workspace import channel_block, convolution_workspace, gemm_weight_gradient
from models.memory import _estimate_training_memory

F32 = 4
CONV = torch.ops.aten.convolution.default
CONV_BACKWARD = torch.ops.aten.convolution_backward.default


class _Recorder(TorchDispatchMode):
    """Records the workspace every operator would add, with the real dispatch arguments."""

    def __init__(self, block: int, threads: int = 1) -> None:
        super().__init__()
        self.block = block
        self.threads = threads
        self.seen: list[tuple[Any, int]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func in (CONV, CONV_BACKWARD):
            self.seen.append((func, convolution_workspace(func, args, out, block=self.block, threads=self.threads)))
        return out


def _run(x_shape: tuple[int, ...], w_shape: tuple[int, ...], *, stride: int = 1, padding: int = 1,
         input_grad: bool = True, block: int = 16, threads: int = 1) -> dict[Any, int]:
    """Forward and backward of one convolution on meta tensors; the workspace per operator."""
    x = torch.empty(x_shape, device="meta", requires_grad=input_grad)
    w = torch.empty(w_shape, device="meta", requires_grad=True)
    b = torch.empty(w_shape[0], device="meta", requires_grad=True)
    with _Recorder(block, threads) as recorder:
        F.conv2d(x, w, b, stride=stride, padding=padding).sum().backward()
    return dict(recorder.seen)


def test_forward_is_the_larger_of_input_and_weight_copies_or_blocked_output() -> None:
    seen = _run((10, 64, 14, 14), (128, 64, 3, 3))
    xb, wb, yb = F32 * 10 * 64 * 196, F32 * 128 * 64 * 9, F32 * 10 * 128 * 196
    assert seen[CONV] == max(xb + wb, yb) == yb
    seen = _run((10, 256, 3, 3), (512, 256, 3, 3))
    assert seen[CONV] == F32 * (10 * 256 * 9 + 512 * 256 * 9)  # the weight copy dominates


def test_channels_are_padded_to_the_block() -> None:
    seen = _run((2, 20, 8, 8), (20, 20, 3, 3))  # 20 channels take two blocks of 16
    assert seen[CONV] == max(F32 * (2 * 32 * 64 + 32 * 32 * 9), F32 * 2 * 32 * 64)
    assert _run((2, 20, 8, 8), (20, 20, 3, 3), block=8)[CONV] == F32 * (2 * 24 * 64 + 24 * 24 * 9)


def test_first_layer_reads_its_input_in_place() -> None:
    seen = _run((32, 3, 32, 32), (64, 3, 3, 3), input_grad=False)
    yb = F32 * 32 * 64 * 1024
    assert seen[CONV] == max(F32 * 64 * 3 * 9, yb)
    # Weight gradient only (the image needs none): no input copy, the blocked output gradient.
    assert seen[CONV_BACKWARD] == yb


def test_small_channel_counts_are_padded_to_one_block() -> None:
    seen = _run((32, 4, 14, 14), (8, 4, 3, 3))
    assert seen[CONV] == max(F32 * (32 * 16 * 196 + 16 * 4 * 9), F32 * 32 * 16 * 196)


def test_backward_phases() -> None:
    seen = _run((10, 128, 7, 7), (256, 128, 3, 3))
    xb, wb, gob = F32 * 10 * 128 * 49, F32 * 256 * 128 * 9, F32 * 10 * 256 * 49
    data = gob + wb - (wb + F32 * 256)  # the weight and bias gradients do not exist yet in the data phase
    assert seen[CONV_BACKWARD] == max(data, max(xb + gob, wb)) == wb


def test_strided_input_gradient_needs_two_input_sized_buffers() -> None:
    seen = _run((32, 64, 32, 32), (128, 64, 1, 1), stride=2, padding=0)
    xb, gob = F32 * 32 * 64 * 1024, F32 * 32 * 128 * 256
    assert seen[CONV_BACKWARD] == max(2 * xb - F32 * (128 * 64 + 128), xb + gob) == 2 * xb - F32 * (128 * 64 + 128)


def test_nothing_without_onednn_or_for_other_operators() -> None:
    assert _run((10, 64, 14, 14), (128, 64, 3, 3), block=0) == {CONV: 0, CONV_BACKWARD: 0}
    x = torch.empty(2, 2, device="meta")
    assert convolution_workspace(torch.ops.aten.add.Tensor, (x, x), x, block=16) == 0


def test_grouped_and_transposed_convolutions_are_not_modelled() -> None:
    x = torch.empty(2, 32, 8, 8, device="meta")
    with _Recorder(16) as recorder:
        F.conv2d(x, torch.empty(32, 1, 3, 3, device="meta"), groups=32)
        F.conv_transpose2d(x, torch.empty(32, 16, 3, 3, device="meta"))
    assert [workspace for _, workspace in recorder.seen] == [0, 0]


def test_channel_block_matches_the_cpu() -> None:
    block = channel_block()
    if not torch.backends.mkldnn.is_available():
        assert block == 0
    else:
        assert block == (16 if torch.backends.cpu.get_cpu_capability().startswith("AVX512") else 8)


def test_cpu_estimate_includes_the_workspace(monkeypatch: pytest.MonkeyPatch) -> None:
    """PreResNet's block 0 (the stem and the first residual block) trained alone: the stem's weight-gradient call
    holds the blocked output gradient and the input copy, more than the tensors around it. Without the term the
    estimate is lower by at least that."""
    if not channel_block():
        pytest.skip("no oneDNN here")

    def estimate() -> int:
        monkeypatch.setattr("models.memory._cache", {})  # estimated anew, not read back
        family = get_family("preresnet18", 10, 3)
        return _estimate_training_memory(family, None, batch_size=32, input_size=(32, 32), segment=(0, 1)).total

    with_workspace = estimate()
    monkeypatch.setattr("models.memory.convolution_workspace", lambda *_, **__: 0)
    without = estimate()
    assert with_workspace - without >= F32 * 32 * 64 * 1024 // 2


@pytest.fixture
def x86(monkeypatch: pytest.MonkeyPatch) -> None:
    """The per-thread GEMM scratch as on x86, where it was measured, on any machine."""
    monkeypatch.setattr("models.conv_workspace.X86_CPU", True)


def test_gemm_weight_gradient_where_the_map_is_smaller_than_the_kernel(x86: None,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """What ``ONEDNN_VERBOSE`` showed on AVX2: GEMM for a 3x3 kernel on 2x2 and 1x1 maps and a 5x5 one on 4x4,
    the jit kernels on 3x3 maps and up and for 1x1 kernels; nothing of this with AVX-512's blocks, nor on aarch64."""
    assert gemm_weight_gradient((32, 128, 2, 2), (256, 128, 3, 3), 8)
    assert gemm_weight_gradient((32, 256, 1, 1), (512, 256, 3, 3), 8)
    assert gemm_weight_gradient((32, 64, 4, 4), (64, 64, 5, 5), 8)
    assert not gemm_weight_gradient((32, 64, 3, 3), (64, 64, 3, 3), 8)
    assert not gemm_weight_gradient((32, 64, 1, 1), (64, 64, 1, 1), 8)
    assert not gemm_weight_gradient((32, 256, 1, 1), (512, 256, 3, 3), 16)
    monkeypatch.setattr("models.conv_workspace.X86_CPU", False)
    assert not gemm_weight_gradient((32, 256, 1, 1), (512, 256, 3, 3), 8)


@pytest.mark.parametrize("threads", [2, 4])
def test_each_further_thread_adds_a_weight_gradient_on_the_gemm_path(threads: int, x86: None) -> None:
    weight = F32 * 512 * 256 * 9
    one, more = (_run((32, 256, 1, 1), (512, 256, 3, 3), block=8, threads=t)[CONV_BACKWARD] for t in (1, threads))
    assert more - one == (threads - 1) * weight
    # the jit kernels (a 3x3 map) and AVX-512's blocks keep no scratch per thread
    assert (_run((32, 64, 3, 3), (128, 64, 3, 3), block=8, threads=threads)
            == _run((32, 64, 3, 3), (128, 64, 3, 3), block=8))
    assert (_run((32, 256, 1, 1), (512, 256, 3, 3), block=16, threads=threads)
            == _run((32, 256, 1, 1), (512, 256, 3, 3), block=16))
    # nor the forward pass
    assert (_run((32, 256, 1, 1), (512, 256, 3, 3), block=8, threads=threads)[CONV]
            == _run((32, 256, 1, 1), (512, 256, 3, 3), block=8)[CONV])


def test_the_estimate_counts_the_threads_where_a_weight_gradient_runs_by_gemm(x86: None,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The CNN on 8x8 digits: its last two convolutions see 2x2 and 1x1 maps. With AVX2's blocks each further
    thread adds at most the largest of their weights to the estimate; on 28x28 (maps of 3x3 and up) nothing."""
    monkeypatch.setattr("models.conv_workspace.channel_block", lambda: 8)  # AVX2's layouts, on any CPU
    monkeypatch.setattr("models.memory._cache", {})
    family = get_family("cnn", 10, 1)
    largest = F32 * 512 * 256 * 9

    def estimate(threads: int, size: tuple[int, int]) -> int:
        return _estimate_training_memory(family, None, batch_size=32, input_size=size, threads=threads).total

    one, two, four = (estimate(threads, (8, 8)) for threads in (1, 2, 4))
    assert one < two < four
    assert two - one <= largest and four - one <= 3 * largest
    assert estimate(4, (28, 28)) == estimate(1, (28, 28))
    with pytest.raises(ValueError, match="threads"):
        estimate(0, (8, 8))
