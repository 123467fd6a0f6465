"""The simulator's fleet data: the training set, or a seeded subset of it, partitioned among the agents."""

from __future__ import annotations

import numpy as np
import pytest

from fedfit.sim.harness import fleet_data


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
