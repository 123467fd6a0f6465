"""Tests for models.spec.SubmodelSpec."""

from __future__ import annotations

import math

import pytest

from models.spec import SubmodelSpec


def test_defaults_are_the_full_model() -> None:
    spec = SubmodelSpec()
    assert spec == SubmodelSpec.full()
    assert spec.is_full
    assert spec.width == 1.0 and spec.layer_widths == () and spec.depth is None
    assert spec.rounding == "ceil"
    assert spec.exits == () and spec.segments is None
    assert spec.full_width
    assert spec.to_dict() == {}


def test_uniform() -> None:
    spec = SubmodelSpec.uniform(0.25)
    assert spec.width == 0.25
    assert not spec.is_full
    assert spec.rate_for("conv3") == 0.25
    assert spec.rounding == "ceil"
    assert SubmodelSpec.uniform(0.25, rounding="floor") == SubmodelSpec(width=0.25, rounding="floor")


def test_layer_widths_are_normalised_sorted_and_hashable() -> None:
    a = SubmodelSpec(width=0.5, layer_widths=(("conv3", 0.25), ("conv1", 1)))
    b = SubmodelSpec(width=0.5, layer_widths={"conv1": 1.0, "conv3": 0.25})  # type: ignore[arg-type]
    assert a.layer_widths == (("conv1", 1.0), ("conv3", 0.25))
    assert a == b and hash(a) == hash(b)
    assert isinstance(a.layer_widths[0][1], float)
    assert a.rate_for("conv3") == 0.25 and a.rate_for("conv1") == 1.0 and a.rate_for("conv2") == 0.5
    assert len({a, b, SubmodelSpec.uniform(0.5)}) == 2


def test_is_full_counts_rate_one_overrides_as_full() -> None:
    assert SubmodelSpec(layer_widths=(("conv1", 1.0),)).is_full
    assert not SubmodelSpec(layer_widths=(("conv1", 0.5),)).is_full
    assert not SubmodelSpec(depth=2).is_full
    assert not SubmodelSpec(exits=(0,)).is_full
    assert not SubmodelSpec(segments=((0, 1),)).is_full
    assert SubmodelSpec(rounding="floor").is_full  # floor of the full width is the full width
    assert SubmodelSpec(depth=2, exits=(1,)).full_width
    assert not SubmodelSpec(layer_widths=(("conv1", 0.5),)).full_width


def test_exits_are_sorted_and_segments_keep_their_order() -> None:
    spec = SubmodelSpec(depth=4, exits=(3, 1), segments=[[2, 4], (0, 1)])  # type: ignore[arg-type]
    assert spec.exits == (1, 3)
    assert spec.segments == ((2, 4), (0, 1))  # trained in the order given
    assert all(isinstance(v, int) for pair in spec.segments for v in pair)
    assert hash(spec) == hash(SubmodelSpec(depth=4, exits=(1, 3), segments=((2, 4), (0, 1))))
    assert spec != SubmodelSpec(depth=4, exits=(1, 3), segments=((0, 1), (2, 4)))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"width": 0.0}, "width"),
        ({"width": 1.5}, "width"),
        ({"width": -0.5}, "width"),
        ({"width": math.nan}, "width"),
        ({"width": True}, "width"),
        ({"width": "0.5"}, "width"),
        ({"layer_widths": (("conv1", 0.0),)}, "conv1"),
        ({"layer_widths": (("conv1", 2),)}, "conv1"),
        ({"layer_widths": (("conv1", 0.5), ("conv1", 0.25))}, "more than once"),
        ({"layer_widths": (("", 0.5),)}, "non-empty"),
        ({"layer_widths": ((1, 0.5),)}, "layer names"),
        ({"layer_widths": (("conv1",),)}, "pairs"),
        ({"layer_widths": "conv1"}, "pairs"),
        ({"depth": 0}, "depth"),
        ({"depth": True}, "depth"),
        ({"depth": 2.0}, "depth"),
        ({"exits": (-1,)}, "exits"),
        ({"exits": (1, 1)}, "repeat"),
        ({"exits": (True,)}, "exits"),
        ({"exits": 3}, "exits"),
        ({"exits": "01"}, "exits"),
        ({"depth": 2, "exits": (2,)}, "inside the 2 kept blocks"),
        ({"rounding": "round"}, "rounding must be one of ceil, floor"),
        ({"rounding": None}, "rounding"),
        ({"segments": ()}, "at least one block range"),
        ({"segments": ((0, 2), (1, 3))}, "overlap"),
        ({"segments": ((2, 4), (0, 3))}, "overlap"),
        ({"segments": ((1, 1), (2, 3))}, "the only one"),
        ({"segments": ((2, 1),)}, "start < stop"),
        ({"segments": ((-1, 1),)}, "start < stop"),
        ({"segments": ((0, 1, 2),)}, "block range"),
        ({"segments": ((0, True),)}, "block range"),
        ({"segments": ((0.0, 1),)}, "block range"),
        ({"segments": (0, 1)}, "block range"),
        ({"segments": "0:1"}, "segments"),
        ({"depth": 3, "segments": ((0, 4),)}, "inside the 3 kept blocks"),
    ],
)
def test_validation(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SubmodelSpec(**kwargs)  # type: ignore[arg-type]


SPECS = [
    SubmodelSpec(),
    SubmodelSpec.uniform(0.0625),
    SubmodelSpec(width=0.25, layer_widths=(("conv2", 0.5),), depth=3),
    SubmodelSpec(depth=5, exits=(1, 4), segments=((2, 5), (0, 1))),
    SubmodelSpec(width=0.7, rounding="floor", depth=35, exits=(17, 34)),
    SubmodelSpec(segments=((0, 1),)),
]


def _primitive(value: object) -> bool:
    if isinstance(value, dict):
        return all(isinstance(k, str) and _primitive(v) for k, v in value.items())
    if isinstance(value, list):
        return all(_primitive(v) for v in value)
    return isinstance(value, (int, float, str, bool)) or value is None


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.describe())
def test_dict_round_trip_uses_primitives(spec: SubmodelSpec) -> None:
    d = spec.to_dict()
    assert _primitive(d)
    assert SubmodelSpec.from_dict(d) == spec


