"""TaskRunner: a task in, an update out (ok, declined or failed with a reason); LocalData validation.

Fixtures (family, make_task, make_runner, local_data, task_plan) come from conftest.py: a tiny CNN (hidden 4, 8)
on 8x8 one-channel inputs, 16 samples, batch size 8, so one epoch is two steps; ``deep_family`` and
``make_deep_task``: the same with three blocks (hidden 4, 8, 8), for exits and depth-wise segments.
"""

from __future__ import annotations

import json
import math
import threading
import time
from dataclasses import replace

import numpy as np
import psutil
import pytest
import torch

from edge_agent import allocator, forkserver
from edge_agent import runner as runner_module
from edge_agent.adaptation import Option
from edge_agent.calibration import Calibration
from edge_agent.decision import Decider, estimate_key
from edge_agent.limits import TaskLimits
from edge_agent.runner import LocalData, TaskRejected, TaskRunner
from edge_agent.workdir import DataShape
from models import MemoryEstimate, SubmodelSpec, estimate_plan_memory, get_family
from protocol import (
    Adaptation,
    Candidate,
    LossTerm,
    ModelRef,
    ProtocolError,
    Stage,
    TrainingPlan,
    decode,
    encode,
)

HIDDEN = (4, 8)
MEMORY_KEYS = {"estimated_bytes", "raw_estimate_bytes", "budget_bytes", "calibration"}
#: Where the device's time went (TaskRunner.run): the whole task, the decision child, the training child.
TIME_KEYS = {"seconds_task", "seconds_decision", "seconds_child"}
OK_METRICS = {"loss", "steps", "seconds", "stages", "peak_bytes"} | MEMORY_KEYS | TIME_KEYS


def heap_metrics(runner) -> set[str]:
    """The metrics a child adds for its heap: whether the page pool ran, where the pooled heap was asked for."""
    return {"pooled_heap"} if runner.allocator == "pooled" else set()
WIDTH_LEVELS = Adaptation("width-levels", rates=[1.0, 0.5, 0.25])


