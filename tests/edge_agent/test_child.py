"""Training in a child process: peak-RSS helpers, run_in_child's outcomes, and the runner surviving a kill."""

from __future__ import annotations

import json
import math
import mmap
import os
import signal
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from edge_agent import allocator, child, forkserver
from edge_agent.calibration import Calibration
from edge_agent.child import peak_rss_bytes, reset_peak_rss, rss_bytes
from edge_agent.config import TaskLimits
from edge_agent.forkserver import ChildOutcome
from edge_agent.forkserver import run_training as run_in_child
from edge_agent.oom import OomCount
from edge_agent.runner import LocalData
from edge_agent.workdir import PLAN_FILE, TASK_FILE, UPDATE_FILE, write_message
from models import SubmodelSpec, estimate_plan_memory, get_family
from protocol import LossTerm, ModelRef, Stage, Task, TrainingPlan, Update, decode, encode, payload_version

U = SubmodelSpec.uniform
MIB = 2**20
LONG = 100_000  # epochs: a task that is still running whenever it gets killed
ENDLESS = TaskLimits(max_epochs=LONG, max_steps=10**9)  # an agent that accepts such a task


# ---------------------------------------------------------------------------------------------- helpers
def write_workdir(directory: Path, task, data, spec: SubmodelSpec | None = None, **plan_overrides) -> Path:
    """A task work directory the way the runner writes it: task.msgpack, plan.json and the data .npz."""
    directory.mkdir(parents=True)
    data_path = directory.parent / f"{directory.name}-data.npz"
    np.savez(data_path, x=data.x, y=data.y)
    (directory / TASK_FILE).write_bytes(encode(task))
    plan = {"spec": (spec or U(0.5)).to_dict(), "device": "cpu", "labels": data.labels,
            "data_path": str(data_path), "copies_dir": str(directory.parent / f"{directory.name}-copies"),
            "torch_threads": 1, "allocator": "compact"}
    plan.update(plan_overrides)
    (directory / PLAN_FILE).write_text(json.dumps(plan))
    return directory


@pytest.fixture
def workdir_for(tmp_path, local_data):
    def write(task, spec: SubmodelSpec | None = None, **plan_overrides) -> Path:
        return write_workdir(tmp_path / "work", task, local_data(), spec, **plan_overrides)

    return write


@pytest.fixture(scope="module")
def trained(tmp_path_factory, make_task, local_data):
    """One real training child, shared by the tests that inspect its outcome (children cost seconds)."""
    spec = U(0.5)
    task = make_task(spec)
    workdir = write_workdir(tmp_path_factory.mktemp("child") / "work", task, local_data(), spec)
    started: list[int] = []
    outcome = run_in_child(workdir, 120, on_start=started.append)
    return task, spec, workdir, started, outcome


def parent_pid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


# ---------------------------------------------------------------------------------------------- RSS
def test_rss_and_peak_are_sane():
    current, peak = rss_bytes(), peak_rss_bytes()
    assert current > MIB
    assert peak >= current
    assert peak < 64 * 2**30  # bytes, not kilobytes mistaken for bytes


def test_reset_peak_rss_drops_the_high_water_mark():
    """A mapping of its own, not the heap: whether ``free`` gives a heap block back depends on what earlier code
    left in the test process's heap. glibc serves a request from any free chunk that fits before it maps a
    block of its own, so a 96 MiB array landing in a hole of free chunks stays resident when freed (an array
    did, after a test that left ~200 MB of them: ``tests/common/test_heap.py``'s trim check, now in a process
    of its own)."""
    before = rss_bytes()
    block = mmap.mmap(-1, 96 * MIB)
    for offset in range(0, 96 * MIB, mmap.PAGESIZE):  # touched: really resident
        block[offset] = 1
    assert peak_rss_bytes() >= before + 90 * MIB
    block.close()
    high = peak_rss_bytes()
    assert reset_peak_rss() is True
    after = peak_rss_bytes()
    assert after < high - 64 * MIB  # the 96 MiB block no longer counts
    assert after >= rss_bytes() - MIB


@pytest.mark.parametrize(("exitcode", "name"), [
    (-signal.SIGKILL, "SIGKILL"), (-signal.SIGTERM, "SIGTERM"), (-200, "signal 200"), (1, None), (0, None),
    (None, None),
])
def test_killed_by(exitcode, name):
    assert ChildOutcome(None, exitcode, None).killed_by == name


