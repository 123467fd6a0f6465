"""The fedfit command turns every user error into one sentence and exit status 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fedfit.cli import main


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    return code, capsys.readouterr().err


def test_unknown_config_key_names_the_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("recipe:\n  lr: 0.1\n  learning_rate: 0.2\n")
    code, err = run(capsys, "coordinator", "--config", str(config))
    assert code == 2
    assert "recipe.learning_rate" in err and "Traceback" not in err


def test_wrong_type_names_the_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("rounds: many\n")
    code, err = run(capsys, "coordinator", "--config", str(config))
    assert code == 2 and "rounds" in err and "integer" in err


def test_cross_field_error_is_reported(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("fraction: 1.5\n")
    code, err = run(capsys, "coordinator", "--config", str(config))
    assert code == 2 and "fraction" in err


def test_agent_needs_an_id_and_data(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "a.yaml"
    config.write_text("federation: lab\n")
    code, err = run(capsys, "agent", "--config", str(config))
    assert code == 2 and "agent_id" in err
    config.write_text("agent_id: pi-1\n")
    code, err = run(capsys, "agent", "--config", str(config))
    assert code == 2 and "data" in err


def test_missing_config_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run(capsys, "agent", "--config", str(tmp_path / "absent.yaml"))
    assert code == 2 and "absent.yaml" in err


def test_sim_bad_partition_and_broker(capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run(capsys, "sim", "--dataset", "digits", "--partition", "halves")
    assert code == 2 and "iid" in err and "shards" in err
    code, err = run(capsys, "sim", "--dataset", "digits", "--broker", "nowhere")
    assert code == 2 and "HOST:PORT" in err


@pytest.mark.broker
def test_coordinator_without_agents_is_one_sentence(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from fedfit.sim.broker import find_mosquitto, start_mosquitto

    if find_mosquitto() is None:
        pytest.skip("mosquitto is not installed")
    broker = start_mosquitto()
    try:
        config = tmp_path / "c.yaml"
        config.write_text(f"broker: {{host: {broker.host}, port: {broker.port}}}\nfederation: empty\n"
                          f"data: {{dataset: digits, bn_samples: 50}}\nmodel: {{options: {{hidden: [4, 8]}}}}\n"
                          f"wait_for_agents_s: 0.5\nrounds: 1\nstate_dir: {tmp_path / 'state'}\n")
        code, err = run(capsys, "coordinator", "--config", str(config), "--log-level", "error")
    finally:
        broker.stop()
    assert code == 2
    assert "no agent of federation 'empty' came online" in err and "Traceback" not in err


def test_plan_prints_scalefl_levels_as_json(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["plan", "--algorithm", "scalefl", "--model", "resnet20", "--dataset", "digits",
                 "--set", "scalefl.cost=params", "--json"])
    out = capsys.readouterr().out
    assert code == 0
    plan = json.loads(out)
    assert plan["tiers"] == []  # one shape with or without --budgets
    rows = plan["levels"]
    assert [row["name"] for row in rows] == ["4", "3", "2", "1"]
    for row, target in zip(rows, (1.0, 0.5, 0.25, 0.125)):
        assert {"name", "spec", "params", "macs", "train_bytes", "s_d", "s_w"} <= set(row)
        assert row["params"] > 0 and row["macs"] > 0 and row["train_bytes"] > 0
        # Eq. 1: the level's parameters are within 10% of its share of the global model's.
        assert abs(row["params"] / rows[0]["params"] / target - 1) <= 0.1 + 1e-9, row
    assert rows[0]["s_d"] == rows[0]["s_w"] == 1.0
    assert all(row["params"] < above["params"] for row, above in zip(rows[1:], rows))


def test_plan_table_and_user_errors(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["plan", "--dataset", "digits", "--set", "model.options={hidden: [8, 16]}"])
    out = capsys.readouterr().out
    assert code == 0
    assert "heterofl | cnn | digits" in out and "train_bytes" in out and "width=0.0625" in out
    code, err = run(capsys, "plan", "--dataset", "digits", "--set", "scalefl.cost=bogus")
    assert code == 2 and "scalefl.cost" in err and "Traceback" not in err
    code, err = run(capsys, "plan", "--dataset", "digits", "--set", "nothing-to-set")
    assert code == 2 and "KEY=VALUE" in err
    code, err = run(capsys, "plan", "--dataset", "digits", "--set", "algorithm=nope")
    assert code == 2 and "unknown algorithm 'nope'" in err
    code, err = run(capsys, "plan", "--dataset", "digits", "--algorithm", "scalefl",
                    "--set", "scalefl.ratios=[0.001, 1.0]", "--set", "scalefl.tolerance=0.0",
                    "--set", "scalefl.cost=params")
    assert code == 2 and "ScaleFL cannot split" in err and "Traceback" not in err
