"""Tests for common.data.datasets."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np
import pytest

from common.data import DATASET_NAMES, DatasetError, load_dataset, subsample
from common.data import datasets as ds_mod

SYSTEM_FASHION = Path("/usr/share/datasets/fashion-mnist")


def _write_idx(path: Path, array: np.ndarray) -> None:
    header = bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    path.write_bytes(gzip.compress(header + array.astype(np.uint8).tobytes()))


def _fake_fashion(folder: Path, n_train: int = 20, n_test: int = 10) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    _write_idx(folder / "train-images-idx3-ubyte.gz", rng.integers(0, 256, (n_train, 28, 28)))
    _write_idx(folder / "train-labels-idx1-ubyte.gz", np.arange(n_train) % 10)
    _write_idx(folder / "t10k-images-idx3-ubyte.gz", rng.integers(0, 256, (n_test, 28, 28)))
    _write_idx(folder / "t10k-labels-idx1-ubyte.gz", np.arange(n_test) % 10)


@pytest.fixture
def no_system_fashion(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Hide the system-wide Fashion-MNIST and the environment override."""
    monkeypatch.setattr(ds_mod, "FASHION_MNIST_SYSTEM_DIR", tmp_path / "no-system-dataset")
    monkeypatch.delenv(ds_mod.FASHION_MNIST_ENV, raising=False)
    ds_mod._load_cached.cache_clear()


def test_names() -> None:
    assert DATASET_NAMES == ("fashion-mnist", "digits")


def test_digits_shapes_split_and_normalisation() -> None:
    d = load_dataset("digits")
    assert d.name == "digits"
    assert d.x_train.shape == (1438, 1, 8, 8)
    assert d.x_test.shape == (359, 1, 8, 8)  # 20% of each class, rounded
    assert d.x_train.dtype == np.float32 and d.y_train.dtype == np.int64
    assert (d.num_classes, d.in_channels, d.image_size) == (10, 1, (8, 8))
    assert abs(float(d.x_train.mean())) < 1e-4
    assert abs(float(d.x_train.std()) - 1.0) < 1e-3
    # Stratified: every class has 35..37 test samples (20% of ~180).
    counts = np.bincount(d.y_test, minlength=10)
    assert counts.min() >= 35 and counts.max() <= 37
    assert len(d.y_train) + len(d.y_test) == 1797


def test_digits_is_cached_and_read_only() -> None:
    a = load_dataset("digits")
    b = load_dataset("digits")
    assert a is b
    assert not a.x_train.flags.writeable
    with pytest.raises(ValueError):
        a.x_train[0, 0, 0, 0] = 1.0
    with pytest.raises(ValueError):
        a.y_test[0] = 3


def test_digits_split_is_deterministic() -> None:
    first = load_dataset("digits")
    ds_mod._load_cached.cache_clear()
    second = load_dataset("digits")
    assert first is not second
    np.testing.assert_array_equal(first.x_train, second.x_train)
    np.testing.assert_array_equal(first.y_test, second.y_test)


def test_unknown_name_lists_valid_names() -> None:
    with pytest.raises(DatasetError) as info:
        load_dataset("cifar-100")
    msg = str(info.value)
    assert "'cifar-100'" in msg
    for name in ("fashion-mnist", "digits", "auto"):
        assert repr(name) in msg


@pytest.mark.usefixtures("no_system_fashion")
def test_fashion_not_found_message(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    with pytest.raises(DatasetError) as info:
        load_dataset("fashion-mnist", root=tmp_path / "data")
    msg = str(info.value)
    assert str(tmp_path / "data") in msg
    assert str(tmp_path / "data" / "FashionMNIST" / "raw") in msg
    assert str(tmp_path / "no-system-dataset") in msg
    assert "dataset-fashion-mnist" in msg
    assert "--dataset digits" in msg


@pytest.mark.parametrize("name", ["fashion-mnist", "digits", "auto"])
def test_a_data_root_that_is_not_a_folder_is_one_sentence(tmp_path: Path, name: str) -> None:
    with pytest.raises(DatasetError, match="data.root '.*absent' is not a folder: fix the path"):
        load_dataset(name, root=tmp_path / "absent")


@pytest.mark.usefixtures("no_system_fashion")
def test_auto_falls_back_to_digits(tmp_path: Path) -> None:
    assert load_dataset("auto", root=tmp_path).name == "digits"


@pytest.mark.usefixtures("no_system_fashion")
def test_fashion_from_torchvision_layout(tmp_path: Path) -> None:
    _fake_fashion(tmp_path / "FashionMNIST" / "raw")
    d = load_dataset("fashion-mnist", root=tmp_path)
    assert d.x_train.shape == (20, 1, 28, 28)
    assert d.x_test.shape == (10, 1, 28, 28)
    assert d.y_train.dtype == np.int64
    assert not d.x_test.flags.writeable
    assert load_dataset("auto", root=tmp_path).name == "fashion-mnist"
    # uint8 0 maps to -mean/std after scaling.
    assert float(d.x_train.min()) == pytest.approx(-0.2860 / 0.3530, rel=1e-5)


@pytest.mark.usefixtures("no_system_fashion")
def test_fashion_from_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_fashion(tmp_path / "env-dir", n_train=30)
    monkeypatch.setenv(ds_mod.FASHION_MNIST_ENV, str(tmp_path / "env-dir"))
    assert load_dataset("fashion-mnist").x_train.shape == (30, 1, 28, 28)


@pytest.mark.usefixtures("no_system_fashion")
def test_fashion_label_count_mismatch(tmp_path: Path) -> None:
    _fake_fashion(tmp_path)
    _write_idx(tmp_path / "train-labels-idx1-ubyte.gz", np.zeros(19))
    with pytest.raises(DatasetError, match="20 images"):
        load_dataset("fashion-mnist", root=tmp_path)


@pytest.mark.skipif(
    not (SYSTEM_FASHION / "train-images-idx3-ubyte.gz").exists(),
    reason="real Fashion-MNIST not installed (Debian package dataset-fashion-mnist)",
)
def test_real_fashion_mnist() -> None:
    d = load_dataset("fashion-mnist")
    assert d.x_train.shape == (60000, 1, 28, 28)
    assert d.x_test.shape == (10000, 1, 28, 28)
    assert d.x_train.dtype == np.float32
    assert np.bincount(d.y_train).tolist() == [6000] * 10
    assert abs(float(d.x_train.mean())) < 0.01
    assert abs(float(d.x_train.std()) - 1.0) < 0.01


def test_subsample() -> None:
    x = np.arange(100, dtype=np.float32).reshape(50, 2)
    y = np.arange(50)
    xs, ys = subsample(x, y, 10, seed=1)
    assert xs.shape == (10, 2) and ys.shape == (10,)
    np.testing.assert_array_equal(xs[:, 0] / 2, ys)  # rows stay paired with their labels
    assert len(set(ys.tolist())) == 10
    xs2, ys2 = subsample(x, y, 10, seed=1)
    np.testing.assert_array_equal(xs, xs2)
    np.testing.assert_array_equal(ys, ys2)
    assert not np.array_equal(ys, subsample(x, y, 10, seed=2)[1])
    xa, ya = subsample(x, y, 500, seed=0)
    assert len(xa) == 50 and len(ya) == 50
    with pytest.raises(ValueError):
        subsample(x, y[:3], 2, seed=0)