# ---------------------------------------------------------------------------------------------- run_in_child
def test_run_in_child_returns_an_encoded_update(trained):
    task, spec, workdir, started, outcome = trained
    assert outcome.error is None, outcome.error
    assert (outcome.exitcode, outcome.killed_by) == (0, None)
    assert len(started) == 1 and started[0] != os.getpid()
    assert outcome.update == (workdir / UPDATE_FILE).read_bytes()
    update = decode(outcome.update, expected=Update)
    assert isinstance(update, Update)
    assert (update.task_id, update.round, update.agent_id, update.status) == (task.task_id, 1, "agent", "ok")
    assert update.spec_trained == spec.to_dict()
    assert update.num_samples == 16 and update.labels == list(range(10))
    assert set(update.weights) == set(task.weights)
    for key, array in update.weights.items():
        assert array.shape == task.weights[key].shape and array.dtype == np.float32
    assert any(not np.array_equal(update.weights[k], task.weights[k]) for k in task.weights)  # trained
    assert set(update.metrics) == {"loss", "steps", "seconds", "stages", "peak_bytes"}
    assert update.metrics["steps"] == 2.0 and update.metrics["stages"] == 1.0
    assert update.metrics["peak_bytes"] > 0
    assert payload_version(outcome.update) == 2  # written straight from its arrays (write_message)


def test_a_tasks_read_only_weights_load_into_a_model_without_a_warning(make_task, tmp_path):
    task = make_task(U(0.5))
    decoded = decode(encode(task), expected=Task)
    assert isinstance(decoded, Task)
    assert not any(array.flags.writeable for array in decoded.weights.values())  # views on the payload
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tensors = child._tensors_to_load(decoded.weights)
    for key, tensor in tensors.items():
        assert np.shares_memory(tensor.numpy(), decoded.weights[key])  # no copy: load_state_dict copies them
    family = get_family(task.model.family, task.model.num_classes, task.model.in_channels, **task.model.options)
    model = family.build(U(0.5), track_bn_stats=False)
    model.load_state_dict(tensors, strict=True)
    for key, value in model.state_dict().items():
        np.testing.assert_array_equal(value.numpy(), decoded.weights[key])
    path = tmp_path / "update.msgpack"
    update = Update(task.task_id, 1, "agent", "ok", None, 3, [0], dict(decoded.weights), {"loss": 0.5})
    write_message(path, update)
    assert path.read_bytes() == encode(update)
    write_message(path, memoryview(encode(task)))  # an encoded message is written as it came
    assert path.read_bytes() == encode(task)


def test_child_refuses_a_plan_for_another_spec_than_its_task(make_task, workdir_for):
    # The runner cuts an adapted spec's weights before it writes the task: a mismatch is a bug, not a guess.
    outcome = run_in_child(workdir_for(make_task(U(0.5)), U(0.25)), 60)
    assert outcome.update is None and outcome.exitcode == 1
    assert "the plan says {'width': 0.25}, the task holds weights for {'width': 0.5}" in outcome.error


@pytest.mark.skipif(not allocator.compact_supported(), reason="needs glibc's mallopt")
def test_child_runs_the_heap_its_plan_names(make_task, tmp_path):
    """The estimate is made for the plan's heap: a compact child peaks near it, a pooled one too (the pages it
    keeps never exceed the live high-water mark), a default one well above."""
    family = get_family("cnn", 10, 1)  # the full-size CNN at 28 x 28: batch tensors of megabytes
    spec = U(0.5)
    task = make_task(spec, model=ModelRef("cnn", 10, 1, {}), of=family, batch_size=64)
    data = LocalData(torch.randn(256, 1, 28, 28), torch.arange(256) % 10)
    peaks = {}
    pooled = allocator.resolve("pooled") == "pooled"
    for heap in ("compact", "default") + (("pooled",) if pooled else ()):
        outcome = run_in_child(write_workdir(tmp_path / heap, task, data, spec, allocator=heap), 120)
        assert outcome.update is not None, outcome.error
        metrics = decode(outcome.update, expected=Update).metrics
        peaks[heap] = metrics["peak_bytes"]
        assert metrics.get("pooled_heap") == (1.0 if heap == "pooled" else None), metrics
    estimate = estimate_plan_memory(family, spec, task.plan, input_size=(28, 28), allocator="compact").total
    assert 0.85 <= estimate / peaks["compact"] <= 1.15, (estimate, peaks)
    assert peaks["default"] > 1.1 * peaks["compact"], peaks
    if pooled:
        assert estimate_plan_memory(family, spec, task.plan, input_size=(28, 28), allocator="pooled").total == estimate
        assert 0.85 <= estimate / peaks["pooled"] <= 1.15, (estimate, peaks)


