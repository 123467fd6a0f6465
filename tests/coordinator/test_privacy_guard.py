"""coordinator.privacy.guard and settings: the bound in every task, the budget refused at start and stopped at,
what a resumed run reads back, adaptive clipping's move, and the agents that cannot serve a private run."""

from __future__ import annotations

from dataclasses import replace

import pytest
import structlog
import torch

from coordinator.aggregation import RoundAggregate
from coordinator.config import ScreeningConfig
from coordinator.metrics import RoundResult
from coordinator.privacy.aggregate import PrivateAggregate
from coordinator.privacy.guard import PrivacyGuard, privacy_misfit, sum_noise_multiplier
from coordinator.privacy.ledger import PrivacyLedger
from coordinator.privacy.settings import AdaptiveClipConfig, PrivacyConfig
from coordinator.tasks import TaskPlan, TaskResult
from models import SubmodelSpec
from protocol import PRIVACY_REVISION, Adaptation, Candidate, TrainingPlan, UpdateClip

LOG = structlog.get_logger()


def guard(settings: PrivacyConfig, rounds: int = 10, record: RoundResult | None = None,
          completed: int = 0) -> PrivacyGuard:
    return PrivacyGuard(settings, rounds, record, completed, LOG)


def record_with(privacy: dict | None) -> RoundResult:
    return RoundResult(round=3, global_accuracy=0.5, level_accuracy={}, participants=1, selected=1, bytes_down=0,
                       bytes_up=0, seconds=1.0, privacy=privacy)


def test_the_section_refuses_what_cannot_be_private() -> None:
    PrivacyConfig().validate("samples")  # off: nothing asked
    for settings, weighting, message in (
            (PrivacyConfig("central", clip=0.0), "uniform", "privacy.clip must be a positive"),
            (PrivacyConfig("central", noise_multiplier=0.0), "uniform", "noise_multiplier must be positive"),
            (PrivacyConfig("central", delta=1.0), "uniform", r"delta must be in \(0, 1\)"),
            (PrivacyConfig("central", max_epsilon=0.0), "uniform", "max_epsilon must be a positive number"),
            (PrivacyConfig("central", max_epsilon=float("inf")), "uniform", "max_epsilon must be a positive number"),
            (PrivacyConfig("central", adaptive=AdaptiveClipConfig(count_noise=float("inf"))), "uniform",
             "count_noise must be finite"),
            (PrivacyConfig("central"), "samples", "privacy needs weighting: uniform"),
            (PrivacyConfig("local", adaptive=AdaptiveClipConfig()), "uniform", "adaptive needs mode: central"),
            (PrivacyConfig("central", noise_multiplier=2.0, adaptive=AdaptiveClipConfig(count_noise=1.0)), "uniform",
             "count_noise must exceed half"),
            (PrivacyConfig("central", adaptive=AdaptiveClipConfig(target_quantile=1.0)), "uniform", "target_quantile"),
    ):
        with pytest.raises(ValueError, match=message):
            settings.validate(weighting)


def test_every_task_and_every_smaller_model_it_offers_carry_the_bound_and_local_mode_its_noise() -> None:
    ladder = Adaptation("ladder", [Candidate({"width": 0.5}, TrainingPlan(epochs=2))])
    tasks = {"t1": TaskPlan("a", "a", SubmodelSpec(), TrainingPlan(epochs=3), adaptation=ladder)}
    assert guard(PrivacyConfig()).plan(tasks) is tasks  # off: untouched
    central = guard(PrivacyConfig("central", clip=0.7, noise_multiplier=1.3)).plan(tasks)["t1"]
    assert central.plan.update_clip == UpdateClip(0.7, 0.0) and central.plan.epochs == 3
    assert central.adaptation is not None
    assert [candidate.plan.update_clip for candidate in central.adaptation.candidates] == [UpdateClip(0.7, 0.0)]
    local = guard(PrivacyConfig("local", clip=0.7, noise_multiplier=1.3)).plan(tasks)["t1"]
    assert local.plan.update_clip == UpdateClip(0.7, 1.3) == local.adaptation.candidates[0].plan.update_clip
    # Screening under privacy: the plan's reach only, and no update's change in its record.
    plain, private = ScreeningConfig(), guard(PrivacyConfig("central")).screening(ScreeningConfig())
    assert guard(PrivacyConfig()).screening(plain) is plain
    assert private.enabled and not private.peers and not private.record


