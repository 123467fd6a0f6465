"""Tests for models.memory: the training-memory estimator (no RSS measurement of training here)."""

from __future__ import annotations

import itertools
import os
import time

import pytest
import torch
from torch import nn

from models import (
    MemoryEstimate,
    ModelFamily,
    SubmodelSpec,
    estimate_plan_memory,
    estimate_plan_stages,
    get_family,
)
from models.conv_workspace import convolution_workspace
from models.family import BYTES_PER_ELEMENT
from models.memory import (
    CPU_HEAP_RETENTION,
    CPU_RUNTIME_BYTES,
    CUDA_BLOCK_BYTES,
    _estimate_training_memory,
    _LiveBytes,
    _Step,
    _step_temporaries,
    _trace,
)
from models.training import backward_step, nested_teachers
from protocol.plan import LossTerm, OptimizerSettings, Stage, TrainingPlan

RATES = (1.0, 0.5, 0.25, 0.125, 0.0625)

Case = tuple[ModelFamily, tuple[int, int]]

PARTS = ("parameters", "gradients", "optimizer_state", "activations", "workspace", "overhead", "cache")


def _estimate(family: ModelFamily, size: tuple[int, int], **kwargs: object) -> MemoryEstimate:
    kwargs.setdefault("batch_size", 8)
    return _estimate_training_memory(family, input_size=size, **kwargs)  # type: ignore[arg-type]


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
    assert est.as_dict() == {**{part: getattr(est, part) for part in PARTS}, "total": est.total, "device": device}


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
    assert per_8 > 0 and per_8 % 8 == 0
    assert acts[24] - acts[16] == per_8  # every batch tensor is a multiple of the batch
    assert acts[64] - acts[8] == 7 * per_8  # what autograd saves is per sample
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
    est = _estimate_training_memory(family, batch_size=4, input_size=(4, 4))
    b, c, hw = 4, 2, 16
    # Input batch (saved by conv), labels (saved by the loss), conv output after the Scaler (saved by BN), BN
    # mean and inverse std, ReLU output (saved by ReLU and by the average pool), the pooled features (saved by
    # the classifier), the log-softmax (saved by the loss), the loss's total weight and the loss itself; and the
    # local label mask the step's loss reads (one byte per class).
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
        + 3
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
    # Where the compact workspace is zero the tensor peak may lie below the four parts (docs/edge-runtime.md), so the
    # parts only bound the working set from above there.
    working_set = compact.total - compact.overhead - compact.parameters - compact.optimizer_state
    retained = default.workspace - compact.workspace
    if compact.workspace > 0:
        assert retained == round(CPU_HEAP_RETENTION * working_set)
    else:
        assert 0 < retained <= round(CPU_HEAP_RETENTION * working_set)


def test_rejects_unknown_allocator(case: Case) -> None:
    family, size = case
    with pytest.raises(ValueError, match="allocator must be one of pooled, compact, default"):
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
    assert cuda.overhead == 0  # the context and cuBLAS's workspace are held before training: counted apart
    # Every block is rounded up to the allocator's 512 bytes, so nothing is smaller than on CPU.
    assert cuda.parameters % CUDA_BLOCK_BYTES == 0
    assert cuda.parameters >= cpu.parameters and cuda.activations >= cpu.activations
    assert cuda.workspace < cpu.workspace  # no heap retention
    assert _estimate(family, size, spec=spec, device="cuda:0") == cuda


@pytest.mark.parametrize("device", ["tpu", "", 3, None])
def test_rejects_unknown_device(case: Case, device: object) -> None:
    family, size = case
    with pytest.raises(ValueError, match="device"):
        _estimate_training_memory(family, None, batch_size=4, input_size=size, device=device)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------------ meta only
def test_big_batch_allocates_nothing_real() -> None:
    family = get_family("cnn", 10, 1, hidden=(16, 32, 32, 64))
    _estimate_training_memory(family, batch_size=2)  # first call: torch loads its meta kernels
    before = _rss()
    started = time.monotonic()
    est = _estimate_training_memory(family, batch_size=100_000)
    elapsed = time.monotonic() - started
    assert est.activations > 10 * 2**30  # tens of GB if they were real
    assert _rss() - before < 64 * 2**20
    assert elapsed < 5


def test_results_are_cached(case: Case) -> None:
    family, size = case
    first = _estimate(family, size, spec=SubmodelSpec.uniform(0.5), batch_size=12)
    assert _estimate(family, size, spec=SubmodelSpec.uniform(0.5), batch_size=12) is first
    assert _estimate(family, size, spec=SubmodelSpec.uniform(0.5), batch_size=13) is not first


