"""coordinator.privacy.aggregate: uniform weights, the clip bound enforced, and each covered coordinate's noise
calibrated to the bound over its own contributor count."""

from __future__ import annotations

import pytest
import torch

from coordinator.privacy.aggregate import PrivateAggregate, RoundRelease
from coordinator.tasks import TaskPlan, TaskResult
from models import SubmodelSpec
from protocol import TrainingPlan, UpdateClip

ROWS, COLUMNS = 4, 20_000


def private_result(rows: int, change: float = 0.0, bound: float = 1.0, noise: float = 0.0, samples: int = 10,
                   agent: str = "a") -> TaskResult:
    """An update of the leading ``rows`` rows, each value moved by ``change`` from the global model's zeros."""
    plan = TrainingPlan(update_clip=UpdateClip(bound, noise))
    task = TaskPlan(agent, "a", SubmodelSpec(), plan)
    index = (torch.arange(rows), torch.arange(COLUMNS))
    return TaskResult(task, SubmodelSpec(), {"w": torch.full((rows, COLUMNS), change)}, {"w": index}, samples, [0])


def states() -> dict[str, dict[str, torch.Tensor]]:
    return {"global": {"w": torch.zeros(ROWS, COLUMNS)}}


def test_each_covered_coordinate_takes_noise_of_the_bound_over_its_own_contributor_count() -> None:
    # Three updates of unequal slices: row 0 has 3 contributors, row 1 has 2, rows 2-3 one; every change is 0, so
    # what the aggregate holds is the noise alone: N(0, (z C)^2) on each sum, divided by the row's count.
    release = RoundRelease(1, noise_multiplier=1.5, planned=3)
    aggregate = PrivateAggregate(states(), [], release)
    for rows, agent in ((4, "a"), (2, "b"), (1, "c")):
        aggregate.add(private_result(rows, bound=0.8, agent=agent, samples=1000 * rows))  # samples: never weights
    merged = aggregate.result()["global"]["w"]
    expected = {0: 1.5 * 0.8 / 3, 1: 1.5 * 0.8 / 2, 2: 1.5 * 0.8, 3: 1.5 * 0.8}
    for row, std in expected.items():
        assert float(merged[row].std()) == pytest.approx(std, rel=0.05), row
        assert abs(float(merged[row].mean())) < 5 * std / COLUMNS**0.5


def test_means_are_uniform_whatever_the_sample_counts_and_uncovered_coordinates_keep_their_value() -> None:
    release = RoundRelease(1, noise_multiplier=1e-9, planned=2)
    aggregate = PrivateAggregate(states(), [], release)
    aggregate.add(private_result(2, change=0.001, samples=1))
    aggregate.add(private_result(1, change=0.003, samples=1000, agent="b"))
    merged = aggregate.result()["global"]["w"]
    assert torch.allclose(merged[0], torch.full((COLUMNS,), 0.002), atol=1e-6)  # (0.001 + 0.003) / 2, not by samples
    assert torch.allclose(merged[1], torch.full((COLUMNS,), 0.001), atol=1e-6)
    assert torch.equal(merged[2:], torch.zeros(2, COLUMNS))


def test_an_update_beyond_its_bound_is_rejected_and_the_bits_say_which_needed_clipping() -> None:
    release = RoundRelease(1, noise_multiplier=1.0, planned=3)
    aggregate = PrivateAggregate(states(), [], release)
    per_value = 1.0 / (2 * COLUMNS) ** 0.5  # a change of norm exactly 1 over 2 rows
    aggregate.add(private_result(2, change=per_value, bound=1.0))  # clipped on the device: at the bound
    aggregate.add(private_result(2, change=per_value / 2, bound=1.0, agent="b"))  # shorter: needed no clipping
    with pytest.raises(ValueError, match=r"L2 norm 2, above the clip bound 1 its task set"):
        aggregate.add(private_result(2, change=2 * per_value, bound=1.0, agent="c"))
    untold = private_result(1, agent="d")
    untold = TaskResult(TaskPlan("d", "a", SubmodelSpec(), TrainingPlan()), untold.spec, untold.state,
                        untold.index_map, 1, [0])
    with pytest.raises(ValueError, match="set no clip bound"):
        aggregate.add(untold)
    assert aggregate.updates == 2 and release.bounds == [1.0, 1.0] and release.unclipped == [False, True]
    assert release.noise_std == 1.0
    rebuilt = aggregate.fresh()  # screening rejected one: the aggregate is built again, its counts with it
    assert release.bounds == [] and rebuilt.updates == 0 and rebuilt.release is release


def test_local_noise_is_the_devices_own_and_widens_the_bound_the_coordinator_checks() -> None:
    release = RoundRelease(1, noise_multiplier=2.0, planned=1, local=True)
    aggregate = PrivateAggregate(states(), [], release)
    noise = torch.distributions.Normal(0.0, 2.0 * 0.1).sample((1, COLUMNS))
    noised = private_result(1, bound=0.1, noise=2.0)
    aggregate.add(TaskResult(noised.task, noised.spec, {"w": noise}, noised.index_map, 1, [0]))
    assert release.noise_std == 0.0  # the coordinator adds none of its own
    assert torch.equal(aggregate.result()["global"]["w"][0], noise[0])


def test_under_local_privacy_an_update_without_its_noise_is_rejected() -> None:
    release = RoundRelease(1, noise_multiplier=2.0, planned=1, local=True)
    aggregate = PrivateAggregate(states(), [], release)
    with pytest.raises(ValueError, match="below what the noise its task set gives"):
        aggregate.add(private_result(1, change=1e-5, bound=0.1, noise=2.0))  # clipped, never noised
    assert aggregate.updates == 0


def test_a_stale_update_is_checked_and_counted_as_the_device_sent_it() -> None:
    # Rebased one round late, a change clipped to 1 arrives scaled by 1/sqrt(2): still a clipped one.
    per_value = 1.0 / (2 * COLUMNS) ** 0.5 / 2**0.5
    stale = private_result(2, change=per_value, bound=1.0)
    release = RoundRelease(1, noise_multiplier=1.0, planned=1)
    aggregate = PrivateAggregate(states(), [], release)
    aggregate.add(TaskResult(stale.task, stale.spec, stale.state, stale.index_map, 1, [0], staleness=1))
    assert release.unclipped == [False]
    too_long = private_result(2, change=2 * per_value, bound=1.0)
    with pytest.raises(ValueError, match="L2 norm 2, above the clip bound 1"):
        aggregate.add(TaskResult(too_long.task, too_long.spec, too_long.state, too_long.index_map, 1, [0],
                                 staleness=1))