def test_children_fork_from_a_server_that_has_torch_loaded(make_task, workdir_for):
    """The agent stays warm: the forkserver imported torch once, children do not import it again."""
    workdir = workdir_for(make_task(epochs=LONG))
    servers: list[bool] = []

    def inspect(pid: int) -> None:
        maps = Path(f"/proc/{parent_pid(pid)}/maps").read_text()
        servers.append("libtorch" in maps)

    outcome = run_in_child(workdir, 1.0, on_start=inspect)
    assert outcome.killed_by == "SIGKILL"  # stopped by the timeout; only the server was of interest
    assert servers == [True]


def test_a_child_may_use_more_threads_than_the_warmed_up_server(make_task, tmp_path):
    """The forkserver ran a warm-up step with one thread; a child asking for two must still train."""
    generator = torch.Generator().manual_seed(0)  # 32x32 inputs: big enough for intra-op threads to engage
    big = LocalData(torch.randn(32, 1, 32, 32, generator=generator), torch.arange(32) % 10)
    task = make_task()
    workdir = write_workdir(tmp_path / "work", task, big, torch_threads=2)
    outcome = run_in_child(workdir, 60)
    assert (outcome.exitcode, outcome.error) == (0, None)
    update = decode(outcome.update, expected=Update)
    assert update.num_samples == 32 and update.metrics["steps"] == 4.0


def test_a_child_killed_with_sigkill_has_no_update(make_task, workdir_for, kill_when_busy):
    workdir = workdir_for(make_task(epochs=LONG))
    killed: list[bool] = []
    started = time.monotonic()
    outcome = run_in_child(workdir, 120, on_start=lambda pid: killed.append(kill_when_busy(pid)))
    assert killed == [True]  # it was killed while working, not after finishing
    assert outcome == ChildOutcome(update=None, exitcode=-signal.SIGKILL, error=None)
    assert outcome.killed_by == "SIGKILL"
    assert not (workdir / UPDATE_FILE).exists()
    assert time.monotonic() - started < 60


@pytest.mark.parametrize("breakage", ["data file missing", "plan missing", "task garbage"])
def test_a_broken_plan_gives_exit_code_1_and_the_error(make_task, workdir_for, tmp_path, breakage):
    missing = tmp_path / "no-such-data.npz"
    if breakage == "data file missing":
        workdir = workdir_for(make_task(), data_path=str(missing))
        expected = ["FileNotFoundError", str(missing)]
    elif breakage == "plan missing":
        workdir = workdir_for(make_task())
        (workdir / PLAN_FILE).unlink()
        expected = ["FileNotFoundError", PLAN_FILE]
    else:
        workdir = workdir_for(make_task())
        (workdir / TASK_FILE).write_bytes(b"\x00 not msgpack")
        expected = ["ProtocolError"]
    outcome = run_in_child(workdir, 60)
    assert outcome.update is None
    assert (outcome.exitcode, outcome.killed_by) == (1, None)
    assert outcome.error is not None
    first_line = outcome.error.splitlines()[0]
    for text in expected:
        assert text in first_line, outcome.error
    assert not (workdir / UPDATE_FILE).exists()


def test_a_timeout_kills_the_child_and_says_so(make_task, workdir_for):
    workdir = workdir_for(make_task(epochs=LONG))
    pids: list[int] = []
    started = time.monotonic()
    outcome = run_in_child(workdir, 1.0, on_start=pids.append)
    elapsed = time.monotonic() - started
    assert outcome.update is None
    assert outcome.killed_by == "SIGKILL"
    assert outcome.error == "training did not finish within 1 s"
    assert 1.0 <= elapsed < 15
    assert not Path(f"/proc/{pids[0]}").exists()  # killed and reaped


