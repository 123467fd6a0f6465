"""Tests for common.data.digits: scikit-learn's digits without importing scikit-learn (compared with
scikit-learn's own loader, which this test process may import) and FedFit's stratified split."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from common.data import DatasetError, load_dataset
from common.data import digits as digits_mod
from common.data.digits import digits_csv_path, read_digits, stratified_split

sklearn_datasets = pytest.importorskip("sklearn.datasets")


def test_the_csv_is_found_inside_the_sklearn_package() -> None:
    path = digits_csv_path()
    assert path.name == "digits.csv.gz" and path.parent.parent.name == "datasets"


def test_read_digits_is_load_digits() -> None:
    images, labels = read_digits()
    bunch = sklearn_datasets.load_digits()
    assert images.dtype == np.float32 and labels.dtype == np.int64
    np.testing.assert_array_equal(images, np.asarray(bunch.images, dtype=np.float32) / np.float32(16.0))
    np.testing.assert_array_equal(labels, bunch.target)


@pytest.mark.parametrize(("test_size", "seed"), [(0.2, 0), (0.2, 1), (0.33, 42)])
def test_the_stratified_split_covers_every_sample_once_and_keeps_each_class_share(test_size: float,
                                                                                  seed: int) -> None:
    _, labels = read_digits()
    train, test = stratified_split(labels, test_size, seed)
    assert np.intersect1d(train, test).size == 0
    np.testing.assert_array_equal(np.sort(np.concatenate([train, test])), np.arange(len(labels)))
    for label in np.unique(labels):
        count = int((labels == label).sum())
        assert abs(int((labels[test] == label).sum()) - test_size * count) <= 0.5  # rounded per class
    again = stratified_split(labels, test_size, seed)
    np.testing.assert_array_equal(again[1], test)  # the same in every process


def test_another_seed_draws_another_test_set() -> None:
    _, labels = read_digits()
    assert not np.array_equal(stratified_split(labels, 0.2, 0)[1], stratified_split(labels, 0.2, 1)[1])


def test_load_dataset_digits_is_the_csv_split_and_normalised_on_its_train_part() -> None:
    images, labels = read_digits()
    train, test = stratified_split(labels, 0.2, 0)
    d = load_dataset("digits")
    np.testing.assert_array_equal(d.y_train, labels[train])
    np.testing.assert_array_equal(d.y_test, labels[test])
    mean, std = images[train].mean(), images[train].std()
    np.testing.assert_allclose(d.x_train[:, 0], (images[train] - mean) / std, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(d.x_test[:, 0], (images[test] - mean) / std, rtol=1e-5, atol=1e-5)


def test_too_small_a_class_is_refused() -> None:
    with pytest.raises(ValueError, match="every class in both sets"):
        stratified_split(np.array([0, 0, 0, 1]), 0.5, 0)


def test_no_scikit_learn_is_one_sentence(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(DatasetError, match="scikit-learn is not installed") as info:
        read_digits()
    assert "data.path" in str(info.value)


def test_a_scikit_learn_without_the_csv_is_one_sentence(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(digits_mod, "_CSV", ("datasets", "data", "no-such-digits.csv.gz"))
    with pytest.raises(DatasetError, match="has no datasets/data/no-such-digits.csv.gz"):
        digits_csv_path()
