"""The coordinator's privacy room (`privacy` section; docs/privacy.md): the clip bound in every task's plan, the
round's private aggregate, the privacy each round spends (`coordinator.privacy.ledger`), adaptive clipping, and the
budget a run may not go beyond.

What a round's record says (``RoundResult.privacy``): ``mode``, ``epsilon`` at ``delta`` after the round, the
budget ``max_epsilon``, the ``accountant``, ``noise_multiplier``, the ``clip`` bound its tasks set, the ``next_clip`` (adaptive), the
``unclipped`` share of its updates (adaptive: noised) and the ``ledger``. A resumed run reads its ledger (and with
adaptive clipping its bound) back from the checkpoint's last record.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import numpy as np

from common.logs import Logger
from coordinator.aggregation import RoundAggregate
from coordinator.config import ScreeningConfig
from coordinator.metrics import RoundResult
from coordinator.privacy.aggregate import PrivateAggregate, RoundRelease
from coordinator.privacy.ledger import PrivacyLedger
from coordinator.privacy.settings import PrivacyConfig
from coordinator.tasks import TaskPlan
from protocol import PRIVACY_REVISION, Adaptation, UpdateClip

__all__ = ["PrivacyGuard", "privacy_misfit"]


def privacy_misfit(settings: PrivacyConfig, revision: int) -> str | None:
    """Why an agent of protocol ``revision`` cannot serve a private run (None: it can)."""
    if settings.enabled and revision < PRIVACY_REVISION:
        return (f"its protocol revision {revision} predates clipping updates for differential privacy (revision "
                f"{PRIVACY_REVISION}): upgrade the agent")
    return None


def sum_noise_multiplier(settings: PrivacyConfig, planned: int) -> float:
    """The noise multiplier of a round's sums: ``noise_multiplier``, or with adaptive clipping what is left of it
    once the count of unclipped updates takes its share (Andrew et al. 2021, Theorem 1)."""
    if settings.adaptive is None:
        return settings.noise_multiplier
    z, count_noise = settings.noise_multiplier, count_noise_of(settings, planned)
    return (z ** -2 - (2 * count_noise) ** -2) ** -0.5


def count_noise_of(settings: PrivacyConfig, planned: int) -> float:
    """The standard deviation of the noise on a round's count of unclipped updates (``planned``: its tasks)."""
    assert settings.adaptive is not None
    if settings.adaptive.count_noise is not None:
        return settings.adaptive.count_noise
    return max(planned / 20, settings.noise_multiplier)


def _with_clip(adaptation: Adaptation | None, terms: UpdateClip) -> Adaptation | None:
    """``adaptation`` with the clip bound in every candidate's plan too: what a device trains instead is clipped
    alike."""
    if adaptation is None:
        return None
    return replace(adaptation, candidates=[replace(candidate, plan=replace(candidate.plan, update_clip=terms))
                                           for candidate in adaptation.candidates])


