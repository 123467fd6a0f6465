"""Tests for common.data.partition."""

from __future__ import annotations

import numpy as np
import pytest

from common.data import PartitionSpec, label_set, parse_partition, partition_indices


def make_labels(per_class: int = 100, classes: int = 10, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).permutation(np.repeat(np.arange(classes), per_class))


def check_disjoint_sorted(parts: list[np.ndarray], n: int, full: bool = True) -> None:
    for p in parts:
        assert p.dtype == np.int64
        assert len(p) > 0
        assert np.all(np.diff(p) > 0)
    merged = np.concatenate(parts)
    assert len(np.unique(merged)) == len(merged)
    assert merged.min() >= 0 and merged.max() < n
    if full:
        assert len(merged) == n


# --- parsing --------------------------------------------------------------------------------------------


def test_parse_forms() -> None:
    assert parse_partition("iid") == PartitionSpec("iid")
    assert parse_partition(" IID ") == PartitionSpec("iid")
    assert parse_partition("dirichlet:0.5") == PartitionSpec("dirichlet", alpha=0.5)
    assert parse_partition("dirichlet:1") == PartitionSpec("dirichlet", alpha=1.0)
    assert parse_partition("shards:2") == PartitionSpec("shards", labels_per_client=2)


@pytest.mark.parametrize("text", ["iid", "dirichlet:0.5", "dirichlet:0.1", "dirichlet:10", "shards:3"])
def test_describe_round_trips(text: str) -> None:
    assert parse_partition(text).describe() == text
    assert parse_partition(parse_partition(text).describe()) == parse_partition(text)


def test_describe_keeps_precision() -> None:
    spec = PartitionSpec("dirichlet", alpha=0.123456789)
    assert parse_partition(spec.describe()).alpha == 0.123456789