class RecordingCalibration(Calibration):
    """A real Calibration that also records what the runner taught it."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.observed: list[tuple[int, int, int]] = []
        self.failures: list[tuple[int, int, int]] = []

    def observe(self, raw_estimate: int, measured_peak: int, overhead: int = 0) -> None:
        self.observed.append((raw_estimate, measured_peak, overhead))
        super().observe(raw_estimate, measured_peak, overhead)

    def observe_failure(self, raw_estimate: int, available: int, overhead: int = 0) -> None:
        self.failures.append((raw_estimate, available, overhead))
        super().observe_failure(raw_estimate, available, overhead)


def raw_estimate(family, spec: SubmodelSpec, plan: TrainingPlan, allocator: str = "compact"):
    """What the runner should ask the estimator for: the plan on 8x8 inputs, on CPU."""
    return estimate_plan_memory(family, spec, plan, input_size=(8, 8), device="cpu", allocator=allocator)


# ---------------------------------------------------------------------------------------------- ok
@pytest.mark.parametrize(("rate", "legacy"), [(1.0, False), (0.25, False), (1.0, True)],
                         ids=["width 1", "width 0.25", "old-style task"])
def test_valid_task_returns_ok_update_with_trained_weights(family, make_task, make_runner, tmp_path, task_plan,
                                                           rate, legacy):
    spec = SubmodelSpec.uniform(rate)
    # The hint allows shrinking, but the sent spec fits: the runner trains exactly what was sent. An old-style
    # task (a recipe, no plan; HeteroFL's width levels) is served the same way.
    if legacy:
        task = make_task(spec, legacy=True, adaptation=WIDTH_LEVELS)
        assert task.plan is None and task.training_plan() == task_plan()
    else:
        smaller = SubmodelSpec.uniform(rate / 2)
        task = make_task(spec, adaptation=Adaptation("ladder", [Candidate(smaller.to_dict(), task_plan())]))
    calibration_file = tmp_path / "agent" / "calibration-cpu-compact.json"
    calibration = RecordingCalibration(calibration_file)
    runner = make_runner(calibration=calibration)
    update = runner.run(task)

    assert update.status == "ok", update.reason
    assert update.reason is None
    assert (update.task_id, update.round, update.agent_id) == (task.task_id, 1, "agent")
    assert update.spec_trained == spec.to_dict()
    assert update.num_samples == 16 and update.labels == list(range(10))
    assert set(update.weights) == set(family.trainable_keys(spec)) == set(task.weights)
    for key, array in update.weights.items():
        assert array.shape == task.weights[key].shape and array.dtype == np.float32
        assert np.isfinite(array).all()
    assert any(not np.array_equal(update.weights[k], task.weights[k]) for k in task.weights)  # trained

    metrics = update.metrics
    assert set(metrics) == OK_METRICS | heap_metrics(runner)
    if runner.allocator == "pooled":  # the child really ran on the page pool
        assert metrics["pooled_heap"] == 1.0
    assert all(math.isfinite(v) for v in metrics.values())
    assert metrics["steps"] == 2.0 and metrics["stages"] == 1.0
    assert metrics["loss"] > 0 and metrics["seconds"] > 0
    estimate = raw_estimate(family, spec, task_plan())
    assert metrics["raw_estimate_bytes"] == estimate.total
    assert metrics["calibration"] == pytest.approx(1.10)  # a fresh device: the initial factor
    # the decision used the corrected estimate: the model-dependent part times the factor, plus the overhead
    assert metrics["estimated_bytes"] == estimate.overhead + int((estimate.total - estimate.overhead) * 1.10)
    assert metrics["estimated_bytes"] <= metrics["budget_bytes"]
    assert metrics["peak_bytes"] > 0

    # The measured peak was fed back into the calibration, with the estimate it belongs to, and stored.
    assert calibration.observed == [(estimate.total, int(metrics["peak_bytes"]), estimate.overhead)]
    assert calibration.failures == []
    expected = Calibration()
    expected.observe(estimate.total, int(metrics["peak_bytes"]), estimate.overhead)
    assert calibration.ratios == pytest.approx(expected.ratios)
    stored = json.loads(calibration_file.read_text()) if calibration_file.exists() else None
    # (a run whose model part is too small to measure against the overhead teaches nothing, writes nothing)
    assert stored == ({"ratios": pytest.approx(expected.ratios), "floor": 0.0} if expected.ratios else None)
    assert not (tmp_path / "agent" / "tasks" / task.task_id).exists()  # the work directory is cleaned up
    decoded = decode(encode(update))  # what goes on the wire is a valid update
    assert decoded.status == "ok" and decoded.metrics == metrics


def test_raw_estimate_matches_family_memory_model(family, model_ref, make_runner, decider_for, task_plan):
    decider = decider_for(make_runner())
    spec = SubmodelSpec.uniform(0.5)
    with_momentum = decider.raw_estimate(model_ref, spec, task_plan(momentum=0.9))
    assert with_momentum == raw_estimate(family, spec, task_plan(momentum=0.9))
    without = decider.raw_estimate(model_ref, spec, task_plan(momentum=0.0))
    assert without == raw_estimate(family, spec, task_plan(momentum=0.0))
    assert without.optimizer_state == 0 < with_momentum.optimizer_state
    assert without.total < with_momentum.total


def test_a_decision_estimates_each_spec_and_plan_once(family, model_ref, make_runner, decider_for, task_plan):
    decider = decider_for(make_runner())
    plan = task_plan()
    half, quarter = Option(SubmodelSpec.uniform(0.5), plan), Option(SubmodelSpec.uniform(0.25), plan)
    first = decider.raw_estimates(model_ref, [half, quarter, half])
    assert first == {half: raw_estimate(family, half.spec, plan), quarter: raw_estimate(family, quarter.spec, plan)}
    assert decider.raw_estimates(model_ref, [quarter]) == {quarter: first[quarter]}
    assert sorted(decider.made) == sorted({estimate_key(model_ref, half), estimate_key(model_ref, quarter)})
    bigger_batch = task_plan(batch_size=16)
    assert decider.raw_estimate(model_ref, half.spec, bigger_batch) == raw_estimate(family, half.spec, bigger_batch)
    assert len(decider.made) == 3  # another batch size is another estimate
    # another model is another estimate, even for the same (spec, plan)
    other = ModelRef("cnn", 10, 1, {"hidden": [4, 4]})
    decider.raw_estimate(other, half.spec, plan)
    assert len(decider.made) == 4
    assert estimate_key(model_ref, half) == estimate_key(model_ref, replace(half, plan=replace(plan, seed=9)))


def test_a_decision_uses_the_estimates_it_is_given_instead_of_estimating(model_ref, make_runner, decider_for,
                                                                         task_plan):
    runner = make_runner()
    option = Option(SubmodelSpec.uniform(0.5), task_plan())
    known = MemoryEstimate(1, 2, 3, 4, 5, 6)
    request = replace(decider_for(runner).request, known={estimate_key(model_ref, option): {
        key: value for key, value in known.as_dict().items() if key != "total"}})
    decider = Decider(request)
    assert decider.raw_estimate(model_ref, option.spec, option.plan) == known
    assert decider.made == {}


def test_the_runner_remembers_the_estimates_its_decisions_made(family, model_ref, make_task, make_runner,
                                                               task_plan):
    runner = make_runner()
    spec = SubmodelSpec.uniform(0.5)
    assert runner.run(make_task(spec)).status == "ok"
    key = estimate_key(model_ref, Option(spec, task_plan()))
    assert MemoryEstimate(**runner.estimates_of(model_ref)[key]) == raw_estimate(family, spec, task_plan())
    remembered = runner.remembered_estimates
    # The next round's task asks for nothing new; its update reports the remembered estimate.
    update = runner.run(make_task(spec, task_id="r2-agent-0001", round_number=2))
    assert update.metrics["raw_estimate_bytes"] == raw_estimate(family, spec, task_plan()).total
    assert runner.remembered_estimates == remembered
    # Another model's decisions get only that model's estimates; the runner keeps a few models' worth.
    other = ModelRef("cnn", 10, 1, {"hidden": [4, 4]})
    assert runner.estimates_of(other) == {}
    for index in range(runner_module.MODELS_KEPT):
        runner._remember(ModelRef("cnn", 10, 1, {"hidden": [4, index + 10]}), {f"k{index}": {"parameters": 1}})
    assert runner.estimates_of(model_ref) == {}  # the least recently used model was forgotten
    assert runner.remembered_estimates == runner_module.MODELS_KEPT


def test_family_is_cached_per_model_ref(make_runner, decider_for):
    decider = decider_for(make_runner())
    ref = ModelRef("cnn", 10, 1, {"hidden": list(HIDDEN)})
    assert decider.family_for(ref) is decider.family_for(ModelRef("cnn", 10, 1, {"hidden": list(HIDDEN)}))
    assert decider.family_for(ref) is not decider.family_for(ModelRef("cnn", 10, 1, {"hidden": [4, 4]}))


def test_available_uses_the_budget_for_the_round(make_runner):
    seen = []

    def budget(round_number: int) -> int:
        seen.append(round_number)
        return 12_345 * round_number

    runner = make_runner(budget=budget)
    assert runner.available(3) == 3 * 12_345
    assert seen == [3]


def test_state_dir_holds_the_data_file_and_calibration(make_runner, model_ref, tmp_path):
    data = LocalData(torch.randn(4, 1, 8, 8), torch.tensor([0, 1, 2, 1]))
    runner = make_runner(data)
    assert runner.state_dir == tmp_path / "agent"
    assert runner.data_path == tmp_path / "agent" / "local-data.npz"
    with np.load(runner.data_path, allow_pickle=False) as archive:
        np.testing.assert_array_equal(archive["x"], data.x)
        np.testing.assert_array_equal(archive["y"], data.y)
    calibration = runner.calibration_for(model_ref)
    assert calibration.path is not None and calibration.path.parent == tmp_path / "agent"
    assert calibration.path.name.startswith("calibration-cpu-compact-")
    # CPU peaks move by a fraction of a MB between identical runs: tasks that small do not calibrate.
    assert calibration.resolution == forkserver.CPU_PEAK_RESOLUTION_BYTES > 0
    runner.close()
    assert runner.data_path.exists()  # close() leaves a state_dir it was given alone


def test_runner_loads_the_calibration_learnt_before(make_runner, model_ref):
    make_runner(name="first").calibration_for(model_ref).observe(10_000_000, 30_000_000)
    assert make_runner(name="first").calibration_for(model_ref).factor == pytest.approx(3.0 * 1.05)


def test_each_model_has_a_calibration_of_its_own(make_runner, model_ref, deep_ref):
    runner = make_runner()
    runner.calibration_for(model_ref).observe(10_000_000, 5_000_000)  # a model measured at half its estimate
    assert runner.calibration_for(model_ref).factor == pytest.approx(0.5 * 1.05)
    other = runner.calibration_for(deep_ref)
    assert other.factor == pytest.approx(1.10) and other.path != runner.calibration_for(model_ref).path
    assert json.loads(runner.calibration_for(model_ref).path.read_text())["of"].startswith('["[\\"cnn\\"')


@pytest.mark.parametrize("allocator", ["compact", "default"])
def test_runner_estimates_for_the_heap_its_children_run(family, model_ref, make_runner, decider_for, tmp_path,
                                                        task_plan, allocator):
    runner = make_runner(allocator=allocator)
    assert runner.allocator == allocator  # glibc here: "compact" is available
    spec = SubmodelSpec.uniform(0.5)
    expected = estimate_plan_memory(family, spec, task_plan(), input_size=runner.data.image_size,
                                    allocator=allocator)
    assert decider_for(runner).raw_estimate(model_ref, spec, task_plan()) == expected
    other = "default" if allocator == "compact" else "compact"
    assert expected != raw_estimate(family, spec, task_plan(), allocator=other)  # the setting matters
    # A factor learnt under one heap setting says nothing about the other: one file per setting.
    assert runner.calibration_for(model_ref).path.name.startswith(f"calibration-cpu-{allocator}-")


def test_a_pooled_runner_shares_the_compact_estimate_and_calibration(family, model_ref, make_runner, decider_for,
                                                                    task_plan):
    runner = make_runner(allocator="pooled")
    assert runner.allocator == ("pooled" if allocator.resolve("pooled") == "pooled" else "compact")
    spec = SubmodelSpec.uniform(0.5)
    assert decider_for(runner).raw_estimate(model_ref, spec, task_plan()) == raw_estimate(family, spec, task_plan())
    # The same peaks: what a device learnt under the compact heap carries over to the pooled one.
    assert runner.calibration_for(model_ref).path.name.startswith("calibration-cpu-compact-")


def test_runner_rejects_an_unknown_allocator(make_runner):
    with pytest.raises(ValueError, match="allocator must be one of"):
        make_runner(allocator="tcmalloc")


def test_runner_uses_a_given_calibration(make_runner):
    calibration = Calibration(initial=2.0)
    assert make_runner(calibration=calibration).calibration is calibration


def test_close_removes_a_temporary_state_dir():
    runner = TaskRunner("agent", LocalData(torch.randn(2, 1, 8, 8), torch.tensor([0, 1])))
    try:
        assert runner.data_path.exists()
        state_dir = runner.state_dir
    finally:
        runner.close()
    assert not state_dir.exists()


def test_closing_kills_the_training_child_answers_failed_and_then_removes_the_state_dir(make_task, local_data):
    runner = TaskRunner("agent", local_data(), 2**30, limits=TaskLimits(max_epochs=10**5, max_steps=10**9))
    state_dir = runner.state_dir
    answers: list = []
    serving = threading.Thread(target=lambda: answers.append(runner.run(make_task(SubmodelSpec.full(), epochs=10**5))))
    serving.start()
    deadline = time.monotonic() + 60
    while runner.child_pid is None and time.monotonic() < deadline:
        time.sleep(0.01)
    child = runner.child_pid
    assert child is not None
    runner.close()  # returns once the task has ended: its child killed, its work directory gone
    assert not state_dir.exists()
    serving.join(10)
    [update] = answers
    assert (update.status, update.reason) == ("failed", "the agent stopped while training")
    assert not psutil.pid_exists(child)  # killed and reaped, not left training in a removed directory
    assert runner.calibration.floor == 0.0  # a kill for stopping says nothing about memory
    late = runner.run(make_task())
    assert (late.status, late.reason) == ("declined", "the agent is stopping")


# ---------------------------------------------------------------------------------------------- declined
def test_declines_when_budget_below_estimate(family, make_task, make_runner):
    update = make_runner(budget=1000).run(make_task())
    assert update.status == "declined"
    assert update.reason.startswith("nothing fits the ")
    assert "width=0.5" in update.reason  # names what it tried
    assert update.weights == {} and update.num_samples == 16 and update.spec_trained is None


def test_declines_when_corrected_estimate_exceeds_budget_although_raw_fits(family, make_task, make_runner,
                                                                           task_plan):
    estimate = raw_estimate(family, SubmodelSpec.uniform(0.5), task_plan())
    corrected = Calibration().corrected(estimate.total, estimate.overhead)
    assert corrected > estimate.total
    # raw estimate < budget < corrected estimate: the calibration factor is what makes it decline
    update = make_runner(budget=(estimate.total + corrected) // 2).run(make_task())
    assert update.status == "declined", update.reason
    assert "nothing fits" in update.reason


@pytest.mark.parametrize(("unified", "gpu_free", "expected"), [
    (False, 3_000_000_000, 1_000_000_000),  # a discrete GPU: its free memory less the CUDA start (budget: 2 GB)
    (True, None, 1_500_000_000),  # a Jetson: one RAM for CPU and GPU (no NVML), the CUDA start taken off it once
])
def test_available_on_cuda_leaves_room_for_the_cuda_start(make_runner, monkeypatch, unified, gpu_free, expected):
    ram = 3_500_000_000
    monkeypatch.setattr(runner_module, "available_memory", lambda budget=None: min(ram, budget or ram))
    monkeypatch.setattr(runner_module, "gpu_free_memory", lambda: gpu_free)
    runner = make_runner(budget=2_000_000_000, device="cuda", unified_memory=unified)
    runner.cuda_context_bytes = 2_000_000_000
    assert runner.available(1) == expected
    runner.cuda_context_bytes = 10**10  # nothing left: never a negative figure
    assert runner.available(1) == 0
    cpu = make_runner(budget=2_000_000_000, name="cpu")  # the CPU path knows nothing of CUDA
    cpu.cuda_context_bytes = 10**10
    assert cpu.available(1) == 2_000_000_000


def test_a_discrete_gpu_nvml_cannot_see_is_left_to_the_budget_and_ram(make_runner, monkeypatch):
    monkeypatch.setattr(runner_module, "available_memory", lambda budget=None: min(3_500_000_000, budget or 10**12))
    monkeypatch.setattr(runner_module, "gpu_free_memory", lambda: None)
    runner = make_runner(budget=2_000_000_000, device="cuda")
    assert runner.available(1) == 2_000_000_000  # not the RAM less a CUDA start it does not come out of


def test_declines_when_available_memory_is_short(make_task, make_runner, monkeypatch):
    asked = []

    def available_memory(budget):
        asked.append(budget)
        return 10

    monkeypatch.setattr(runner_module, "available_memory", available_memory)
    update = make_runner(budget=5_000_000).run(make_task())
    assert update.status == "declined" and "nothing fits" in update.reason
    assert asked == [5_000_000]  # the budget for the round is passed on


def test_declines_when_deadline_passed(make_task, make_runner):
    update = make_runner().run(make_task(deadline=time.time() - 1))
    assert update.status == "declined"
    assert "deadline" in update.reason


# ---------------------------------------------------------------------------------------------- failed
def test_fails_on_wrong_weight_shape(make_task, make_runner):
    task = make_task()
    task.weights["conv1.weight"] = np.zeros((3, 1, 3, 3), np.float32)  # level 0.5 of 4 channels is 2
    update = make_runner().run(task)
    assert update.status == "failed"
    assert "conv1.weight" in update.reason and "(3, 1, 3, 3)" in update.reason


def test_fails_on_missing_keys(make_task, make_runner):
    task = make_task()
    del task.weights["classifier.bias"]
    update = make_runner().run(task)
    assert update.status == "failed"
    assert "missing ['classifier.bias']" in update.reason


def test_fails_on_unexpected_keys(make_task, make_runner):
    task = make_task()
    task.weights["bn1.running_mean"] = np.zeros(2, np.float32)
    update = make_runner().run(task)
    assert update.status == "failed" and "bn1.running_mean" in update.reason


@pytest.mark.parametrize(("spec_dict", "detail"), [
    ({"width": 2.0}, "width must be a number in (0, 1]"),
    ({"bogus": 1}, "unknown sub-model spec key 'bogus'"),
    ({"width": "half"}, "'width' must be a number"),
])
def test_fails_on_invalid_spec(make_task, make_runner, spec_dict, detail):
    update = make_runner().run(make_task(spec_dict=spec_dict))
    assert update.status == "failed"
    assert update.reason.startswith("invalid task: ")
    assert detail in update.reason


@pytest.mark.parametrize(("candidate", "detail"), [
    ({"width": 2.0}, "width must be a number in (0, 1]"),
    ({"bogus": 1}, "unknown sub-model spec key 'bogus'"),
    ({"width": "half"}, "'width' must be a number"),
    ({"width": 0.25, "depth": 1}, "a sub-model cut after block 0 needs an exit there"),
])
def test_fails_on_invalid_adaptation_candidate(make_task, make_runner, task_plan, candidate, detail):
    hint = Adaptation("ladder", [Candidate(candidate, task_plan())])
    update = make_runner().run(make_task(SubmodelSpec.uniform(1.0), adaptation=hint))
    assert update.status == "failed"
    assert update.reason.startswith("invalid task: adaptation candidate 0: ") and detail in update.reason
    assert update.weights == {}


@pytest.mark.parametrize(("hint", "detail"), [
    (Adaptation("width-levels", rates=[]), "'width-levels' adaptation needs 'rates'"),
    (Adaptation("width-levels", rates=[0.5, 2.0]), "rates in (0, 1]"),
    (Adaptation("prune"), "unknown adaptation kind"),
    (Adaptation("ladder"), "'ladder' adaptation needs at least one candidate"),
], ids=repr)
def test_a_malformed_hint_never_reaches_the_runner(make_task, hint, detail):
    """Hints are typed now: the protocol refuses a malformed one when the task arrives (the daemon answers such
    a payload without running it)."""
    with pytest.raises(ProtocolError, match="adaptation") as raised:
        decode(encode(make_task(adaptation=hint)))
    assert detail in str(raised.value)


def test_fails_on_batch_size_below_two(make_task, make_runner):
    update = make_runner().run(make_task(batch_size=1))
    assert update.status == "failed" and "batch_size must be at least 2" in update.reason


def test_fails_on_in_channels_mismatch(make_task, make_runner):
    task = make_task(model=ModelRef("cnn", 10, 3, {"hidden": list(HIDDEN)}))
    update = make_runner().run(task)
    assert update.status == "failed"
    assert "3 input channels" in update.reason and "has 1" in update.reason


def test_fails_on_labels_beyond_num_classes(make_task, make_runner, local_data):
    small = get_family("cnn", 5, 1, hidden=HIDDEN)
    task = make_task(of=small, model=ModelRef("cnn", 5, 1, {"hidden": list(HIDDEN)}))
    update = make_runner(local_data(num_classes=10)).run(task)
    assert update.status == "failed"
    assert "label 9" in update.reason and "5 classes" in update.reason


def test_fails_on_unknown_model_family(make_task, make_runner):
    task = make_task(model=ModelRef("transformer", 10, 1, {}))
    update = make_runner().run(task)
    assert update.status == "failed" and update.reason


def test_failed_and_declined_updates_do_not_touch_the_calibration(make_task, make_runner, tmp_path):
    runner = make_runner(budget=1000)
    runner.run(make_task())  # declined
    runner.run(make_task(spec_dict={"width": 2.0}))  # failed
    assert (runner.calibration.ratios, runner.calibration.floor) == ([], 0.0)
    assert not list((tmp_path / "agent").glob("calibration-*.json"))


def test_task_rejected_carries_status_and_reason():
    exc = TaskRejected("declined", "too big")
    assert (exc.status, exc.reason, str(exc)) == ("declined", "too big", "too big")


def test_task_id_dot_dot_does_not_delete_the_agents_state(make_task, make_runner):
    task = decode(encode(make_task(task_id="..")))  # the protocol accepts '..' as a task id
    runner = make_runner()
    calibration = runner.calibration_for(task.model)
    calibration.observe(10_000_000, 20_000_000)  # a task large enough to learn from: the file exists
    for _ in range(2):  # the first one leaves state_dir/tasks behind, as every task does
        runner.run(task)
    assert runner.data_path.exists()
    assert calibration.path is not None and calibration.path.exists()


# ---------------------------------------------------------------------------------------------- plans
def changed(before: dict[str, np.ndarray], after: dict[str, np.ndarray]) -> set[str]:
    """The keys of ``after`` whose tensors differ from ``before``'s."""
    return {key for key, array in after.items() if not np.array_equal(array, before[key])}


