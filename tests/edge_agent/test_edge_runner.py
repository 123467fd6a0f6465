"""TaskRunner: a task in, an update out (ok, declined or failed with a reason); LocalData validation.

Fixtures (family, make_task, make_runner, local_data) come from conftest.py: a tiny CNN (hidden 4, 8) on
8x8 one-channel inputs, 16 samples, batch size 8, so one epoch is two steps.
"""

from __future__ import annotations

import json
import math
import time

import numpy as np
import pytest
import torch

from edge_agent import child
from edge_agent import runner as runner_module
from edge_agent.calibration import Calibration
from edge_agent.runner import LocalData, TaskRejected, TaskRunner
from models import SubmodelSpec, get_family
from protocol import ModelRef, decode, encode

HIDDEN = (4, 8)
MEMORY_KEYS = {"estimated_bytes", "raw_estimate_bytes", "budget_bytes", "calibration"}
OK_METRICS = {"loss", "steps", "seconds", "peak_bytes"} | MEMORY_KEYS
WIDTH_LEVELS = {"kind": "width-levels", "rates": [1.0, 0.5, 0.25]}


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


def raw_estimate(family, spec: SubmodelSpec, batch_size: int = 8, momentum: float = 0.9):
    """What the runner should ask the estimator for: 8x8 inputs, one optimizer slot with momentum, CPU."""
    return family.training_memory_estimate(spec, batch_size=batch_size, input_size=(8, 8),
                                           optimizer_slots=1 if momentum > 0 else 0, device="cpu")


# ---------------------------------------------------------------------------------------------- ok
@pytest.mark.parametrize("rate", [1.0, 0.25])
def test_valid_task_returns_ok_update_with_trained_weights(family, make_task, make_runner, tmp_path, rate):
    spec = SubmodelSpec.uniform(rate)
    # The hint allows shrinking, but the sent spec fits: the runner trains exactly what was sent.
    task = make_task(spec, adaptation=WIDTH_LEVELS)
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
    assert set(metrics) == OK_METRICS
    assert all(math.isfinite(v) for v in metrics.values())
    assert metrics["steps"] == 2.0
    assert metrics["loss"] > 0 and metrics["seconds"] > 0
    estimate = raw_estimate(family, spec)
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


def test_raw_estimate_matches_family_memory_model(family, model_ref, make_runner):
    runner = make_runner()
    spec = SubmodelSpec.uniform(0.5)
    with_momentum = runner.raw_estimate(model_ref, spec, 8, 0.9)
    assert with_momentum == raw_estimate(family, spec, 8, 0.9)
    without = runner.raw_estimate(model_ref, spec, 8, 0.0)
    assert without == raw_estimate(family, spec, 8, 0.0)
    assert without.optimizer_state == 0 < with_momentum.optimizer_state
    assert without.total < with_momentum.total


def test_estimates_are_made_in_a_child_once_per_spec(family, model_ref, make_runner, monkeypatch):
    runner = make_runner()
    made: list[list[SubmodelSpec]] = []
    estimate_in_child = runner_module.child.estimate_in_child

    def recording(model, specs, **kwargs):
        made.append(list(specs))
        return estimate_in_child(model, specs, **kwargs)

    monkeypatch.setattr(runner_module.child, "estimate_in_child", recording)
    half, quarter = SubmodelSpec.uniform(0.5), SubmodelSpec.uniform(0.25)
    first = runner.raw_estimates(model_ref, [half, quarter, half], 8, 0.9)
    assert first == {half: raw_estimate(family, half), quarter: raw_estimate(family, quarter)}
    assert runner.raw_estimates(model_ref, [quarter], 8, 0.9) == {quarter: first[quarter]}
    assert made == [[half, quarter]]  # one child for both, nothing again for a spec already estimated
    runner.raw_estimate(model_ref, half, 16, 0.9)  # another batch size is another estimate
    assert made == [[half, quarter], [half]]


def test_family_is_cached_per_model_ref(make_runner):
    runner = make_runner()
    ref = ModelRef("cnn", 10, 1, {"hidden": list(HIDDEN)})
    assert runner.family_for(ref) is runner.family_for(ModelRef("cnn", 10, 1, {"hidden": list(HIDDEN)}))
    assert runner.family_for(ref) is not runner.family_for(ModelRef("cnn", 10, 1, {"hidden": [4, 4]}))