def test_a_child_trains_a_depth_wise_task_and_uploads_only_what_it_trained(make_task, tmp_path, local_data,
                                                                          task_plan):
    family = get_family("cnn", 10, 1, hidden=(4, 8, 8))
    spec = SubmodelSpec(segments=((0, 1), (2, 3)))
    plan = task_plan(schedule=(Stage(epochs=2), Stage(epochs=1)))
    task = make_task(spec, of=family, model=ModelRef("cnn", 10, 1, {"hidden": [4, 8, 8]}), plan=plan)
    outcome = run_in_child(write_workdir(tmp_path / "work", task, local_data(), spec), 120)
    assert outcome.update is not None, outcome.error
    update = decode(outcome.update, expected=Update)
    assert list(update.weights) == list(family.trainable_keys(spec))
    assert {key.split(".")[0] for key in update.weights} == {"conv1", "bn1", "conv3", "bn3", "classifier"}
    assert (update.metrics["stages"], update.metrics["steps"]) == (2.0, 4.0 + 2.0)


def test_a_child_trains_a_task_distilling_from_nested_sub_models(make_task, tmp_path, local_data, task_plan, family):
    # FlexFL: a per-layer-width spec distils from two narrower specs nested in it, cut from its current weights.
    spec = SubmodelSpec(layer_widths={"conv1": 1.0, "conv2": 0.75}, rounding="floor")
    teachers = [SubmodelSpec(layer_widths={"conv1": 0.5, "conv2": 0.5}, rounding="floor"), U(0.25, "floor")]
    plan = task_plan(loss=(LossTerm.ce(), *(LossTerm.nested_kd(t.to_dict(), weight=10.0 / 2, tau=3.0)
                                            for t in teachers)))
    task = make_task(spec, plan=plan)
    outcome = run_in_child(write_workdir(tmp_path / "work", task, local_data(), spec), 120)
    assert outcome.update is not None, outcome.error
    update = decode(outcome.update, expected=Update)
    assert update.status == "ok" and list(update.weights) == list(family.state_keys(spec))
    assert any(not np.array_equal(update.weights[k], task.weights[k]) for k in task.weights)  # trained
    assert math.isfinite(update.metrics["loss"]) and update.metrics["peak_bytes"] > 0


# ---------------------------------------------------------------------------------------------- warm-up
def test_warm_up_runs_every_stage_of_the_plan_once_at_learning_rate_zero(monkeypatch):
    family = get_family("cnn", 10, 1, hidden=(4, 8, 8))
    spec = SubmodelSpec(exits=(0,), segments=((0, 1), (1, 3)))
    plan = TrainingPlan(epochs=3, batch_size=4, seed=5, schedule=(Stage(epochs=4, route="exit"), Stage(epochs=2)),
                        loss=(LossTerm.ce(weight=0.5, masked=True),))
    x, y = torch.randn(16, 1, 8, 8), torch.arange(16) % 10
    built, calls = [], []

    def build():
        built.append(family.build(spec, track_bn_stats=False))
        return built[-1]

    def recording_train(model, spec_, x_, y_, plan_, **kwargs):
        calls.append((model, spec_, x_, y_, plan_, kwargs))

    monkeypatch.setattr(child, "train", recording_train)
    child.warm_up_training(build, spec, x, y, plan, [0, 1, 2], 10, "cpu", "default")
    [(model, spec_, x_, y_, still, kwargs)] = calls
    assert model is built[0] and spec_ == spec
    assert torch.equal(x_, x[:4]) and torch.equal(y_, y[:4])  # one batch
    assert still.optimizer.lr == 0.0  # the throwaway copy's step changes nothing that matters
    assert still.epochs == 1 and still.batch_size == 4
    assert still.schedule == (Stage(epochs=1, route="exit"), Stage(epochs=1, route="skip"))  # every stage, once
    assert still.loss == plan.loss and still.seed == plan.seed  # the same loss terms: the same code is mapped
    assert kwargs == {"labels": [0, 1, 2], "num_classes": 10, "device": "cpu", "copies": [], "family": None,
                      "on_step": None}


