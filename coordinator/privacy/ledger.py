"""The privacy a run has spent: every round a Gaussian mechanism of its noise multiplier, composed by Google's
dp-accounting (`dp_accounting`, RDP or PLD accountant), reported as epsilon at a delta.

No amplification by sampling is claimed: a round releases its sums only on the coordinates some selected device
trains (masked aggregation), so the model a round produces shows which sub-models were trained and the selection
is not secret; each round counts whole for every device (sampling probability 1), an upper bound whatever the
method's selection. The neighbouring runs are those where one device's data differs or is absent while the device
stays in the fleet (its presence, budget and task are the coordinator's public plan).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["PLD_DISCRETIZATION", "PrivacyLedger"]

#: The PLD accountant's discretization of privacy-loss values: its rounding is pessimistic (an upper bound at any
#: interval); 1e-3 gives the library default's (1e-4) epsilon to four digits here, ten times faster.
PLD_DISCRETIZATION = 1e-3


@dataclass
class PrivacyLedger:
    """Rounds accounted, as runs of ``[noise_multiplier, rounds]`` (a noise multiplier changed on resume starts a new
    run); ``accountant`` ``rdp`` or ``pld``."""

    accountant: str = "rdp"
    entries: list[list[float]] = field(default_factory=list)

    @property
    def rounds(self) -> int:
        """How many rounds are accounted."""
        return int(sum(count for _, count in self.entries))

    def add(self, noise_multiplier: float, rounds: int = 1) -> None:
        """Account ``rounds`` more rounds of Gaussian noise ``noise_multiplier``."""
        if self.entries and self.entries[-1][0] == noise_multiplier:
            self.entries[-1][1] += rounds
        else:
            self.entries.append([float(noise_multiplier), float(rounds)])

    def epsilon(self, delta: float, more: Sequence[tuple[float, int]] = ()) -> float:
        """Epsilon at ``delta`` of the rounds accounted (and of ``more`` ``(noise_multiplier, rounds)`` after them,
        without accounting them); 0 before any round."""
        events = [(z, int(count)) for z, count in self.entries] + [(z, n) for z, n in more if n > 0]
        if not events:
            return 0.0
        accountant = self._accountant()
        from dp_accounting import dp_event

        for noise_multiplier, count in events:
            accountant.compose(dp_event.SelfComposedDpEvent(dp_event.GaussianDpEvent(noise_multiplier), count))
        return float(accountant.get_epsilon(delta))

    def rounds_within(self, budget: float, delta: float, noise_multiplier: float, limit: int) -> int:
        """How many more rounds of ``noise_multiplier`` keep epsilon at ``delta`` within ``budget`` (at most
        ``limit``)."""
        if self.epsilon(delta, [(noise_multiplier, 1)]) > budget:
            return 0
        low, high = 1, limit  # epsilon grows with the rounds: the last count within the budget, by bisection
        if self.epsilon(delta, [(noise_multiplier, high)]) <= budget:
            return high
        while high - low > 1:
            middle = (low + high) // 2
            if self.epsilon(delta, [(noise_multiplier, middle)]) <= budget:
                low = middle
            else:
                high = middle
        return low

    def _accountant(self) -> Any:
        if self.accountant == "pld":
            from dp_accounting.pld import pld_privacy_accountant

            return pld_privacy_accountant.PLDAccountant(value_discretization_interval=PLD_DISCRETIZATION)
        from dp_accounting.rdp import rdp_privacy_accountant

        return rdp_privacy_accountant.RdpAccountant()

    def to_list(self) -> list[list[float]]:
        """The entries, for the round's record."""
        return [list(entry) for entry in self.entries]

    @classmethod
    def from_list(cls, accountant: str, entries: object) -> PrivacyLedger:
        """The ledger a record's entries hold; ValueError naming what is wrong."""
        if not isinstance(entries, list) or not all(
                isinstance(entry, list) and len(entry) == 2 and all(isinstance(v, (int, float)) for v in entry)
                and entry[0] > 0 and entry[1] >= 1 and float(entry[1]).is_integer() for entry in entries):
            raise ValueError(f"the privacy ledger must be a list of [noise_multiplier, rounds] pairs, got {entries!r}")
        return cls(accountant, [[float(z), float(count)] for z, count in entries])
