"""Tests for common.data.load_shard: one client's share of a training set, equal to slicing load_dataset's."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np
import pytest

from common.data import DatasetError, load_dataset, load_shard, parse_partition, partition_indices
from common.data import datasets as ds_mod

SYSTEM_FASHION = Path("/usr/share/datasets/fashion-mnist")
needs_fashion = pytest.mark.skipif(not SYSTEM_FASHION.is_dir(),
                                   reason=f"Fashion-MNIST is not installed in {SYSTEM_FASHION}")


def _expected(name: str, root: Path | None, num_shards: int, partition: str, shard: int,
              seed: int) -> tuple[np.ndarray, np.ndarray]:
    d = load_dataset(name, root)
    indices = partition_indices(d.y_train, num_shards, parse_partition(partition), seed)[shard]
    return d.x_train[indices], d.y_train[indices]


def _assert_same(got: tuple[np.ndarray, np.ndarray], want: tuple[np.ndarray, np.ndarray]) -> None:
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert a.tobytes() == b.tobytes()  # bit for bit


@pytest.mark.parametrize(("partition", "num_shards", "shard", "seed"),
                         [("iid", 1, 0, 0), ("iid", 10, 3, 0), ("dirichlet:0.3", 7, 6, 5), ("shards:2", 10, 9, 1)])
def test_digits_shard_is_load_dataset_sliced(partition: str, num_shards: int, shard: int, seed: int) -> None:
    got = load_shard("digits", None, num_shards, partition, shard, seed)
    _assert_same(got, _expected("digits", None, num_shards, partition, shard, seed))
    assert got[0].flags.writeable and got[0].flags.c_contiguous


@needs_fashion
@pytest.mark.parametrize(("partition", "num_shards", "shard", "seed"),
                         [("iid", 10, 0, 0), ("shards:2", 20, 13, 3)])
def test_fashion_shard_is_load_dataset_sliced(partition: str, num_shards: int, shard: int, seed: int) -> None:
    got = load_shard("fashion-mnist", None, num_shards, parse_partition(partition), shard, seed)
    _assert_same(got, _expected("fashion-mnist", None, num_shards, partition, shard, seed))
    assert got[0].shape[1:] == (1, 28, 28)


def _write_idx(path: Path, array: np.ndarray) -> None:
    header = bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    data = header + array.astype(np.uint8).tobytes()
    path.write_bytes(gzip.compress(data) if path.suffix == ".gz" else data)


def _fake_fashion(folder: Path, n_train: int = 40, labels: np.ndarray | None = None, gz: bool = True) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    ext = ".gz" if gz else ""
    _write_idx(folder / f"train-images-idx3-ubyte{ext}", rng.integers(0, 256, (n_train, 28, 28)))
    _write_idx(folder / f"train-labels-idx1-ubyte{ext}", np.arange(n_train) % 10 if labels is None else labels)
    _write_idx(folder / f"t10k-images-idx3-ubyte{ext}", rng.integers(0, 256, (10, 28, 28)))
    _write_idx(folder / f"t10k-labels-idx1-ubyte{ext}", np.arange(10) % 10)


@pytest.mark.parametrize("gz", [True, False])
def test_fashion_shard_from_a_root_folder(tmp_path: Path, gz: bool) -> None:
    _fake_fashion(tmp_path, gz=gz)
    ds_mod._load_cached.cache_clear()
    for partition, num_shards, shard in (("iid", 3, 2), ("dirichlet:0.5", 2, 1), ("shards:3", 4, 0)):
        got = load_shard("fashion-mnist", tmp_path, num_shards, partition, shard, 2)
        _assert_same(got, _expected("fashion-mnist", tmp_path, num_shards, partition, shard, 2))
    _assert_same(load_shard("auto", tmp_path, 3, "iid", 1, 0), _expected("auto", tmp_path, 3, "iid", 1, 0))
    ds_mod._load_cached.cache_clear()


def test_bad_fashion_labels_are_refused_as_load_dataset_refuses_them(tmp_path: Path) -> None:
    _fake_fashion(tmp_path, labels=np.arange(40) % 12)
    with pytest.raises(DatasetError, match="go up to 11"):
        load_shard("fashion-mnist", tmp_path, 2, "iid", 0, 0)
    _fake_fashion(tmp_path, labels=np.arange(39) % 10)
    with pytest.raises(DatasetError, match="there are 40 images"):
        load_shard("fashion-mnist", tmp_path, 2, "iid", 0, 0)


def test_bad_names_roots_and_shards(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="Unknown dataset 'mnist'"):
        load_shard("mnist", None, 2, "iid", 0, 0)
    with pytest.raises(DatasetError, match="is not a folder"):
        load_shard("digits", tmp_path / "missing", 2, "iid", 0, 0)
    with pytest.raises(ValueError, match=r"shard must be in \[0, num_shards\), got 2 of 2"):
        load_shard("digits", None, 2, "iid", 2, 0)
    with pytest.raises(ValueError, match="not understood"):
        load_shard("digits", None, 2, "iid:3", 0, 0)
    with pytest.raises(ValueError, match="shards:11"):
        load_shard("digits", None, 2, "shards:11", 0, 0)
