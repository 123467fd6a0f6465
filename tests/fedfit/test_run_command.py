"""``fedfit sim`` and ``compare`` settings: a flag given wins, else what the configuration sets, else the default."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from coordinator.config import CoordinatorConfig, ModelConfig
from coordinator.strategies import ALGORITHM_NAMES
from fedfit.cli import _coordinator_settings, main
from fedfit.compare_command import _labels, compare_variant
from fedfit.experiment import Experiment
from fedfit.run_command import SETTINGS, add_run_arguments, resolve
from models import FAMILY_NAMES


def parse(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_run_arguments(parser, ALGORITHM_NAMES, FAMILY_NAMES, compare=False)
    return parser.parse_args(list(flags))


def test_the_configuration_is_honoured_where_no_flag_is_given(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("algorithm: scalefl\nrounds: 20\nseed: 7\nmodel: {family: resnet20}\n"
                      f"state_dir: {tmp_path / 'run'}\n")
    args = parse("--config", str(config))
    mapping, loaded, _ = _coordinator_settings(args.config, args.overrides)
    values, given = resolve(args, mapping, loaded)
    assert (values["algorithm"], values["rounds"], values["seed"], values["model"]) == ("scalefl", 20, 7, "resnet20")
    assert values["state_dir"] == str(tmp_path / "run") and values["dataset"] == "fashion-mnist"
    assert given == []


def test_flags_given_win_and_are_recorded(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("algorithm: scalefl\nrounds: 20\n")
    args = parse("--config", str(config), "--rounds", "3", "--algorithm", "fedepth", "--set", "seed=5")
    mapping, loaded, _ = _coordinator_settings(args.config, args.overrides)
    values, given = resolve(args, mapping, loaded)
    assert (values["algorithm"], values["rounds"], values["seed"]) == ("fedepth", 3, 5)  # --set counts as config
    assert given == ["--algorithm fedepth", "--rounds 3"]
    values, given = resolve(parse("--speeds", " 10,1 "), {}, CoordinatorConfig())
    assert values["speeds"] == "10,1" and given == ["--speeds 10,1"]


def test_without_configuration_the_defaults() -> None:
    values, given = resolve(parse(), {}, CoordinatorConfig())
    assert values == {name: setting.default for name, setting in SETTINGS.items()}
    assert given == []
    # a configuration that leaves a key out does not impose its own default (e.g. rounds: 10, federation)
    values, _ = resolve(parse(), {"model": {"options": {}}}, CoordinatorConfig(model=ModelConfig("cnn")))
    assert values["rounds"] == 5 and values["federation"] == "sim"


def test_help_shows_the_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["sim", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: the config's, else heterofl)" in text and "(default: 8)" in text
    assert "(default: tiers)" in text


def test_version_without_torch(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("fedfit 0.1.0")


@pytest.mark.parametrize(("flags", "said"), [
    (["sim", "--rounds", "0"], "--rounds: must be at least 1"),
    (["sim", "--budgets", "fractions:1/0"], "needs positive numbers or p/q with q > 0"),
    (["sim", "--speeds", "1,0.5"], "argument --speeds: every factor is a number of at least 1"),
    (["sim", "--speeds", "1,fast"], "got 'fast'"),
    (["sim", "--speeds", ""], "argument --speeds: takes slowdown factors separated by commas"),
    (["compare", "--algorithms", "heterofl", "--speeds", "0"], "argument --speeds: every factor"),
    (["compare", "runs/a", "--speeds", "1,10"], "--speeds only apply to runs it makes"),
    (["compare"], "needs --algorithms"),
    (["compare", "runs/a", "--algorithms", "heterofl"], "either run directories or --algorithms"),
    (["compare", "runs/a", "--rounds", "3", "--seed", "1"], "--rounds, --seed only apply to runs it makes"),
    (["compare", "--algorithms", "heterofl,nope"], "unknown algorithm 'nope'"),
    (["compare", "--algorithms", "heterofl,heterofl"], "names one more than once"),
    (["compare", "--algorithms", "all-large", "--baseline", "all-large"], "names one more than once"),
    (["compare", "--algorithms", "heterofl", "--baseline", "all-medium"], "all-large and/or all-small"),
    (["compare", "--algorithms", "heterofl", "--seeds", "0,x"], "--seeds takes whole numbers"),
    (["compare", "--algorithms", "heterofl", "--seeds", "0,1", "--seed", "2"], "--seed or --seeds, not both"),
    (["compare", "runs/a", "--seeds", "0,1"], "--seeds only apply to runs it makes"),
    (["compare", "runs/a", "--baseline", "all-large"], "either run directories or --algorithms/--baseline"),
])  # fmt: skip
def test_user_errors_are_one_sentence(capsys: pytest.CaptureFixture[str], tmp_path: Path, flags: list[str],
                                      said: str) -> None:
    out = ["--out", str(tmp_path / "cmp")] if flags[0] == "compare" else []
    try:
        code = main([*flags, *out])
    except SystemExit as exit_:  # argparse's own errors
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2 and said in err and "Traceback" not in err


def test_resume_goes_on_as_the_comparison_started(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["compare", "--resume", str(tmp_path)]) == 2
    assert "no compare.json there" in capsys.readouterr().err
    assert main(["compare", "--resume", str(tmp_path), "--agents", "3", "--seed=1"]) == 2
    assert "leave out --agents, --seed=1" in capsys.readouterr().err
    (tmp_path / "compare.json").write_text('{"format": "something else"}')
    assert main(["compare", "--resume", str(tmp_path)]) == 2
    assert "not of format fedfit-compare-v1" in capsys.readouterr().err


def test_compare_reads_runs_that_are_not_there(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code = main(["compare", str(tmp_path / "nothing"), "--out", str(tmp_path / "cmp")])
    err = capsys.readouterr().err
    assert code == 2 and "does not exist: give a run directory" in err


def test_a_simulation_waits_for_its_fleet_training_one_device_after_another(tmp_path: Path) -> None:
    from fedfit.run_command import SIM_ROUND_TIMEOUT_S, _load

    args = parse()
    assert _load(args, _coordinator_settings)[1].round_timeout_s == SIM_ROUND_TIMEOUT_S > 600
    config = tmp_path / "c.yaml"
    config.write_text("round_timeout_s: 90\n")
    assert _load(parse("--config", str(config)), _coordinator_settings)[1].round_timeout_s == 90


@pytest.mark.parametrize(("flags", "said"), [
    (["--partition", "shards:11"], "shard"),
    (["--set", "model.options={bogus: 1}"], "unknown option 'bogus'"),
    (["--log-file", "{tmp}"], "is a directory"),
    (["--report", "{tmp}"], "is a directory"),
    (["--algorithm", "scalefl", "--set", "scalefl.ratios=[0.5]"], "scalefl.ratios must increase"),
])  # fmt: skip
def test_a_run_refused_at_its_start_leaves_no_directory(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                        flags: list[str], said: str) -> None:
    run_dir = tmp_path / "run"
    flags = [flag.replace("{tmp}", str(tmp_path)) for flag in flags]
    code = main(["sim", "--dataset", "digits", "--agents", "2", "--run-dir", str(run_dir), *flags])
    err = capsys.readouterr().err
    assert code == 2 and said in err and "Traceback" not in err
    assert not run_dir.exists()


def test_compare_refused_at_its_start_leaves_no_directory(capsys: pytest.CaptureFixture[str],
                                                          tmp_path: Path) -> None:
    out = tmp_path / "cmp"
    assert main(["compare", "--algorithms", ",", "--out", str(out)]) == 2
    assert "names no algorithm" in capsys.readouterr().err and not out.exists()
    assert main(["compare", "--algorithms", "heterofl", "--dataset", "digits", "--partition", "shards:11",
                 "--out", str(out)]) == 2
    assert not out.exists()


@pytest.mark.parametrize("command", ["sim", "compare"])
def test_a_used_directory_is_refused_before_anything_slower(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                            command: str) -> None:
    used = tmp_path / "used"
    used.mkdir()
    (used / "report.json").write_text("{}")
    # ScaleFL cannot split this model at these ratios: the directory, checked first, is what is said.
    flags = ["--algorithm" if command == "sim" else "--algorithms", "scalefl", "--dataset", "digits",
             "--set", "scalefl.ratios=[0.001, 1.0]", "--run-dir" if command == "sim" else "--out", str(used)]
    assert main([command, *flags]) == 2
    err = capsys.readouterr().err
    assert "holds a run already (report.json)" in err and "split" not in err
    assert sorted(p.name for p in used.iterdir()) == ["report.json"]


def test_compare_runs_adaptivefl_ablations_by_name() -> None:
    assert compare_variant("adaptivefl-random") == ("adaptivefl", "random")
    assert compare_variant("adaptivefl-greedy") == ("adaptivefl", "greedy")
    assert compare_variant("adaptivefl") == ("adaptivefl", None)
    assert compare_variant("adaptivefl-smart") == ("adaptivefl-smart", None)  # then refused as unknown
    assert compare_variant("adaptivefl-rl") == ("adaptivefl-rl", None)  # rl is adaptivefl itself: one row, one name
    assert compare_variant("heterofl") == ("heterofl", None)


def test_compare_runs_the_baselines_before_the_methods() -> None:
    args = argparse.Namespace(algorithms="heterofl,fedepth", baseline="all-large,all-small")
    assert _labels(args, Experiment()) == ["all-large", "all-small", "heterofl", "fedepth"]
    from_file = Experiment(algorithms=["scalefl"], baselines=["all-small"])
    assert _labels(argparse.Namespace(algorithms=None, baseline=None), from_file) == ["all-small", "scalefl"]


def test_a_gpu_that_cannot_train_is_refused_before_the_run_has_a_directory(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from edge_agent import forkserver

    monkeypatch.setattr(forkserver, "cuda_available", lambda: False)  # what a machine without a GPU answers
    run_dir = tmp_path / "run"
    code = main(["sim", "--dataset", "digits", "--agents", "2", "--device", "cuda", "--run-dir", str(run_dir)])
    err = capsys.readouterr().err
    assert code == 2 and "--device cuda: torch cannot train on a GPU here" in err and "Traceback" not in err
    assert not run_dir.exists()


def test_a_resumed_comparison_cannot_cut_back_a_run_finished_or_stopped_past_its_rounds(tmp_path: Path) -> None:
    import json

    import torch

    from common.config import ConfigError
    from coordinator.checkpoint import save_checkpoint
    from fedfit.compare_command import _check_rounds

    finished = tmp_path / "seed-0" / "heterofl"
    finished.mkdir(parents=True)
    (finished / "report.json").write_text(json.dumps({"algorithm": "heterofl", "settings": {"rounds": 40}, "rounds": [], "tasks": []}))
    stopped = tmp_path / "seed-1" / "heterofl"  # carried on from 40 and stopped at 55: its report still says 40
    (stopped).mkdir(parents=True)
    (stopped / "report.json").write_text(json.dumps({"algorithm": "heterofl", "settings": {"rounds": 40}, "rounds": [], "tasks": []}))
    save_checkpoint(stopped / "checkpoint.safetensors", {"global": {"w": torch.zeros(1)}}, {"round": 55})
    _check_rounds(tmp_path, 80)
    _check_rounds(tmp_path, 55)
    with pytest.raises(ConfigError, match="seed-1/heterofl ran 55 rounds.*cannot cut its runs back to 50"):
        _check_rounds(tmp_path, 50)
    with pytest.raises(ConfigError, match="ran (40|55) rounds"):
        _check_rounds(tmp_path, 30)