def test_warm_up_takes_two_samples_at_least_and_really_runs(monkeypatch):
    family = get_family("cnn", 10, 1, hidden=(4, 8))
    spec = SubmodelSpec(exits=(0,))
    plan = TrainingPlan(batch_size=2, loss=(LossTerm.ce(), LossTerm.kd(0, 1, weight=1.0, tau=2.0)))
    x, y = torch.randn(8, 1, 8, 8), torch.arange(8) % 10
    models = []

    def build():
        models.append(family.build(spec, track_bn_stats=False))
        models.append({k: v.clone() for k, v in models[-1].state_dict().items()})
        return models[0]

    real_train = child.train
    results = []
    monkeypatch.setattr(child, "train", lambda *a, **k: results.append(real_train(*a, **k)))
    child.warm_up_training(build, spec, x, y, plan, list(range(8)), 10, "cpu", "compact")
    [result] = results
    assert (result.steps, result.samples, result.stages) == (1, 2, 1)
    assert math.isfinite(result.loss) and result.loss > 0
    # learning rate 0: the step ran (gradients and all) but left the throwaway model where it was
    after = models[0].state_dict()
    assert all(torch.equal(after[key], before) for key, before in models[1].items())


def test_warm_up_runs_every_width_of_ordered_dropout_once(monkeypatch):
    # Each width has its own shapes (its own oneDNN primitives): the run's first batches would draw one or two.
    family = get_family("cnn", 10, 1, hidden=(8, 8))
    spec = SubmodelSpec.uniform(0.5)
    plan = TrainingPlan(batch_size=4, seed=3, loss=(LossTerm.ce(), LossTerm.width_kd()), widths=(0.5, 0.25, 0.125))
    x, y = torch.randn(8, 1, 8, 8), torch.arange(8) % 10
    real_train = child.train
    plans, results = [], []

    def recording_train(*args, **kwargs):
        plans.append(args[4])
        results.append(real_train(*args, **kwargs))

    monkeypatch.setattr(child, "train", recording_train)
    child.warm_up_training(lambda: family.build(spec, track_bn_stats=False), spec, x, y, plan, list(range(8)), 10,
                           "cpu", "compact", family=family)
    assert [each.widths for each in plans] == [(0.5,), (0.25,), (0.125,)]
    assert all(each.loss == plan.loss and each.optimizer.lr == 0.0 for each in plans)
    assert [result.steps for result in results] == [1, 1, 1]


# ---------------------------------------------------------------------------------------------- runner
def kill_runner_child(runner, kill_when_busy,
                      sig: int = signal.SIGKILL) -> tuple[threading.Thread, list[bool]]:
    """Start a thread that signals the runner's training child once it is busy."""
    killed: list[bool] = []

    def watch() -> None:
        deadline = time.monotonic() + 60
        while runner.child_pid is None and time.monotonic() < deadline:
            time.sleep(0.01)
        pid = runner.child_pid
        if pid is not None:
            killed.append(kill_when_busy(pid, sig=sig))

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    return watcher, killed


def test_a_child_that_stops_making_progress_is_killed_and_its_task_failed(make_task, make_runner, kill_when_busy):
    """A child that hangs (here: stopped once busy, as a deadlocked one would sit) is killed after the runner's
    stall timeout, long before the task's deadline, and the task fails saying so."""
    runner = make_runner(budget=2**30, limits=ENDLESS, stall_timeout=5.0)
    watcher, stopped = kill_runner_child(runner, kill_when_busy, sig=signal.SIGSTOP)
    started = time.monotonic()
    failed = runner.run(make_task(U(1.0), epochs=LONG, deadline=time.time() + 3600))
    watcher.join(10)
    assert stopped == [True]
    assert failed.status == "failed" and failed.weights == {}
    assert failed.reason.startswith("the training process made no progress for 5 s"), failed.reason
    assert "signs of progress before" in failed.reason and "killed" in failed.reason
    assert time.monotonic() - started < 600  # the hour's deadline was not waited for
    assert runner.child_pid is None
    assert runner.run(make_task(U(0.5), task_id="r2-agent-0001")).status == "ok"  # the runner serves on


