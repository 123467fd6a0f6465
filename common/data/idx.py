"""Reader for the IDX file format used by MNIST and Fashion-MNIST.

An IDX file starts with a 4-byte magic number ``0x00 0x00 <dtype code> <ndim>``, followed by ``ndim``
big-endian uint32 dimension sizes, followed by the data in row-major order (big-endian for multi-byte types).
Files ending in ``.gz`` are decompressed transparently.

:func:`read_idx` reads a whole file; :func:`read_idx_header` only its header; :func:`read_idx_rows` streams the
file and keeps only the rows (first-axis entries) asked for, so a few thousand images of a gzip-compressed
file cost their own size in memory, not the whole file's (a gzip stream cannot be memory-mapped or seeked).
"""

from __future__ import annotations

import gzip
import io
import math
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np

from common.data.errors import DatasetError

__all__ = ["IDX_DTYPES", "read_idx", "read_idx_header", "read_idx_rows"]

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
_HINT = "re-download or reinstall the dataset."
#: Decompressed bytes :func:`read_idx_rows` holds at a time besides the rows it keeps.
_CHUNK_BYTES = 1 << 22


def _unreadable(path: Path, exc: BaseException) -> DatasetError:
    if isinstance(exc, FileNotFoundError):
        return DatasetError(f"IDX file {str(path)!r} does not exist; check the dataset path.")
    return DatasetError(f"IDX file {str(path)!r} could not be read ({exc}); {_HINT}")


def _read_bytes(path: Path) -> bytes:
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rb") as fh:
                return fh.read()
        return path.read_bytes()
    except FileNotFoundError as exc:
        raise _unreadable(path, exc) from None
    except (OSError, EOFError, zlib.error) as exc:
        raise _unreadable(path, exc) from exc


def _open(path: Path) -> io.BufferedIOBase:
    return gzip.open(path, "rb") if path.suffix == ".gz" else path.open("rb")


def _parse_header(p: Path, read: Callable[[int], bytes]) -> tuple[tuple[int, ...], np.dtype, int]:
    """(dims, file dtype, header bytes) from ``read(n)`` (up to ``n`` more bytes of the file's start)."""
    magic = read(4)
    if len(magic) < 4:
        raise DatasetError(f"IDX file {str(p)!r} is too short to hold a header ({len(magic)} bytes); {_HINT}")
    if magic[0] != 0 or magic[1] != 0:
        raise DatasetError(
            f"IDX file {str(p)!r} has a bad magic number {magic[:4].hex()} (must start with 0000); {_HINT}"
        )
    code, ndim = magic[2], magic[3]
    if code not in IDX_DTYPES:
        raise DatasetError(f"IDX file {str(p)!r} has an unknown data type code 0x{code:02x}; {_HINT}")
    if ndim == 0 or ndim > _MAX_NDIM:
        raise DatasetError(
            f"IDX file {str(p)!r} declares {ndim} dimensions (must be 1..{_MAX_NDIM}); {_HINT}"
        )
    header = 4 + 4 * ndim
    sizes = read(4 * ndim)
    if len(sizes) < 4 * ndim:
        raise DatasetError(
            f"IDX file {str(p)!r} is truncated inside its header ({4 + len(sizes)} of {header} bytes); {_HINT}"
        )
    dims = tuple(int(d) for d in np.frombuffer(sizes, dtype=">u4", count=ndim))
    return dims, IDX_DTYPES[code], header


def _size_error(p: Path, actual: int, dims: tuple[int, ...], expected: int) -> DatasetError:
    return DatasetError(
        f"IDX file {str(p)!r} holds {actual} data bytes but its header {dims} needs {expected}; {_HINT}"
    )


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
    offset = 0

    def read(n: int) -> bytes:
        nonlocal offset
        piece = raw[offset:offset + n]
        offset += len(piece)
        return piece

    dims, dtype, header = _parse_header(p, read)
    expected = math.prod(dims) * dtype.itemsize
    actual = len(raw) - header
    if actual != expected:
        raise _size_error(p, actual, dims, expected)
    data = np.frombuffer(raw, dtype=dtype, offset=header).reshape(dims)
    return data.astype(dtype.newbyteorder("="), copy=True)