@pytest.mark.parametrize(("spec", "schedule", "epochs", "trained", "steps"), [
    # one segment in the middle, no schedule: block 1 (conv2, bn2) and the final head; block 0 runs frozen
    (SubmodelSpec(segments=((1, 2),)), (), 1, ("conv2", "bn2"), 2),
    # two segments of a half-width model, one stage each as the schedule says (1 epoch, then 2)
    (SubmodelSpec(width=0.5, segments=((0, 1), (1, 2))), (Stage(epochs=1), Stage(epochs=2)), 1,
     ("conv1", "bn1", "conv2", "bn2"), 2 + 4),
    # two segments without a schedule: every stage runs the plan's epochs through the skip path
    (SubmodelSpec(segments=((0, 1), (1, 2))), (), 2, ("conv1", "bn1", "conv2", "bn2"), 4 + 4),
], ids=["one segment", "scheduled", "unscheduled"])
def test_a_depth_wise_task_uploads_only_the_trained_blocks_and_the_head(deep_family, deep_ref, make_deep_task,
                                                                         make_runner, task_plan, spec, schedule,
                                                                         epochs, trained, steps):
    plan = task_plan(epochs=epochs, schedule=schedule)
    task = make_deep_task(spec, plan=plan)
    # The task carries every tensor of the sub-model, frozen blocks included (they run in every stage).
    assert set(task.weights) == set(deep_family.state_keys(spec)) > set(deep_family.trainable_keys(spec))
    runner = make_runner()
    update = runner.run(task)

    assert update.status == "ok", update.reason
    assert update.spec_trained == spec.to_dict()
    expected = {f"{layer}.{kind}" for layer in (*trained, "classifier") for kind in ("weight", "bias")}
    assert set(update.weights) == expected == set(deep_family.trainable_keys(spec))
    assert "conv3.weight" not in update.weights  # block 2 is in no segment: neither trained nor uploaded
    for key, array in update.weights.items():
        assert array.shape == task.weights[key].shape, key
        assert np.isfinite(array).all()
    assert {f"{layer}.weight" for layer in (*trained, "classifier")} <= changed(task.weights, update.weights)
    stage_peaks = {f"stage_peak_bytes.{i}" for i in range(len(spec.segments))}  # one measured peak per segment
    assert set(update.metrics) == OK_METRICS | stage_peaks | heap_metrics(runner)
    assert all(0 < update.metrics[key] <= update.metrics["peak_bytes"] for key in stage_peaks)
    # Where the device's time went: nested intervals, each measured around the next.
    times = update.metrics
    assert 0 < times["seconds"] <= times["seconds_child"]
    assert 0 < times["seconds_decision"] and times["seconds_decision"] + times["seconds_child"] <= times["seconds_task"]
    assert update.metrics["stages"] == float(len(spec.segments))
    assert update.metrics["steps"] == float(steps)
    assert update.metrics["raw_estimate_bytes"] == estimate_plan_memory(deep_family, spec, plan,
                                                                        input_size=(8, 8)).total