def test_a_child_that_keeps_making_progress_outlives_the_stall_timeout(make_task, workdir_for):
    """Progress resets the stall clock: a child training for longer than the stall timeout, step after step, is
    not killed for it (the task's own time limit stops this one)."""
    workdir = workdir_for(make_task(epochs=LONG))
    started = time.monotonic()
    outcome = run_in_child(workdir, 6.0, stall_timeout=3.0)
    assert outcome.timed_out and not outcome.stalled
    assert time.monotonic() - started >= 6.0
    beats = int.from_bytes((workdir / "progress").read_bytes(), "little")
    assert beats > 3  # it reported its start, its data, its warm-up and its steps


def test_runner_survives_a_killed_child_and_serves_the_next_task(model_ref, make_task, make_runner, decider_for,
                                                                 tmp_path, kill_when_busy):
    runner = make_runner(budget=2**30, limits=ENDLESS)
    readings = [OomCount("kernel", 7), OomCount("kernel", 8)]  # the kernel counts an OOM kill meanwhile
    runner.oom_kills = lambda: readings.pop(0) if len(readings) > 1 else readings[0]
    watcher, killed = kill_runner_child(runner, kill_when_busy)
    task = make_task(U(1.0), task_id="r1-agent-0001", epochs=LONG)
    failed = runner.run(task)
    watcher.join(10)

    assert killed == [True]
    assert failed.status == "failed"
    assert failed.reason.startswith("training process was killed by the kernel's OOM killer (SIGKILL")
    assert failed.spec_trained == U(1.0).to_dict() and failed.weights == {}
    assert set(failed.metrics) == {"estimated_bytes", "raw_estimate_bytes", "budget_bytes", "calibration",
                                   "seconds_task", "seconds_decision", "seconds_child"}
    assert runner.child_pid is None
    assert not (tmp_path / "agent" / "tasks" / "r1-agent-0001").exists()

    # The OOM kill says the real need was above what was available: the floor rises (at most doubling).
    estimate = decider_for(runner).raw_estimate(model_ref, U(1.0), task.plan)
    assert failed.metrics["raw_estimate_bytes"] == estimate.total
    expected = Calibration()
    expected.observe_failure(estimate.total, int(failed.metrics["budget_bytes"]), estimate.overhead)
    expected_floor = expected.floor
    assert expected_floor == pytest.approx(2 * 1.10)  # a GiB was available: only the doubling applies
    assert runner.calibration.floor == pytest.approx(expected_floor)
    stored = json.loads(runner.calibration.path.read_text())
    assert stored["floor"] == pytest.approx(expected_floor)

    # The same runner carries on with the next task.
    update = runner.run(make_task(U(1.0), task_id="r2-agent-0001", round_number=2))
    assert update.status == "ok", update.reason
    assert update.round == 2 and update.weights
    assert update.metrics["calibration"] == pytest.approx(expected_floor)
    assert update.metrics["estimated_bytes"] == (estimate.overhead
                                                 + int((estimate.total - estimate.overhead) * expected_floor))


def test_a_child_stopped_by_sigterm_fails_the_task_without_touching_the_calibration(make_task, make_runner,
                                                                                    kill_when_busy):
    runner = make_runner(budget=2**30, limits=ENDLESS)
    watcher, killed = kill_runner_child(runner, kill_when_busy, signal.SIGTERM)
    update = runner.run(make_task(U(1.0), epochs=LONG))
    watcher.join(10)
    assert killed == [True]
    assert update.status == "failed"
    assert update.reason.startswith("training process was killed by SIGTERM")
    assert runner.calibration.floor == 0.0  # only the OOM killer's kills count as out of memory


def test_a_crashing_child_fails_the_task_with_its_error(make_task, make_runner, tmp_path):
    runner = make_runner(budget=2**30)
    runner.data_path.unlink()  # the child cannot load the local data
    update = runner.run(make_task())
    assert update.status == "failed"
    assert update.reason.startswith("training process failed (exit code 1): FileNotFoundError")
    assert "local-data.npz" in update.reason
    assert len(update.reason.splitlines()) == 1  # the first line of the error, not the traceback
    assert update.spec_trained == U(0.5).to_dict() and update.weights == {}
    assert (runner.calibration.floor, runner.calibration.ratios) == (0.0, [])
    assert not list((tmp_path / "agent").glob("calibration-*.json"))