def test_a_run_whose_rounds_would_pass_the_budget_is_refused_and_one_within_it_stops_at_it() -> None:
    settings = PrivacyConfig("central", noise_multiplier=4.0, max_epsilon=3.0)
    ledger = PrivacyLedger("rdp")
    fit = ledger.rounds_within(3.0, 1e-5, 4.0, 1000)
    with pytest.raises(ValueError, match=rf"affords {fit} round\(s\); lower rounds"):
        guard(settings, rounds=fit + 1)
    running = guard(settings, rounds=fit)
    for number in range(1, fit + 1):
        assert running.allows(number)
        running.aggregate(number, 1, RoundAggregate({"global": {}}, lambda _: 1.0, []))
        assert running.settle(number)["epsilon"] <= 3.0
    assert not running.allows(fit + 1)  # the next round would pass it
    spent = record_with(running.settle(fit + 1))  # (accounted anyway: as a run resumed after it)
    with pytest.raises(ValueError, match="the privacy budget is spent"):
        guard(settings, rounds=fit + 5, record=spent, completed=fit + 1)


def test_a_resumed_run_reads_its_ledger_and_bound_back_and_a_run_begun_without_privacy_is_refused() -> None:
    settings = PrivacyConfig("central", clip=1.0, noise_multiplier=2.0)
    first = guard(settings)
    first.aggregate(1, 1, RoundAggregate({"global": {}}, lambda _: 1.0, []))
    kept = first.settle(1)
    assert kept is not None and kept["ledger"] == [[2.0, 1.0]] and kept["clip"] == kept["next_clip"] == 1.0
    resumed = guard(settings, record=record_with({**kept, "next_clip": 0.25}), completed=1)
    assert resumed.ledger.rounds == 1 and resumed.epsilon() == first.epsilon()
    assert resumed.clip == 1.0  # a fixed bound is the configuration's
    adaptive = replace(settings, adaptive=AdaptiveClipConfig())
    assert guard(adaptive, record=record_with({**kept, "next_clip": 0.25}), completed=1).clip == 0.25
    with pytest.raises(ValueError, match="ran 3 round\\(s\\) and its last round.s record holds no privacy ledger"):
        guard(settings, record=record_with(None), completed=3)


def test_adaptive_clipping_raises_a_bound_every_update_exceeded_and_lowers_one_none_reached() -> None:
    settings = PrivacyConfig("central", clip=1.0, noise_multiplier=1.0,
                             adaptive=AdaptiveClipConfig(target_quantile=0.5, learning_rate=0.2, count_noise=0.6))
    assert sum_noise_multiplier(settings, 8) == pytest.approx((1.0 - (1 / 1.2) ** 2) ** -0.5)
    for change, rises in ((5.0, True), (0.01, False)):  # every update clipped / none needed it
        room = guard(settings)
        aggregate = room.aggregate(1, 40, RoundAggregate({"global": {"w": torch.zeros(40)}}, lambda _: 1.0, []))
        assert isinstance(aggregate, PrivateAggregate)
        for agent in range(40):
            plan = TrainingPlan(update_clip=UpdateClip(1.0))
            value = min(change, 1.0) if rises else change  # a device clips its change to the bound
            aggregate.add(TaskResult(TaskPlan(str(agent), "a", SubmodelSpec(), plan), SubmodelSpec(),
                                     {"w": torch.tensor([value])}, {"w": (torch.tensor([agent]),)}, 1, [0]))
        kept = room.settle(1)
        assert kept is not None
        # The noised share (0 or 1, noise 0.6 / 40 at most a few hundredths) moves the bound by exp(-0.2 (share - 0.5)).
        assert (kept["next_clip"] > 1.05) is rises and (kept["next_clip"] < 0.95) is not rises, kept
        assert room.clip == kept["next_clip"]


def test_an_agent_that_predates_clipping_cannot_serve_a_private_run() -> None:
    assert privacy_misfit(PrivacyConfig(), 1) is None
    assert privacy_misfit(PrivacyConfig("central"), PRIVACY_REVISION) is None
    reason = privacy_misfit(PrivacyConfig("local"), PRIVACY_REVISION - 1)
    assert reason is not None and f"revision {PRIVACY_REVISION - 1} predates clipping" in reason
