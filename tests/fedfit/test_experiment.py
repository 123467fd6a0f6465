"""Experiment files: the ``experiment`` section beside a coordinator configuration, and ``--seeds``/``--baseline``."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.config import ConfigError, load_yaml
from fedfit.cli import _coordinator_settings
from fedfit.experiment import Experiment, parse_baselines, parse_seeds, split_experiment
from fedfit.run_command import resolve

EXPERIMENTS = Path(__file__).resolve().parents[2] / "experiments"


def test_the_section_is_apart_from_the_coordinator_configuration(tmp_path: Path) -> None:
    path = tmp_path / "x.yaml"
    path.write_text("rounds: 7\nmodel: {family: resnet20}\nexperiment:\n  claim: a beats b\n  algorithms: [heterofl]\n"
                    "  baselines: [all-large]\n  seeds: [0, 2]\n  agents: 12\n  budgets: fair\n")
    mapping, config, experiment = _coordinator_settings(str(path))
    assert "experiment" not in mapping and config.rounds == 7 and config.model.family == "resnet20"
    assert experiment == Experiment(claim="a beats b", algorithms=["heterofl"], baselines=["all-large"],
                                    seeds=[0, 2], agents=12, budgets="fair")
    assert experiment.settings() == {"agents": 12, "budgets": "fair"}
    assert experiment.describe() == {"claim": "a beats b"}


def test_a_plain_configuration_has_no_experiment(tmp_path: Path) -> None:
    assert split_experiment({"rounds": 3}, "c.yaml") == ({"rounds": 3}, None)


@pytest.mark.parametrize(("section", "said"), [
    ("{agnets: 3}", "did you mean 'agents'"),
    ("{baselines: [all-medium]}", "all-large, all-small"),
    ("{seeds: [1, 1]}", "more than once"),
    ("{agents: many}", "experiment.agents"),
    ("[heterofl]", "mapping"),
    ("{budgets: nonsense}", "must be one of uniform, tiers"),
    ("{allocator: jemalloc}", "experiment.allocator"),
    ("{agents: 0}", "agents must be at least 1"),
    ("{budget_variance: -1}", "budget_variance must be non-negative"),
    ("{size_for: mean}", "experiment.size_for"),
    ("{speeds: [1, 0.5]}", "speeds: every factor is a number of at least 1"),
    ("{speeds: '10,x'}", "got 'x'"),
])
def test_a_malformed_section_is_refused_naming_the_file_and_key(tmp_path: Path, section: str, said: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(f"experiment: {section}\n")
    with pytest.raises(ConfigError, match=str(path)) as refused:
        _coordinator_settings(str(path))
    assert said in str(refused.value)


def test_flags_win_over_the_file_which_wins_over_the_defaults() -> None:
    import argparse

    args = argparse.Namespace(agents=None, partition="iid", budgets=None)
    values, given = resolve(args, {}, None, {"agents": 12, "partition": "dirichlet:0.3", "budgets": "fair"})
    assert (values["agents"], values["partition"], values["budgets"]) == (12, "iid", "fair")
    assert given == ["--partition iid"]
    values, _ = resolve(argparse.Namespace(), {}, None, {})
    assert (values["agents"], values["budgets"]) == (8, "tiers")


def test_size_for_reaches_the_run_from_the_file_or_the_flag() -> None:
    import argparse

    from fedfit.sim.harness import SimOptions

    _, experiment = split_experiment({"experiment": {"size_for": "typical"}}, "e.yaml")
    assert experiment is not None and experiment.settings() == {"size_for": "typical"}
    values, _ = resolve(argparse.Namespace(size_for=None), {}, None, experiment.settings())
    assert SimOptions(**{key: values[key] for key in ("size_for", "budgets")}).size_for == "typical"
    values, given = resolve(argparse.Namespace(size_for="dip"), {}, None, experiment.settings())
    assert values["size_for"] == "dip" and given == ["--size-for dip"]  # the flag wins, and is recorded
    assert resolve(argparse.Namespace(), {}, None, {})[0]["size_for"] == "dip"


@pytest.mark.parametrize(("given", "text"), [("10,1", "10,1"), ([10, 1.5], "10,1.5"), (3, "3")])
def test_the_files_speeds_are_taken_as_the_flag_takes_them(given: object, text: str) -> None:
    import argparse

    _, experiment = split_experiment({"experiment": {"speeds": given}}, "e.yaml")
    assert experiment is not None and experiment.settings() == {"speeds": text}
    values, _ = resolve(argparse.Namespace(speeds=None), {}, None, experiment.settings())
    assert values["speeds"] == text
    values, _ = resolve(argparse.Namespace(speeds="1,2"), {}, None, experiment.settings())
    assert values["speeds"] == "1,2"  # the flag wins


def test_seeds_and_baselines_from_the_command_line() -> None:
    assert parse_seeds("0,1,2") == [0, 1, 2] and parse_seeds("5") == [5]
    for text, said in (("0,x", "whole numbers"), (",", "no seed"), ("1,1", "more than once")):
        with pytest.raises(ValueError, match=said):
            parse_seeds(text)
    assert parse_baselines("all-small,all-large,all-small") == ["all-small", "all-large"]
    with pytest.raises(ValueError, match="all-large and/or all-small"):
        parse_baselines("all-medium")


@pytest.mark.parametrize("path", sorted(EXPERIMENTS.glob("*.yaml")), ids=lambda path: path.stem)
def test_every_experiment_file_loads_and_names_what_it_tests(path: Path) -> None:
    from coordinator.strategies import check_algorithm
    from fedfit.sim.budgets import scenario_tiers

    _, config, experiment = _coordinator_settings(str(path))
    assert experiment is not None and experiment.claim and experiment.algorithms
    assert config.rounds >= 20  # an experiment runs until its curves flatten, not a smoke test's few rounds
    for name in experiment.algorithms:
        check_algorithm(name.partition("-")[0])
    scenario_tiers(experiment.budgets or "tiers")
    assert "fedfit compare --config experiments/" + path.name in path.read_text()  # how to run it, in the file
    assert load_yaml(path)["experiment"]["claim"] == experiment.claim
