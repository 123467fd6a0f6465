"""CoordinatorConfig.validate and loading through common.config.from_mapping."""

from __future__ import annotations

import random
import re

import pytest

from common.config import ConfigError, from_mapping
from coordinator.config import (
    HETEROFL_RATES,
    CoordinatorConfig,
    DataConfig,
    ModelConfig,
    RecipeConfig,
    ScaleFLConfig,
)
from coordinator.strategies import ALGORITHM_NAMES, check_algorithm, make_strategy


def test_defaults_are_valid():
    config = CoordinatorConfig()
    config.validate()
    assert config.levels == list(HETEROFL_RATES)
    assert config.fraction == 1.0  # the upper bound of (0, 1] is valid: every online agent


@pytest.mark.parametrize("fraction", [0.0, -0.1, 1.01])
def test_fraction_outside_unit_interval_is_rejected(fraction):
    with pytest.raises(ValueError, match="fraction must be in"):
        CoordinatorConfig(fraction=fraction).validate()


@pytest.mark.parametrize("levels", [[0.5, 1.0], [1.0, 0.25, 0.5], [1.0, 1.0, 0.5]])
def test_levels_must_be_distinct_and_descending(levels):
    with pytest.raises(ValueError, match="largest to smallest"):
        CoordinatorConfig(levels=levels).validate()


@pytest.mark.parametrize("levels", [[], [1.5, 0.5], [1.0, 0.0]])
def test_levels_must_be_width_rates(levels):
    with pytest.raises(ValueError, match=r"width rates in \(0, 1\]"):
        CoordinatorConfig(levels=levels).validate()


@pytest.mark.parametrize("proportions", [[1, -1, 1, 1, 1], [0, 0, 0, 0, 0]])
def test_level_proportions_need_nonnegative_weights_not_all_zero(proportions):
    # Their number is checked by the strategy (test_strategies), which knows its levels.
    with pytest.raises(ValueError, match="level_proportions"):
        CoordinatorConfig(level_proportions=proportions).validate()


def test_a_zero_weight_is_valid_and_keeps_its_level_out_of_the_round(make_context, make_agent):
    config = CoordinatorConfig(model=ModelConfig(family="cnn", options={"hidden": [4, 8]}), levels=[1.0, 0.5],
                               level_assignment="dynamic", level_proportions=[0.0, 2.0])
    config.validate()
    strategy = make_strategy(config.algorithm, make_context(config))
    plan = strategy.configure_round(1, [make_agent(f"x{i}", 10**6) for i in range(8)], random.Random(0))
    smaller = strategy.levels[1]
    assert smaller.spec.width == 0.5
    assert len(plan.tasks) == 8 and {task.level for task in plan.tasks} == {smaller.name}


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"rounds": 0}, "rounds and min_agents"),
        ({"min_agents": 0}, "rounds and min_agents"),
        ({"data": DataConfig(bn_samples=0)}, "bn_samples"),
        ({"data": DataConfig(levels_every=0)}, "levels_every"),
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


def test_unknown_algorithm_is_rejected_by_the_strategy_registry():
    # The config keeps the name as a plain string; the registry of strategies checks it.
    config = from_mapping(CoordinatorConfig, {"algorithm": "fedprox"})
    assert config.algorithm == "fedprox"
    with pytest.raises(ValueError, match="unknown algorithm 'fedprox'.*heterofl, fedavg, decoupled, scalefl"):
        check_algorithm(config.algorithm)
    for name in ALGORITHM_NAMES:
        check_algorithm(from_mapping(CoordinatorConfig, {"algorithm": name}).algorithm)


def test_unknown_model_family_is_rejected_by_validate():
    with pytest.raises(ValueError, match="model.family must be one of .*cnn.*'vgg19'"):
        CoordinatorConfig(model=ModelConfig(family="vgg19")).validate()
    for family in ("cnn", "preresnet18", "resnet20", "resnet56", "resnet110", "vgg16"):
        CoordinatorConfig(model=ModelConfig(family=family)).validate()