def test_a_timeout_is_not_counted_as_a_memory_failure(make_task, make_runner, monkeypatch):
    real_run_training = forkserver.run_training

    def quick_timeout(workdir, timeout, on_start=None, cancel=None, stall_timeout=None, device="cpu"):
        return real_run_training(workdir, 1.0, on_start=on_start, cancel=cancel, stall_timeout=stall_timeout,
                                 device=device)  # instead of the deadline + 30 s

    monkeypatch.setattr(forkserver, "run_training", quick_timeout)
    runner = make_runner(budget=2**30, limits=ENDLESS)
    update = runner.run(make_task(U(1.0), epochs=LONG))
    assert update.status == "failed"
    assert "did not finish within 1 s" in update.reason
    assert runner.calibration.floor == 0.0
    assert runner.calibration.factor == pytest.approx(1.10)


CUDA_OOM = "OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of 3.9 GiB"


@pytest.mark.parametrize(("error", "cuda_start", "learns"), [
    (CUDA_OOM, None, True),
    (CUDA_OOM, 600 * 2**20, True),  # CUDA's start cost what was assumed or less: the estimate was short
    (CUDA_OOM, 3 * 2**30, False),  # it cost more than the budget left for it: the budget was wrong, not the estimate
    ("RuntimeError: cuDNN error: CUDNN_STATUS_INTERNAL_ERROR", None, False),
])
def test_a_cuda_out_of_memory_teaches_the_calibration_as_an_oom_kill_does(make_task, make_runner, monkeypatch,
                                                                         error, cuda_start, learns):
    """The CUDA allocator's refusal kills nothing (the child raises): it alone among errors says the estimate was
    too low, and the task fails with the error as it was; what the child measured of CUDA's start is kept."""
    def child(workdir, *args, **kwargs):
        if cuda_start is not None:
            (workdir / "cuda_start.json").write_text(json.dumps({"cuda_context_bytes": cuda_start}))
        return ChildOutcome(None, 1, f"{error}\nTraceback (most recent call last):")

    monkeypatch.setattr(forkserver, "run_training", child)
    runner = make_runner(budget=2**30)
    update = runner.run(make_task(U(1.0)))
    assert (update.status, update.reason) == ("failed", f"training process failed (exit code 1): {error}")
    assert (runner.calibration.floor > 0) == learns
    assert runner.cuda_context_bytes == (cuda_start or 2**30)


@pytest.mark.parametrize(("samples", "warmed"), [(16, 4), (18, 6), (17, 4), (3, 3)],
                         ids=["whole batches", "short last batch", "last batch of one (skipped)", "under a batch"])
def test_warm_up_also_runs_the_shorter_batch_an_epoch_ends_with(monkeypatch, samples, warmed):
    family = get_family("cnn", 10, 1, hidden=(4, 8))
    calls = []
    monkeypatch.setattr(child, "train", lambda model, spec, x, y, plan, **kwargs: calls.append((x, plan)))
    x, y = torch.randn(samples, 1, 8, 8), torch.arange(samples) % 10
    child.warm_up_training(lambda: family.build(track_bn_stats=False), SubmodelSpec(), x, y,
                           TrainingPlan(batch_size=4), [0, 1], 10, "cpu", "default")
    [(x_, still)] = calls
    assert torch.equal(x_, x[:warmed]) and still.batch_size == 4  # one full batch, then the short one


def test_a_head_alone_model_runs_its_frozen_body_from_the_received_weights_and_copies_only_the_head(deep_family):
    # What the CPU estimate of a head-alone spec relies on: the body is not copied, the head is.
    spec = SubmodelSpec(segments=((deep_family.num_blocks, deep_family.num_blocks),))
    received = {key: value.detach().clone()
                for key, value in deep_family.build(spec, track_bn_stats=False).state_dict().items()}
    model = child._built(deep_family, spec, received, "cpu")
    head = set(deep_family.trainable_keys(spec))
    state = model.state_dict(keep_vars=True)
    assert head and head < set(state)
    for key, value in state.items():
        shared = value.data_ptr() == received[key].data_ptr()
        assert shared is (key not in head), key
    half = {key: value.half() for key, value in received.items()}  # another float type: copied and cast, all of it
    cast = child._built(deep_family, spec, half, "cpu")
    assert all(value.dtype == torch.float32 for value in cast.state_dict().values())