def test_available_uses_the_budget_for_the_round(make_runner):
    seen = []

    def budget(round_number: int) -> int:
        seen.append(round_number)
        return 12_345 * round_number

    runner = make_runner(budget=budget)
    assert runner.available(3) == 3 * 12_345
    assert seen == [3]


def test_state_dir_holds_the_data_file_and_calibration(make_runner, tmp_path):
    data = LocalData(torch.randn(4, 1, 8, 8), torch.tensor([0, 1, 2, 1]))
    runner = make_runner(data)
    assert runner.state_dir == tmp_path / "agent"
    assert runner.data_path == tmp_path / "agent" / "local-data.npz"
    with np.load(runner.data_path, allow_pickle=False) as archive:
        np.testing.assert_array_equal(archive["x"], data.x.numpy())
        np.testing.assert_array_equal(archive["y"], data.y.numpy())
    assert runner.calibration.path == tmp_path / "agent" / "calibration-cpu-compact.json"
    # CPU peaks move by a fraction of a MB between identical runs: tasks that small do not calibrate.
    assert runner.calibration.resolution == child.CPU_PEAK_RESOLUTION_BYTES > 0
    runner.close()
    assert runner.data_path.exists()  # close() leaves a state_dir it was given alone


def test_runner_loads_the_calibration_learnt_before(make_runner, tmp_path):
    Calibration(tmp_path / "agent" / "calibration-cpu-compact.json").observe(1000, 3000)
    runner = make_runner()
    assert runner.calibration.factor == pytest.approx(3.0 * 1.05)


@pytest.mark.parametrize("allocator", ["compact", "default"])
def test_runner_estimates_for_the_heap_its_children_run(family, model_ref, make_runner, tmp_path, allocator):
    runner = make_runner(allocator=allocator)
    assert runner.allocator == allocator  # glibc here: "compact" is available
    spec = SubmodelSpec.uniform(0.5)
    expected = family.training_memory_estimate(spec, batch_size=8, input_size=runner.data.image_size,
                                               allocator=allocator)
    assert runner.raw_estimate(model_ref, spec, 8, 0.9) == expected
    # A factor learnt under one heap setting says nothing about the other: one file per setting.
    assert runner.calibration.path == tmp_path / "agent" / f"calibration-cpu-{allocator}.json"


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


# ---------------------------------------------------------------------------------------------- declined
def test_declines_when_budget_below_estimate(family, make_task, make_runner):
    update = make_runner(budget=1000).run(make_task())
    assert update.status == "declined"
    assert update.reason.startswith("nothing fits the ")
    assert "width=0.5" in update.reason  # names what it tried
    assert update.weights == {} and update.num_samples == 16 and update.spec_trained is None


def test_declines_when_corrected_estimate_exceeds_budget_although_raw_fits(family, make_task, make_runner):
    estimate = raw_estimate(family, SubmodelSpec.uniform(0.5))
    corrected = Calibration().corrected(estimate.total, estimate.overhead)
    assert corrected > estimate.total
    # raw estimate < budget < corrected estimate: the calibration factor is what makes it decline
    update = make_runner(budget=(estimate.total + corrected) // 2).run(make_task())
    assert update.status == "declined", update.reason
    assert "nothing fits" in update.reason


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


@pytest.mark.parametrize(("hint", "detail"), [
    ({"kind": "width-levels", "rates": []}, "'rates'"),
    ({"kind": "width-levels", "rates": [0.5, 2.0]}, "'rates'"),
    ({"kind": "prune"}, "unknown adaptation kind 'prune'"),
])
def test_fails_on_invalid_adaptation_hint(make_task, make_runner, hint, detail):
    update = make_runner().run(make_task(adaptation=hint))
    assert update.status == "failed"
    assert update.reason.startswith("invalid task: ") and detail in update.reason


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
    assert not (tmp_path / "agent" / "calibration-cpu-compact.json").exists()


def test_task_rejected_carries_status_and_reason():
    exc = TaskRejected("declined", "too big")
    assert (exc.status, exc.reason, str(exc)) == ("declined", "too big", "too big")


def test_task_id_dot_dot_does_not_delete_the_agents_state(make_task, make_runner):
    task = decode(encode(make_task(task_id="..")))  # the protocol accepts '..' as a task id
    runner = make_runner()
    runner.calibration.observe(10_000_000, 20_000_000)  # a task large enough to learn from: the file exists
    for _ in range(2):  # the first one leaves state_dir/tasks behind, as every task does
        runner.run(task)
    assert runner.data_path.exists()
    assert runner.calibration.path is not None and runner.calibration.path.exists()


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