# ---------------------------------------------------------------------------------------------- scalefl
def test_scalefl_section_loads_and_defaults_are_valid():
    defaults = ScaleFLConfig()
    defaults.validate()
    assert defaults.ratios == "auto"  # sized to the fleet at its first round
    assert defaults.fixed_ratios() == [0.125, 0.25, 0.5, 1.0] and defaults.tolerances() == [0.1] * 4
    with pytest.raises(ValueError, match="auto or a list"):
        ScaleFLConfig(ratios="fleet").validate()  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="one number with scalefl.ratios: auto"):
        ScaleFLConfig(tolerance=[0.1, 0.1, 0.1, 0.0]).validate()
    config = from_mapping(CoordinatorConfig, {
        "algorithm": "scalefl",
        "scalefl": {"ratios": [0.25, 0.5, 1.0], "cost": "flops", "tolerance": [0.05, 0.1, 0.0], "tau": 2.0,
                    "kd_warmup": 0.25, "normalization": "reference", "detach_teacher": True}})
    assert isinstance(config.scalefl, ScaleFLConfig)
    assert config.scalefl.cost == "flops" and config.scalefl.tolerances() == [0.05, 0.1, 0.0]
    assert config.scalefl.normalization == "reference" and config.scalefl.detach_teacher is True
    config.validate()


def test_scalefl_section_rejects_unknown_keys_and_choices():
    with pytest.raises(ConfigError, match=r"'scalefl\.ratio'"):
        from_mapping(CoordinatorConfig, {"scalefl": {"ratio": [1.0]}})
    with pytest.raises(ConfigError, match=r"'scalefl\.cost'"):
        from_mapping(CoordinatorConfig, {"scalefl": {"cost": "bytes"}})


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"ratios": [0.5, 0.25, 1.0]}, "scalefl.ratios"),
        ({"ratios": [0.25, 0.25, 1.0]}, "scalefl.ratios"),
        ({"ratios": [0.25, 0.5]}, "scalefl.ratios"),
        ({"ratios": [0.0, 1.0]}, "scalefl.ratios"),
        ({"ratios": []}, "scalefl.ratios"),
        ({"tolerance": [0.1, 0.1]}, "scalefl.tolerance"),
        ({"tolerance": -0.1}, "scalefl.tolerance"),
        ({"grid_step": 0.0}, "scalefl.grid_step"),
        ({"grid_step": 0.6}, "scalefl.grid_step"),
        ({"tau": 0.0}, "scalefl.tau"),
        ({"beta": -0.1}, "scalefl.beta"),
        ({"kd_warmup": 1.0}, "kd_warmup"),
    ],
)
def test_scalefl_validate(kwargs, match):
    with pytest.raises(ValueError, match=match.replace(".", r"\.")):
        ScaleFLConfig(**kwargs).validate()
    with pytest.raises(ValueError, match=match.replace(".", r"\.")):
        CoordinatorConfig(scalefl=ScaleFLConfig(**kwargs)).validate()


@pytest.mark.parametrize(("recipe", "said"), [
    ({"lr": 0.0}, "recipe.lr must be positive"), ({"momentum": 1.0}, "recipe.momentum in [0, 1)"),
    ({"weight_decay": -1.0}, "weight_decay"), ({"clip_norm": 0.0}, "recipe.clip_norm must be positive or null"),
    ({"batch_size": 1}, "recipe.batch_size at least 2"), ({"epochs": 0}, "recipe.epochs must be at least 1"),
])  # fmt: skip
def test_a_recipe_no_agent_could_run_is_one_sentence(recipe: dict, said: str) -> None:
    from coordinator.config import CoordinatorConfig, RecipeConfig

    with pytest.raises(ValueError, match=re.escape(said)):
        CoordinatorConfig(recipe=RecipeConfig(**recipe)).validate()


def test_the_deployment_wait_is_a_finite_number_of_seconds() -> None:
    import pytest as _pytest

    from coordinator.config import DeploymentConfig

    DeploymentConfig(wait_s=0).validate()
    for wait in (-1.0, float("inf"), float("nan")):
        with _pytest.raises(ValueError, match="deployment.wait_s must be a finite number"):
            DeploymentConfig(wait_s=wait).validate()
