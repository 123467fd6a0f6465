"""Tests for models.memory: the training-memory estimator (no RSS measurement of training here)."""

from __future__ import annotations

import itertools
import math
import os
import time

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from models import BlockTrainingModel, MemoryEstimate, ModelFamily, SubmodelSpec, get_family
from models.family import BYTES_PER_ELEMENT
from models.memory import (
    CPU_HEAP_RETENTION,
    CPU_RUNTIME_BYTES,
    CUDA_BLAS_WORKSPACE_BYTES,
    CUDA_BLOCK_BYTES,
    _LiveBytes,
    _step_temporaries,
    block_training_model,
    estimate_training_memory,
    split_blocks,
)

RATES = (1.0, 0.5, 0.25, 0.125, 0.0625)

Case = tuple[ModelFamily, tuple[int, int]]

PARTS = ("parameters", "gradients", "optimizer_state", "activations", "workspace", "overhead")


def _estimate(family: ModelFamily, size: tuple[int, int], **kwargs: object) -> MemoryEstimate:
    kwargs.setdefault("batch_size", 8)
    return family.training_memory_estimate(input_size=size, **kwargs)  # type: ignore[arg-type]


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# ------------------------------------------------------------------------------------------------ the parts
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_parts_add_up_to_total(case: Case, spec: SubmodelSpec, device: str) -> None:
    family, size = case
    est = _estimate(family, size, spec=spec, device=device)
    assert est.total == sum(getattr(est, part) for part in PARTS)
    assert all(getattr(est, part) >= 0 for part in PARTS)
    assert est.device == device
    assert est.as_dict()["total"] == est.total
    assert family.training_memory_bytes(spec, batch_size=8, input_size=size, device=device) == est.total


@pytest.mark.parametrize("slots", [0, 1, 2])
def test_parameter_terms_are_exact_byte_counts(case: Case, spec: SubmodelSpec, slots: int) -> None:
    family, size = case
    est = _estimate(family, size, spec=spec, optimizer_slots=slots)
    weights = family.param_count(spec) * BYTES_PER_ELEMENT
    assert est.parameters == weights
    assert est.gradients == weights
    assert est.optimizer_state == slots * weights


def test_more_optimizer_slots_cost_exactly_their_state(case: Case) -> None:
    family, size = case
    spec = SubmodelSpec.uniform(0.5)
    one = _estimate(family, size, spec=spec, optimizer_slots=1)
    two = _estimate(family, size, spec=spec, optimizer_slots=2)
    none = _estimate(family, size, spec=spec, optimizer_slots=0)
    assert two.optimizer_state - one.optimizer_state == family.param_count(spec) * BYTES_PER_ELEMENT
    assert none.total < one.total < two.total


def test_activations_are_linear_in_batch(case: Case) -> None:
    family, size = case
    spec = SubmodelSpec.uniform(0.5)
    acts = {b: _estimate(family, size, spec=spec, batch_size=b).activations for b in (8, 16, 24, 64)}
    per_8 = acts[16] - acts[8]
    assert per_8 > 0
    assert acts[24] - acts[16] == per_8  # every batch tensor is a multiple of the batch
    assert acts[64] / acts[8] == pytest.approx(8, rel=0.05)
    # Everything but the runtime constant grows with the batch; parameters do not.
    small, large = (
        _estimate(family, size, spec=spec, batch_size=8),
        _estimate(family, size, spec=spec, batch_size=64),
    )
    assert large.parameters == small.parameters and large.total > small.total


def test_activations_and_total_shrink_with_width(case: Case) -> None:
    family, size = case
    ests = [_estimate(family, size, spec=SubmodelSpec.uniform(r), batch_size=10) for r in RATES]
    assert all(a.activations > b.activations for a, b in itertools.pairwise(ests))
    assert all(a.total > b.total for a, b in itertools.pairwise(ests))


def test_activations_cover_what_autograd_saves() -> None:
    """A conv -> BN -> ReLU stack: the hand-counted saved tensors of a tiny CNN."""
    family = get_family("cnn", 3, 1, hidden=(2,))
    est = family.training_memory_estimate(batch_size=4, input_size=(4, 4))
    b, c, hw = 4, 2, 16
    # Input batch (saved by conv), labels (saved by the loss), conv output after the Scaler (saved by BN), BN
    # mean and inverse std, ReLU output (saved by ReLU and by the average pool), the pooled features (saved by
    # the classifier), the log-softmax (saved by the loss), the loss's total weight and the loss itself.
    expected = (
        4 * (b * 1 * hw)
        + 8 * b
        + 4 * (b * c * hw)
        + 4 * 2 * c
        + 4 * (b * c * hw)
        + 4 * b * c
        + 4 * b * 3
        + 4
        + 4
    )
    assert est.activations == expected


def test_cpu_overhead_is_the_fixed_runtime_cost(case: Case) -> None:
    family, size = case
    small = _estimate(family, size, spec=SubmodelSpec.uniform(0.0625), batch_size=2)
    large = _estimate(family, size, batch_size=64)
    assert small.overhead == large.overhead == CPU_RUNTIME_BYTES