def test_instances_of_one_model_share_their_estimates_and_other_models_do_not() -> None:
    # A start-of-run check, the run's coordinator and each run of a comparison make their own instance of one model.
    first = _estimate(get_family("cnn", 10, 1, hidden=(8, 16)), (8, 8), spec=SubmodelSpec.uniform(0.5))
    assert _estimate(get_family("cnn", 10, 1, hidden=[8, 16]), (8, 8), spec=SubmodelSpec.uniform(0.5)) is first
    others = [_estimate(get_family("cnn", 10, 1, hidden=(8, 32)), (8, 8), spec=SubmodelSpec.uniform(0.5)),
              _estimate(get_family("cnn", 10, 3, hidden=(8, 16)), (8, 8), spec=SubmodelSpec.uniform(0.5)),
              _estimate(get_family("cnn", 5, 1, hidden=(8, 16)), (8, 8), spec=SubmodelSpec.uniform(0.5))]
    assert all(other is not first for other in others)
    assert others[0].total > first.total and others[1].total > first.total  # wider; three input channels


@pytest.mark.parametrize(
    "kwargs",
    [{"batch_size": 0}, {"batch_size": 4, "optimizer_slots": -1}, {"batch_size": 4, "input_size": (0, 2)}],
)
def test_rejects_bad_arguments(case: Case, kwargs: dict[str, object]) -> None:
    family, _ = case
    with pytest.raises(ValueError):
        _estimate_training_memory(family, None, **kwargs)  # type: ignore[arg-type]


def test_rejects_input_too_small_for_the_model() -> None:
    family = get_family("cnn", 10, 1)  # three 2x2 max pools need at least 8x8 pixels
    with pytest.raises(ValueError, match="input_size"):
        _estimate_training_memory(family, None, batch_size=2, input_size=(4, 4))
    with pytest.raises(ValueError, match="input_size"):
        _estimate_training_memory(family, None, batch_size=2, input_size=(4, 4), segment=(0, 1))


def test_a_failure_of_the_traced_pass_reaches_the_caller_as_itself(monkeypatch) -> None:
    """Only an input the model cannot take is "does not fit": torch refusing the pass (as it refuses autograd in
    a child forked after a GPU's autograd threads started) keeps its own type and words."""
    from models import memory

    refusal = "Unable to handle autograd's threading in combination with fork-based multiprocessing."

    def refuse(*_args: object, **_kwargs: object) -> None:
        raise RuntimeError(refusal)

    monkeypatch.setattr(memory, "backward_step", refuse)
    monkeypatch.setattr(memory, "_cache", {})  # estimated anew, whatever an earlier test estimated of this model
    family = get_family("cnn", 10, 1, hidden=(4, 8, 8))
    with pytest.raises(RuntimeError) as caught:
        _estimate_training_memory(family, None, batch_size=11, input_size=(28, 28))
    assert str(caught.value) == refusal


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


# ------------------------------------------------------------------------------------------------ blocks, segments
def test_num_blocks() -> None:
    assert get_family("cnn", 10, 1).num_blocks == 4
    assert get_family("cnn", 10, 1, hidden=(8, 8)).num_blocks == 2
    assert get_family("preresnet18", 10, 3).num_blocks == 8  # 8 residual blocks, the stem in block 0
    assert get_family("preresnet18", 10, 3, blocks=(1, 1, 1, 2)).num_blocks == 5
    assert get_family("resnet20", 10, 3).num_blocks == 9
    assert get_family("resnet56", 10, 3).num_blocks == 27
    assert get_family("resnet110", 10, 3).num_blocks == 54


def _trained_bytes(family: ModelFamily, spec: SubmodelSpec, start: int, stop: int, exit_head: bool = False) -> int:
    """Bytes of blocks ``start..stop-1`` and of the head a segment trains (the output head, or the exit after
    its last block)."""
    with torch.device("meta"):
        model = family.build(spec, track_bn_stats=False)
    head = model.exit_head(stop - 1) if exit_head else model.output_head()
    return sum(p.nbytes for m in (*model.blocks[start:stop], head) for p in m.parameters())


