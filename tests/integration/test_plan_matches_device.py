"""What ``fedfit plan`` says a device trains is what that device's agent then decides to train: the strategies'
``plan_for_budget`` and the agent's decision (``edge_agent.decision``, a fresh calibration) apply one rule
(``common.device_need``), for every method sized (where it says ``auto``) to a fleet of the ``fair`` and ``tiers``
budgets, at those budgets and exactly at the edge of
every level the plan names (for FeDepth: of its costliest stage, and of the least a tier it cannot serve would
need, where the head alone on the frozen blocks starts to fit)."""

from __future__ import annotations

import random
import time
from dataclasses import replace
from typing import Any

import pytest

from common.data import load_dataset
from common.device_need import INITIAL_FACTOR
from coordinator.config import AdaptiveFLConfig, CoordinatorConfig
from coordinator.planning import strategy_for
from coordinator.registry import AgentRecord
from coordinator.strategies import ALGORITHM_NAMES, Strategy
from coordinator.strategies.base import base_plan
from edge_agent.decision import Decider
from edge_agent.workdir import DataShape, DecisionRequest
from fedfit.sim.budgets import BudgetAnchor, scenario_tiers
from protocol import Capabilities, ModelRef, Task


@pytest.fixture(scope="module")
def digits() -> Any:
    return load_dataset("digits")


def strategy_of(algorithm: str, dataset: Any) -> Strategy:
    config = CoordinatorConfig(algorithm=algorithm)
    config.data.dataset = "digits"
    if algorithm == "adaptivefl":  # the largest pool model to every client: the device then picks what fits
        config = replace(config, adaptivefl=AdaptiveFLConfig(selection="greedy"))
    strategy = strategy_for(config, dataset)
    strategy.fit_to_fleet(scenario_budgets(strategy, dataset))  # as a run sizes the methods that say auto
    return strategy


def scenario_budgets(strategy: Strategy, dataset: Any) -> list[int]:
    """The budgets of the ``fair`` and ``tiers`` scenarios' devices."""
    anchor = BudgetAnchor.estimate(strategy.family, base_plan(strategy.config.recipe), input_size=dataset.image_size)
    return sorted({anchor.tier_bytes(tier) for scenario in ("fair", "tiers") for tier in scenario_tiers(scenario)})


def agent(budget: int) -> AgentRecord:
    capabilities = Capabilities(device_kind="generic", memory_total=10**10, memory_available=10**10,
                                budget_bytes=budget, num_samples=64, labels=list(range(10)))
    return AgentRecord("device", "online", capabilities, 0.0)


def device_decides(strategy: Strategy, dataset: Any, budget: int,
                   known: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """What an agent with ``budget`` bytes decides for the task the strategy sends it (None: sent nothing). Its
    calibration is fresh; it remembers the estimates of its earlier decisions (``known``, added to), as an agent
    does."""
    round_plan = strategy.configure_round(1, [agent(budget)], random.Random(0))
    if not round_plan.tasks:
        return None
    planned = round_plan.tasks[0]
    family, config = strategy.family, strategy.config
    state = strategy.initial_states(config.seed)[planned.group]
    weights = family.extract(state, planned.spec, keys=family.state_keys(planned.spec), views=True)
    model = ModelRef(config.model.family, dataset.num_classes, dataset.in_channels, dict(config.model.options))
    task = Task("t", 1, "device", time.time() + 600, model, planned.spec.to_dict(), None,
                {key: value.detach().cpu().numpy() for key, value in weights.items()},
                adaptation=planned.adaptation, plan=planned.plan)
    data = DataShape(64, tuple(range(10)), dataset.in_channels, dataset.image_size)
    decision, _ = Decider(DecisionRequest("cpu", "pooled", budget, INITIAL_FACTOR, data, known=known)).decide(task)
    known.update(decision.estimates)
    return {"status": decision.status, "spec": decision.spec, "reason": decision.reason,
            "copies": (planned.plan.copies if decision.spec == planned.spec.to_dict() else None)}


def budgets(strategy: Strategy, dataset: Any) -> list[int]:
    """The scenarios' tier budgets, and one byte either side of every level's need the plan names."""
    found = set(scenario_budgets(strategy, dataset))
    for row in list(found):
        said = strategy.plan_for_budget(row)
        need = said.get("train_bytes")
        if strategy.name == "fedepth":  # its costliest stage, or the least a tier it cannot serve would need
            need = max(need) if isinstance(need, list) else said.get("needs_bytes", need)
        if isinstance(need, int):
            found |= {need, need - 1}
    return sorted(found)


def spec_text(strategy: Strategy, spec: dict[str, Any] | None) -> str | None:
    from models import SubmodelSpec
    return None if spec is None else SubmodelSpec.from_dict(spec).describe()


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ALGORITHM_NAMES)
def test_the_plan_names_what_the_device_trains(algorithm: str, digits: Any) -> None:
    strategy = strategy_of(algorithm, digits)
    checked = 0
    answers = set()
    known: dict[str, dict[str, Any]] = {}
    for budget in budgets(strategy, digits):
        said = strategy.plan_for_budget(budget)
        answers.add(said.get("trains"))
        done = device_decides(strategy, digits, budget, known)
        where = f"{algorithm} at {budget} B: plan {said}, device {done}"
        if said.get("trains") == "nothing" or said.get("fits") is False:
            assert done is None or done["status"] == "declined", where
            continue
        assert done is not None and done["status"] in ("ok", "adapted"), where
        if algorithm == "fedepth":
            if "cut" in said:
                from models import SubmodelSpec
                assert [list(s) for s in SubmodelSpec.from_dict(done["spec"]).segments or ()] == said["cut"], where
            else:
                assert SubmodelSpec_is_whole(done["spec"]), where
        else:
            assert spec_text(strategy, done["spec"]) == said["spec"], where
        checked += 1
    assert checked > 0, f"{algorithm}: no budget of the scenarios trains anything"
    if algorithm == "fedepth":  # where no block fits alone, the head alone on the frozen blocks (the device agrees)
        assert "head alone" in answers, answers


def SubmodelSpec_is_whole(spec: dict[str, Any]) -> bool:
    from models import SubmodelSpec
    return SubmodelSpec.from_dict(spec).segments is None