class PrivacyGuard:
    """Differential privacy for one run (nothing when the ``privacy`` section is off); see the module docstring.
    ValueError at construction when the budget is spent or the run's rounds would spend more."""

    def __init__(self, settings: PrivacyConfig, rounds: int, last_record: RoundResult | None, completed: int,
                 log: Logger) -> None:
        self.settings = settings
        self.log = log
        self.ledger = PrivacyLedger(settings.accountant)
        self.clip = settings.clip
        self._releases: dict[int, RoundRelease] = {}
        self._ahead: tuple[int, float] | None = None  # (rounds accounted, epsilon after one more): allows()'s
        if not settings.enabled:
            if completed and last_record is not None and last_record.privacy:
                log.warning("privacy_turned_off", round=completed, epsilon=last_record.privacy.get("epsilon"),
                            message="this run was private and goes on without privacy: the models of its next "
                                    "rounds are not covered by any epsilon")
            return
        if completed:
            self._restore(last_record, completed)
        self._refuse_beyond_budget(rounds, completed)

    @property
    def enabled(self) -> bool:
        """Whether the run is private."""
        return self.settings.enabled

    def epsilon(self) -> float:
        """Epsilon at the configured delta after the rounds accounted."""
        return self.ledger.epsilon(self.settings.delta)

    def _restore(self, last_record: RoundResult | None, completed: int) -> None:
        kept = last_record.privacy if last_record is not None else None
        if not kept:
            raise ValueError(f"the run in this state_dir ran {completed} round(s) and its last round's record holds "
                             f"no privacy ledger (a run begun without privacy, whose updates were released unnoised, "
                             f"or a record this version cannot read): no epsilon holds for it; give a private run a "
                             f"new state_dir")
        self.ledger = PrivacyLedger.from_list(self.settings.accountant, kept.get("ledger"))
        if self.settings.adaptive is not None:  # (a fixed bound is the configuration's, changed or not)
            self.clip = float(kept.get("next_clip", self.settings.clip))

    def _refuse_beyond_budget(self, rounds: int, completed: int) -> None:
        budget, settings = self.settings.max_epsilon, self.settings
        left = rounds - completed
        if budget is None or left <= 0:
            return
        spent = self.epsilon()
        if self.ledger.rounds and spent >= budget:
            raise ValueError(f"the privacy budget is spent: epsilon {spent:.3g} of privacy.max_epsilon {budget:g} at "
                             f"delta {settings.delta:g} after {self.ledger.rounds} round(s); no further round can run")
        fit = self.ledger.rounds_within(budget, settings.delta, settings.noise_multiplier, left)
        if fit < left:
            after = self.ledger.epsilon(settings.delta, [(settings.noise_multiplier, left)])
            affords = (f"the budget affords {completed + fit} round(s); lower rounds, raise the noise multiplier or "
                       f"the budget" if fit else "not one round more fits the budget; raise the noise multiplier or "
                       "the budget")
            raise ValueError(f"rounds {rounds} would spend epsilon {after:.3g} at delta {settings.delta:g}, beyond "
                             f"privacy.max_epsilon {budget:g}: at privacy.noise_multiplier "
                             f"{settings.noise_multiplier:g} {affords}")

    def allows(self, round_number: int) -> bool:
        """Whether round ``round_number`` keeps the run within its budget (logged when it does not)."""
        budget = self.settings.max_epsilon
        if not self.enabled or budget is None:
            return True
        after = self.ledger.epsilon(self.settings.delta, [(self.settings.noise_multiplier, 1)])
        self._ahead = (self.ledger.rounds, after)  # what settle() would compute again once the round is accounted
        if after <= budget:
            return True
        self.log.warning("privacy_budget_reached", round=round_number, epsilon=self.epsilon(), budget=budget,
                         message=f"round {round_number} would spend epsilon {after:.3g}: the run stops here")
        return False

    def plan(self, tasks: dict[str, TaskPlan]) -> dict[str, TaskPlan]:
        """The round's tasks with the clip bound (and in local mode the noise) in their training plans."""
        if not self.enabled:
            return tasks
        noise = self.settings.noise_multiplier if self.settings.mode == "local" else 0.0
        terms = UpdateClip(self.clip, noise)
        return {task_id: replace(task, plan=replace(task.plan, update_clip=terms),
                                 adaptation=_with_clip(task.adaptation, terms)) for task_id, task in tasks.items()}

    def screening(self, screening: ScreeningConfig) -> ScreeningConfig:
        """The round's screening: under privacy without rule 2 (an update rejected for being unlike the others would
        let one device's data decide whether another's counts) and without each update's change in its record (its
        norm says whether it was clipped)."""
        return replace(screening, peers=False, record=False) if self.enabled else screening

    def aggregate(self, round_number: int, planned: int, aggregate: RoundAggregate) -> RoundAggregate:
        """The round's aggregate: ``aggregate`` itself, or under privacy a private one over its states (``planned``:
        the round's tasks)."""
        if not self.enabled:
            return aggregate
        release = RoundRelease(round_number, sum_noise_multiplier(self.settings, planned), planned,
                               local=self.settings.mode == "local")
        self._releases[round_number] = release
        return PrivateAggregate(aggregate.states, aggregate.classifier_keys, release)

    def settle(self, round_number: int) -> dict[str, Any] | None:
        """Round ``round_number`` closed: account it, move the bound (adaptive) and return its record's ``privacy``
        (None when the run is not private)."""
        if not self.enabled:
            return None
        release = self._releases.pop(round_number, None)
        settings = self.settings
        used = self.clip
        record: dict[str, Any] = {"mode": settings.mode, "noise_multiplier": settings.noise_multiplier,
                                  "clip": used, "updates": len(release.bounds) if release else 0}
        if settings.adaptive is not None and release is not None:
            planned = max(1, release.planned)
            noise = np.random.default_rng().normal(0.0, count_noise_of(settings, planned))
            share = (sum(release.unclipped) + noise) / planned
            self.clip = used * math.exp(-settings.adaptive.learning_rate * (share - settings.adaptive.target_quantile))
            record["unclipped"] = share
        accounted = self.ledger.rounds
        self.ledger.add(settings.noise_multiplier)
        ahead = self._ahead
        epsilon = ahead[1] if ahead is not None and ahead[0] == accounted else self.epsilon()
        record.update(next_clip=self.clip, epsilon=epsilon, delta=settings.delta,
                      max_epsilon=settings.max_epsilon, accountant=settings.accountant, ledger=self.ledger.to_list())
        self.log.info("privacy_spent", round=round_number, epsilon=record["epsilon"], delta=settings.delta,
                      clip=used, next_clip=self.clip)
        return record
