"""Tensors on the wire and the checks every tensor passes, whichever layout carries it.

Version 1 carries a tensor as a map ``{"dtype": str, "shape": [int, ...], "data": raw little-endian C-order
bytes}`` (`encode_tensor`, `decode_tensor`); version 2 carries the same raw bytes after the message's header
(`protocol.framing`). Either way a decoded tensor is a read-only view on the bytes received (a copy only on a
big-endian host or for bytes that are not aligned for the dtype).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from protocol._ids import shown
from protocol.errors import ProtocolError
from protocol.limits import DEFAULT_LIMITS, Limits

ALLOWED_DTYPES: frozenset[str] = frozenset(
    {"float32", "float16", "float64", "int64", "int32", "int16", "int8", "uint8", "uint64", "bool"}
)
TENSOR_KEYS: frozenset[str] = frozenset({"dtype", "shape", "data"})
_ALLOWED_TEXT = ", ".join(sorted(ALLOWED_DTYPES))
_DTYPES: dict[str, np.dtype[Any]] = {name: np.dtype(name) for name in ALLOWED_DTYPES}
_WIRE_DTYPES: dict[str, np.dtype[Any]] = {name: np.dtype(name).newbyteorder("<") for name in ALLOWED_DTYPES}
_NAME_OF: dict[tuple[str, int], str] = {(np.dtype(name).kind, np.dtype(name).itemsize): name for name in ALLOWED_DTYPES}
_SMALL = 4096  # elements: an array this small is tested for NaN/Inf element by element at once


def allowed_dtype(name: object) -> np.dtype[Any]:
    """The numpy dtype of a whitelisted dtype name; ProtocolError for any other value."""
    dtype = _DTYPES.get(name) if isinstance(name, str) else None
    if dtype is None:
        raise ProtocolError(f"tensor dtype {shown(name)} is not allowed (allowed: {_ALLOWED_TEXT})")
    return dtype


def dtype_name(dtype: np.dtype[Any]) -> str:
    """The whitelisted name of an array's dtype, whatever its byte order; ProtocolError for any other dtype."""
    name = _NAME_OF.get((dtype.kind, dtype.itemsize)) if dtype.fields is None and not dtype.shape else None
    if name is None:
        raise ProtocolError(f"tensor dtype {shown(dtype.name)} is not allowed (allowed: {_ALLOWED_TEXT})")
    return name


def all_finite(array: np.ndarray) -> bool:
    """Whether a float array holds no NaN or Inf (any other array: True), in one read of its memory.

    NaN and Inf propagate through IEEE multiplication and addition, so a finite sum of squares (a BLAS dot
    product, float16 summed in float32) proves every element finite. Only a non-finite result, which finite
    values as large as 1e19 can also give by overflowing, takes the exact elementwise test.
    """
    if array.dtype.kind != "f" or array.size == 0:
        return True
    if array.size <= _SMALL:
        return bool(np.isfinite(array).all())
    flat = array.reshape(-1)
    with np.errstate(over="ignore", invalid="ignore"):
        total = np.add.reduce(flat, dtype=np.float32) if array.dtype.itemsize < 4 else np.dot(flat, flat)
    return bool(np.isfinite(total)) or bool(np.isfinite(array).all())


def check_values(array: np.ndarray) -> None:
    """The rules on a tensor's values: bool bytes 0 or 1, floats without NaN or Inf."""
    if array.dtype.kind == "b" and array.size and int(np.maximum.reduce(array.reshape(-1).view(np.uint8))) > 1:
        raise ProtocolError("bool tensor data holds bytes other than 0 and 1")
    if not all_finite(array):
        raise ProtocolError("tensor contains NaN or Inf")


