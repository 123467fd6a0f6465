"""The estimates strategy set-ups share (coordinator.planning.TrainingMemory)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from coordinator import planning
from coordinator.planning import TrainingMemory
from models import SubmodelSpec, get_family
from protocol import LossTerm, OptimizerSettings, TrainingPlan

PLAN = TrainingPlan(optimizer=OptimizerSettings(), batch_size=8, loss=(LossTerm.ce(),), seed=3)


@pytest.fixture
def counted(monkeypatch):
    """Every estimate actually made, by (family name, options' hidden, spec width, device)."""
    made: list[tuple] = []
    real = planning.estimate_plan_memory

    def estimate(family, spec, plan, *, input_size, device):
        made.append((family.name, tuple(family.options.get("hidden", ())), spec, device))
        return real(family, spec, plan, input_size=input_size, device=device)

    monkeypatch.setattr(planning, "estimate_plan_memory", estimate)
    monkeypatch.setattr(planning, "_shared_estimates", {})
    return made


def test_estimators_of_one_model_share_their_estimates_and_the_seed_moves_none(counted):
    spec = SubmodelSpec.uniform(0.5)
    first = TrainingMemory(get_family("cnn", 10, 1), (8, 8))
    again = TrainingMemory(get_family("cnn", 10, 1), (8, 8))  # another strategy's set-up of the same model
    assert again(spec, replace(PLAN, seed=9)) is first(spec, PLAN)
    assert len(counted) == 1


def test_another_model_input_or_device_is_estimated_on_its_own(counted):
    spec = SubmodelSpec.uniform(0.5)
    estimates = [TrainingMemory(get_family("cnn", 10, 1), (8, 8))(spec, PLAN),
                 TrainingMemory(get_family("cnn", 10, 1, hidden=[8, 16]), (8, 8))(spec, PLAN),
                 TrainingMemory(get_family("cnn", 10, 1), (12, 12))(spec, PLAN),
                 TrainingMemory(get_family("cnn", 10, 1), (8, 8), device="cuda")(spec, PLAN)]
    assert len(counted) == 4
    assert estimates[1].total < estimates[0].total < estimates[2].total  # narrower model; larger images


def test_the_oldest_estimate_goes_past_the_limit(counted, monkeypatch):
    monkeypatch.setattr(planning, "SHARED_ESTIMATES_KEPT", 2)
    memory = TrainingMemory(get_family("cnn", 10, 1), (8, 8))
    for width in (0.25, 0.5, 1.0):
        memory(SubmodelSpec.uniform(width), PLAN)
    memory(SubmodelSpec.uniform(1.0), PLAN)  # kept
    memory(SubmodelSpec.uniform(0.25), PLAN)  # dropped: made again
    assert [entry[2] for entry in counted] == [SubmodelSpec.uniform(w) for w in (0.25, 0.5, 1.0, 0.25)]
