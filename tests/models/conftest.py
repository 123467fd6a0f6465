"""Shared fixtures for the models tests: every family, small enough to run fast."""

from __future__ import annotations

import pytest

from models import ModelFamily, SubmodelSpec, get_family

#: HeteroFL levels a..e.
RATES = (1.0, 0.5, 0.25, 0.125, 0.0625)

#: (family name, in_channels, options, input size) per family under test.
FAMILY_CASES = {
    "cnn": ("cnn", 1, {"hidden": (16, 32, 32, 64)}, (28, 28)),
    "preresnet18": ("preresnet18", 3, {"hidden": (8, 16, 16, 32)}, (16, 16)),
}


@pytest.fixture(params=sorted(FAMILY_CASES))
def case(request: pytest.FixtureRequest) -> tuple[ModelFamily, tuple[int, int]]:
    name, in_channels, options, size = FAMILY_CASES[request.param]
    return get_family(name, num_classes=10, in_channels=in_channels, **options), size


@pytest.fixture(params=RATES, ids=lambda r: f"rate={r:g}")
def spec(request: pytest.FixtureRequest) -> SubmodelSpec:
    return SubmodelSpec.uniform(request.param)
