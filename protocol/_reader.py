"""Typed access to the fields of one decoded msgpack map, naming the field in every error."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import fields
from typing import Any, TypeVar

import numpy as np

from protocol._ids import shown, validate_name, validate_task_id
from protocol.errors import ProtocolError
from protocol.framing import TensorSection
from protocol.limits import Limits
from protocol.tensors import decode_tensor

T = TypeVar("T")

MAX_TREE_DEPTH = 16
"""Deepest nesting of maps/lists accepted in a spec or options value."""


def check_int(value: object, label: str, minimum: int | None = None) -> int:
    """An int (bool refused), optionally >= minimum."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ProtocolError(f"{label} must be an integer, got {shown(value)}")
    if minimum is not None and value < minimum:
        raise ProtocolError(f"{label} must be >= {minimum}, got {value}")
    return value


def check_number(
    value: object,
    label: str,
    minimum: float | None = None,
    above: float | None = None,
    below: float | None = None,
) -> float:
    """A finite float (ints accepted and converted, bool refused) within the given bounds."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ProtocolError(f"{label} must be a number, got {shown(value)}")
    try:
        number = float(value)
    except OverflowError:
        raise ProtocolError(f"{label} is too large for a float") from None
    if not math.isfinite(number):
        raise ProtocolError(f"{label} must be finite, got {number}")
    if minimum is not None and number < minimum:
        raise ProtocolError(f"{label} must be >= {minimum}, got {number}")
    if above is not None and number <= above:
        raise ProtocolError(f"{label} must be > {above}, got {number}")
    if below is not None and number >= below:
        raise ProtocolError(f"{label} must be < {below}, got {number}")
    return number


def check_text(
    value: object, label: str, limits: Limits, choices: Iterable[str] | None = None, allow_empty: bool = False
) -> str:
    """A string of at most limits.max_str_len chars, non-empty unless allowed, optionally one of choices."""
    if not isinstance(value, str):
        raise ProtocolError(f"{label} must be a string, got {shown(value)}")
    if len(value) > limits.max_str_len:
        raise ProtocolError(
            f"{label} is {len(value)} characters long, more than the limit of {limits.max_str_len}"
        )
    if not value and not allow_empty:
        raise ProtocolError(f"{label} must not be empty")
    if choices is not None:
        options = tuple(choices)
        if value not in options:
            raise ProtocolError(f"{label} must be one of {', '.join(options)}; got {shown(value)}")
    return value


def _check_key(key: object, label: str, limits: Limits) -> str:
    if not isinstance(key, str):
        raise ProtocolError(f"{label} keys must be strings, got {shown(key)}")
    return check_text(key, f"{label} key", limits)


def _check_scalar(value: object, label: str, limits: Limits) -> None:
    if value is None or isinstance(value, (bool, int)):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ProtocolError(f"{label} must be finite, got {value}")
        return
    if isinstance(value, str):
        check_text(value, label, limits, allow_empty=True)
        return
    raise ProtocolError(f"{label} must be None, bool, int, float, str, list or map; got {shown(value)}")


def check_tree(value: object, label: str, limits: Limits, depth: int = 0) -> Any:
    """A str-keyed map or list of msgpack primitives, lists and maps, nested at most MAX_TREE_DEPTH deep."""
    if depth >= MAX_TREE_DEPTH:
        raise ProtocolError(f"{label} is nested deeper than {MAX_TREE_DEPTH} levels")
    if isinstance(value, dict):
        for key, item in value.items():
            item_label = f"{label}.{_check_key(key, label, limits)}"
            if isinstance(item, (dict, list)):
                check_tree(item, item_label, limits, depth + 1)
            else:
                _check_scalar(item, item_label, limits)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            if isinstance(item, (dict, list)):
                check_tree(item, f"{label}[{index}]", limits, depth + 1)
            else:
                _check_scalar(item, f"{label} item", limits)
    else:
        raise ProtocolError(f"{label} must be a list or map, got {shown(value)}")
    return value


class FieldReader:
    """Reads the fields of one msgpack map that must hold exactly the fields of a dataclass.

    Missing and unknown fields are reported at construction; each getter checks one field's type and range.
    Fields named in ``optional`` (added to a message after its first version) may be absent and then read as
    None, so that messages of older senders still decode.
    """

    def __init__(
        self, obj: object, where: str, limits: Limits, cls: type, header: Iterable[str] = (),
        optional: Iterable[str] = (),
    ) -> None:
        if not isinstance(obj, dict):
            raise ProtocolError(f"{where} must be a map, got {shown(obj)}")
        expected = [f.name for f in fields(cls)] + list(header)
        may_lack = set(optional)
        missing = [name for name in expected if name not in obj and name not in may_lack]
        if missing:
            raise ProtocolError(f"{where}: missing field(s) {', '.join(map(repr, missing))}")
        unknown = [key for key in obj if key not in expected]
        if unknown:
            raise ProtocolError(f"{where}: unknown field(s) {', '.join(repr(k)[:40] for k in unknown[:5])}")
        self._obj: dict[str, object] = {**{name: None for name in may_lack if name not in obj}, **obj}
        self.where = where
        self.limits = limits

    def label(self, name: str) -> str:
        """The dotted path of a field, for error messages."""
        return f"{self.where}.{name}"

    def raw(self, name: str) -> object:
        """The field's value, unchecked."""
        return self._obj[name]

    def integer(self, name: str, minimum: int | None = None) -> int:
        return check_int(self._obj[name], self.label(name), minimum)

    def opt_integer(self, name: str, minimum: int | None = None) -> int | None:
        value = self._obj[name]
        return None if value is None else check_int(value, self.label(name), minimum)

    def number(
        self, name: str, minimum: float | None = None, above: float | None = None, below: float | None = None
    ) -> float:
        return check_number(self._obj[name], self.label(name), minimum, above, below)

    def opt_number(self, name: str, above: float | None = None) -> float | None:
        value = self._obj[name]
        return None if value is None else check_number(value, self.label(name), above=above)

    def boolean(self, name: str) -> bool:
        value = self._obj[name]
        if not isinstance(value, bool):
            raise ProtocolError(f"{self.label(name)} must be true or false, got {shown(value)}")
        return value

    def text(self, name: str, choices: Iterable[str] | None = None) -> str:
        return check_text(self._obj[name], self.label(name), self.limits, choices)

    def opt_text(self, name: str) -> str | None:
        value = self._obj[name]
        return None if value is None else check_text(value, self.label(name), self.limits, allow_empty=True)

    def name(self, name: str) -> str:
        """An agent or federation id (one topic level)."""
        return validate_name(self._obj[name], self.label(name))

    def task_id(self, name: str) -> str:
        return validate_task_id(self._obj[name], self.label(name))

    def labels(self, name: str) -> list[int]:
        """A list of non-negative ints."""
        value = self._obj[name]
        if not isinstance(value, list):
            raise ProtocolError(f"{self.label(name)} must be a list of ints, got {shown(value)}")
        label = f"{self.label(name)} item"
        return [check_int(item, label, 0) for item in value]

    def tree(self, name: str) -> dict[str, Any]:
        """A str-keyed map of primitives, lists and maps (a sub-model spec)."""
        value = self._obj[name]
        if not isinstance(value, dict):
            raise ProtocolError(f"{self.label(name)} must be a map, got {shown(value)}")
        result: dict[str, Any] = check_tree(value, self.label(name), self.limits)
        return result

    def opt_tree(self, name: str) -> dict[str, Any] | None:
        return None if self._obj[name] is None else self.tree(name)

    def options(self, name: str) -> dict[str, Any]:
        """A str-keyed map whose values are primitives or flat lists of primitives."""
        value = self._obj[name]
        label = self.label(name)
        if not isinstance(value, dict):
            raise ProtocolError(f"{label} must be a map, got {shown(value)}")
        for key, item in value.items():
            item_label = f"{label}.{_check_key(key, label, self.limits)}"
            for scalar in item if isinstance(item, list) else [item]:
                _check_scalar(scalar, item_label, self.limits)
        return value

    def float_map(self, name: str) -> dict[str, float]:
        """A str-keyed map of finite numbers, returned as floats."""
        value = self._obj[name]
        label = self.label(name)
        if not isinstance(value, dict):
            raise ProtocolError(f"{label} must be a map of numbers, got {shown(value)}")
        return {
            key: check_number(item, f"{label}.{key}")
            for key, item in ((_check_key(k, label, self.limits), v) for k, v in value.items())
        }

    def weights(self, name: str, section: TensorSection | None = None) -> dict[str, np.ndarray]:
        """A map of tensor name to tensor, decoded as read-only arrays: version 1 wire maps (see `decode_tensor`),
        or, with the ``section`` of a version 2 payload, the entries that place them in it."""
        value = self._obj[name]
        label = self.label(name)
        if not isinstance(value, dict):
            raise ProtocolError(f"{label} must be a map of tensors, got {shown(value)}")
        if len(value) > self.limits.max_tensors:
            raise ProtocolError(
                f"{label} has {len(value)} tensors, more than the limit of {self.limits.max_tensors}"
            )
        result: dict[str, np.ndarray] = {}
        for key, item in value.items():
            tensor_name = _check_key(key, label, self.limits)
            try:
                result[tensor_name] = (decode_tensor(item, self.limits) if section is None
                                       else section.tensor(item, self.limits))
            except ProtocolError as exc:
                raise ProtocolError(f"{label}[{tensor_name!r}]: {exc}") from None
        return result

    def nested(self, name: str, read: Callable[[object, str, Limits], T]) -> T:
        """A nested message, read by ``read(value, label, limits)``."""
        return read(self._obj[name], self.label(name), self.limits)

    def opt_nested(self, name: str, read: Callable[[object, str, Limits], T]) -> T | None:
        return None if self._obj[name] is None else self.nested(name, read)