def test_default_heap_adds_the_retention_to_the_workspace(case: Case) -> None:
    family, size = case
    compact = _estimate(family, size, batch_size=64)
    default = _estimate(family, size, batch_size=64, allocator="default")
    assert compact == _estimate(family, size, batch_size=64, allocator="compact")  # the default setting
    same = ("parameters", "gradients", "optimizer_state", "activations", "overhead")
    assert [getattr(default, part) for part in same] == [getattr(compact, part) for part in same]
    # The working set (the tensor peak less parameters and optimizer state) once more, with CPU_HEAP_RETENTION 1.
    # Where the compact workspace is zero the tensor peak may lie below the four parts (module docstring), so the
    # parts only bound the working set from above there.
    working_set = compact.total - compact.overhead - compact.parameters - compact.optimizer_state
    retained = default.workspace - compact.workspace
    if compact.workspace > 0:
        assert retained == round(CPU_HEAP_RETENTION * working_set)
    else:
        assert 0 < retained <= round(CPU_HEAP_RETENTION * working_set)


def test_rejects_unknown_allocator(case: Case) -> None:
    family, size = case
    with pytest.raises(ValueError, match="allocator must be one of compact, default"):
        _estimate(family, size, allocator="tcmalloc")


def test_cuda_estimate_ignores_the_cpu_heap_setting(case: Case) -> None:
    family, size = case
    assert _estimate(family, size, device="cuda", allocator="default") == _estimate(family, size, device="cuda")


# ------------------------------------------------------------------------------------------------ CUDA
def test_cuda_estimate_without_gpu(case: Case) -> None:
    family, size = case
    spec = SubmodelSpec.uniform(0.25)
    cpu = _estimate(family, size, spec=spec, allocator="default")
    cuda = _estimate(family, size, spec=spec, device="cuda")
    assert cuda.device == "cuda"
    assert cuda.overhead == CUDA_BLAS_WORKSPACE_BYTES  # the CUDA context is not counted
    # Every block is rounded up to the allocator's 512 bytes, so nothing is smaller than on CPU.
    assert cuda.parameters % CUDA_BLOCK_BYTES == 0
    assert cuda.parameters >= cpu.parameters and cuda.activations >= cpu.activations
    assert cuda.workspace < cpu.workspace  # no heap retention
    assert _estimate(family, size, spec=spec, device="cuda:0") == cuda


@pytest.mark.parametrize("device", ["tpu", "", 3, None])
def test_rejects_unknown_device(case: Case, device: object) -> None:
    family, size = case
    with pytest.raises(ValueError, match="device"):
        family.training_memory_bytes(None, batch_size=4, input_size=size, device=device)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------------ meta only
def test_big_batch_allocates_nothing_real() -> None:
    family = get_family("cnn", 10, 1, hidden=(16, 32, 32, 64))
    family.training_memory_bytes(batch_size=2)  # first call: torch loads its meta kernels
    before = _rss()
    started = time.monotonic()
    est = family.training_memory_estimate(batch_size=100_000)
    elapsed = time.monotonic() - started
    assert est.activations > 10 * 2**30  # tens of GB if they were real
    assert _rss() - before < 64 * 2**20
    assert elapsed < 5


def test_results_are_cached(case: Case) -> None:
    family, size = case
    first = _estimate(family, size, spec=SubmodelSpec.uniform(0.5), batch_size=12)
    assert _estimate(family, size, spec=SubmodelSpec.uniform(0.5), batch_size=12) is first
    assert _estimate(family, size, spec=SubmodelSpec.uniform(0.5), batch_size=13) is not first


@pytest.mark.parametrize(
    "kwargs",
    [{"batch_size": 0}, {"batch_size": 4, "optimizer_slots": -1}, {"batch_size": 4, "input_size": (0, 2)}],
)
def test_rejects_bad_arguments(case: Case, kwargs: dict[str, object]) -> None:
    family, _ = case
    with pytest.raises(ValueError):
        family.training_memory_estimate(None, **kwargs)  # type: ignore[arg-type]


def test_rejects_input_too_small_for_the_model() -> None:
    family = get_family("cnn", 10, 1)  # three 2x2 max pools need at least 8x8 pixels
    with pytest.raises(ValueError, match="input_size"):
        family.training_memory_bytes(None, batch_size=2, input_size=(4, 4))


