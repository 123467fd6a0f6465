"""Shared fixtures for the edge-agent tests: tiny CNNs on 8x8 inputs, tasks for them, runners in tmp_path.

Tasks carry a :class:`protocol.TrainingPlan` (``make_task(plan=...)`` or the plan ``task_plan(...)`` builds from
the keyword arguments); ``make_task(legacy=True)`` makes a task the way coordinators that predate plans send it
(a :class:`protocol.Recipe`, no plan).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from edge_agent.decision import Decider
from edge_agent.runner import LocalData, TaskRunner
from edge_agent.workdir import DecisionRequest
from models import ModelFamily, SubmodelSpec, get_family
from protocol import Adaptation, LossTerm, ModelRef, OptimizerSettings, Recipe, Stage, Task, TrainingPlan

HIDDEN = (4, 8)
#: A three-block CNN (exits may follow blocks 0 and 1): room for ScaleFL-like depth cuts and FeDepth segments.
DEEP_HIDDEN = (4, 8, 8)
TASK_SEED = 3


def task_plan(*, batch_size: int = 8, epochs: int = 1, momentum: float = 0.9, lr: float = 0.05,
              weight_decay: float = 5e-4, clip_norm: float | None = 1.0, seed: int = TASK_SEED,
              loss: tuple[LossTerm, ...] = (LossTerm.ce(),), schedule: tuple[Stage, ...] = ()) -> TrainingPlan:
    """The training plan of the tests' tasks (plain cross-entropy of the last output unless ``loss`` says)."""
    return TrainingPlan(optimizer=OptimizerSettings("sgd", lr, momentum, weight_decay, clip_norm), epochs=epochs,
                        batch_size=batch_size, seed=seed, loss=tuple(loss), schedule=tuple(schedule))



@pytest.fixture(scope="session", name="task_plan")
def task_plan_fixture() -> Callable[..., TrainingPlan]:
    """:func:`task_plan`, for the test modules (conftest is not importable under ``--import-mode=importlib``)."""
    return task_plan


@pytest.fixture(scope="session")
def family() -> ModelFamily:
    return get_family("cnn", 10, 1, hidden=HIDDEN)


@pytest.fixture(scope="session")
def model_ref() -> ModelRef:
    """How tasks name :func:`family`."""
    return ModelRef("cnn", 10, 1, {"hidden": list(HIDDEN)})


@pytest.fixture(scope="session")
def deep_family() -> ModelFamily:
    return get_family("cnn", 10, 1, hidden=DEEP_HIDDEN)


@pytest.fixture(scope="session")
def deep_ref() -> ModelRef:
    """How tasks name :func:`deep_family`."""
    return ModelRef("cnn", 10, 1, {"hidden": list(DEEP_HIDDEN)})


def build_local_data(n: int = 16, num_classes: int = 10, channels: int = 1) -> LocalData:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(n, channels, 8, 8, generator=generator)
    y = torch.arange(n) % num_classes
    return LocalData(x, y)


@pytest.fixture(scope="session")
def local_data() -> Callable[..., LocalData]:
    """Factory: ``local_data(n=16, num_classes=10, channels=1)``; labels cycle through the classes."""
    return build_local_data