@pytest.mark.parametrize(("spec", "schedule", "detail"), [
    (SubmodelSpec(segments=((0, 1), (1, 2))), (Stage(), Stage(), Stage()),
     "the plan schedules 3 stage(s) for the spec's 2 segment(s)."),
    (SubmodelSpec(segments=((0, 2),)), (Stage(), Stage()), "the plan schedules 2 stage(s) for the spec's 1 segment(s)."),
    (SubmodelSpec(width=0.5), (Stage(),),
     "the plan schedules depth-wise stages, but the spec trains the whole model at once."),
], ids=["too many stages", "too few segments", "no segments"])
def test_fails_on_a_schedule_that_does_not_match_the_segments(make_deep_task, make_runner, task_plan, spec, schedule,
                                                              detail):
    runner = make_runner()
    update = runner.run(make_deep_task(spec, plan=task_plan(schedule=schedule)))
    assert update.status == "failed"
    assert update.reason == f"invalid task: {detail}"
    assert update.weights == {} and update.spec_trained is None
    assert runner.remembered_estimates == 0  # refused before anything was estimated or trained
    assert (runner.calibration.ratios, runner.calibration.floor) == ([], 0.0)


def test_a_kd_term_between_two_exits_trains_every_output(deep_family, make_deep_task, make_runner, task_plan):
    spec = SubmodelSpec(exits=(0, 1))
    plan = task_plan(loss=(LossTerm.ce(), LossTerm.ce(output=0), LossTerm.kd(0, 1, weight=0.5, tau=2.0)))
    task = make_deep_task(spec, plan=plan)
    update = make_runner().run(task)
    assert update.status == "ok", update.reason
    assert list(update.weights) == list(deep_family.trainable_keys(spec))
    assert {"exits.0.classifier.weight", "exits.1.classifier.weight"} <= set(update.weights)
    assert changed(task.weights, update.weights) >= {key for key in update.weights if key.endswith(".weight")}
    assert update.metrics["loss"] > 0 and math.isfinite(update.metrics["loss"])


