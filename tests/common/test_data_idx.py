"""Tests for common.data.idx: read_idx, read_idx_header and read_idx_rows."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np
import pytest

from common.data import DatasetError, read_idx
from common.data import idx as idx_mod
from common.data.idx import read_idx_header, read_idx_rows


def idx_bytes(array: np.ndarray, code: int, dtype: str) -> bytes:
    header = bytes([0, 0, code, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    return header + array.astype(dtype).tobytes()


def test_reads_uint8_images(tmp_path: Path) -> None:
    data = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    path = tmp_path / "images-idx3-ubyte"
    path.write_bytes(idx_bytes(data, 0x08, "u1"))
    out = read_idx(path)
    assert out.dtype == np.uint8
    assert out.shape == (2, 3, 4)
    np.testing.assert_array_equal(out, data)


def test_reads_gzip_and_str_path(tmp_path: Path) -> None:
    data = np.array([3, 1, 4, 1, 5], dtype=np.uint8)
    path = tmp_path / "labels-idx1-ubyte.gz"
    path.write_bytes(gzip.compress(idx_bytes(data, 0x08, "u1")))
    np.testing.assert_array_equal(read_idx(str(path)), data)


@pytest.mark.parametrize(
    ("code", "wire", "native"),
    [(0x09, "i1", np.int8), (0x0B, ">i2", np.int16), (0x0C, ">i4", np.int32), (0x0D, ">f4", np.float32),
     (0x0E, ">f8", np.float64)],
)
def test_reads_big_endian_types(tmp_path: Path, code: int, wire: str, native: type) -> None:
    data: np.ndarray = np.array([[-2, 7], [100, -5]]).astype(native)
    path = tmp_path / "x.idx"
    path.write_bytes(idx_bytes(data, code, wire))
    out = read_idx(path)
    assert out.dtype == np.dtype(native)
    assert out.dtype.isnative
    np.testing.assert_array_equal(out, data)


MALFORMED = [
        (b"\x00\x00", "too short"),
        (b"\x01\x00\x08\x01\x00\x00\x00\x01\x05", "magic"),
        (b"\x00\x00\x07\x01\x00\x00\x00\x01\x05", "data type code 0x07"),
        (b"\x00\x00\x08\x00", "0 dimensions"),
        (b"\x00\x00\x08\x02\x00\x00\x00\x01", "truncated inside its header"),
        (b"\x00\x00\x08\x01\x00\x00\x00\x03\x01\x02", "holds 2 data bytes"),
        (b"\x00\x00\x08\x01\x00\x00\x00\x01\x01\x02", "holds 2 data bytes"),
        (b"\x00\x00\x0b\x01\x00\x00\x00\x02\x00\x01\x00", "needs 4"),
]


@pytest.mark.parametrize(("payload", "fragment"), MALFORMED)
def test_rejects_malformed(tmp_path: Path, payload: bytes, fragment: str) -> None:
    path = tmp_path / "bad-idx"
    path.write_bytes(payload)
    with pytest.raises(DatasetError, match="bad-idx") as info:
        read_idx(path)
    assert fragment in str(info.value)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="does not exist"):
        read_idx(tmp_path / "nope-idx3-ubyte")


def test_corrupt_gzip(tmp_path: Path) -> None:
    path = tmp_path / "broken.gz"
    path.write_bytes(b"not gzip at all")
    with pytest.raises(DatasetError, match="could not be read"):
        read_idx(path)


@pytest.mark.parametrize("gz", [False, True])
@pytest.mark.parametrize("chunk_bytes", [1, 7 * 3 * 2, 1 << 22])
def test_read_rows_matches_read_idx(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gz: bool,
                                    chunk_bytes: int) -> None:
    monkeypatch.setattr(idx_mod, "_CHUNK_BYTES", chunk_bytes)  # one row, a few rows, the whole file per chunk
    data = np.arange(23 * 3 * 7, dtype=np.int16).reshape(23, 3, 7) - 100
    raw = idx_bytes(data, 0x0B, ">i2")
    path = tmp_path / ("x.idx.gz" if gz else "x.idx")
    path.write_bytes(gzip.compress(raw) if gz else raw)
    whole = read_idx(path)
    for rows in ([0, 5, 6, 22], [22, 3, 3, 0, 17], list(range(23)), []):
        out = read_idx_rows(path, np.array(rows, dtype=np.int64))
        assert out.dtype == np.dtype(np.int16) and out.dtype.isnative
        assert out.shape == (len(rows), 3, 7)
        np.testing.assert_array_equal(out, whole[rows])
    assert read_idx_header(path) == ((23, 3, 7), np.dtype(np.int16))


@pytest.mark.parametrize(("payload", "fragment"), MALFORMED)
@pytest.mark.parametrize("gz", [False, True])
def test_read_rows_and_header_reject_malformed_files_as_read_idx_does(tmp_path: Path, payload: bytes,
                                                                     fragment: str, gz: bool) -> None:
    path = tmp_path / ("bad-idx.gz" if gz else "bad-idx")
    path.write_bytes(gzip.compress(payload) if gz else payload)
    with pytest.raises(DatasetError) as whole:
        read_idx(path)
    with pytest.raises(DatasetError) as rows:
        read_idx_rows(path, np.array([], dtype=np.int64))
    assert str(rows.value) == str(whole.value)
    assert fragment in str(rows.value)
    if "data bytes" not in fragment and "needs" not in fragment:  # the header alone is wrong
        with pytest.raises(DatasetError) as header:
            read_idx_header(path)
        assert str(header.value) == str(whole.value)


def test_read_rows_missing_corrupt_and_out_of_range(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="does not exist"):
        read_idx_rows(tmp_path / "nope-idx3-ubyte", np.array([0]))
    broken = tmp_path / "broken.gz"
    broken.write_bytes(b"not gzip at all")
    with pytest.raises(DatasetError, match="could not be read"):
        read_idx_rows(broken, np.array([0]))
    with pytest.raises(DatasetError, match="could not be read"):
        read_idx_header(broken)
    truncated = tmp_path / "truncated.gz"
    truncated.write_bytes(gzip.compress(idx_bytes(np.zeros((50, 4)), 0x08, "u1"))[:-12])
    with pytest.raises(DatasetError, match="could not be read"):
        read_idx_rows(truncated, np.array([1]))
    path = tmp_path / "x.idx"
    path.write_bytes(idx_bytes(np.zeros((4, 2)), 0x08, "u1"))
    with pytest.raises(IndexError, match="0..3"):
        read_idx_rows(path, np.array([4]))
    with pytest.raises(IndexError):
        read_idx_rows(path, np.array([-1]))
