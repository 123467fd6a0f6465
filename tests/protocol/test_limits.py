"""Limits: defaults, immutability and validation."""

from __future__ import annotations

import dataclasses

import pytest

from protocol import DEFAULT_LIMITS, Limits


def test_defaults() -> None:
    assert Limits() == DEFAULT_LIMITS
    assert DEFAULT_LIMITS.max_payload_bytes == 512 * 2**20
    assert DEFAULT_LIMITS.max_tensor_elements == 2**28
    assert (DEFAULT_LIMITS.max_tensors, DEFAULT_LIMITS.max_dims) == (4096, 8)
    assert (DEFAULT_LIMITS.max_str_len, DEFAULT_LIMITS.max_list_len) == (4096, 100_000)


def test_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        DEFAULT_LIMITS.max_dims = 99  # type: ignore[misc]


@pytest.mark.parametrize("value", [0, -1, 1.5, True, None])
def test_rejects_non_positive_or_non_int(value: object) -> None:
    with pytest.raises(ValueError, match="max_dims"):
        Limits(max_dims=value)  # type: ignore[arg-type]