@pytest.mark.parametrize("detach_teacher", [True, False])
def test_a_kd_term_alone_moves_exactly_the_weights_between_its_outputs(deep_family, make_deep_task, make_runner,
                                                                      task_plan, detach_teacher):
    """Only a kd term from exit 0 (the student) towards exit 1 (the teacher), without weight decay: the student's
    path is trained, the teacher's only when it is not detached, and the rest of the model not at all."""
    spec = SubmodelSpec(exits=(0, 1))
    plan = task_plan(weight_decay=0.0,
                     loss=(LossTerm.kd(0, 1, weight=1.0, tau=2.0, detach_teacher=detach_teacher),))
    task = make_deep_task(spec, plan=plan)
    update = make_runner().run(task)
    assert update.status == "ok", update.reason
    assert update.metrics["loss"] > 0

    moved = changed(task.weights, update.weights)
    student = {"conv1.weight", "bn1.weight", "bn1.bias", "exits.0.classifier.weight", "exits.0.classifier.bias"}
    teacher = {"conv2.weight", "bn2.weight", "bn2.bias", "exits.1.classifier.weight", "exits.1.classifier.bias"}
    untouched = {key for key in update.weights if key.startswith(("conv3.", "bn3.", "classifier."))}
    assert len(untouched) == 6
    assert student <= moved
    assert moved.isdisjoint(untouched)  # the final head's output is in no loss term
    if detach_teacher:
        assert moved.isdisjoint(teacher | {"conv2.bias"})
    else:
        assert teacher <= moved


