"""scikit-learn's digits dataset without importing scikit-learn (nor, with it, scipy).

scikit-learn ships the 1797 8x8 images as ``sklearn/datasets/data/digits.csv.gz`` (64 pixel columns, 0..16, then
the label). The file is found with ``importlib.util.find_spec("sklearn")``, which locates the top-level package
without running its ``__init__``; it is parsed as ``sklearn.datasets.load_digits`` parses it (``tests/common/test_data_digits.py`` compares the
two). The train/test split is FedFit's own stratified split (:func:`stratified_split`), the same in every process
that loads the dataset: coordinator, simulator and agents.
"""

from __future__ import annotations

import gzip
import importlib.util
import zlib
from pathlib import Path

import numpy as np

from common.data.errors import DatasetError

__all__ = ["digits_csv_path", "read_digits", "stratified_split"]

_CSV = ("datasets", "data", "digits.csv.gz")


def digits_csv_path() -> Path:
    """Where scikit-learn keeps the digits CSV; raises DatasetError when it has none."""
    try:
        spec = importlib.util.find_spec("sklearn")  # finds the package; does not import it
    except (ImportError, ValueError):
        spec = None
    where = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in where:
        candidate = Path(folder).joinpath(*_CSV)
        if candidate.is_file():
            return candidate
    found = f"scikit-learn at {where[0]} has no {'/'.join(_CSV)}" if where else "scikit-learn is not installed"
    raise DatasetError(
        f"The digits dataset is read from scikit-learn's copy (sklearn/{'/'.join(_CSV)}) but {found} for this "
        "Python; install scikit-learn, use 'fashion-mnist', or give the data as a file (data.path)."
    )


def read_digits() -> tuple[np.ndarray, np.ndarray]:
    """All 1797 digits: float32 ``N x 8 x 8`` images scaled to 0..1 (pixel / 16) and int64 labels."""
    path = digits_csv_path()
    try:
        with path.open("rb") as compressed, gzip.open(compressed, mode="rt", encoding="utf-8") as text:
            data = np.loadtxt(text, delimiter=",")
    except (OSError, EOFError, zlib.error, ValueError) as exc:
        raise DatasetError(f"scikit-learn's digits file {str(path)!r} could not be read ({exc}); reinstall "
                           "scikit-learn.") from exc
    if data.ndim != 2 or data.shape[1] != 65:
        raise DatasetError(f"scikit-learn's digits file {str(path)!r} has shape {data.shape} (expected N x 65); "
                           "reinstall scikit-learn.")
    labels = np.asarray(data[:, -1].astype(int, copy=False), dtype=np.int64)
    images = np.asarray(data[:, :-1].reshape(-1, 8, 8), dtype=np.float32) / np.float32(16.0)
    return images, labels


def stratified_split(labels: np.ndarray, test_size: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, test) indices, sorted, that keep every class's share in both: each class gives
    ``round(test_size * its count)`` samples (at least one, and at least one left for training), drawn by a
    ``numpy.random.default_rng(seed)`` permutation of the class, to the test set. Deterministic for a seed."""
    y = np.asarray(labels)
    if not 0.0 < test_size < 1.0:
        raise ValueError(f"test_size must be in (0, 1), got {test_size}")
    rng = np.random.default_rng(seed)
    test: list[np.ndarray] = []
    for label in np.unique(y):
        members = np.flatnonzero(y == label)
        if len(members) < 2:
            raise ValueError(f"class {label} has {len(members)} sample(s): a stratified split needs every class "
                             f"in both sets, so at least 2 samples each")
        count = min(len(members) - 1, max(1, round(test_size * len(members))))
        test.append(rng.permutation(members)[:count])
    chosen = np.sort(np.concatenate(test))
    train = np.setdiff1d(np.arange(len(y)), chosen, assume_unique=True)
    return train, chosen