def check_array(array: object, limits: Limits = DEFAULT_LIMITS) -> np.ndarray:
    """Check an in-memory array against the rules a decoder applies on the wire; returns it."""
    if not isinstance(array, np.ndarray):
        raise ProtocolError(
            f"tensor must be a numpy array, got {shown(array)} (convert torch tensors with .numpy())"
        )
    dtype_name(array.dtype)
    if array.ndim > limits.max_dims:
        raise ProtocolError(f"tensor has {array.ndim} dimensions, more than the limit of {limits.max_dims}")
    if array.size > limits.max_tensor_elements:
        raise ProtocolError(
            f"tensor has {array.size} elements, more than the limit of {limits.max_tensor_elements}"
        )
    if not all_finite(array):
        raise ProtocolError("tensor contains NaN or Inf")
    return array


def wire_array(array: np.ndarray) -> np.ndarray:
    """The array as it goes on the wire: little-endian, C order (the array itself when it is already so)."""
    if not isinstance(array, np.ndarray):
        raise ProtocolError(
            f"tensor must be a numpy array, got {shown(array)} (convert torch tensors with .numpy())"
        )
    wire = _WIRE_DTYPES[dtype_name(array.dtype)]
    if array.dtype == wire and array.flags.c_contiguous:
        return array
    return np.asarray(array, dtype=wire, order="C")


def encode_tensor(array: np.ndarray) -> dict[str, Any]:
    """Turn a numpy array of an allowed dtype into its version 1 wire map (little-endian, C order).

    Values are not inspected here; `protocol.encode` rejects NaN/Inf weights before sending.
    """
    wire = wire_array(array)
    return {"dtype": dtype_name(wire.dtype), "shape": [int(n) for n in array.shape], "data": wire.tobytes()}


def check_shape(shape: object, limits: Limits) -> tuple[tuple[int, ...], int]:
    """A wire shape (a list of non-negative ints within the limits) and its element count."""
    if not isinstance(shape, (list, tuple)):
        raise ProtocolError(f"tensor shape must be a list of ints, got {shown(shape)}")
    if len(shape) > limits.max_dims:
        raise ProtocolError(f"tensor has {len(shape)} dimensions, more than the limit of {limits.max_dims}")
    for size in shape:
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ProtocolError(f"tensor shape must hold non-negative ints, got {shown(size)}")
    count = math.prod(shape)
    if count > limits.max_tensor_elements:
        raise ProtocolError(
            f"tensor has {count} elements, more than the limit of {limits.max_tensor_elements}"
        )
    return tuple(shape), count


def view_tensor(
    buffer: bytes | bytearray | memoryview, dtype: np.dtype[Any], shape: tuple[int, ...], count: int, offset: int
) -> np.ndarray:
    """A read-only array of ``count`` elements of little-endian ``dtype`` at ``offset`` of ``buffer``, checked
    with `check_values`. A view on the buffer, copied only where the host is big-endian or the bytes are not
    aligned for the dtype."""
    array = np.frombuffer(buffer, dtype=_WIRE_DTYPES[dtype_name(dtype)], count=count, offset=offset).reshape(shape)
    if not (array.dtype.isnative and array.flags.aligned):
        array = array.astype(dtype.newbyteorder("="), copy=True)
    array.flags.writeable = False
    check_values(array)
    return array


def decode_tensor(obj: object, limits: Limits = DEFAULT_LIMITS) -> np.ndarray:
    """Validate a version 1 wire map and return the tensor: a read-only, native-endian view on its data.

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
    dtype = allowed_dtype(obj["dtype"])
    shape, count = check_shape(obj["shape"], limits)
    data = obj["data"]
    if not isinstance(data, (bytes, bytearray)):
        raise ProtocolError(f"tensor data must be bytes, got {shown(data)}")
    if len(data) != count * dtype.itemsize:
        raise ProtocolError(
            f"tensor data is {len(data)} bytes but shape {list(shape)} of {dtype.name} needs "
            f"{count * dtype.itemsize}"
        )
    return view_tensor(data, dtype, shape, count, 0)