def test_estimates_with_exits_and_kd_terms_are_cached_per_spec_and_plan_without_seed(
        deep_family, deep_ref, make_deep_task, make_runner, decider_for, task_plan):
    spec = SubmodelSpec(width=0.5, rounding="floor", depth=2, exits=(0, 1))
    kd = (LossTerm.ce(output=0, weight=1 / 6), LossTerm.ce(output=1, weight=2 / 6),
          LossTerm.kd(0, 1, weight=0.5 / 6, tau=3.0))
    plan = task_plan(loss=kd, seed=1)
    expected = estimate_plan_memory(deep_family, spec, plan, input_size=(8, 8))
    ce_only = task_plan(loss=kd[:2], seed=1)
    assert estimate_plan_memory(deep_family, spec, ce_only, input_size=(8, 8)) != expected  # the kd term counts

    runner = make_runner()
    decider = decider_for(runner)
    first, again = Option(spec, plan), Option(spec, replace(plan, seed=2))
    assert decider.raw_estimates(deep_ref, [first, again]) == {first: expected, again: expected}
    assert list(decider.made) == [estimate_key(deep_ref, first)]  # one (spec, plan) for both seeds
    assert decider.raw_estimate(deep_ref, spec, replace(plan, seed=7)) == expected
    assert len(decider.made) == 1

    # Anything else about the plan or the spec is another estimate.
    others = [(spec, ce_only), (spec, task_plan(loss=kd[:2] + (replace(kd[2], tau=1.0),))),
              (spec, task_plan(loss=kd, batch_size=4)), (SubmodelSpec(width=0.25, rounding="floor", depth=2,
                                                                      exits=(0, 1)), plan)]
    for other_spec, other_plan in others:
        decider.raw_estimate(deep_ref, other_spec, other_plan)
    assert list(decider.made)[1:] == [estimate_key(deep_ref, Option(*pair)) for pair in others]

    # The runner's tasks for the same spec and plan with another seed are served from one estimate.
    update = runner.run(make_deep_task(spec, plan=replace(plan, seed=11)))
    assert update.status == "ok", update.reason
    assert update.metrics["raw_estimate_bytes"] == expected.total
    assert list(runner.estimates_of(deep_ref)) == [estimate_key(deep_ref, first)]
    update = runner.run(make_deep_task(spec, plan=replace(plan, seed=12), task_id="r2-agent-0001", round_number=2))
    assert update.status == "ok" and update.metrics["raw_estimate_bytes"] == expected.total
    assert list(runner.estimates_of(deep_ref)) == [estimate_key(deep_ref, first)]


# ---------------------------------------------------------------------------------------------- LocalData
@pytest.mark.parametrize(
    ("x", "y"),
    [
        (torch.zeros(4, 8, 8), torch.zeros(4, dtype=torch.long)),  # no channel dimension
        (torch.zeros(4, 1, 8, 8), torch.zeros(3, dtype=torch.long)),  # label count differs
        (torch.zeros(0, 1, 8, 8), torch.zeros(0, dtype=torch.long)),  # empty
    ],
)
def test_local_data_rejects_bad_shapes(x, y):
    with pytest.raises(ValueError, match="N x C x H x W"):
        LocalData(x, y)


def test_local_data_rejects_negative_labels():
    with pytest.raises(ValueError, match="non-negative"):
        LocalData(torch.zeros(3, 1, 8, 8), torch.tensor([0, -1, 2]))


def test_local_data_properties():
    data = LocalData(torch.zeros(3, 2, 6, 5), torch.tensor([4, 1, 4]))
    assert data.labels == [1, 4]
    assert data.image_size == (6, 5) and data.in_channels == 2
    assert data.x.dtype == np.float32 and data.y.dtype == np.int64  # numpy: the agent process holds no torch
    assert data.shape() == DataShape(3, (1, 4), 2, (6, 5))


def test_the_runner_keeps_the_datas_shape_not_the_data(make_runner):
    runner = make_runner(LocalData(np.zeros((3, 1, 8, 8), np.float32), np.array([0, 1, 1])))
    assert runner.data == DataShape(3, (0, 1), 1, (8, 8))



# --------------------------------------------------------------------------- FeDepth's depthwise adaptation
def corrected_cost(family, spec: SubmodelSpec, plan: TrainingPlan) -> int:
    """What a fresh runner's calibration makes of the estimate of training ``spec`` with ``plan``."""
    estimate = raw_estimate(family, spec, plan)
    return Calibration().corrected(estimate.total, estimate.overhead)


def test_depthwise_trains_the_whole_model_when_it_fits(deep_family, make_deep_task, make_runner, task_plan):
    plan = task_plan()
    whole = corrected_cost(deep_family, SubmodelSpec.full(), plan)
    update = make_runner(budget=whole + 1000).run(
        make_deep_task(SubmodelSpec.full(), plan=plan, adaptation=Adaptation("depthwise")))
    assert update.status == "ok" and update.spec_trained == SubmodelSpec.full().to_dict(), update.reason
    assert "stage_peak_bytes.0" not in update.metrics


def test_depthwise_cuts_the_fewest_segments_that_fit(deep_family, make_deep_task, make_runner, task_plan):
    plan = task_plan()
    cost = {(a, b): corrected_cost(deep_family, SubmodelSpec(segments=((a, b),)), plan)
            for a in range(3) for b in range(a + 1, 4)}
    assert cost[(0, 2)] < cost[(0, 3)]
    budget = (cost[(0, 2)] + cost[(0, 3)]) // 2  # blocks 0-1 fit together, all three do not
    update = make_runner(budget=budget).run(
        make_deep_task(SubmodelSpec.full(), plan=plan, adaptation=Adaptation("depthwise")))
    assert update.status == "adapted", update.reason
    assert update.spec_trained == SubmodelSpec(segments=((0, 2), (2, 3))).to_dict()
    assert update.reason.startswith("trained depth-wise, blocks 0-1 | 2 via the skip path; frozen blocks recomputed "
                                    "every batch in stage 2 (one epoch a stage), to fit ")
    assert set(update.weights) == set(deep_family.trainable_keys(SubmodelSpec.full()))  # every block trained
    assert update.metrics["stages"] == 2.0
    assert {"stage_peak_bytes.0", "stage_peak_bytes.1"} <= set(update.metrics)
    assert update.metrics["estimated_bytes"] <= budget


