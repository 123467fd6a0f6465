"""FedRolex: the rolling window of channels (by hand for three rounds), the wire form, overlapping windows
aggregated element by element, and what is evaluated."""

from __future__ import annotations

import random

import pytest
import torch

from coordinator.aggregation import MaskedAggregator
from coordinator.config import CoordinatorConfig, FedRolexConfig, ModelConfig
from coordinator.strategies import make_strategy
from models import SubmodelSpec, get_family

# A CNN with 4 channels in its first hidden layer and 8 in its second; HeteroFL's level b is width 1/2.
FAMILY = get_family("cnn", 10, 1, hidden=[4, 8])


def fedrolex(make_context, direction: str = "forward"):
    config = CoordinatorConfig(model=ModelConfig(family="cnn", options={"hidden": [4, 8]}), levels=[1.0, 0.5],
                               fedrolex=FedRolexConfig(direction=direction))
    return make_strategy("fedrolex", make_context(config, family=FAMILY))


def windows(strategy, agent, round_number: int) -> dict[str, list[int]]:
    """The global channels of each hidden layer the agent's task trains in that round."""
    (task,) = strategy.configure_round(round_number, [agent], random.Random(0)).tasks
    index_map = FAMILY.index_map(task.spec)
    return {"conv1": index_map["conv1.bias"][0].tolist(), "conv2": index_map["conv2.bias"][0].tolist(),
            "classes": index_map["classifier.bias"][0].tolist(), "inputs": index_map["conv1.weight"][1].tolist()}


def test_the_window_rolls_one_channel_a_round_wrapping_around(make_context, make_agent):
    strategy = fedrolex(make_context)
    half = make_agent("half", 500)  # the width cost of the conftest: 1000 bytes for the whole model, 500 for b
    assert [windows(strategy, half, t)["conv1"] for t in (1, 2, 3, 4)] == [[0, 1], [1, 2], [2, 3], [3, 0]]
    assert [windows(strategy, half, t)["conv2"] for t in (1, 2, 3)] == [[0, 1, 2, 3], [1, 2, 3, 4], [2, 3, 4, 5]]
    # The input channel and the classes stay whole; a device of full width trains every channel, from the start.
    assert windows(strategy, half, 3)["inputs"] == [0] and windows(strategy, half, 3)["classes"] == list(range(10))
    assert windows(strategy, make_agent("whole", 1000), 3)["conv2"] == [2, 3, 4, 5, 6, 7, 0, 1]


def test_a_smaller_level_is_the_front_of_the_larger_window_as_an_agent_cuts_it():
    # An agent short of memory trains the front of the tensors it was sent (a smaller level down its ladder); the
    # intake places that at the task's roll: it must be the front of the sent window, whole groups included.
    family = get_family("cnn", 10, 1, hidden=[8, 64])  # 0.9 keeps all 8 channels of conv1, 58 of conv2's 64
    for roll in (0, 3, 61, -5):
        sent = family.index_map(SubmodelSpec.uniform(0.9).rolled(roll))
        smaller = family.index_map(SubmodelSpec.uniform(0.5).rolled(roll))
        for key, indices in smaller.items():
            for dim, positions in enumerate(indices):
                assert torch.equal(positions, sent[key][dim][:len(positions)]), (roll, key, dim)


def test_the_reference_codes_window_rolls_backwards(make_context, make_agent):
    strategy = fedrolex(make_context, "backward")
    half = make_agent("half", 500)
    assert [windows(strategy, half, t)["conv1"] for t in (1, 2, 3)] == [[0, 1], [3, 0], [2, 3]]
    assert [windows(strategy, half, t)["conv2"] for t in (1, 2, 3)] == [[0, 1, 2, 3], [7, 0, 1, 2], [6, 7, 0, 1]]


def test_the_window_is_the_coordinators_the_agent_is_sent_its_width(make_context, make_agent):
    (task,) = fedrolex(make_context).configure_round(3, [make_agent("half", 500)], random.Random(0)).tasks
    assert task.spec == SubmodelSpec.uniform(0.5).rolled(2) and task.spec.describe() == "width=0.5 roll=2"
    assert task.spec.unrolled().to_dict() == {"width": 0.5}  # what the dispatcher writes into the task
    assert SubmodelSpec.from_dict(task.spec.to_dict()) == task.spec  # the journal keeps the roll
    # The weights sent are the window's, in window order.
    state = {key: torch.randn(shape) for key, shape in FAMILY.global_shapes().items() if shape}
    sent = FAMILY.extract(state, task.spec, keys=["conv1.weight", "conv2.weight"])
    assert torch.equal(sent["conv1.weight"], state["conv1.weight"][[2, 3]])
    assert torch.equal(sent["conv2.weight"], state["conv2.weight"][[2, 3, 4, 5]][:, [2, 3]])
    assert FAMILY.shapes(task.spec) == FAMILY.shapes(SubmodelSpec.uniform(0.5))


def test_overlapping_windows_average_each_element_over_the_updates_that_trained_it():
    old = {"conv1.bias": torch.tensor([10.0, 20.0, 30.0, 40.0])}
    aggregator = MaskedAggregator(old)
    late = FAMILY.index_map(SubmodelSpec.uniform(0.5).rolled(3))["conv1.bias"]  # channels 3, 0
    early = FAMILY.index_map(SubmodelSpec.uniform(0.5))["conv1.bias"]  # channels 0, 1
    aggregator.add({"conv1.bias": torch.tensor([1.0, 2.0])}, {"conv1.bias": late})
    aggregator.add({"conv1.bias": torch.tensor([5.0, 7.0])}, {"conv1.bias": early})
    # channel 0: (2 + 5) / 2; channel 1: 7 alone; channel 2: nobody, kept; channel 3: 1 alone
    assert aggregator.result()["conv1.bias"].tolist() == [3.5, 7.0, 30.0, 1.0]


def test_only_the_global_model_is_evaluated(make_context):
    targets = fedrolex(make_context).eval_targets()
    assert list(targets) == ["global"] and targets["global"].spec.is_full and targets["global"].store_bn


def test_a_direction_it_does_not_know_is_refused():
    with pytest.raises(ValueError, match="fedrolex.direction must be forward or backward, got 'sideways'"):
        FedRolexConfig(direction="sideways").validate()  # type: ignore[arg-type]