def read_idx_header(path: str | Path) -> tuple[tuple[int, ...], np.dtype]:
    """The shape and (native-endian) dtype :func:`read_idx` would return, from the file's header alone.

    Raises
    ------
    DatasetError
        When the file is missing, unreadable, or its header is malformed (the data is not checked).
    """
    p = Path(path)
    try:
        with _open(p) as fh:
            dims, dtype, _ = _parse_header(p, fh.read)
    except FileNotFoundError as exc:
        raise _unreadable(p, exc) from None
    except (OSError, EOFError, zlib.error) as exc:
        raise _unreadable(p, exc) from exc
    return dims, dtype.newbyteorder("=")


def _read_full(fh: io.BufferedIOBase, view: memoryview) -> int:
    """Fill ``view`` from ``fh``; the number of bytes read (fewer only at the end of the file)."""
    done = 0
    while done < len(view):
        got = fh.readinto(view[done:])
        if not got:
            break
        done += got
    return done


def read_idx_rows(path: str | Path, rows: np.ndarray) -> np.ndarray:
    """``read_idx(path)[rows]`` without holding the whole file: the file is streamed in chunks of about 4 MiB
    and only the asked rows are kept. The whole file is still read, so a malformed one is refused as by
    :func:`read_idx`.

    Parameters
    ----------
    path:
        File to read; a ``.gz`` suffix means gzip-compressed.
    rows:
        Indices along the first axis, in any order (repeats allowed).

    Raises
    ------
    DatasetError
        When the file is missing, unreadable, or not a well-formed IDX file.
    IndexError
        When a row is outside the file's first dimension.
    """
    p = Path(path)
    want = np.asarray(rows, dtype=np.int64).reshape(-1)
    try:
        with _open(p) as fh:
            dims, dtype, _ = _parse_header(p, fh.read)
            if want.size and (int(want.min()) < 0 or int(want.max()) >= dims[0]):
                raise IndexError(f"rows of {str(p)!r} must be in 0..{dims[0] - 1}, got "
                                 f"{int(want.min())}..{int(want.max())}")
            row_items = math.prod(dims[1:])
            row_bytes = row_items * dtype.itemsize
            expected = dims[0] * row_bytes
            out = np.empty((len(want), *dims[1:]), dtype=dtype.newbyteorder("="))
            order = np.argsort(want, kind="stable")
            ordered = want[order]
            per_chunk = max(1, _CHUNK_BYTES // max(1, row_bytes))
            buffer = bytearray(min(per_chunk, dims[0]) * row_bytes)
            view = memoryview(buffer)
            actual, start, taken = 0, 0, 0
            while start < dims[0]:
                count = min(per_chunk, dims[0] - start)
                got = _read_full(fh, view[:count * row_bytes])
                actual += got
                if got < count * row_bytes:
                    raise _size_error(p, actual, dims, expected)
                chunk = np.frombuffer(buffer, dtype=dtype, count=count * row_items).reshape(count, *dims[1:])
                stop = int(np.searchsorted(ordered, start + count, side="left"))
                if stop > taken:
                    out[order[taken:stop]] = chunk[ordered[taken:stop] - start]
                taken, start = stop, start + count
            spare = view if len(view) else memoryview(bytearray(1))
            while trailing := fh.readinto(spare):  # bytes past the data: counted for the message
                actual += trailing
            if actual != expected:
                raise _size_error(p, actual, dims, expected)
    except FileNotFoundError as exc:
        raise _unreadable(p, exc) from None
    except (OSError, EOFError, zlib.error) as exc:
        raise _unreadable(p, exc) from exc
    return out
