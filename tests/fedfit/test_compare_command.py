"""fedfit.compare_command: a resumed comparison of private runs is refused before anything is written when its
rounds would pass a run's privacy budget."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.config import ConfigError
from coordinator.checkpoint import save_checkpoint
from coordinator.config import CoordinatorConfig
from coordinator.metrics import RoundResult
from coordinator.privacy.ledger import PrivacyLedger
from coordinator.privacy.settings import PrivacyConfig
from fedfit.compare_command import _check_privacy_budget


def private_checkpoint(path: Path, rounds: int, noise: float) -> None:
    ledger = PrivacyLedger("rdp")
    ledger.add(noise, rounds)
    record = RoundResult(round=rounds, global_accuracy=0.5, level_accuracy={}, participants=1, selected=1,
                         bytes_down=0, bytes_up=0, seconds=1.0,
                         privacy={"epsilon": ledger.epsilon(1e-5), "delta": 1e-5, "ledger": ledger.to_list(),
                                  "next_clip": 1.0})
    save_checkpoint(path / "checkpoint.safetensors", {}, {"round": rounds, "record": record.to_dict()})


def test_a_resume_past_a_runs_budget_is_refused_naming_the_run(tmp_path: Path) -> None:
    run = tmp_path / "seed-0" / "heterofl"
    private_checkpoint(run, 10, 3.0)
    base = CoordinatorConfig(privacy=PrivacyConfig("central", noise_multiplier=3.0, max_epsilon=6.0))
    fits = PrivacyLedger("rdp")
    fits.add(3.0, 10)
    more = fits.rounds_within(6.0, 1e-5, 3.0, 1000)
    _check_privacy_budget(tmp_path, 10 + more, base)  # within the budget: nothing said
    with pytest.raises(ConfigError, match=rf"seed-0/heterofl: rounds {11 + more} would spend epsilon"):
        _check_privacy_budget(tmp_path, 11 + more, base)
    _check_privacy_budget(tmp_path, 1000, CoordinatorConfig())  # not private: nothing to check
