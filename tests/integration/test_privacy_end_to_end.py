"""End to end under differential privacy: a simulated fleet over a real mosquitto (secured) with the privacy section
on; the devices clip their updates, the coordinator noises and accounts them, and the figures reach the report."""

from __future__ import annotations

from pathlib import Path

import pytest

from coordinator.privacy.ledger import PrivacyLedger
from coordinator.privacy.settings import AdaptiveClipConfig, PrivacyConfig
from fedfit.sim.harness import SimOptions, run_simulation

from .conftest import tiny_config

pytestmark = [pytest.mark.broker, pytest.mark.slow]


def test_a_private_heterofl_run_clips_on_the_devices_and_accounts_every_round(mosquitto_installed: None,
                                                                              tmp_path: Path) -> None:
    # A bound far below what two epochs move the weights: every device clips.
    privacy = PrivacyConfig("central", clip=0.05, noise_multiplier=0.05, max_epsilon=1e4,
                            adaptive=AdaptiveClipConfig(count_noise=0.2))
    options = SimOptions(algorithm="heterofl", agents=3, rounds=2, dataset="digits", seed=1, federation="e2e-dp",
                         base=tiny_config(privacy=privacy), budgets="widths:1,1/2,1/4",
                         state_dir=str(tmp_path / "dp"))
    report = run_simulation(options, progress=None).report
    rounds, tasks = report["rounds"], report["tasks"]
    assert {task["status"] for task in tasks} == {"ok"} and all(r["participants"] == 3 for r in rounds), tasks
    ledger = PrivacyLedger("rdp")
    for number, entry in enumerate(rounds, start=1):
        spent = entry["privacy"]
        ledger.add(0.05)
        assert spent["mode"] == "central" and spent["updates"] == 3 and spent["delta"] == 1e-5
        assert spent["epsilon"] == pytest.approx(ledger.epsilon(1e-5)) and spent["ledger"] == [[0.05, float(number)]]
        # Every device clipped its change to the bound its task set: the private aggregate, which rejects a longer
        # one, took them all, and read each as clipped, so the noised share of unclipped updates (0 + noise 0.2 / 3)
        # raised the bound towards their median. No task's record keeps its change (its norm would tell).
        assert spent["next_clip"] > spent["clip"] and spent["unclipped"] < 0.5, spent
        assert all(task["screening"] == {} for task in tasks if task["round"] == number)
    assert rounds[1]["privacy"]["clip"] == rounds[0]["privacy"]["next_clip"]
    assert report["summary"]["epsilon"] == rounds[-1]["privacy"]["epsilon"]
    summary = (tmp_path / "dp" / "summary.txt").read_text()
    assert "epsilon: the privacy spent after the round, at delta 1e-05" in summary
