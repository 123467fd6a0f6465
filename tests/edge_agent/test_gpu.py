"""Training where torch sees a GPU: the runner's children on CUDA and on the CPU beside it, and a forkserver that
never starts CUDA itself. Marked ``gpu``: skipped where torch cannot train on a GPU (``tests/conftest.py``);
``benchmarks/gpu_check.py`` adds the federation over mosquitto and the memory rows."""

from __future__ import annotations

import multiprocessing.forkserver

import pytest

from edge_agent import gpu_stack
from models import SubmodelSpec

pytestmark = pytest.mark.gpu


def test_a_cuda_runner_trains_on_the_gpu_and_reports_what_cuda_cost(make_task, make_runner):
    update = make_runner(device="cuda").run(make_task(SubmodelSpec.uniform(1.0)))
    assert update.status == "ok", update.reason
    assert update.metrics["peak_bytes"] > 0
    assert update.metrics["cuda_reserved_peak_bytes"] >= 0
    assert update.metrics.get("cuda_context_bytes", 1) > 0  # absent only without NVML (a Jetson)


def test_a_cpu_runner_on_a_gpu_machine_trains_on_the_cpu(make_task, make_runner):
    update = make_runner(device="cpu").run(make_task())
    assert update.status == "ok", update.reason
    assert "cuda_reserved_peak_bytes" not in update.metrics


def test_the_forkserver_that_forks_cuda_children_holds_no_cuda_itself(make_task, make_runner):
    """A CUDA started before the fork is unusable in the child: the server never starts it (CUDA's library may
    be loaded with torch's GPU packages; started, it would hold the driver's device files open)."""
    assert make_runner(device="cuda").run(make_task()).status == "ok"
    server = multiprocessing.forkserver._forkserver._forkserver_pid  # type: ignore[attr-defined]
    assert server is not None
    assert gpu_stack.gpu_files_open(server) == []
