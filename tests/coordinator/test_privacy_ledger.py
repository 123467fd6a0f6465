"""coordinator.privacy.ledger: epsilon as Google's dp-accounting computes it for the same rounds, its budget
arithmetic, and the entries a record keeps."""

from __future__ import annotations

import pytest
from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant

from coordinator.privacy.ledger import PLD_DISCRETIZATION, PrivacyLedger


@pytest.mark.parametrize("kind", ["rdp", "pld"])
def test_epsilon_is_the_accountants_own_for_the_same_rounds(kind: str) -> None:
    ledger = PrivacyLedger(kind)
    assert ledger.epsilon(1e-5) == 0.0
    for _ in range(10):
        ledger.add(1.1)
    ledger.add(2.0, rounds=5)  # resumed with another noise multiplier
    assert ledger.entries == [[1.1, 10.0], [2.0, 5.0]] and ledger.rounds == 15
    library = (rdp_privacy_accountant.RdpAccountant() if kind == "rdp"
               else pld_privacy_accountant.PLDAccountant(value_discretization_interval=PLD_DISCRETIZATION))
    for _ in range(10):
        library.compose(dp_event.GaussianDpEvent(1.1))
    library.compose(dp_event.GaussianDpEvent(2.0), 5)
    assert ledger.epsilon(1e-5) == pytest.approx(library.get_epsilon(1e-5), rel=1e-5)


def test_pld_is_no_looser_than_rdp_and_epsilon_grows_with_rounds_and_falls_with_noise() -> None:
    def epsilon(kind: str, z: float, rounds: int) -> float:
        ledger = PrivacyLedger(kind)
        ledger.add(z, rounds)
        return ledger.epsilon(1e-5)

    assert epsilon("pld", 1.0, 20) <= epsilon("rdp", 1.0, 20)
    assert epsilon("rdp", 1.0, 10) < epsilon("rdp", 1.0, 20) and epsilon("rdp", 2.0, 20) < epsilon("rdp", 1.0, 20)


def test_rounds_within_a_budget_is_the_last_count_that_keeps_within_it() -> None:
    ledger = PrivacyLedger("rdp")
    ledger.add(3.0, 4)
    fit = ledger.rounds_within(4.0, 1e-5, 3.0, 1000)
    assert 0 < fit < 1000
    assert ledger.epsilon(1e-5, [(3.0, fit)]) <= 4.0 < ledger.epsilon(1e-5, [(3.0, fit + 1)])
    assert ledger.rounds_within(4.0, 1e-5, 3.0, fit - 1) == fit - 1
    assert ledger.rounds_within(1e-3, 1e-5, 3.0, 10) == 0


def test_a_records_entries_are_read_back_or_refused() -> None:
    ledger = PrivacyLedger("rdp")
    ledger.add(1.0, 3)
    again = PrivacyLedger.from_list("rdp", ledger.to_list())
    assert again.entries == ledger.entries and again.epsilon(1e-5) == ledger.epsilon(1e-5)
    for bad in ("x", [[1.0]], [[0.0, 3]], [[1.0, 0]], [[1.0, 2.5]], [["1", 2]]):
        with pytest.raises(ValueError, match=r"\[noise_multiplier, rounds\] pairs"):
            PrivacyLedger.from_list("rdp", bad)
