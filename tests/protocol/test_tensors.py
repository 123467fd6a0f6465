"""Tensor wire maps: encoding, and every rejection of decode_tensor."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from protocol import DEFAULT_LIMITS, Limits, ProtocolError, decode_tensor, encode_tensor
from protocol.tensors import ALLOWED_DTYPES, all_finite, check_array


def _sample(dtype: str) -> np.ndarray:
    values = np.arange(-6, 6).reshape(3, 4)
    if dtype == "bool":
        return np.asarray(values % 3 == 0)
    if dtype == "uint8":
        return (values + 6).astype(dtype)
    return (values * (1.5 if dtype.startswith("float") else 1)).astype(dtype)


@pytest.mark.parametrize("dtype", sorted(ALLOWED_DTYPES))
def test_round_trip_every_allowed_dtype(dtype: str) -> None:
    array = _sample(dtype)
    wire = encode_tensor(array)
    assert wire["dtype"] == dtype
    assert wire["shape"] == [3, 4]
    assert wire["data"] == array.astype(np.dtype(dtype).newbyteorder("<")).tobytes()
    decoded = decode_tensor(wire, DEFAULT_LIMITS)
    assert decoded.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(decoded, array)


def test_encode_makes_little_endian_c_order() -> None:
    big_endian = np.arange(6, dtype=">i4").reshape(2, 3)
    transposed = big_endian.T  # not C-contiguous, not native order
    wire = encode_tensor(transposed)
    assert wire["shape"] == [3, 2]
    assert wire["data"] == np.ascontiguousarray(transposed).astype("<i4").tobytes()
    np.testing.assert_array_equal(decode_tensor(wire, DEFAULT_LIMITS), transposed)


def test_decoded_array_is_a_native_read_only_view() -> None:
    wire = encode_tensor(np.ones((2, 2), dtype=np.float32))
    decoded = decode_tensor(wire, DEFAULT_LIMITS)
    assert decoded.dtype.isnative and decoded.flags.c_contiguous
    assert not decoded.flags.writeable and not decoded.flags.owndata  # a view on the wire bytes
    with pytest.raises(ValueError, match="read-only"):
        decoded[0, 0] = 5.0
    copy = decoded.copy()  # what a consumer that must write takes
    copy[0, 0] = 5.0
    assert copy[0, 0] == 5.0


def test_all_finite_takes_the_exact_test_only_when_the_sum_of_squares_overflows() -> None:
    assert all_finite(np.ones(1000, dtype=np.float32))
    assert all_finite(np.arange(5))  # not floats
    assert all_finite(np.zeros(0, dtype=np.float32))
    # Large finite values: the fast sum of squares overflows, the exact test says finite (the second branch).
    large = np.full(10, 3e38, dtype=np.float32)
    with np.errstate(over="ignore"):
        assert not np.isfinite(np.dot(large, large))
    assert all_finite(large)
    assert all_finite(np.full(10, 6e4, dtype=np.float16))  # float16 is summed in float32: no overflow here
    assert all_finite(np.full(10, 1e300))
    for dtype in ("float16", "float32", "float64"):
        for bad in (np.nan, np.inf, -np.inf):
            for at in (0, 4, 9):
                array = np.full(10, 1e4 if dtype == "float16" else 1e30, dtype=dtype)  # overflow-prone, finite
                array[at] = bad
                assert not all_finite(array), (dtype, bad, at)
                assert not all_finite(array.reshape(2, 5)), (dtype, bad, at)
                with pytest.raises(ProtocolError, match="NaN or Inf"):
                    check_array(array)


@pytest.mark.parametrize("shape", [(), (0,), (0, 5), (1, 1, 1, 1, 1, 1, 1, 1)])
def test_edge_shapes_round_trip(shape: tuple[int, ...]) -> None:
    array = np.full(shape, 2.5, dtype=np.float64)
    decoded = decode_tensor(encode_tensor(array), DEFAULT_LIMITS)
    assert decoded.shape == shape
    np.testing.assert_array_equal(decoded, array)


@pytest.mark.parametrize(
    "array",
    [
        np.zeros(2, dtype=np.complex64),
        np.array(["a"], dtype=object),
        np.array(["ab"]),
        np.zeros(2, dtype="datetime64[s]"),
        np.zeros(2, dtype=[("a", "f4")]),
        np.zeros(2, dtype=np.uint16),
    ],
)
def test_encode_rejects_disallowed_dtype(array: np.ndarray) -> None:
    with pytest.raises(ProtocolError, match="not allowed"):
        encode_tensor(array)


def test_encode_rejects_non_arrays() -> None:
    with pytest.raises(ProtocolError, match="numpy array"):
        encode_tensor([1.0, 2.0])  # type: ignore[arg-type]


def _wire(**changes: Any) -> dict[str, Any]:
    wire = encode_tensor(np.arange(6, dtype=np.float32).reshape(2, 3))
    wire.update(changes)
    return wire


@pytest.mark.parametrize(
    ("obj", "reason"),
    [
        ([1, 2], "must be a map"),
        ({"dtype": "float32", "shape": [0]}, "missing"),
        ({**_wire(), "order": "C"}, "unknown"),
        (_wire(dtype="complex64"), "not allowed"),
        (_wire(dtype="<f4"), "not allowed"),
        (_wire(dtype=5), "not allowed"),
        (_wire(shape="2,3"), "shape"),
        (_wire(shape=[2, -3]), "non-negative"),
        (_wire(shape=[2, True]), "non-negative"),
        (_wire(shape=[2.0, 3]), "non-negative"),
        (_wire(shape=[1] * 9), "dimensions"),
        (_wire(shape=[2**20, 2**20]), "elements"),
        (_wire(shape=[2**40]), "elements"),
        (_wire(shape=[2**62, 2**62, 2**62]), "elements"),
        (_wire(shape=[3, 3]), "bytes"),
        (_wire(shape=[2, 2]), "bytes"),
        (_wire(data=b""), "bytes"),
        (_wire(data="abc"), "bytes"),
        (_wire(data=[1, 2]), "bytes"),
    ],
)
def test_decode_rejects_malformed(obj: object, reason: str) -> None:
    with pytest.raises(ProtocolError, match=reason):
        decode_tensor(obj, DEFAULT_LIMITS)


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_decode_rejects_nan_and_inf(dtype: str, bad: float) -> None:
    array = np.ones(5, dtype=dtype)
    array[3] = bad
    with pytest.raises(ProtocolError, match="tensor contains NaN or Inf"):
        decode_tensor(encode_tensor(array), DEFAULT_LIMITS)


def test_decode_rejects_bool_bytes_other_than_zero_and_one() -> None:
    wire = {"dtype": "bool", "shape": [3], "data": b"\x00\x01\x02"}
    with pytest.raises(ProtocolError, match="bool"):
        decode_tensor(wire, DEFAULT_LIMITS)


def test_decode_honours_limits() -> None:
    wire = encode_tensor(np.zeros((4, 4), dtype=np.int8))
    with pytest.raises(ProtocolError, match="elements"):
        decode_tensor(wire, Limits(max_tensor_elements=15))
    with pytest.raises(ProtocolError, match="dimensions"):
        decode_tensor(wire, Limits(max_dims=1))
    assert decode_tensor(wire, Limits(max_tensor_elements=16, max_dims=2)).shape == (4, 4)


def test_check_array_applies_decode_rules() -> None:
    good = np.ones(3, dtype=np.float32)
    assert check_array(good) is good
    with pytest.raises(ProtocolError, match="NaN or Inf"):
        check_array(np.array([1.0, np.nan]))
    with pytest.raises(ProtocolError, match="dimensions"):
        check_array(np.zeros((1,) * 3), Limits(max_dims=2))
    with pytest.raises(ProtocolError, match="not allowed"):
        check_array(np.zeros(1, dtype=np.complex128))
