"""Shared fixtures for the models tests: every family, small enough to run fast, and specs using every feature."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from models import ModelFamily, SubmodelSpec, get_family

#: HeteroFL levels a..e.
RATES = (1.0, 0.5, 0.25, 0.125, 0.0625)

#: (family name, in_channels, options, input size) per family under test.
FAMILY_CASES = {
    "cnn": ("cnn", 1, {"hidden": (16, 32, 32, 64)}, (28, 28)),
    "preresnet18": ("preresnet18", 3, {"hidden": (8, 16, 16, 32)}, (16, 16)),
    "resnet20": ("resnet20", 3, {"hidden": (8, 16, 16)}, (8, 8)),
    # Six convolutions and five ceil-mode pools (28 -> 14 -> 7 -> 4 -> 2 -> 1), two hidden linear layers; no
    # dropout, because the generic tests compare train-mode forward passes (test_vgg covers dropout).
    "vgg": ("vgg11", 1, {"config": (8, "M", 16, "M", 16, 16, "M", 32, "M", 32, "M"), "head": (16, 16),
                         "dropout": 0.0}, (28, 28)),
}



@pytest.fixture(scope="session", params=sorted(FAMILY_CASES))
def case(request: pytest.FixtureRequest) -> tuple[ModelFamily, tuple[int, int]]:
    """One family object per case for the whole session: families are immutable, and sharing them shares their
    caches (memory estimates, spatial sizes), which keeps the suite fast."""
    name, in_channels, options, size = FAMILY_CASES[request.param]
    return get_family(name, num_classes=10, in_channels=in_channels, **options), size


@pytest.fixture(params=RATES, ids=lambda r: f"rate={r:g}")
def spec(request: pytest.FixtureRequest) -> SubmodelSpec:
    return SubmodelSpec.uniform(request.param)


# ------------------------------------------------------------------------------------------------ feature specs
def _exits(family: ModelFamily) -> SubmodelSpec:
    points = family.exit_points
    return SubmodelSpec(exits=(points[0], points[len(points) // 2]))


def _cut(family: ModelFamily) -> SubmodelSpec:
    depth = family.num_blocks - 1
    return SubmodelSpec(depth=depth, exits=(0, depth - 1))


def _floor(family: ModelFamily) -> SubmodelSpec:
    return SubmodelSpec(width=0.7, rounding="floor")


def _layer_widths(family: ModelFamily) -> SubmodelSpec:
    prunable = family.prunable_layers()
    return SubmodelSpec(width=0.5, layer_widths={prunable[0]: 0.25, prunable[-1]: 1.0})


def _segments(family: ModelFamily) -> SubmodelSpec:
    """Two segments, in reverse depth order, and an exit after a frozen block."""
    n = family.num_blocks
    return SubmodelSpec(width=0.5, exits=(1,), segments=((n - 2, n), (0, 1)))


def _everything(family: ModelFamily) -> SubmodelSpec:
    """Floor rounding, a per-layer width (an exit head's own group where the family has one), a depth cut with
    two exits and two segments that leave a frozen block between them."""
    depth = family.num_blocks - 1
    names = [g for g in family.layer_names() if g.startswith(f"exits.{depth - 1}.")] or [family.prunable_layers()[1]]
    return SubmodelSpec(width=0.6, rounding="floor", layer_widths={names[0]: 0.3}, depth=depth,
                        exits=(0, depth - 1), segments=((0, 1), (2, depth)))


#: Spec builders by feature: each gives a valid spec for any family with at least three blocks.
FEATURES: dict[str, Callable[[ModelFamily], SubmodelSpec]] = {
    "full": lambda family: SubmodelSpec(),
    "exits": _exits,
    "cut": _cut,
    "floor": _floor,
    "layer_widths": _layer_widths,
    "segments": _segments,
    "everything": _everything,
}


@pytest.fixture(params=list(FEATURES))
def feature(request: pytest.FixtureRequest) -> Callable[[ModelFamily], SubmodelSpec]:
    """A spec builder using one feature (or all of them): ``feature(family)`` is the spec."""
    return FEATURES[request.param]


def _global_state(family: ModelFamily, seed: int = 0) -> dict[str, torch.Tensor]:
    """The full model's state with an exit at every exit point (every key any spec may have), BN statistics
    tracked and set to distinctive values so that slicing them is checked too."""
    torch.manual_seed(seed)
    state = family.build(SubmodelSpec(exits=family.exit_points)).state_dict()
    for key, value in state.items():
        if key.endswith(("running_mean", "running_var")):
            value.copy_(torch.rand_like(value) + 0.5)
        elif key.endswith("num_batches_tracked"):
            value.fill_(7)
    return state


@pytest.fixture
def global_state_of() -> Callable[..., dict[str, torch.Tensor]]:
    """``global_state_of(family, seed=0)``: see :func:`_global_state`."""
    return _global_state