@pytest.fixture(scope="session")
def make_task(family: ModelFamily) -> Callable[..., Task]:
    """Factory for a task on the tiny CNN (``of``: another family, named by ``model``); the weights are the
    global model's slice for ``spec`` (every tensor of ``state_keys(spec)``, frozen blocks included).

    The task carries ``plan``, or the plan :func:`task_plan` makes from the keyword arguments; ``legacy=True``
    makes an old-style task instead: the same settings as a :class:`Recipe`, no plan.
    """

    def make(spec: SubmodelSpec | None = None, *, task_id: str = "r1-agent-0001", round_number: int = 1,
             deadline: float | None = None, model: ModelRef | None = None, spec_dict: dict | None = None,
             weights: dict[str, np.ndarray] | None = None, batch_size: int = 8, epochs: int = 1,
             momentum: float = 0.9, adaptation: Adaptation | None = None, of: ModelFamily | None = None,
             plan: TrainingPlan | None = None, legacy: bool = False) -> Task:
        spec = SubmodelSpec.uniform(0.5) if spec is None else spec
        source = family if of is None else of
        if weights is None:
            torch.manual_seed(0)
            # The global model with an exit at every exit point: any spec's weights are a slice of it.
            global_state = source.build(SubmodelSpec(exits=source.exit_points)).state_dict()
            sliced = source.extract(global_state, spec, keys=source.state_keys(spec))
            weights = {key: value.numpy() for key, value in sliced.items()}
        if legacy:
            assert plan is None, "an old-style task carries a recipe, not a plan"
            recipe = Recipe(epochs=epochs, batch_size=batch_size, lr=0.05, momentum=momentum, weight_decay=5e-4,
                            clip_norm=1.0, masked_ce=False, seed=TASK_SEED)
        else:
            recipe = None
            if plan is None:
                plan = task_plan(batch_size=batch_size, epochs=epochs, momentum=momentum)
        return Task(
            task_id=task_id, round=round_number, agent_id="agent",
            deadline=time.time() + 60 if deadline is None else deadline,
            model=model or ModelRef("cnn", 10, 1, {"hidden": list(HIDDEN)}),
            spec=spec.to_dict() if spec_dict is None else spec_dict,
            recipe=recipe,
            weights=weights,
            adaptation=adaptation,
            plan=plan,
        )

    return make


@pytest.fixture(scope="session")
def make_deep_task(make_task: Callable[..., Task], deep_family: ModelFamily,
                   deep_ref: ModelRef) -> Callable[..., Task]:
    """``make_task`` on the three-block CNN (:data:`DEEP_HIDDEN`)."""

    def make(spec: SubmodelSpec | None = None, **kwargs) -> Task:
        return make_task(spec, of=deep_family, model=deep_ref, **kwargs)

    return make


@pytest.fixture
def make_runner(tmp_path: Path) -> Iterator[Callable[..., TaskRunner]]:
    """Factory for TaskRunners whose state (calibration, data file, task dirs) lives under tmp_path."""
    runners: list[TaskRunner] = []

    def make(data: LocalData | None = None, budget=None, *, name: str = "agent", **kwargs) -> TaskRunner:
        runner = TaskRunner("agent", data if data is not None else build_local_data(), budget,
                            state_dir=tmp_path / name, **kwargs)
        runners.append(runner)
        return runner

    yield make
    for runner in runners:
        runner.close()


@pytest.fixture(scope="session")
def decider_for() -> Callable[..., Decider]:
    """``decider_for(runner, round_number=1)``: the :class:`Decider` a decision child of ``runner`` would run (its
    device, heap, memory available, calibration factor, data and limits), in this process, knowing no estimates."""

    def make(runner: TaskRunner, round_number: int = 1) -> Decider:
        return Decider(DecisionRequest(runner.device, runner.allocator, runner.available(round_number),
                                       runner.calibration.factor, runner.data, runner.limits,
                                       threads=runner.torch_threads if runner.device == "cpu" else 1))

    return make


def cpu_seconds(pid: int) -> float:
    """User + system CPU time process ``pid`` has used so far (-1 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return -1.0
    if fields[0] in ("Z", "X"):  # exited, not yet reaped
        return -1.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def sigkill_once_busy(pid: int, cpu: float = 0.3, timeout: float = 60.0, sig: int = signal.SIGKILL) -> bool:
    """Block until ``pid`` has used ``cpu`` seconds of CPU (it is inside its task), then SIGKILL (``sig``) it.

    False, with nothing killed, when it ended or did not get that far within ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    while True:
        used = cpu_seconds(pid)
        if used < 0 or time.monotonic() > deadline:
            return False
        if used >= cpu:
            os.kill(pid, sig)
            return True
        time.sleep(0.02)


@pytest.fixture
def kill_when_busy() -> Callable[[int], bool]:
    """``kill_when_busy(pid, sig=SIGKILL)``: wait until the child has done some work, then signal it."""
    return sigkill_once_busy