@pytest.mark.parametrize(
    "text",
    ["", "iid:3", "dirichlet", "dirichlet:", "dirichlet:0", "dirichlet:-1", "dirichlet:abc", "dirichlet:nan",
     "dirichlet:inf", "shards", "shards:0", "shards:-2", "shards:1.5", "shards:x", "random",
     "pathological:2"],
)
def test_parse_rejects(text: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_partition(text)
    msg = str(info.value)
    assert repr(text) in msg
    assert "'iid'" in msg and "'dirichlet:ALPHA'" in msg and "'shards:N'" in msg


def test_spec_validates_direct_construction() -> None:
    with pytest.raises(ValueError):
        PartitionSpec("dirichlet")
    with pytest.raises(ValueError):
        PartitionSpec("shards", labels_per_client=0)
    with pytest.raises(ValueError):
        PartitionSpec("iid", alpha=1.0)
    with pytest.raises(ValueError):
        PartitionSpec("nope")


def test_label_set() -> None:
    assert label_set(np.array([3, 1, 3, 0, 1])) == [0, 1, 3]
    assert all(type(v) is int for v in label_set(np.array([2, 2], dtype=np.int64)))


# --- IID ------------------------------------------------------------------------------------------------


def test_iid_equal_sizes_and_coverage() -> None:
    labels = make_labels()
    parts = partition_indices(labels, 10, PartitionSpec("iid"), seed=0)
    assert [len(p) for p in parts] == [100] * 10
    check_disjoint_sorted(parts, len(labels))


def test_iid_uneven_sizes_differ_by_at_most_one() -> None:
    parts = partition_indices(make_labels(), 7, parse_partition("iid"), seed=3)
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1
    check_disjoint_sorted(parts, 1000)


# --- Dirichlet ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("alpha", [0.05, 0.5, 100.0])
def test_dirichlet_min_size_and_coverage(alpha: float) -> None:
    labels = make_labels()
    parts = partition_indices(labels, 20, PartitionSpec("dirichlet", alpha=alpha), seed=1)
    assert len(parts) == 20
    assert min(len(p) for p in parts) >= 10
    check_disjoint_sorted(parts, len(labels))


def test_dirichlet_repairs_extreme_skew() -> None:
    labels = make_labels(per_class=30)
    parts = partition_indices(labels, 30, PartitionSpec("dirichlet", alpha=0.001), seed=0)
    assert min(len(p) for p in parts) >= 10
    check_disjoint_sorted(parts, len(labels))


def test_dirichlet_small_alpha_is_skewed() -> None:
    labels = make_labels()
    skewed = partition_indices(labels, 10, PartitionSpec("dirichlet", alpha=0.1), seed=0)
    flat = partition_indices(labels, 10, PartitionSpec("dirichlet", alpha=1000.0), seed=0)

    def mean_classes(parts: list[np.ndarray]) -> float:
        # classes holding at least 5% of a client's data
        return float(np.mean([(np.bincount(labels[p], minlength=10) >= 0.05 * len(p)).sum() for p in parts]))

    assert mean_classes(skewed) < mean_classes(flat)
    assert mean_classes(flat) == 10


def test_dirichlet_min_size_when_data_is_scarce() -> None:
    labels = make_labels(per_class=5, classes=4)  # 20 samples, 8 clients -> at least 2 each
    parts = partition_indices(labels, 8, PartitionSpec("dirichlet", alpha=0.3), seed=5)
    assert min(len(p) for p in parts) >= 2
    check_disjoint_sorted(parts, 20)


# --- Shards ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("clients", "per_client"), [(10, 2), (20, 2), (7, 3), (10, 1), (4, 10)])
def test_shards_labels_per_client_and_balance(clients: int, per_client: int) -> None:
    labels = make_labels()
    parts = partition_indices(labels, clients, PartitionSpec("shards", labels_per_client=per_client), seed=0)
    check_disjoint_sorted(parts, len(labels), full=clients * per_client >= 10)
    counts = np.stack([np.bincount(labels[p], minlength=10) for p in parts])  # clients x classes
    # every client holds exactly N classes
    assert ((counts > 0).sum(axis=1) == per_client).all()
    # classes are covered as evenly as possible
    holders = (counts > 0).sum(axis=0)
    assert holders.max() - holders.min() <= 1
    # each class is split equally among the clients holding it
    for cls in range(10):
        shares = counts[:, cls][counts[:, cls] > 0]
        if len(shares):
            assert shares.max() - shares.min() <= 1
            assert shares.sum() == 100


def test_shards_equal_share_of_each_class() -> None:
    labels = make_labels()
    parts = partition_indices(labels, 10, PartitionSpec("shards", labels_per_client=2), seed=4)
    for p in parts:
        counts = np.bincount(labels[p], minlength=10)
        assert sorted(counts[counts > 0].tolist()) == [50, 50]


def test_shards_too_many_labels() -> None:
    with pytest.raises(ValueError, match="only 10"):
        partition_indices(make_labels(), 5, PartitionSpec("shards", labels_per_client=11), seed=0)


def test_shards_class_too_small() -> None:
    labels = np.array([0, 0, 0, 0, 0, 0, 1])
    with pytest.raises(ValueError, match="Class 1 has 1 samples"):
        partition_indices(labels, 4, PartitionSpec("shards", labels_per_client=1), seed=0)


# --- common ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["iid", "dirichlet:0.3", "shards:2"])
def test_deterministic_per_seed(text: str) -> None:
    labels = make_labels()
    spec = parse_partition(text)
    a = partition_indices(labels, 8, spec, seed=42)
    b = partition_indices(labels, 8, spec, seed=42)
    c = partition_indices(labels, 8, spec, seed=43)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c, strict=True))


@pytest.mark.parametrize("text", ["iid", "dirichlet:0.3", "shards:1"])
def test_more_clients_than_samples(text: str) -> None:
    with pytest.raises(ValueError, match="fewer clients"):
        partition_indices(np.arange(5) % 2, 6, parse_partition(text), seed=0)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="num_clients"):
        partition_indices(make_labels(), 0, PartitionSpec("iid"), seed=0)
    with pytest.raises(ValueError, match="1-D"):
        partition_indices(np.zeros((4, 2), dtype=int), 2, PartitionSpec("iid"), seed=0)
    with pytest.raises(ValueError, match="integers"):
        partition_indices(np.zeros(4), 2, PartitionSpec("iid"), seed=0)


def test_single_client_gets_everything() -> None:
    labels = make_labels()
    for text in ("iid", "dirichlet:0.5"):
        parts = partition_indices(labels, 1, parse_partition(text), seed=0)
        np.testing.assert_array_equal(parts[0], np.arange(len(labels)))