@pytest.mark.parametrize("rate", [1.0, 0.25])
def test_segment_estimates(case: Case, rate: float) -> None:
    family, size = case
    spec = SubmodelSpec.uniform(rate)
    full = _estimate(family, size, spec=spec)
    for block in range(family.num_blocks):
        est = _estimate(family, size, spec=spec, segment=(block, block + 1))
        assert est.total == sum(getattr(est, part) for part in PARTS)
        assert est.total < full.total
        # All weights are loaded; only the block and the head have gradients and optimizer state.
        assert est.parameters == full.parameters
        assert est.gradients == est.optimizer_state == _trained_bytes(family, spec, block, block + 1)
        assert est.gradients < full.gradients
        assert est.activations < full.activations


def test_segment_of_every_block_is_the_whole_model_minus_nothing(case: Case) -> None:
    """A segment over every block trains what the whole model trains (the blocks then run with autograd)."""
    family, size = case
    full = _estimate(family, size)
    whole = _estimate(family, size, segment=(0, family.num_blocks))
    assert (whole.parameters, whole.gradients, whole.optimizer_state) == (
        full.parameters, full.gradients, full.optimizer_state)
    assert whole.activations == full.activations


@pytest.mark.parametrize("segment", [(-1, 0), "n", (2, 1), (0, "n+1"), (1.5, 2), (True, 1), (0,), "01", 3])
def test_segment_rejects_bad_ranges(case: Case, segment: object) -> None:
    family, size = case
    n = family.num_blocks
    if segment == "n":
        segment = (n, n + 1)
    elif segment == (0, "n+1"):
        segment = (0, n + 1)
    with pytest.raises(ValueError, match="segment"):
        _estimate(family, size, segment=segment)


def test_frozen_prefix_saves_nothing() -> None:
    """A segment's activations do not depend on how many frozen blocks run before it at the same resolution."""
    family = get_family("preresnet18", 10, 3, hidden=(8, 16), blocks=(3, 1))
    size = (8, 8)
    ests = [_estimate_training_memory(family, None, batch_size=8, input_size=size, segment=(b, b + 1))
            for b in (1, 2)]
    assert ests[0].activations == ests[1].activations  # layer1.1 and layer1.2 are identical residual blocks
    assert ests[0].gradients == ests[1].gradients


def test_spec_with_segments_estimates_its_most_expensive_stage(case: Case) -> None:
    family, size = case
    n = family.num_blocks
    segments = ((n - 1, n), (0, n - 1))
    spec = SubmodelSpec(width=0.5, segments=segments)
    stages = [_estimate(family, size, spec=spec, segment=seg) for seg in segments]
    assert stages[0].total != stages[1].total
    worst = max(stages, key=lambda e: e.total)
    assert _estimate(family, size, spec=spec) == worst
    # The segments do not change the model: the same stage of the spec trained whole costs the same.
    plain = SubmodelSpec.uniform(0.5)
    assert stages == [_estimate(family, size, spec=plain, segment=seg) for seg in segments]
    assert worst.total < _estimate(family, size, spec=plain).total


def test_route_exit_trains_the_exit_after_the_segment(case: Case) -> None:
    family, size = case
    spec = SubmodelSpec(width=0.5, exits=(1,))
    est = _estimate(family, size, spec=spec, segment=(0, 2), route="exit")
    assert est.gradients == _trained_bytes(family, spec, 0, 2, exit_head=True)
    skip = _estimate(family, size, spec=spec, segment=(0, 2), route="skip")
    assert skip.gradients == _trained_bytes(family, spec, 0, 2)
    assert est != skip
    with pytest.raises(ValueError, match="route 'exit' needs an exit after block 2"):
        _estimate(family, size, spec=spec, segment=(0, 3), route="exit")


def test_a_buffered_stage_adds_the_frozen_outputs_of_every_sample(case: Case) -> None:
    family, size = case
    spec = SubmodelSpec(width=0.5, segments=((0, 2), (2, 3)))
    model = family.build(spec, track_bn_stats=False)
    with torch.no_grad():
        out = torch.randn(1, family.in_channels, *size)
        for block in model.blocks[:2]:
            out = block(out)
    per_sample = out.nbytes  # what the interpreter buffers per sample before block 2
    recomputed = _estimate(family, size, spec=spec, segment=(2, 3))
    buffered = _estimate(family, size, spec=spec, segment=(2, 3), cache_samples=100)
    assert recomputed.cache == 0 and buffered.cache == 100 * per_sample
    assert buffered.total == recomputed.total + 100 * per_sample
    assert _estimate(family, size, spec=spec, segment=(0, 2), cache_samples=100).cache == 0  # nothing frozen
    plan = TrainingPlan(batch_size=8, schedule=(Stage(2), Stage(2, cache=True)))
    assert estimate_plan_memory(family, spec, plan, input_size=size, samples=100) == max(
        (_estimate(family, size, spec=spec, segment=(0, 2), optimizer_slots=1), buffered), key=lambda e: e.total)
    with pytest.raises(ValueError, match="cache_samples"):
        _estimate(family, size, spec=spec, segment=(2, 3), cache_samples=-1)


