"""Tensors on the wire: ``{"dtype": str, "shape": [int, ...], "data": raw little-endian C-order bytes}``."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from protocol._ids import shown
from protocol.errors import ProtocolError
from protocol.limits import DEFAULT_LIMITS, Limits

ALLOWED_DTYPES: frozenset[str] = frozenset(
    {"float32", "float16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool"}
)
TENSOR_KEYS: frozenset[str] = frozenset({"dtype", "shape", "data"})
_ALLOWED_TEXT = ", ".join(sorted(ALLOWED_DTYPES))


def _allowed_dtype(name: object) -> np.dtype[Any]:
    if not isinstance(name, str) or name not in ALLOWED_DTYPES:
        raise ProtocolError(f"tensor dtype {shown(name)} is not allowed (allowed: {_ALLOWED_TEXT})")
    return np.dtype(name)


def check_array(array: object, limits: Limits = DEFAULT_LIMITS) -> np.ndarray:
    """Check an in-memory array against the rules `decode_tensor` applies on the wire; returns it."""
    if not isinstance(array, np.ndarray):
        raise ProtocolError(
            f"tensor must be a numpy array, got {shown(array)} (convert torch tensors with .numpy())"
        )
    _allowed_dtype(array.dtype.name)
    if array.ndim > limits.max_dims:
        raise ProtocolError(f"tensor has {array.ndim} dimensions, more than the limit of {limits.max_dims}")
    if array.size > limits.max_tensor_elements:
        raise ProtocolError(
            f"tensor has {array.size} elements, more than the limit of {limits.max_tensor_elements}"
        )
    if array.dtype.kind == "f" and not np.isfinite(array).all():
        raise ProtocolError("tensor contains NaN or Inf")
    return array


def encode_tensor(array: np.ndarray) -> dict[str, Any]:
    """Turn a numpy array of an allowed dtype into its wire map (little-endian, C order).

    Values are not inspected here; `protocol.encode` rejects NaN/Inf weights before sending.
    """
    if not isinstance(array, np.ndarray):
        raise ProtocolError(
            f"tensor must be a numpy array, got {shown(array)} (convert torch tensors with .numpy())"
        )
    dtype = _allowed_dtype(array.dtype.name)
    wire = np.ascontiguousarray(array, dtype=dtype.newbyteorder("<"))
    return {"dtype": dtype.name, "shape": [int(n) for n in array.shape], "data": wire.tobytes()}


def _check_shape(shape: object, limits: Limits) -> tuple[int, ...]:
    if not isinstance(shape, (list, tuple)):
        raise ProtocolError(f"tensor shape must be a list of ints, got {shown(shape)}")
    if len(shape) > limits.max_dims:
        raise ProtocolError(f"tensor has {len(shape)} dimensions, more than the limit of {limits.max_dims}")
    for size in shape:
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ProtocolError(f"tensor shape must hold non-negative ints, got {shown(size)}")
    return tuple(shape)


def decode_tensor(obj: object, limits: Limits = DEFAULT_LIMITS) -> np.ndarray:
    """Validate a wire map and return a writable, native-endian copy of the tensor.

    Raises ProtocolError for a wrong key set, a dtype off the whitelist, a bad or oversized shape, a byte
    length that does not match the shape, bool bytes other than 0/1, or NaN/Inf in a float tensor.
    """
    if not isinstance(obj, dict):
        raise ProtocolError(f"tensor must be a map with keys data, dtype, shape; got {shown(obj)}")
    keys = set(obj)
    if keys != TENSOR_KEYS:
        missing = sorted(TENSOR_KEYS - keys)
        unknown = sorted(repr(key) for key in keys - TENSOR_KEYS)
        raise ProtocolError(
            f"tensor map must have exactly data, dtype, shape (missing: {missing}; unknown: {unknown})"
        )
    dtype = _allowed_dtype(obj["dtype"])
    shape = _check_shape(obj["shape"], limits)
    count = math.prod(shape)
    if count > limits.max_tensor_elements:
        raise ProtocolError(
            f"tensor has {count} elements, more than the limit of {limits.max_tensor_elements}"
        )
    data = obj["data"]
    if not isinstance(data, (bytes, bytearray)):
        raise ProtocolError(f"tensor data must be bytes, got {shown(data)}")
    if len(data) != count * dtype.itemsize:
        raise ProtocolError(
            f"tensor data is {len(data)} bytes but shape {list(shape)} of {dtype.name} needs "
            f"{count * dtype.itemsize}"
        )
    if dtype.kind == "b" and bool((np.frombuffer(data, dtype=np.uint8) > 1).any()):
        raise ProtocolError("bool tensor data holds bytes other than 0 and 1")
    array = np.frombuffer(data, dtype=dtype.newbyteorder("<")).astype(dtype, copy=True).reshape(shape)
    if dtype.kind == "f" and not np.isfinite(array).all():
        raise ProtocolError("tensor contains NaN or Inf")
    return array
