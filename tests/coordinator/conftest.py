"""Shared fixtures of the coordinator tests: strategy contexts with a hand-made training-memory cost, agents."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from coordinator.config import CoordinatorConfig
from coordinator.registry import AgentRecord
from coordinator.strategies import StrategyContext
from models import MemoryEstimate, ModelFamily, SubmodelSpec, get_family
from protocol import Capabilities, TrainingPlan

Cost = Callable[[SubmodelSpec, TrainingPlan], int]


def width_cost(spec: SubmodelSpec, plan: TrainingPlan) -> int:
    """Training cost proportional to the width: 1000 bytes for the full model (a 1000, b 500, c 250, d 125,
    e 62)."""
    return int(spec.width * 1000)



@pytest.fixture
def make_context() -> Callable[..., StrategyContext]:
    """``make_context(config, family=None, cost=width_cost, overhead=0, input_size=(8, 8))``: a strategy context
    whose training-memory estimate is ``cost(spec, plan)`` bytes plus ``overhead`` (its ``overhead`` part), for
    devices that need exactly that (calibration factor 1)."""

    def make(config: CoordinatorConfig, *, family: ModelFamily | None = None, cost: Cost = width_cost,
             overhead: int = 0, input_size: tuple[int, int] = (8, 8)) -> StrategyContext:
        family = family or get_family(config.model.family, 10, 1, **config.model.options)

        def memory(spec: SubmodelSpec, plan: TrainingPlan) -> MemoryEstimate:
            return MemoryEstimate(parameters=cost(spec, plan), gradients=0, optimizer_state=0, activations=0,
                                  workspace=0, overhead=overhead)

        return StrategyContext(family=family, config=config, input_size=input_size,
                               server_x=torch.zeros(4, 1, *input_size), server_y=torch.zeros(4, dtype=torch.long),
                               training_memory=memory, device_factor=1.0)

    return make


@pytest.fixture
def make_agent() -> Callable[..., AgentRecord]:
    """``make_agent(agent_id, budget, available=10**9)``: an online agent reporting that budget."""

    def make(agent_id: str, budget: int | None, available: int = 10**9) -> AgentRecord:
        capabilities = Capabilities(device_kind="generic", memory_total=10**9, memory_available=available,
                                    budget_bytes=budget, num_samples=10, labels=[0])
        return AgentRecord(agent_id, "online", capabilities, 0.0)

    return make
