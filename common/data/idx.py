"""Reader for the IDX file format used by MNIST and Fashion-MNIST.

An IDX file starts with a 4-byte magic number ``0x00 0x00 <dtype code> <ndim>``, followed by ``ndim``
big-endian uint32 dimension sizes, followed by the data in row-major order (big-endian for multi-byte types).
Files ending in ``.gz`` are decompressed transparently.
"""

from __future__ import annotations

import gzip
import math
import zlib
from pathlib import Path

import numpy as np

from common.data.errors import DatasetError

__all__ = ["IDX_DTYPES", "read_idx"]

#: IDX type code -> numpy dtype (big-endian where it matters).
IDX_DTYPES: dict[int, np.dtype] = {
    0x08: np.dtype(np.uint8),
    0x09: np.dtype(np.int8),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}

_MAX_NDIM = 16


def _read_bytes(path: Path) -> bytes:
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rb") as fh:
                return fh.read()
        return path.read_bytes()
    except FileNotFoundError:
        raise DatasetError(f"IDX file {str(path)!r} does not exist; check the dataset path.") from None
    except (OSError, EOFError, zlib.error) as exc:
        raise DatasetError(
            f"IDX file {str(path)!r} could not be read ({exc}); re-download or reinstall the dataset."
        ) from exc


def read_idx(path: str | Path) -> np.ndarray:
    """Read an IDX file (optionally gzip-compressed) into a numpy array.

    Parameters
    ----------
    path:
        File to read; a ``.gz`` suffix means gzip-compressed.

    Returns
    -------
    numpy.ndarray
        Array with the file's shape and a native-endian dtype matching the IDX type code.

    Raises
    ------
    DatasetError
        When the file is missing, unreadable, or not a well-formed IDX file.
    """
    p = Path(path)
    raw = _read_bytes(p)
    hint = "re-download or reinstall the dataset."
    if len(raw) < 4:
        raise DatasetError(f"IDX file {str(p)!r} is too short to hold a header ({len(raw)} bytes); {hint}")
    if raw[0] != 0 or raw[1] != 0:
        raise DatasetError(
            f"IDX file {str(p)!r} has a bad magic number {raw[:4].hex()} (must start with 0000); {hint}"
        )
    code, ndim = raw[2], raw[3]
    if code not in IDX_DTYPES:
        raise DatasetError(f"IDX file {str(p)!r} has an unknown data type code 0x{code:02x}; {hint}")
    if ndim == 0 or ndim > _MAX_NDIM:
        raise DatasetError(
            f"IDX file {str(p)!r} declares {ndim} dimensions (must be 1..{_MAX_NDIM}); {hint}"
        )
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise DatasetError(
            f"IDX file {str(p)!r} is truncated inside its header ({len(raw)} of {header} bytes); {hint}"
        )
    dims = tuple(int(d) for d in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
    dtype = IDX_DTYPES[code]
    expected = math.prod(dims) * dtype.itemsize
    actual = len(raw) - header
    if actual != expected:
        raise DatasetError(
            f"IDX file {str(p)!r} holds {actual} data bytes but its header {dims} needs {expected}; {hint}"
        )
    data = np.frombuffer(raw, dtype=dtype, offset=header).reshape(dims)
    return data.astype(dtype.newbyteorder("="), copy=True)