#: A three-block CNN whose first block (16 channels at full resolution) is far dearer to train than the two after
#: it (4 channels at a quarter and a sixteenth of the pixels), whatever the CPU's oneDNN blocking pads 4 channels to.
WIDE_FIRST = (16, 4, 4)


def wide_first_task(make_task, plan, adaptation: Adaptation):
    family = get_family("cnn", 10, 1, hidden=WIDE_FIRST)
    return family, make_task(SubmodelSpec.full(), of=family, model=ModelRef("cnn", 10, 1, {"hidden": list(WIDE_FIRST)}),
                             plan=plan, adaptation=adaptation)


def test_depthwise_skips_the_input_side_blocks_that_fit_nowhere(make_task, make_runner, task_plan):
    plan = task_plan()
    family, task = wide_first_task(make_task, plan, Adaptation("depthwise"))  # no micro-batches
    cost = {(a, b): corrected_cost(family, SubmodelSpec(segments=((a, b),)), plan) for a, b in ((0, 1), (1, 3))}
    budget = cost[(0, 1)] - 1
    assert cost[(1, 3)] <= budget  # blocks 1-2 together cost less than block 0 alone
    update = make_runner(budget=budget).run(task)
    assert update.status == "adapted", update.reason
    assert update.spec_trained == SubmodelSpec(segments=((1, 3),)).to_dict()
    assert "(skipped 0)" in update.reason and update.metrics["skipped_blocks"] == 1.0
    assert "conv1.weight" not in update.weights and "conv2.weight" in update.weights  # skipped: not uploaded


def test_depthwise_trains_a_block_that_fits_nowhere_whole_in_micro_batches(make_task, make_runner, task_plan):
    plan = task_plan()  # batch 8: micro-batches of 4, then 2
    family, task = wide_first_task(make_task, plan, Adaptation("depthwise", min_micro_batch=2))
    whole = corrected_cost(family, SubmodelSpec(segments=((0, 1),)), plan)
    budget = whole - 1
    micro = {m: corrected_cost(family, SubmodelSpec(segments=((0, 1),)), replace(plan, schedule=(
        Stage(micro_batch=m),))) for m in (4, 2)}
    assert micro[2] <= micro[4] <= budget  # half the batch's activations fit where the whole batch's did not
    update = make_runner(budget=budget).run(task)
    assert update.status == "adapted", update.reason
    assert update.spec_trained == SubmodelSpec(segments=((0, 1), (1, 3))).to_dict()
    assert "blocks 0 (micro-batches of 4) | 1-2 via the skip path" in update.reason
    assert update.metrics["micro_batched_stages"] == 1.0 and update.metrics["skipped_blocks"] == 0.0
    assert update.metrics["estimated_bytes"] <= budget
    assert "conv1.weight" in update.weights  # every block trained and uploaded
    # A floor above the batch's half leaves no micro-batch to try: the block is skipped as before.
    _, floored = wide_first_task(make_task, plan, Adaptation("depthwise", min_micro_batch=5))
    assert "(skipped 0)" in make_runner(budget=budget, name="floored").run(floored).reason


HEAD_ONLY = SubmodelSpec(segments=((3, 3),))  # the head alone on the frozen output of the deep CNN's three blocks


def test_depthwise_trains_the_head_alone_exactly_where_no_block_fits(deep_family, make_deep_task, make_runner,
                                                                      task_plan):
    plan = task_plan()
    smallest = min(corrected_cost(deep_family, SubmodelSpec(segments=((b, b + 1),)), plan) for b in range(3))
    head = corrected_cost(deep_family, HEAD_ONLY, plan)
    assert head < smallest  # on a CPU the frozen body runs from the received weights: only the head is copied
    task = make_deep_task(SubmodelSpec.full(), plan=plan, adaptation=Adaptation("depthwise", head_alone=True))
    update = make_runner(budget=smallest - 1).run(task)
    assert update.status == "adapted", update.reason
    assert update.spec_trained == HEAD_ONLY.to_dict()
    assert update.reason.startswith("trained the head alone on the frozen output of blocks 0-2 (no block fits "
                                    "alone); frozen blocks recomputed every batch")
    assert update.metrics["head_only"] == 1.0 and update.metrics["skipped_blocks"] == 3.0
    assert update.metrics["estimated_bytes"] <= smallest - 1
    assert set(update.weights) == set(deep_family.head_keys())  # only what it trained goes up
    assert changed(task.weights, update.weights) == set(deep_family.head_keys())
    # Where a block fits, it trains that block, never the head alone.
    fits = make_runner(budget=smallest, name="fits").run(task)
    assert fits.status == "adapted" and fits.metrics["head_only"] == 0.0 and "blocks" in fits.reason, fits.reason
    # A task that does not offer the head alone (a coordinator that predates it) is declined instead.
    older = make_runner(budget=smallest - 1, name="older").run(
        make_deep_task(SubmodelSpec.full(), plan=plan, adaptation=Adaptation("depthwise")))
    assert older.status == "declined" and older.weights == {}
    assert "no block fits alone, the smallest needs" in older.reason and "head alone" not in older.reason


def test_depthwise_declines_when_not_even_the_head_fits_alone(deep_family, make_deep_task, make_runner, task_plan):
    plan = task_plan()
    smallest = min(corrected_cost(deep_family, spec, plan)
                   for spec in (HEAD_ONLY, *(SubmodelSpec(segments=((b, b + 1),)) for b in range(3))))
    assert smallest == corrected_cost(deep_family, HEAD_ONLY, plan)
    update = make_runner(budget=smallest - 1).run(
        make_deep_task(SubmodelSpec.full(), plan=plan, adaptation=Adaptation("depthwise", head_alone=True)))
    assert update.status == "declined"
    assert "no block fits alone, nor the head alone on the frozen blocks, the smallest needs" in update.reason
    assert update.weights == {}


