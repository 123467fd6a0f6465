"""Benchmark datasets: Fashion-MNIST (from IDX files on disk) and scikit-learn's bundled digits.

Loaded datasets are cached per process (the simulator builds many agents from one dataset) and their arrays
are read-only: callers that need to change them must copy first. :func:`load_shard` gives one client's share of
a training set without either: what an edge agent holds (it reads the labels, partitions them, and converts only
its own images; it imports neither scikit-learn nor scipy).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from common.data.digits import read_digits, stratified_split
from common.data.errors import DatasetError
from common.data.idx import read_idx, read_idx_header, read_idx_rows
from common.data.partition import PartitionSpec, parse_partition, partition_indices

__all__ = [
    "DATASET_NAMES",
    "FASHION_MNIST_CLASSES",
    "FASHION_MNIST_ENV",
    "FASHION_MNIST_MEAN",
    "FASHION_MNIST_STD",
    "FASHION_MNIST_SYSTEM_DIR",
    "Dataset",
    "fashion_mnist_search_dirs",
    "find_fashion_mnist",
    "load_dataset",
    "load_shard",
    "subsample",
]

DATASET_NAMES: tuple[str, ...] = ("fashion-mnist", "digits")
FASHION_MNIST_MEAN = 0.2860
FASHION_MNIST_STD = 0.3530
FASHION_MNIST_CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag",
                         "Ankle boot")
FASHION_MNIST_ENV = "FEDFIT_FASHION_MNIST"
FASHION_MNIST_SYSTEM_DIR = Path("/usr/share/datasets/fashion-mnist")
_FASHION_FILES: tuple[str, ...] = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)


@dataclass
class Dataset:
    """A train/test image-classification dataset.

    ``x_*`` are float32 ``N x C x H x W`` arrays, already normalised; ``y_*`` are int64 labels in
    ``0 .. num_classes - 1``. Arrays returned by :func:`load_dataset` are read-only.
    """

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int
    in_channels: int
    image_size: tuple[int, int]
    #: The name of every class, by label.
    class_names: tuple[str, ...] = ()
    #: ``(mean, std)``: the images are ``(p - mean) / std`` of their pixels ``p`` scaled to [0, 1].
    normalization: tuple[float, float] = (0.0, 1.0)


def fashion_mnist_search_dirs(root: str | Path | None = None) -> list[Path]:
    """Folders searched for the Fashion-MNIST IDX files, in order of preference."""
    dirs: list[Path] = []
    if root is not None:
        base = Path(root).expanduser()
        dirs += [base, base / "FashionMNIST" / "raw"]
    env = os.environ.get(FASHION_MNIST_ENV)
    if env:
        dirs.append(Path(env).expanduser())
    dirs.append(FASHION_MNIST_SYSTEM_DIR)
    return dirs


def _find_files(folder: Path) -> list[Path] | None:
    found: list[Path] = []
    for stem in _FASHION_FILES:
        for candidate in (folder / stem, folder / f"{stem}.gz"):
            if candidate.is_file():
                found.append(candidate)
                break
        else:
            return None
    return found


def find_fashion_mnist(root: str | Path | None = None) -> Path | None:
    """Return the first searched folder holding all four Fashion-MNIST files, or None."""
    for folder in fashion_mnist_search_dirs(root):
        if _find_files(folder) is not None:
            return folder
    return None


def _readonly(*arrays: np.ndarray) -> None:
    for a in arrays:
        a.flags.writeable = False


def _fashion_files(root: str | Path | None) -> list[Path]:
    """The four Fashion-MNIST files (train images, train labels, test images, test labels)."""
    folder = find_fashion_mnist(root)
    if folder is None:
        searched = ", ".join(str(d) for d in fashion_mnist_search_dirs(root))
        raise DatasetError(
            f"Fashion-MNIST files ({', '.join(_FASHION_FILES)}, optionally .gz) were not found in any of: "
            f"{searched}; install the Debian package 'dataset-fashion-mnist', set ${FASHION_MNIST_ENV} to "
            "the folder holding them, or use '--dataset digits'."
        )
    files = _find_files(folder)
    assert files is not None
    return files


def _check_fashion(split: str, shape: tuple[int, ...], dtype: np.dtype, y: np.ndarray, xf: Path, yf: Path) -> None:
    if dtype != np.uint8 or len(shape) != 3 or shape[1:] != (28, 28):
        raise DatasetError(
            f"Fashion-MNIST {split} images in {str(xf)!r} have shape {shape} and dtype {dtype} "
            "(expected N x 28 x 28 uint8); reinstall the dataset."
        )
    if y.ndim != 1 or y.shape[0] != shape[0]:
        raise DatasetError(
            f"Fashion-MNIST {split} labels in {str(yf)!r} have shape {y.shape} but there are "
            f"{shape[0]} images; reinstall the dataset."
        )
    if y.size and int(y.max()) > 9:
        raise DatasetError(
            f"Fashion-MNIST {split} labels in {str(yf)!r} go up to {int(y.max())} (expected 0..9); "
            "reinstall the dataset."
        )


def _prep_fashion(x: np.ndarray) -> np.ndarray:
    """uint8 ``N x 28 x 28`` -> normalised float32 ``N x 1 x 28 x 28``."""
    out = x.astype(np.float32)[:, None, :, :]
    out /= 255.0
    out -= np.float32(FASHION_MNIST_MEAN)
    out /= np.float32(FASHION_MNIST_STD)
    return out


def _load_fashion_mnist(root: str | Path | None) -> Dataset:
    files = _fashion_files(root)
    x_train, y_train, x_test, y_test = (read_idx(f) for f in files)
    _check_fashion("train", x_train.shape, x_train.dtype, y_train, files[0], files[1])
    _check_fashion("test", x_test.shape, x_test.dtype, y_test, files[2], files[3])
    return Dataset(
        name="fashion-mnist",
        x_train=_prep_fashion(x_train),
        y_train=y_train.astype(np.int64),
        x_test=_prep_fashion(x_test),
        y_test=y_test.astype(np.int64),
        num_classes=10,
        in_channels=1,
        image_size=(28, 28),
        class_names=FASHION_MNIST_CLASSES,
        normalization=(FASHION_MNIST_MEAN, FASHION_MNIST_STD),
    )


def _load_digits() -> Dataset:
    # sklearn's load_digits without importing scikit-learn, split 80/20 per class (common.data.digits).
    images, labels = read_digits()
    train, test = stratified_split(labels, test_size=0.2, seed=0)
    x_train, x_test, y_train, y_test = images[train], images[test], labels[train], labels[test]
    mean = np.float32(x_train.mean())
    std = np.float32(x_train.std())
    x_train = ((x_train - mean) / std).astype(np.float32)[:, None, :, :]
    x_test = ((x_test - mean) / std).astype(np.float32)[:, None, :, :]
    return Dataset(
        name="digits",
        x_train=np.ascontiguousarray(x_train),
        y_train=np.ascontiguousarray(y_train, dtype=np.int64),
        x_test=np.ascontiguousarray(x_test),
        y_test=np.ascontiguousarray(y_test, dtype=np.int64),
        num_classes=10,
        in_channels=1,
        image_size=(8, 8),
        class_names=tuple(str(digit) for digit in range(10)),
        normalization=(float(mean), float(std)),  # read_digits scales the pixels to [0, 1]
    )


@functools.lru_cache(maxsize=8)
def _load_cached(name: str, root: str | None, env: str | None) -> Dataset:
    # ``env`` is part of the key so a changed $FEDFIT_FASHION_MNIST is honoured.
    ds = _load_fashion_mnist(root) if name == "fashion-mnist" else _load_digits()
    _readonly(ds.x_train, ds.y_train, ds.x_test, ds.y_test)
    return ds


def _resolve(name: str, root: str | Path | None) -> str:
    """The dataset a name means (``"auto"`` resolved); raises DatasetError for a bad name or root."""
    key = name.strip().lower()
    if root is not None and not Path(root).expanduser().is_dir():
        raise DatasetError(f"data.root {str(root)!r} is not a folder: fix the path, or leave data.root out to use "
                           f"the system's copy of the data")
    if key == "auto":
        key = "fashion-mnist" if find_fashion_mnist(root) is not None else "digits"
    if key not in DATASET_NAMES:
        valid = ", ".join(repr(n) for n in (*DATASET_NAMES, "auto"))
        raise DatasetError(f"Unknown dataset {name!r}; choose one of {valid}.")
    return key


def load_dataset(name: str, root: str | Path | None = None) -> Dataset:
    """Load a dataset by name: ``"fashion-mnist"``, ``"digits"`` or ``"auto"``.

    ``"auto"`` picks Fashion-MNIST when its files are found and digits otherwise. ``root`` is an extra folder
    searched first for Fashion-MNIST (also as ``root/FashionMNIST/raw``). Results are cached per process and
    their arrays are read-only.

    Raises
    ------
    DatasetError
        For an unknown name, or Fashion-MNIST files that are missing or malformed.
    """
    key = _resolve(name, root)
    root_key = str(Path(root).expanduser()) if root is not None and key == "fashion-mnist" else None
    env_key = os.environ.get(FASHION_MNIST_ENV) if key == "fashion-mnist" else None
    return _load_cached(key, root_key, env_key)


def load_shard(
    name: str,
    root: str | Path | None,
    num_shards: int,
    partition: PartitionSpec | str,
    shard: int,
    seed: int,
) -> tuple[np.ndarray, np.ndarray]:
    """One client's share of a dataset's training set: ``(x, y)`` equal to ``load_dataset(name, root)``'s
    ``x_train[i], y_train[i]`` with ``i = partition_indices(y_train, num_shards, partition, seed)[shard]``.

    For an edge agent: nothing is cached and no whole training set is converted to float32. Fashion-MNIST's
    labels are read first and only the shard's images are kept while the images file is streamed (its test
    files are not read); digits are parsed from scikit-learn's CSV without importing scikit-learn (the whole
    set is 0.5 MB as float32). The arrays are writable float32 ``N x 1 x H x W`` and int64.

    Raises
    ------
    DatasetError
        As :func:`load_dataset` for a bad name, root or dataset files.
    ValueError
        For a bad partition, ``num_shards`` or ``shard``.
    """
    spec = parse_partition(partition) if isinstance(partition, str) else partition
    if isinstance(shard, bool) or not 0 <= shard < num_shards:
        raise ValueError(f"shard must be in [0, num_shards), got {shard} of {num_shards}")
    key = _resolve(name, root)
    if key == "digits":
        digits = _load_digits()
        indices = partition_indices(digits.y_train, num_shards, spec, seed)[shard]
        return digits.x_train[indices], digits.y_train[indices]
    files = _fashion_files(root)
    y_train = read_idx(files[1])
    shape, dtype = read_idx_header(files[0])
    _check_fashion("train", shape, dtype, y_train, files[0], files[1])
    labels = y_train.astype(np.int64)
    indices = partition_indices(labels, num_shards, spec, seed)[shard]
    return _prep_fashion(read_idx_rows(files[0], indices)), labels[indices]


def subsample(x: np.ndarray, y: np.ndarray, count: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Return a seeded random subset of ``count`` samples (all of them, unchanged, if ``count >= len(x)``).

    The subset keeps the original sample order.
    """
    if len(x) != len(y):
        raise ValueError(f"x has {len(x)} samples but y has {len(y)}; they must be the same length.")
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}.")
    if count >= len(x):
        return x, y
    rng = np.random.default_rng(seed)
    idx = np.sort(rng.choice(len(x), size=count, replace=False))
    return x[idx], y[idx]
