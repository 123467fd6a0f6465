"""CoordinatorConfig.validate and loading through common.config.from_mapping."""

from __future__ import annotations

import pytest

from common.config import ConfigError, from_mapping
from coordinator.config import HETEROFL_RATES, CoordinatorConfig, DataConfig, RecipeConfig


def test_defaults_are_valid():
    config = CoordinatorConfig()
    config.validate()
    assert config.levels == list(HETEROFL_RATES)


@pytest.mark.parametrize("fraction", [0.0, -0.1, 1.01])
def test_fraction_outside_unit_interval_is_rejected(fraction):
    with pytest.raises(ValueError, match="fraction must be in"):
        CoordinatorConfig(fraction=fraction).validate()


def test_fraction_of_one_is_accepted():
    CoordinatorConfig(fraction=1.0).validate()


@pytest.mark.parametrize("levels", [[0.5, 1.0], [1.0, 0.25, 0.5], [1.0, 1.0, 0.5]])
def test_levels_must_be_distinct_and_descending(levels):
    with pytest.raises(ValueError, match="largest to smallest"):
        CoordinatorConfig(levels=levels).validate()


@pytest.mark.parametrize("levels", [[], [1.5, 0.5], [1.0, 0.0]])
def test_levels_must_be_width_rates(levels):
    with pytest.raises(ValueError, match=r"width rates in \(0, 1\]"):
        CoordinatorConfig(levels=levels).validate()


@pytest.mark.parametrize("proportions", [[1.0, 1.0], [1, 1, 1, 1, 1, 1], [1, -1, 1, 1, 1], [0, 0, 0, 0, 0]])
def test_level_proportions_need_one_nonnegative_weight_per_level(proportions):
    with pytest.raises(ValueError, match="level_proportions"):
        CoordinatorConfig(level_proportions=proportions).validate()


def test_matching_level_proportions_are_accepted():
    CoordinatorConfig(levels=[1.0, 0.5], level_proportions=[0.0, 2.0]).validate()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"rounds": 0}, "rounds and min_agents"),
        ({"min_agents": 0}, "rounds and min_agents"),
        ({"data": DataConfig(bn_samples=0)}, "bn_samples"),
        ({"round_timeout_s": 0.0}, "round_timeout_s"),
    ],
)
def test_other_cross_field_checks(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CoordinatorConfig(**kwargs).validate()


def test_from_mapping_builds_nested_config():
    config = from_mapping(CoordinatorConfig, {
        "algorithm": "decoupled", "recipe": {"lr": 0.1, "clip_norm": None}, "levels": [1.0, 0.5],
        "broker": {"port": 1884},
    })
    assert config.algorithm == "decoupled"
    assert isinstance(config.recipe, RecipeConfig) and config.recipe.lr == 0.1 and config.recipe.clip_norm is None
    assert config.broker.port == 1884 and config.broker.host == "127.0.0.1"
    assert config.levels == [1.0, 0.5]
    config.validate()


def test_from_mapping_rejects_unknown_nested_key_with_dotted_path():
    with pytest.raises(ConfigError, match=r"'recipe\.lrr'"):
        from_mapping(CoordinatorConfig, {"recipe": {"lrr": 0.1}})


def test_from_mapping_names_wrong_type_with_dotted_path():
    with pytest.raises(ConfigError, match=r"'recipe\.lr' must be a number, got 'fast' \(str\)"):
        from_mapping(CoordinatorConfig, {"recipe": {"lr": "fast"}})


def test_from_mapping_rejects_unknown_algorithm():
    with pytest.raises(ConfigError, match="algorithm"):
        from_mapping(CoordinatorConfig, {"algorithm": "scalefl"})
