"""The simulator's fleet data: the training set, or a seeded subset of it, partitioned among the agents."""

from __future__ import annotations

import numpy as np
import pytest

from fedfit.sim import harness
from fedfit.sim.harness import fleet_data

GIB = 2**30


def test_a_train_sample_subset_is_partitioned_whole_and_seeded() -> None:
    dataset, shards = fleet_data("digits", None, 4, "dirichlet:0.3", seed=3, train_samples=500)
    used = np.concatenate(shards)
    assert len(used) == 500 and len(np.unique(used)) == 500  # every kept sample in exactly one shard
    assert used.max() < len(dataset.y_train)
    _, again = fleet_data("digits", None, 4, "dirichlet:0.3", seed=3, train_samples=500)
    assert all(np.array_equal(a, b) for a, b in zip(shards, again))
    _, other = fleet_data("digits", None, 4, "dirichlet:0.3", seed=4, train_samples=500)
    assert not np.array_equal(np.sort(used), np.sort(np.concatenate(other)))


def test_train_samples_at_or_above_the_set_take_all_of_it() -> None:
    dataset, everything = fleet_data("digits", None, 3, "iid", seed=0)
    _, capped = fleet_data("digits", None, 3, "iid", seed=0, train_samples=len(dataset.y_train) + 10)
    assert all(np.array_equal(a, b) for a, b in zip(everything, capped))
    assert sum(len(shard) for shard in everything) == len(dataset.y_train)


def test_train_samples_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="--train-samples"):
        fleet_data("digits", None, 3, "iid", seed=0, train_samples=0)


@pytest.mark.parametrize(("gpu_free", "ram", "expected"), [
    (10 * GIB, None, 4),  # a GPU: 10 GiB free room for four of (1 GiB start + 1.5 GiB task), not ten of 1 GiB
    (None, 5 * GIB, 2),  # no NVML (a Jetson): the RAM CPU and GPU share, the same rule
    (GIB, None, 1),  # too little for one: one still runs (its budget check then declines what does not fit)
])
def test_cuda_workers_are_sized_by_the_task_and_count_each_cuda_start_once(monkeypatch, gpu_free, ram, expected):
    monkeypatch.setattr(harness, "gpu_free_memory", lambda: gpu_free)
    monkeypatch.setattr(harness, "available_memory", lambda: ram)
    assert harness.cuda_workers(16, task_bytes=3 * GIB // 2, context_bytes=GIB) == expected
    assert harness.cuda_workers(2, task_bytes=3 * GIB // 2, context_bytes=GIB) == min(2, expected)  # one per core
    # a smaller task: more at once, never more than the cores
    assert harness.cuda_workers(16, task_bytes=0, context_bytes=GIB) >= expected