def test_the_head_alone_on_a_cpu_counts_the_heads_weights_only(case: Case) -> None:
    """FeDepth's last resort: the head alone on the frozen output of every block. On a CPU the frozen body runs
    from the received weights (the training child's baseline), so only the head has weights of its own; on CUDA
    the body is copied to the GPU and counts."""
    family, size = case
    n = family.num_blocks
    spec = SubmodelSpec(segments=((n, n),))
    head = _trained_bytes(family, spec, n, n)
    cpu = _estimate(family, size, spec=spec, segment=(n, n))
    assert cpu.parameters == cpu.gradients == head
    cuda = _estimate(family, size, spec=spec, segment=(n, n), device="cuda")
    assert cuda.parameters >= family.param_count(SubmodelSpec()) * BYTES_PER_ELEMENT > head
    assert _estimate(family, size, spec=spec) == cpu  # the spec's one stage
    # A block trained with the body held whole counts every weight, as before.
    block = _estimate(family, size, spec=SubmodelSpec(segments=((n - 1, n),)), segment=(n - 1, n))
    assert block.parameters == family.param_count(SubmodelSpec()) * BYTES_PER_ELEMENT
    model = family.build(spec, track_bn_stats=False)
    with torch.no_grad():
        out = torch.randn(1, family.in_channels, *size)
        for each in model.blocks:
            out = each(out)
    buffered = _estimate(family, size, spec=spec, segment=(n, n), cache_samples=10)
    assert buffered.cache == 10 * out.nbytes and buffered.total == cpu.total + buffered.cache


def _scalefl_loss(outputs: int) -> tuple[LossTerm, ...]:
    """ScaleFL's Eq. 5 over ``outputs`` outputs: CE of each, KD of each early exit towards the last."""
    terms = [LossTerm.ce(weight=i / outputs, output=i - 1) for i in range(1, outputs + 1)]
    terms += [LossTerm.kd(i - 1, -1, weight=0.1 * i / outputs, tau=3.0) for i in range(1, outputs)]
    return tuple(terms)


