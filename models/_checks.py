"""Argument checks shared by the models modules (each raises ``ValueError`` with one clear sentence)."""

from __future__ import annotations

__all__ = ["check_input_size", "check_positive_int", "positive_int_tuple"]


def check_positive_int(what: str, value: object) -> int:
    """``value`` as an int when it is a positive integer (bools refused)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{what} must be a positive integer, got {value!r}.")
    return int(value)


def positive_int_tuple(what: str, value: object) -> tuple[int, ...]:
    """Validate a non-empty sequence of positive integers (e.g. a ``hidden`` option) and return it as a tuple."""
    if isinstance(value, (str, bytes)) or not isinstance(value, (tuple, list)) or not value:
        raise ValueError(f"{what} must be a non-empty sequence of positive integers, got {value!r}.")
    return tuple(check_positive_int(f"every entry of {what}", v) for v in value)


def check_input_size(input_size: object) -> tuple[int, int]:
    """``(height, width)`` of input images, both positive integers."""
    if (
        not isinstance(input_size, (tuple, list))
        or len(input_size) != 2
        or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in input_size)
    ):
        raise ValueError(f"input_size must be (height, width) with positive integers, got {input_size!r}.")
    return int(input_size[0]), int(input_size[1])