def test_round_trip_through_msgpack() -> None:
    msgpack = pytest.importorskip("msgpack")
    spec = SPECS[2]
    assert SubmodelSpec.from_dict(msgpack.unpackb(msgpack.packb(spec.to_dict()))) == spec


def test_to_dict_omits_defaults() -> None:
    assert SubmodelSpec.uniform(0.5).to_dict() == {"width": 0.5}
    assert SubmodelSpec(layer_widths=(("conv1", 0.5),), exits=(0,)).to_dict() == {
        "layer_widths": {"conv1": 0.5},
        "exits": [0],
    }
    assert SubmodelSpec(width=0.5, rounding="floor", depth=3, exits=(2,), segments=((2, 3), (0, 2))).to_dict() == {
        "width": 0.5,
        "rounding": "floor",
        "depth": 3,
        "exits": [2],
        "segments": [[2, 3], [0, 2]],
    }


@pytest.mark.parametrize(
    ("d", "message"),
    [
        ({"widht": 0.5}, "'widht'"),
        ({"width": "0.5"}, "'width'"),
        ({"width": True}, "'width'"),
        ({"width": 2.0}, "width"),
        ({"layer_widths": [["conv1", 0.5]]}, "'layer_widths'"),
        ({"layer_widths": {"conv1": "half"}}, "'layer_widths'"),
        ({"depth": "3"}, "'depth'"),
        ({"exits": 3}, "'exits'"),
        ({"exits": [1, True]}, "'exits'"),
        ({"trainable_blocks": [0]}, "'trainable_blocks'"),
        ({"rounding": 1}, "'rounding'"),
        ({"rounding": "round"}, "rounding must be one of"),
        ({"segments": "0"}, "'segments'"),
        ({"segments": [0, 1]}, "'segments'"),
        ({"segments": [[0, 1, 2]]}, "'segments'"),
        ({"segments": [[0, True]]}, "'segments'"),
        ({"segments": [[0, 1.0]]}, "'segments'"),
        ({"segments": [[0, 2], [1, 3]]}, "invalid sub-model spec: segments must not overlap"),
        ({"segments": []}, "at least one block range"),
        ({1: 0.5}, "unknown sub-model spec key 1"),
        ({"roll": 1.5}, "'roll' must be an integer"),
        ({"roll": True}, "'roll' must be an integer"),
    ],
)
def test_from_dict_is_strict(d: dict[object, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SubmodelSpec.from_dict(d)


@pytest.mark.parametrize("d", [None, [("width", 0.5)], "width=0.5", 3])
def test_from_dict_rejects_non_mappings(d: object) -> None:
    with pytest.raises(ValueError, match="mapping"):
        SubmodelSpec.from_dict(d)


def test_from_dict_accepts_integer_rates_and_explicit_none() -> None:
    spec = SubmodelSpec.from_dict({"width": 1, "depth": None, "segments": None, "rounding": "ceil", "exits": []})
    assert spec == SubmodelSpec.full()
    assert SubmodelSpec.from_dict({"segments": ((0, 1),), "exits": (0,)}) == SubmodelSpec(
        exits=(0,), segments=((0, 1),))


def test_describe() -> None:
    assert SubmodelSpec().describe() == "width=1"
    assert SubmodelSpec.uniform(0.5).describe() == "width=0.5"
    assert SubmodelSpec.uniform(1 / 16).describe() == "width=0.0625"
    assert SubmodelSpec(width=0.25, layer_widths=(("conv2", 0.5),), depth=3).describe() == (
        "width=0.25 conv2=0.5 depth=3"
    )
    assert SubmodelSpec(depth=4, exits=(1, 3), segments=((2, 4), (0, 1))).describe() == (
        "width=1 depth=4 exits=1,3 segments=2:4,0:1"
    )
    assert SubmodelSpec(width=0.7, rounding="floor", depth=35, exits=(34,)).describe() == (
        "width=0.7 floor depth=35 exits=34"
    )
    assert str(SubmodelSpec.uniform(0.5)) == "width=0.5"


def test_frozen() -> None:
    spec = SubmodelSpec()
    with pytest.raises(AttributeError):
        spec.width = 0.5  # type: ignore[misc]


def test_a_roll_moves_positions_only_and_stays_off_the_wire_at_zero() -> None:
    rolled = SubmodelSpec.uniform(0.25).rolled(-3)
    assert rolled.to_dict() == {"width": 0.25, "roll": -3} and SubmodelSpec.from_dict(rolled.to_dict()) == rolled
    assert rolled.describe() == "width=0.25 roll=-3" and rolled.unrolled() == SubmodelSpec.uniform(0.25)
    assert SubmodelSpec.uniform(0.25).rolled(0).to_dict() == {"width": 0.25}