def test_exits_and_distillation_cost_more(case: Case) -> None:
    family, size = case
    plain = SubmodelSpec.uniform(0.5)
    spec = SubmodelSpec(width=0.5, exits=(0, family.num_blocks // 2))
    without = _estimate(family, size, spec=plain)
    with_exits = _estimate(family, size, spec=spec)  # cross-entropy of the last output only
    every_ce = tuple(LossTerm.ce(output=i) for i in range(3))
    with_ce = _estimate(family, size, spec=spec, loss=every_ce)
    with_kd = _estimate(family, size, spec=spec, loss=_scalefl_loss(3))
    head_bytes = (family.param_count(spec) - family.param_count(plain)) * BYTES_PER_ELEMENT
    assert with_exits.parameters - without.parameters == head_bytes > 0
    assert with_exits.gradients - without.gradients == head_bytes
    assert with_exits.total > without.total
    # Trained through the loss, the exit heads keep what their backward needs.
    assert with_ce.parameters == with_exits.parameters
    assert with_ce.activations > with_exits.activations >= without.activations
    assert with_ce.total > with_exits.total
    # Distillation adds the softened outputs of student and teacher.
    assert with_kd.parameters == with_exits.parameters
    assert with_kd.activations > with_ce.activations
    assert with_kd.total >= with_ce.total  # the peak may lie elsewhere (e.g. in a convolution's backward)
    assert with_kd.total > without.total


def test_loss_terms_must_fit_the_model() -> None:
    family, size = get_family("cnn", 10, 1, hidden=(4, 8)), (8, 8)
    with pytest.raises(ValueError, match="output"):
        _estimate(family, size, loss=(LossTerm.kd(-2, -1, weight=1.0, tau=2.0),))  # one output only
    with pytest.raises(ValueError, match="output"):
        _estimate(family, size, spec=SubmodelSpec(exits=(0,)), loss=(LossTerm.ce(output=-3),))
    for loss in ((), ("ce",)):
        with pytest.raises(ValueError, match="loss"):
            _estimate(family, size, loss=loss)


def test_plan_memory_uses_the_plans_batch_size_optimizer_and_loss() -> None:
    family, size = get_family("cnn", 10, 1, hidden=(4, 8, 8)), (8, 8)
    spec = SubmodelSpec(width=0.5, exits=(0,))
    loss = _scalefl_loss(2)
    plan = TrainingPlan(optimizer=OptimizerSettings(momentum=0.9), batch_size=6, loss=loss)
    est = estimate_plan_memory(family, spec, plan, input_size=size)
    assert est == _estimate(family, size, spec=spec, batch_size=6, optimizer_slots=1, loss=loss)
    assert est.optimizer_state == est.gradients > 0
    assert est != _estimate(family, size, spec=spec, batch_size=6, optimizer_slots=1)  # the loss counts
    assert est.activations < estimate_plan_memory(family, spec, TrainingPlan(batch_size=12, loss=loss),
                                                  input_size=size).activations
    plain_sgd = TrainingPlan(optimizer=OptimizerSettings(momentum=0.0), batch_size=6, loss=loss)
    no_state = estimate_plan_memory(family, spec, plain_sgd, input_size=size)
    assert no_state == _estimate(family, size, spec=spec, batch_size=6, optimizer_slots=0, loss=loss)
    assert no_state.optimizer_state == 0
    cuda = estimate_plan_memory(family, spec, plan, input_size=size, device="cuda")
    assert cuda == _estimate(family, size, spec=spec, batch_size=6, loss=loss, device="cuda")
    assert estimate_plan_memory(family, spec, plan, input_size=size, allocator="default") == _estimate(
        family, size, spec=spec, batch_size=6, loss=loss, allocator="default")


def test_plan_memory_takes_each_stages_route() -> None:
    family, size = get_family("cnn", 10, 1, hidden=(4, 8, 8, 8)), (8, 8)
    n = family.num_blocks
    spec = SubmodelSpec(exits=(1,), segments=((0, 2), (2, n)))
    plan = TrainingPlan(batch_size=4, schedule=(Stage(route="exit"), Stage(epochs=2)))
    stages = [_estimate(family, size, spec=spec, batch_size=4, segment=(0, 2), route="exit"),
              _estimate(family, size, spec=spec, batch_size=4, segment=(2, n))]
    assert estimate_plan_stages(family, spec, plan, input_size=size) == stages
    assert estimate_plan_memory(family, spec, plan, input_size=size) == max(stages, key=lambda e: e.total)
    # Without a schedule every stage takes the skip path.
    assert estimate_plan_memory(family, spec, TrainingPlan(batch_size=4), input_size=size) == _estimate(
        family, size, spec=spec, batch_size=4)
    with pytest.raises(ValueError, match="schedules 1 stage"):
        estimate_plan_memory(family, spec, TrainingPlan(schedule=(Stage(),)), input_size=size)
    with pytest.raises(ValueError, match="whole model at once"):
        estimate_plan_memory(family, SubmodelSpec(), TrainingPlan(schedule=(Stage(),)), input_size=size)


def test_copies_add_their_parameters_gradients_and_state_but_not_their_activations() -> None:
    family = get_family("cnn", 10, 1, hidden=(8, 16))
    mutual = (LossTerm.ce(), LossTerm.mutual_kd(weight=1.0, tau=1.0))
    one = _estimate_training_memory(family, batch_size=32, input_size=(16, 16), loss=mutual)
    two = _estimate_training_memory(family, batch_size=32, input_size=(16, 16), loss=mutual, copies=2)
    assert two.parameters == 2 * one.parameters and two.gradients == 2 * one.gradients
    assert two.optimizer_state == 2 * one.optimizer_state
    # One copy's activations are alive at a time (plus the others' predictions): far below twice one copy's.
    assert one.activations <= two.activations < 1.5 * one.activations
    assert two.total < 2 * one.total
    with pytest.raises(ValueError, match="copies are trained whole"):
        _estimate_training_memory(family, SubmodelSpec(segments=((0, 1),)), batch_size=8, copies=2)
    with pytest.raises(ValueError, match="copies"):
        _estimate_training_memory(family, batch_size=8, copies=0)


@pytest.mark.parametrize("segment", [(0, 1), (3, 9)])
def test_accumulated_micro_batches_count_their_gradients_once(segment: tuple[int, int]) -> None:
    # The second micro-batch's pass runs beside the first one's gradients: they are the estimate's gradients, and
    # its activations are the same pass's as a single micro-batch's (the first pass's loss, a scalar, aside).
    family = get_family("preresnet20", 10, 1)
    one = _estimate_training_memory(family, batch_size=16, segment=segment)
    two = _estimate_training_memory(family, batch_size=16, segment=segment, accumulate=True)
    assert two.gradients == one.gradients > 0
    assert one.activations <= two.activations < one.activations + two.gradients
    assert two.total >= one.total


# ------------------------------------------------------------------------------- nested teachers (FlexFL)
NESTED_CASES = {  # student spec, teacher spec
    "layer-widths": (SubmodelSpec(layer_widths={"conv1": 1.0, "conv2": 0.75}, rounding="floor"),
                     SubmodelSpec(layer_widths={"conv1": 0.5, "conv2": 0.5}, rounding="floor")),
    "uniform": (SubmodelSpec.uniform(0.5), SubmodelSpec.uniform(0.25)),
}


@pytest.mark.parametrize("allocator", ["pooled", "compact", "default"])
@pytest.mark.parametrize("name", list(NESTED_CASES))
def test_nested_teachers_cost_their_outputs_and_no_weights(name: str, allocator: str) -> None:
    family = get_family("cnn", 10, 1, hidden=(8, 16))
    spec, teacher = NESTED_CASES[name]
    ce = (LossTerm.ce(),)
    nested = (*ce, LossTerm.nested_kd(teacher.to_dict(), weight=10.0, tau=3.0))
    without = _estimate_training_memory(family, spec, batch_size=32, input_size=(16, 16), loss=ce, allocator=allocator)
    with_teacher = _estimate_training_memory(family, spec, batch_size=32, input_size=(16, 16), loss=nested,
                                             allocator=allocator)
    # No weights, gradients or state of its own; its logits (and their softmax) stay for the student's backward.
    assert (with_teacher.parameters, with_teacher.gradients, with_teacher.optimizer_state) == (
        without.parameters, without.gradients, without.optimizer_state)
    assert with_teacher.activations > without.activations and with_teacher.total >= without.total
    plan = TrainingPlan(batch_size=32, loss=nested)
    assert estimate_plan_memory(family, spec, plan, input_size=(16, 16), allocator=allocator) == with_teacher
    with pytest.raises(ValueError, match="is not nested"):  # a student narrower than its teacher
        estimate_plan_memory(family, SubmodelSpec.uniform(0.125), plan, input_size=(16, 16))
    with pytest.raises(ValueError, match="not supported"):
        _estimate_training_memory(family, spec, batch_size=8, loss=nested, segment=(0, 1))
    with pytest.raises(ValueError, match="not supported"):
        _estimate_training_memory(family, spec, batch_size=8, loss=nested, copies=2)


@pytest.mark.parametrize("name", list(NESTED_CASES))
def test_the_traced_step_with_nested_teachers_is_the_real_one(name: str) -> None:
    """The meta trace gives the tensor peak a real CPU step of the interpreter tracks, with teachers as without."""
    family = get_family("cnn", 10, 1, hidden=(8, 16))
    spec, teacher = NESTED_CASES[name]
    ce = (LossTerm.ce(),)
    for loss in (ce, (*ce, LossTerm.nested_kd(teacher.to_dict(), weight=10.0, tau=3.0))):
        step = _Step.checked(family, spec, batch_size=32, input_size=(16, 16), optimizer_slots=1, device="cpu",
                             allocator="pooled", loss=loss, segment=None, route="skip", copies=1, accumulate=False,
                             widths=(), threads=1)
        traced = _trace(family, step)
        torch.manual_seed(0)
        model = family.build(spec, track_bn_stats=False)
        teachers = nested_teachers(family, spec, loss, model)
        assert (teachers is None) == (len(loss) == 1)
        tracker = _LiveBytes(1, convolution_workspace)
        tracker.ignore(list(model.parameters()))
        with torch.enable_grad(), tracker:
            x, y = torch.randn(32, 1, 16, 16), torch.randint(0, 10, (32,))
            mask = torch.ones(10, dtype=torch.bool)
            value = backward_step(model, x, y, loss, mask, teachers=teachers)
            after_backward = tracker.live
        del value
        assert (tracker.peak, after_backward) == (traced.fb_peak, traced.after_backward), loss
