"""Tests for models.width.scaled_channels."""

from __future__ import annotations

import pytest

from models.width import scaled_channels


@pytest.mark.parametrize(
    ("channels", "rate", "expected"),
    [
        (64, 1 / 16, 4),
        (30, 1 / 16, 2),  # ceil(1.875)
        (30, 0.1, 3),  # 0.1 * 30 == 3.0000000000000004 must not round up to 4
        (10, 0.3, 3),  # 0.3 * 10 == 3.0000000000000004
        (10, 0.7, 7),  # 0.7 * 10 == 7.000000000000001
        (3, 0.5, 2),
        (512, 0.5, 256),
        (512, 1.0, 512),
        (7, 1e-6, 1),  # never below one channel
        (100, 0.333, 34),
    ],
)
def test_ceil_rounding(channels: int, rate: float, expected: int) -> None:
    assert scaled_channels(channels, rate) == expected


def test_monotone_in_rate_and_bounded() -> None:
    rates = [i / 64 for i in range(1, 65)]
    for channels in (1, 3, 30, 64, 100):
        kept = [scaled_channels(channels, r) for r in rates]
        assert kept == sorted(kept)
        assert kept[0] >= 1 and kept[-1] == channels


@pytest.mark.parametrize("rate", [0, -0.5, 1.5, float("nan"), True, "0.5"])
def test_invalid_rate(rate: object) -> None:
    with pytest.raises(ValueError, match="width rate"):
        scaled_channels(10, rate)  # type: ignore[arg-type]


@pytest.mark.parametrize("channels", [0, -3, 2.0, True])
def test_invalid_channels(channels: object) -> None:
    with pytest.raises(ValueError, match="channels"):
        scaled_channels(channels, 0.5)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("channels", "rate", "expected"),
    [
        (16, 0.7, 11),  # ScaleFL ResNet-110 at s_w = 0.7: 16, 32, 64 -> 11, 22, 44
        (32, 0.7, 22),
        (64, 0.7, 44),
        (10, 0.7, 7),  # 0.7 * 10 == 6.999999999999999 must not round down to 6
        (30, 0.1, 3),
        (3, 0.5, 1),
        (7, 0.1, 1),  # never below one channel
        (64, 1.0, 64),
    ],
)
def test_floor_rounding(channels: int, rate: float, expected: int) -> None:
    assert scaled_channels(channels, rate, "floor") == expected


def test_floor_is_monotone_and_never_above_ceil() -> None:
    rates = [i / 64 for i in range(1, 65)]
    for channels in (1, 3, 30, 64, 100):
        floor = [scaled_channels(channels, r, "floor") for r in rates]
        ceil = [scaled_channels(channels, r, "ceil") for r in rates]
        assert floor == sorted(floor) and floor[-1] == channels
        assert all(1 <= f <= c <= f + 1 for f, c in zip(floor, ceil))


@pytest.mark.parametrize("rounding", ["round", "", None, "CEIL"])
def test_invalid_rounding(rounding: object) -> None:
    with pytest.raises(ValueError, match="rounding must be one of ceil, floor"):
        scaled_channels(10, 0.5, rounding)  # type: ignore[arg-type]