# ------------------------------------------------------------------------------------------------ the optimizer step
@pytest.mark.parametrize(("slots", "device"), [(0, "cpu"), (1, "cpu"), (2, "cpu"), (1, "cuda"), (2, "cuda")])
def test_step_temporaries_match_torch_optimizers(slots: int, device: str) -> None:
    """The analytic optimizer-step model against torch's own optimizers, run on meta tensors."""
    shapes = [(64, 32, 3, 3), (64,), (10, 64), (10,)]
    params = [nn.Parameter(torch.empty(s, device="meta")) for s in shapes]
    foreach = device == "cuda"
    optimizer: torch.optim.Optimizer
    if slots < 2:
        optimizer = torch.optim.SGD(params, lr=0.1, momentum=0.9 * slots, weight_decay=5e-4, foreach=foreach)
    else:
        optimizer = torch.optim.Adam(params, lr=0.1, weight_decay=5e-4, foreach=foreach)
    sizes = [p.nbytes for p in params]
    tracker = _LiveBytes()
    tracker.ignore(params)
    with tracker:
        for _ in range(2):  # the second step is the steady state: the state exists before it
            for p in params:
                p.grad = torch.empty_like(p)
            tracker.peak = tracker.live
            before = tracker.live
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    # Adam keeps a scalar step count per parameter besides its two moments.
    assert tracker.peak - before == pytest.approx(_step_temporaries(sizes, slots, device), abs=64)


# ------------------------------------------------------------------------------------------------ blocks
def test_num_blocks() -> None:
    assert get_family("cnn", 10, 1).num_blocks() == 4
    assert get_family("cnn", 10, 1, hidden=(8, 8)).num_blocks() == 2
    assert get_family("preresnet18", 10, 3).num_blocks() == 9  # stem + 8 residual blocks
    assert get_family("preresnet18", 10, 3, blocks=(1, 1, 1, 2)).num_blocks() == 6


def test_split_blocks_compose_to_the_model(case: Case) -> None:
    family, size = case
    torch.manual_seed(0)
    model = family.build(SubmodelSpec.uniform(0.5), track_bn_stats=False).train()
    blocks, head = split_blocks(family, model)
    assert len(blocks) == family.num_blocks()
    x = torch.randn(4, family.in_channels, *size)
    out = x
    for b in blocks:
        out = b(out)
    torch.testing.assert_close(head(out), model(x))
    covered = {id(p) for m in (*blocks, head) for p in m.parameters()}
    assert covered == {id(p) for p in model.parameters()}


def _block_and_head_bytes(family: ModelFamily, spec: SubmodelSpec, block: int) -> int:
    with torch.device("meta"):
        model = family.build(spec, track_bn_stats=False)
    blocks, head = split_blocks(family, model)
    return sum(p.nbytes for m in (blocks[block], head) for p in m.parameters())


@pytest.mark.parametrize("rate", [1.0, 0.25])
def test_block_estimates(case: Case, rate: float) -> None:
    family, size = case
    spec = SubmodelSpec.uniform(rate)
    full = _estimate(family, size, spec=spec)
    for block in range(family.num_blocks(spec)):
        est = family.block_training_memory_estimate(spec, block, batch_size=8, input_size=size)
        assert est.total == family.block_training_memory_bytes(spec, block, batch_size=8, input_size=size)
        assert est.total == sum(getattr(est, part) for part in PARTS)
        assert est.total < full.total
        # All weights are loaded; only the block and the head have gradients and optimizer state.
        assert est.parameters == full.parameters
        assert est.gradients == est.optimizer_state == _block_and_head_bytes(family, spec, block)
        assert est.gradients < full.gradients
        assert est.activations < full.activations


def test_block_rejects_bad_index(case: Case) -> None:
    family, size = case
    n = family.num_blocks()
    for block in (-1, n, 1.5, True):
        with pytest.raises(ValueError, match="block"):
            family.block_training_memory_bytes(None, block, batch_size=4, input_size=size)  # type: ignore[arg-type]


def test_block_training_model_trains_only_block_and_head(case: Case) -> None:
    family, size = case
    torch.manual_seed(0)
    for block in (0, 1, family.num_blocks() - 1):
        model = family.build(SubmodelSpec.uniform(0.5), track_bn_stats=False)
        net = block_training_model(family, model, block, size)
        assert isinstance(net, BlockTrainingModel)
        x = torch.randn(4, family.in_channels, *size)
        logits = net(x)
        assert logits.shape == (4, 10)
        F.cross_entropy(logits, torch.tensor([0, 1, 2, 3])).backward()
        blocks, head = split_blocks(family, model)
        trained = {id(p) for m in (blocks[block], head) for p in m.parameters()}
        for p in model.parameters():
            assert (p.grad is not None) == (id(p) in trained)
            assert p.requires_grad == (id(p) in trained)


def test_frozen_prefix_saves_nothing() -> None:
    """Block j's activations do not depend on how many frozen blocks run before it at the same resolution."""
    family = get_family("preresnet18", 10, 3, hidden=(8, 16))
    size = (8, 8)
    acts = [
        family.block_training_memory_estimate(None, b, batch_size=8, input_size=size).activations
        for b in (1, 2)
    ]
    assert acts[0] == acts[1]  # blocks 1 and 2 are identical residual blocks of stage 1


def test_estimate_function_matches_family_methods(case: Case) -> None:
    family, size = case
    spec = SubmodelSpec.uniform(0.25)
    direct = estimate_training_memory(family, spec, batch_size=8, input_size=size, block=1)
    assert direct == family.block_training_memory_estimate(spec, 1, batch_size=8, input_size=size)
    assert math.isclose(
        direct.total, family.block_training_memory_bytes(spec, 1, batch_size=8, input_size=size)
    )