def test_depthwise_buffers_the_frozen_outputs_of_a_stage_of_several_epochs_when_they_fit(
        deep_family, make_deep_task, make_runner, task_plan):
    plan = task_plan(epochs=2)
    cost = {(a, b): corrected_cost(deep_family, SubmodelSpec(segments=((a, b),)), plan) for a, b in ((0, 2), (0, 3))}
    budget = (cost[(0, 2)] + cost[(0, 3)]) // 2  # blocks 0-1, then block 2 on their buffered outputs
    update = make_runner(budget=budget).run(
        make_deep_task(SubmodelSpec.full(), plan=plan, adaptation=Adaptation("depthwise")))
    assert update.status == "adapted", update.reason
    assert update.spec_trained == SubmodelSpec(segments=((0, 2), (2, 3))).to_dict()
    assert "via the skip path; frozen blocks' outputs buffered in stage 2, to fit" in update.reason
    assert update.metrics["cached_stages"] == 1.0 and update.metrics["stages"] == 2.0
    buffered = estimate_plan_memory(deep_family, SubmodelSpec(segments=((2, 3),)),
                                    replace(plan, schedule=(Stage(2, cache=True),)), input_size=(8, 8), samples=16)
    assert buffered.cache > 0  # the 16 samples' outputs of block 1
    assert update.metrics["estimated_bytes"] <= budget


@pytest.mark.slow
def test_depthwise_recomputes_the_frozen_blocks_when_their_buffer_does_not_fit(
        deep_family, make_deep_task, make_runner, task_plan, local_data):
    plan = task_plan(epochs=2)
    data = local_data(n=4096)  # block 1's outputs of 4096 samples outweigh the budget
    cost = {(a, b): corrected_cost(deep_family, SubmodelSpec(segments=((a, b),)), plan) for a, b in ((0, 2), (0, 3))}
    budget = (cost[(0, 2)] + cost[(0, 3)]) // 2
    update = make_runner(data, budget=budget).run(
        make_deep_task(SubmodelSpec.full(), plan=plan, adaptation=Adaptation("depthwise")))
    assert update.status == "adapted", update.reason
    assert update.spec_trained == SubmodelSpec(segments=((0, 2), (2, 3))).to_dict()
    assert "; frozen blocks recomputed every batch in stage 2 (buffering needs " in update.reason
    assert update.metrics["cached_stages"] == 0.0


def test_depthwise_through_auxiliary_classifiers_trains_the_exit_closing_each_segment(
        deep_family, make_deep_task, make_runner, task_plan):
    plan = task_plan()
    sent = SubmodelSpec(exits=(0, 1))  # an auxiliary classifier after every block but the last

    def cost(a: int, b: int) -> int:
        exits = (b - 1,) if b < 3 else ()
        return corrected_cost(deep_family, SubmodelSpec(exits=exits, segments=((a, b),)),
                              replace(plan, schedule=(Stage(1, "exit"),)))

    budget = (cost(0, 2) + cost(0, 3)) // 2
    update = make_runner(budget=budget).run(
        make_deep_task(sent, plan=plan, adaptation=Adaptation("depthwise", route="exit")))
    trained = SubmodelSpec(exits=(1,), segments=((0, 2), (2, 3)))
    assert update.status == "adapted", update.reason
    assert update.spec_trained == trained.to_dict()
    assert "blocks 0-1 | 2 via auxiliary classifiers" in update.reason
    assert set(update.weights) == set(deep_family.trainable_keys(trained))
    exit_keys = set(deep_family.state_keys(SubmodelSpec(exits=(1,)))) - set(deep_family.state_keys())
    assert exit_keys and exit_keys <= set(update.weights)  # the classifier of segment 0-1 trained and uploaded
    assert not set(update.weights) - set(deep_family.state_keys(sent))


def test_depthwise_through_auxiliary_classifiers_trains_whole_through_the_models_own_head(
        deep_family, make_deep_task, make_runner, task_plan):
    plan = task_plan()
    whole = corrected_cost(deep_family, SubmodelSpec.full(), plan)
    update = make_runner(budget=whole + 1000).run(
        make_deep_task(SubmodelSpec(exits=(0, 1)), plan=plan, adaptation=Adaptation("depthwise", route="exit")))
    assert update.status == "ok", update.reason
    assert update.spec_trained == SubmodelSpec.full().to_dict()  # the auxiliary classifiers are not trained
    assert set(update.weights) == set(deep_family.trainable_keys(SubmodelSpec.full()))


# ---------------------------------------------------------------------------------------------- limits
@pytest.mark.parametrize(("limits", "task_args", "said"), [
    ({"max_epochs": 3}, {"epochs": 4}, "task refused: it trains 4 epochs, more than limits.max_epochs 3"),
    ({"max_steps": 5}, {"epochs": 3}, "task refused: it takes 6 steps on the local data, more than limits.max_steps 5"),
    ({"max_deadline_s": 60.0}, {"deadline_in": 7200.0},
     "task refused: its deadline lies 2.0 h ahead, more than limits.max_deadline_s 60 s"),
    ({"max_parameters": 100}, {}, "task refused: its model has "),
], ids=["epochs", "steps", "deadline", "parameters"])
def test_a_task_beyond_the_agents_limits_is_declined_before_training(make_task, make_runner, limits, task_args,
                                                                     said):
    runner = make_runner(limits=TaskLimits(**limits))  # 16 local samples, batch 8: 2 steps an epoch
    deadline_in = task_args.pop("deadline_in", 600.0)
    update = runner.run(make_task(SubmodelSpec.full(), deadline=time.time() + deadline_in, **task_args))
    assert update.status == "declined" and update.reason.startswith(said), update.reason
    assert update.weights == {} and runner.child_pid is None


def test_depth_wise_epochs_count_once_per_block_against_the_limits(make_deep_task, make_runner, task_plan):
    from edge_agent.config import TaskLimits

    runner = make_runner(limits=TaskLimits(max_epochs=5))
    update = runner.run(make_deep_task(SubmodelSpec.full(), plan=task_plan(epochs=2),
                                       adaptation=Adaptation("depthwise")))
    assert update.reason == "task refused: it trains 6 epochs, more than limits.max_epochs 5"  # 3 blocks x 2


def test_a_task_is_handed_to_its_children_as_the_message_it_came_as(make_task, make_runner):
    """The agent passes the payload it received (either protocol version): the children read that, the runner
    encodes nothing."""
    from protocol import encode

    task = make_task(SubmodelSpec.uniform(0.5))
    update = make_runner().run(task, encode(task, version=1))
    assert update.status == "ok", update.reason
    assert set(update.weights) == set(task.weights)
